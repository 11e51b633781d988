"""One folder per run, written by rank 0 only: text log, TensorBoard, Weights & Biases, results.json.

Rank 0 gets a ``RunLogger``; every other rank gets a ``NullLogger`` with the same methods that do
nothing, so the training loop calls ``log.scalars(...)`` on every rank without an ``if rank == 0``::

    log = make_logger(settings, rank)            # DDP: only rank 0 writes files or W&B runs
    log.info(f"global batch {settings.global_batch_size}")
    log.scalars({"Loss/train": 2.31, "lr": 0.1}, step=20)
    log.results({"acc1": 71.2, "wall_time_s": 4480})
    log.close()

What a run folder holds (``runs/<dataset>-<arch>-ws<world_size>-<YYYYmmdd-HHMMSS>`` by default)::

    settings.json         the Settings of the run (after a resume with changed settings the old
                          file is kept as settings.<YYYYmmdd-HHMMSS>.json)
    log.txt               everything info() printed on the console
    model_summary.txt     the layer table from model_summary()
    tb/                   TensorBoard event files: tensorboard --logdir runs
    wandb/                the W&B run (offline-run-*/ until uploaded with `wandb sync`)
    wandb_run_id.txt      lets a resumed run continue the same W&B run
    results.json          final numbers, rewritten atomically by results()
    last.pt, best.pt      checkpoints (see checkpoint.py)

TensorBoard tags the course uses (the logger writes whatever dict it is given, with these names
the curves line up with the course's)::

    Loss/train  acc1/train  acc5/train       training loss and top-1 / top-5 accuracy in %
    Loss/val    acc1/val    acc5/val         the same on the validation split (global, all ranks)
    lr                                       learning rate of the optimiser's first group
    throughput/images_per_s                  global images per second (all ranks together)
    throughput/images_per_s_rank             one rank's share of it
    time/data_s  time/compute_s              seconds per epoch spent waiting for data / computing
    time/comm_s  time/idle_s                 ... waiting for the gradients' all-reduce / on the rest
    gpu/util_mean  gpu/mem_peak_mb           on GPUs: utilisation (%) and peak memory (MB) per epoch

Weights & Biases never prompts: ``auto`` runs online when a key is set up (``WANDB_API_KEY`` or
``wandb login``, which stores it in ~/.netrc), offline otherwise. The key is never written into the
run folder: Settings has no field for it and nothing here reads it.
"""
from __future__ import annotations

import json
import netrc
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch
from torch.utils.tensorboard import SummaryWriter

from .robust.peers import describe_failure
from .robust.files import atomic_write_text, folder_refusal, remove_leftovers

from .summary import model_summary as _model_summary_text

# A folder holding any of these already holds a run: starting another one there would mix them.
RUN_MARKERS = ("settings.json", "results.json", "log.txt", "last.pt", "best.pt")


class RunFolderError(ValueError):
    """The run folder cannot be used (a file in its place, not writable, holding another run, a finished run):
    said on every rank before anything is built or written."""


def run_folder_refusal(run_dir, new_run: bool | None) -> str | None:
    """Why rank 0 cannot write its run in ``run_dir``, as a paragraph (robust/files.folder_refusal's, or the
    other run it holds), or None. ``new_run``: the folder must not hold another run's checkpoint or results (False:
    a resume continues it; None: not known yet, resume=auto)."""
    refusal = folder_refusal(run_dir, "the run folder")
    if refusal is None and new_run:
        refusal = _holds_a_run(Path(run_dir))
    return refusal


def default_run_dir(settings) -> Path:
    """``settings.run_dir`` if set, else ``runs/<dataset>-<arch>-ws<world_size>-<YYYYmmdd-HHMMSS>``."""
    if settings.run_dir:
        return Path(settings.run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{settings.dataset}-{settings.arch}-ws{settings.world_size}-{stamp}"


# -- Weights & Biases mode -----------------------------------------------------------------------
def wandb_mode(settings, environ=None) -> str:
    """The W&B mode to run: ``online``, ``offline`` or ``disabled``; never one that would prompt.

    ``auto`` follows ``WANDB_MODE`` if that is set, else is ``online`` when an API key is set up
    (``WANDB_API_KEY``, or ``wandb login``'s entry in ~/.netrc) and ``offline`` otherwise.
    ``online`` without any key raises ValueError (W&B would otherwise ask for the key and a
    headless run or a notebook cell would wait forever).
    """
    env = os.environ if environ is None else environ
    mode = settings.wandb
    if mode == "auto":
        mode = env.get("WANDB_MODE", "")
        if mode not in ("online", "offline", "disabled"):
            mode = "online" if has_wandb_key(env) else "offline"
    if mode == "online" and not has_wandb_key(env):
        raise ValueError(
            "W&B mode 'online' needs an API key and none is set up on this node (no WANDB_API_KEY "
            "and no W&B entry in ~/.netrc). Run `wandb login` once in a terminal on this node, or "
            "`export WANDB_API_KEY=...` before starting Python; never paste the key into a notebook "
            "or a file that goes to git. Or use wandb='offline' (upload later with `wandb sync`) "
            "or wandb='disabled'.")
    return mode


def wandb_start_bound(settings) -> float:
    """Seconds rank 0 may wait for W&B's servers when starting online: a third of ``init_timeout``
    (the other ranks wait that long for rank 0 to start the run), at least 5."""
    return max(5.0, settings.init_timeout / 3)


def has_wandb_key(environ=None) -> bool:
    """True when W&B can log in without asking: ``WANDB_API_KEY`` or a netrc entry for its host."""
    env = os.environ if environ is None else environ
    if env.get("WANDB_API_KEY"):
        return True
    host = urlsplit(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    netrc_path = Path(env["NETRC"]) if env.get("NETRC") else home / ".netrc"
    try:
        entry = netrc.netrc(netrc_path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])  # entry = (login, account, password); the key is the password


# -- the loggers ---------------------------------------------------------------------------------
class RunLogger:
    """Writes one run folder (see the module docstring). Use it on rank 0 only: ``make_logger``.

    ``resume=True`` continues a run in an existing folder: log.txt is appended to, TensorBoard
    starts a new event file beside the old ones, and W&B continues the same run. ``resume_step``
    (the step the checkpoint was saved at) makes TensorBoard drop the points the interrupted run
    logged after that step, so the curves do not show them twice.
    """

    def __init__(self, settings, run_dir: Path | None = None, resume: bool = False,
                 resume_step: int | None = None):
        self.settings = settings
        self.run_dir = Path(run_dir) if run_dir is not None else default_run_dir(settings)
        self._closed = False
        mode = wandb_mode(settings)  # a missing key fails here, before anything is written
        set_aside = _refuse_existing_run(self.run_dir) if not resume else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.run_dir)   # half-written files of a run killed while saving
        if resume and (self.run_dir / "log.txt").exists():
            self.info(f"=== resumed {time.strftime('%Y-%m-%d %H:%M:%S')} ===")
        self._write_settings()
        self.tb = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=resume_step,
                                flush_secs=10)  # curves appear in TensorBoard within 10 s
        self.info(f"Run folder: {self.run_dir}  (TensorBoard: tensorboard --logdir {self.run_dir.parent})")
        if set_aside:
            self.info(f"This folder held a start that never finished an epoch; its files are kept in {set_aside.name}/")
        self.wandb_run = self._start_wandb(mode, resume)

    def info(self, msg: str) -> None:
        """Append ``msg`` to log.txt and print it (the file first: it outlives a closed terminal)."""
        with open(self.run_dir / "log.txt", "a", encoding="utf-8") as f:
            f.write(f"{msg}\n")
        print(msg, flush=True)

    def error(self, msg: str) -> None:
        """Append a final error to log.txt only: the console shows it already (the CLI's ``error:``
        line, the notebook's traceback), but the run folder must say why the run ended."""
        with open(self.run_dir / "log.txt", "a", encoding="utf-8") as f:
            f.write(f"error: {msg}\n")

    def scalars(self, values: dict[str, float], step: int) -> None:
        """Log ``{tag: number}`` at ``step`` (global optimiser steps) to TensorBoard and W&B."""
        self._check_open()
        values = {tag: float(value) for tag, value in values.items()}  # also 0-d tensors
        for tag, value in values.items():
            self.tb.add_scalar(tag, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def epoch(self, record: dict, step: int) -> None:
        """An epoch's scalars to TensorBoard and W&B, from its record (``epoch_scalars``)."""
        self.scalars(epoch_scalars(record), step)

    def model_summary(self, model, input_shape: tuple) -> str:
        """Write model_summary.txt (see summary.py) and return its text."""
        self._check_open()
        text = _model_summary_text(model, input_shape)
        (self.run_dir / "model_summary.txt").write_text(text, encoding="utf-8")
        return text

    def results(self, values: dict) -> None:
        """Write results.json atomically (never half a file) and put the values in the W&B summary."""
        self._check_open()
        text = json.dumps(values, indent=2, sort_keys=True, default=_plain)
        atomic_write_text(self.run_dir / "results.json", text + "\n")
        if self.wandb_run is not None:
            self.wandb_run.summary.update(json.loads(text))

    def close(self, exit_code: int = 0) -> None:
        """Flush TensorBoard and finish the W&B run. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(exit_code=0 if exc_type is None else 1)  # W&B marks a crashed run as failed

    # -- helpers ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"This RunLogger for {self.run_dir} is closed; to log more, "
                               f"make a new one with resume=True.")

    def _write_settings(self) -> None:
        """settings.json; on a resume with different settings the old file is kept, renamed."""
        path = self.run_dir / "settings.json"
        text = self.settings.to_json() + "\n"
        if path.exists():
            old = path.read_text(encoding="utf-8")
            if old == text or self._same_but_the_folders_name(old):
                return
            kept = _unused(self.run_dir, f"settings.{time.strftime('%Y%m%d-%H%M%S')}", ".json")
            os.replace(path, kept)
            self.info(f"Settings differ from this run's earlier ones ({_changed(old, self.settings)}); "
                      f"the earlier ones are kept in {kept.name}")
        atomic_write_text(path, text)

    def _same_but_the_folders_name(self, old_json: str) -> bool:
        """The earlier settings.json says the same but names this folder another way (unset: the default name;
        relative or absolute): a resume's settings are then not new ones."""
        try:
            old, new = json.loads(old_json), json.loads(self.settings.to_json())
        except ValueError:
            return False
        named = old.pop("run_dir", None)
        new.pop("run_dir", None)
        return old == new and (named is None or Path(named).resolve() == self.run_dir.resolve())

    def _start_wandb(self, mode: str, resume: bool):
        if mode == "disabled":
            return None
        os.environ.setdefault("WANDB_SILENT", "true")  # no banners; we print the one line that matters
        import wandb  # imported here: it is slow to import and not needed when disabled

        id_file = self.run_dir / "wandb_run_id.txt"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        kwargs = {"project": self.settings.wandb_project, "name": self.run_dir.name,
                  "config": self.settings.to_dict(), "dir": str(self.run_dir),
                  "id": run_id, "resume": "allow" if run_id else None,  # continue the same run
                  "reinit": "finish_previous"}  # re-running a notebook cell ends the old run
        try:
            # Online, W&B may wait for its servers (90 s by default, far longer than the other ranks wait for
            # rank 0 to start the run): bounded by a third of init_timeout here, then the run goes on offline.
            bound = wandb.Settings(init_timeout=wandb_start_bound(self.settings)) if mode == "online" else None
            run = wandb.init(mode=mode, settings=bound, **kwargs)
        except Exception as e:
            if mode != "online":
                raise
            # A W&B outage, no route to its servers or a bad key must not stop a training run: keep the data locally.
            self.info(f"W&B online start failed ({describe_failure(e)}); logging offline instead")
            mode = "offline"
            run = wandb.init(mode=mode, **kwargs)
        id_file.write_text(run.id + "\n")
        if mode == "offline":
            self.info(f"W&B offline; upload later with: wandb sync {Path(run.dir).parent}")
        else:
            self.info(f"W&B run: {run.url}")
        return run


class NullLogger:
    """What ranks other than 0 get: the RunLogger methods writing nothing; ``info`` prints, so that
    every rank shows the same global lines as rank 0 (only rank 0 writes them to log.txt)."""

    run_dir = None

    def __init__(self, *args, **kwargs):
        pass

    def info(self, msg: str) -> None:
        print(msg, flush=True)

    def error(self, msg: str) -> None:
        pass

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def epoch(self, record: dict, step: int) -> None:
        pass

    def model_summary(self, model, input_shape: tuple) -> str:
        return ""

    def results(self, values: dict) -> None:
        pass

    def close(self, exit_code: int = 0) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        pass


def make_logger(settings, rank: int, resume: bool = False,
                resume_step: int | None = None) -> RunLogger | NullLogger:
    """A RunLogger on rank 0 (in ``settings.run_dir``), a NullLogger on every other rank."""
    if rank == 0:
        return RunLogger(settings, resume=resume, resume_step=resume_step)
    return NullLogger()


# -- the results of a run -----------------------------------------------------------------------
def cpu_name() -> str:
    """The processor's model name, for results and pictures (a speed means nothing without its machine)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        return platform.processor() or "unknown CPU"


TIME_PARTS = ("data_s", "compute_s", "comm_s", "idle_s")   # per rank, they add up to the train time


def summarize(settings, ctx, val, history, run: dict) -> dict:
    """What results.json holds: final evaluation, speed and its time split over every trained
    epoch, and the hardware. ``run``: what the run says of itself: ``wall_time_s``, ``best_acc1``,
    ``epochs_run`` (the epochs trained now; default: every epoch of ``history``), and the rest (probe, GPU use,
    early stop, mode), added as it is."""
    run = dict(run)
    wall, best_acc1, epochs_run = run.pop("wall_time_s"), run.pop("best_acc1"), run.pop("epochs_run", None)
    trained = [h["train"] for h in history]
    images = sum(t["count"] for t in trained)
    train_s = sum(t["wall_s"] for t in trained)
    steps = sum(t.get("steps", 0) for t in trained)
    split = {key: sum(t.get(key, 0.0) for t in trained) for key in (*TIME_PARTS, "comm_total_s")}
    # Each rank's own split, when every epoch ran with this world size (a run resumed on another one has
    # epochs with other ranks: then only the ranks' means above).
    same_ranks = all(len(t.get("per_rank") or []) == settings.world_size for t in trained)
    per_rank = [{"rank": r, **{key: sum(t["per_rank"][r][key] for t in trained) for key in TIME_PARTS}}
                for r in range(settings.world_size)] if same_ranks else []
    return {
        "acc1": val["acc1"], "acc5": val["acc5"], "loss": val["loss"], "best_acc1": best_acc1,
        "val_images": val["count"], "epochs": settings.epochs,
        "epochs_run": len(history) if epochs_run is None else epochs_run,
        "world_size": settings.world_size, "global_batch_size": settings.global_batch_size,
        "lr": settings.effective_lr, "seed": settings.seed, "wall_time_s": wall, "train_time_s": train_s,
        "images_per_s": images / max(train_s, 1e-9) if trained else 0.0,
        "data_wait_fraction": split["data_s"] / max(train_s, 1e-9) if trained else 0.0,
        **split, "steps": steps, "measured_step_s": train_s / steps if steps else None, "per_rank": per_rank,
        "dataset": settings.dataset, "arch": settings.arch, "device": str(ctx.device),
        "device_name": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "backend": ctx.backend or "none", "host": socket.gethostname(), "cpus": os.cpu_count(),
        "cpu_name": cpu_name(), "threads": torch.get_num_threads(),
        **run,
        "history": history,
    }


# -- reading back --------------------------------------------------------------------------------
def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from a run's TensorBoard files (``run_dir/tb`` or a tb folder)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = Path(run_dir) / "tb"
    if not tb_dir.is_dir():
        tb_dir = Path(run_dir)
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0 = keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# -- small file helpers --------------------------------------------------------------------------
def _refuse_existing_run(run_dir: Path) -> Path | None:
    """FileExistsError if ``run_dir`` holds a run with something to keep (a checkpoint or results).

    A start that failed before its first checkpoint (a bad resume, an early error) must not block the
    next attempt: its files are moved into ``attempt-<time>/`` inside the folder, which is returned.
    """
    held = _holds_a_run(run_dir)
    if held:   # open_run refused it earlier (run_folder_refusal): this is a RunLogger made by hand
        raise FileExistsError(held)
    if not any((run_dir / name).exists() for name in RUN_MARKERS):
        return None
    aside = _unused(run_dir, f"attempt-{time.strftime('%Y%m%d-%H%M%S')}", "")
    aside.mkdir()
    for entry in list(run_dir.iterdir()):
        if entry != aside and not entry.name.startswith("attempt-"):
            os.replace(entry, aside / entry.name)
    return aside


def _holds_a_run(run_dir: Path) -> str | None:
    """The refusal of a new run in ``run_dir`` when it holds a run with something to keep (a checkpoint or
    results), or None."""
    if not any((run_dir / name).exists() for name in ("last.pt", "best.pt", "results.json")):
        return None
    found = [name for name in RUN_MARKERS if (run_dir / name).exists()]
    resume = next((run_dir / n for n in ("last.pt", "best.pt") if (run_dir / n).exists()), None)
    how = f", or resume with --resume {resume}" if resume else ""
    return f"{run_dir} already holds a run ({', '.join(found)}); choose another run_dir or delete that folder{how}"


def _unused(folder: Path, stem: str, suffix: str) -> Path:
    """``folder/stem+suffix``, or ``stem-2+suffix`` ... if that exists already."""
    path, n = folder / f"{stem}{suffix}", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}{suffix}"
    return path


def _changed(old_json: str, settings) -> str:
    try:
        old = json.loads(old_json)
    except ValueError:
        return "the old file is not valid JSON"
    new = settings.to_dict()
    names = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in names)


def _plain(value):
    """JSON fallback for results: tensors and numpy numbers as numbers, anything else as text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


# -- an epoch's record: {"epoch", "train", "val"}, one per epoch in results.json's history ----------------------
def epoch_scalars(record: dict) -> dict:
    """The epoch's TensorBoard (and W&B) scalars, from its record."""
    train, val = record["train"], record["val"]
    return {"Loss/val": val["loss"], "acc1/val": val["acc1"], "acc5/val": val["acc5"],
            "throughput/images_per_s": train["images_per_s"], "throughput/images_per_s_rank": train["images_per_s_rank"],
            **{f"time/{key}": train[key] for key in ("data_s", "compute_s", "comm_s", "idle_s")}}


def epoch_line(settings, train: dict, val: dict, epoch: int, algorithm: str = "") -> str:
    """The console line at each epoch end, with where the epoch's time went (and, with several ranks, the
    ``algorithm``: DDP, how its gradients travel, or local SGD)."""
    wall = train.get("wall_mean_s", train["wall_s"])   # the parts are the ranks' means: so is this wall time
    shares = " ".join(f"{name} {100 * train[key] / max(wall, 1e-9):.0f}%" for name, key in
                      (("data", "data_s"), ("compute", "compute_s"), ("comm", "comm_s"), ("idle", "idle_s")))
    # Two lines of under 100 characters: one line of 165 wrapped mid-word in a notebook ("pe" / "r rank").
    return (f"epoch {epoch + 1}/{settings.epochs}: train loss {train['loss']:.4f} acc1 {train['acc1']:.2f} | "
            f"val loss {val['loss']:.4f} acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f}\n"
            f"  {train['images_per_s']:.0f} img/s global, {train['images_per_s_rank']:.0f} per rank | "
            f"time: {shares} | {train['wall_s']:.1f}s" + (f" | {algorithm}" if settings.world_size > 1 else ""))

"""``prepare()``: the notebook's steps in one call, for the command line, the labs and the benchmarks.

``main.ipynb`` makes a run in four visible cells; ``prepare`` makes the same calls in the same order
(a test keeps them in step), so a resume, the TensorBoard purge or a lost peer behave alike everywhere::

    ctx = setup(settings)                                      # DDP: join the process group
    data = build_data(settings, ctx)                           # DDP: this rank's share (DistributedSampler)
    model = build_model(settings.arch, data.num_classes, settings.seed, data.image_size)
    model = prepare_model(model, settings, ctx)   # DDP: wrap
    job = open_run(settings, ctx, data, model, resume)         # DDP: rank 0 writes the run folder
    with job:                                                  # closes the logs; after an error leaves the group
        results = fit(job)                                     # train.fit: the epochs

``run_job(settings)`` does all of it and always leaves the process group: ``python -m ddp_utils train``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time
from dataclasses import dataclass

import torch

from . import checkpoint, collectives, distributed, parallel
from .robust import peers
from .checkpoint import kept_checkpoint
from .data import build_data
from .loaders import Data
from .distributed import setup
from .robust.peers import describe_failure
from .model import build_model, ddp_of, parallel_mode, prepare_model, unwrap
from .parallel import load_model_state
from .robust import autoresume
from .runlog import NullLogger, RunFolderError, RunLogger, default_run_dir, make_logger, run_folder_refusal, summarize
from .settings import Settings, field_type
from .train import evaluate, fit
from .watch import wait_for_the_others


class Evaluate(str):
    """``resume=Evaluate(path)``: the checkpoint at ``path`` is only evaluated, into a new run folder (``--evaluate``),
    not continued."""


def _check_evaluate(resume, evaluate: bool) -> None:
    if evaluate and (not resume or resume == "auto"):
        raise ValueError("--evaluate needs --resume PATH: the checkpoint whose weights to evaluate")


@dataclass
class Job:
    """What ``open_run`` (or ``prepare``) made: pass it to ``fit`` (or ``evaluate_only``)."""
    settings: object                  # the Settings of the run (run_dir filled in on a resume)
    ctx: distributed.DistContext      # rank, world size, device, backend
    data: Data                        # this rank's loaders
    model: torch.nn.Module            # on the device; DDP-wrapped with several ranks
    logger: RunLogger | NullLogger    # rank 0 writes the run folder, the others get a NullLogger
    state: dict | None = None         # the checkpoint to continue from (or to evaluate), on every rank
    resume: str | None = None         # its path on rank 0
    model_table: str = ""             # the layer table (rank 0), also in model_summary.txt
    parallel: str = "none"            # what runs: ddp, dp or none (model.parallel_mode)
    log: object = print               # where the run's own notes go (rank 0)
    optimizer: object = None          # a weak reference to the run's optimizer (new_loop), for release_group

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.logger.close()       # flush TensorBoard, finish the W&B run; the process group stays
        else:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """After an error or an interrupt: tell the other ranks why (DDP), write it to the run folder,
        and leave the process group so that its connections close now and setup can run again."""
        own = isinstance(exc, peers.PeerLost)   # another rank's failure: nothing new to tell
        if not own:
            kept = kept_checkpoint(self.logger.run_dir, self.ctx)
            if isinstance(exc, KeyboardInterrupt):   # the command line's stop paragraph says what exists
                exc.kept = what_exists(kept, self.logger.run_dir, self.ctx)
            peers.report_failure(self.ctx, f"rank {self.ctx.rank} stopped: {describe_failure(exc)}"
                                                 + (f". {kept[0].upper()}{kept[1:]}" if kept else ""))
        self.logger.error(str(exc) if str(exc).startswith("rank") else describe_failure(exc))
        self.logger.close(exit_code=1)
        release_group(self.model, self.optimizer() if self.optimizer is not None else None)
        distributed.teardown(abort=True)   # DDP: the other ranks' collectives fail now, not at a timeout


def what_exists(kept: str, run_dir, ctx) -> str:
    """After an interrupt: what this rank can say is kept (``kept``: checkpoint.kept_checkpoint's sentence, rank
    0's) and how to go on, for the stop paragraph."""
    if not ctx.is_main:   # the run folder is rank 0's: it says what is there
        return ("rank 0 says what its run folder holds; if an epoch finished, continue every rank with --resume "
                "RUN_DIR/last.pt (rank 0's run folder)")
    if kept.startswith("no checkpoint"):
        return f"no epoch finished, so no checkpoint was written ({run_dir} holds the log): start the run again"
    return f"{kept}: continue with --resume {checkpoint.checkpoint_paths(run_dir)[0]}"


def release_group(model, optimizer=None) -> None:
    """Make a model (and its optimizer) let go of the process group, so that tearing the group down frees it (its
    threads and buffers) although the notebook and the error's traceback still reference them: DDP's reducer here,
    ZeRO's optimizer and FSDP's blocks in their modes (``Mode.release``).
    The other ranks' collectives fail at once either way: teardown(abort=True) shuts the connections."""
    import gc
    if model is None:
        return
    ddp = ddp_of(model)
    if ddp is not None:
        for name in ("reducer", "logger", "process_group", "_comm_hooks"):
            ddp.__dict__.pop(name, None)
    net = unwrap(model)
    parallel.of_state(net, optimizer).release(net, optimizer)
    gc.collect()


def prepare(settings, resume: str | None = None, evaluate: bool = False, log=print) -> Job:
    """Join the process group and build the data, model and run folder of a run, on this rank: the
    notebook's cells in one call (the same calls, in the same order; tests/test_notebooks.py).

    ``resume``: rank 0's path to a last.pt / best.pt, or ``"auto"`` (see ``open_run``). With
    ``evaluate`` its weights are only evaluated, into a new run folder. Every rank must call this
    with the same settings; on an error the process group is left, so that calling it again starts
    cleanly.
    """
    _check_evaluate(resume, evaluate)   # before joining: a wrong command fails at once
    resume = Evaluate(resume) if evaluate else resume
    try:
        ctx = setup(settings, log)   # DDP: pre-flight, init_process_group, settings agreement
        with distributed.leaving_on_error(ctx):   # before the data and the model: a folder it cannot write, said now
            check_run_folder(continued_in(settings, resume), ctx, resume)
        data = build_data(settings, ctx, log)   # DDP: DistributedSampler shards; the ranks agree on the data
        model = build_model(settings.arch, data.num_classes, settings.seed, data.image_size)   # seeded, for this size
        model = prepare_model(model, settings, ctx, log)   # DDP: wrap
        return open_run(settings, ctx, data, model, resume, log)   # DDP: rank 0 writes the run folder
    except KeyboardInterrupt as exc:
        if not hasattr(exc, "kept"):   # stopped before the run folder was opened (open_run's job.fail says after)
            exc.kept = "it stopped while preparing the run, before writing anything: start it again"
        raise


def open_run(settings, ctx, data: Data, model, resume: str | None = None, log=print) -> Job:
    """Open the run folder (rank 0 writes it; the other ranks get a NullLogger) and find where the
    run starts: a new run, or a resume.

    ``resume``: rank 0's path to a last.pt / best.pt; training continues after its epoch, in its
    folder (unless ``settings.run_dir`` says otherwise). ``"auto"``: continue the unfinished run of
    these settings if rank 0 has one (``robust/autoresume.py``), else start a new one; it says
    which. ``Evaluate(path)``: the checkpoint's weights are only evaluated, into a new run folder.
    """
    evaluate = isinstance(resume, Evaluate)
    with distributed.leaving_on_error(ctx):
        _check_evaluate(resume, evaluate)
        # DDP: the cell's first collective (the resume decision) waits for the other notebook here, up to init_timeout
        peers.wait_for_all("start the run cell (open_run)", ctx, settings.init_timeout, log)
        settings = continued_in(settings, resume)
        if resume == "auto":   # DDP: rank 0 has the run folders; it decides for every rank
            resume, run_dir, why = collectives.broadcast_object(autoresume.decide(settings) if ctx.is_main else None,
                                                                ctx)
            log(f"resume auto: {why}")   # every rank says what all of them do
            settings = settings.replace(run_dir=run_dir)
        check_run_folder(settings, ctx, resume)   # DDP: rank 0 looks, every rank says it; nothing written yet
        # DDP: loading is a collective (rank 0 reads its file and sends it), so all resume or none.
        collectives.agree({"resume": bool(resume)}, ctx, what="whether to resume")
        state = checkpoint.load_state(resume, ctx, settings.init_timeout) if resume else None
        if state is not None:
            checkpoint.check_matches(state, settings, resume)   # not an 8 KB key dump from load_state_dict
        continuing = state is not None and not evaluate
        if continuing:
            refuse_finished(state, settings, ctx, resume)
        # DDP: rank 0 writes the run folder, the other ranks a NullLogger. On a resume, TensorBoard drops
        # what the interrupted run logged after its checkpoint.
        logger = make_logger(settings, ctx.rank, resume=continuing, resume_step=state["step"] if continuing else None)
    job = Job(settings, ctx, data, model, logger, state, resume, parallel=parallel_mode(settings, ctx), log=log)
    with _failing(job):
        job.model_table = logger.model_summary(model, (3, data.image_size, data.image_size))
        # DDP: rank 0 may take a while to start W&B; the others wait here, not in the first all-reduce
        peers.wait_for_all("finish starting the run", ctx, settings.init_timeout, log)
    return job


def continued_in(settings, resume):
    """The settings of a run that continues ``resume`` (a path): written into the folder the checkpoint came
    from, unless run_dir says otherwise (``--evaluate`` gets a new folder; ``auto`` decides in open_run)."""
    if resume and resume != "auto" and not isinstance(resume, Evaluate) and not settings.run_dir:
        return settings.replace(run_dir=os.path.dirname(resume) or ".")
    return settings


def check_run_folder(settings, ctx, resume=None) -> None:
    """Rank 0 looks at the folder its run will write (a file in its place, one it cannot write, a new run's
    folder that holds another run) before anything is built or written there; every rank raises its answer
    (RunFolderError), so every node says the same paragraph and nothing is left half made."""
    new_run = None if resume == "auto" else not resume or isinstance(resume, Evaluate)
    refusal = run_folder_refusal(default_run_dir(settings), new_run) if ctx.is_main else None
    refusal = collectives.broadcast_object(refusal, ctx)
    if refusal:
        raise RunFolderError(refusal)


def refuse_finished(state: dict, settings, ctx, resume) -> None:
    """A finished run's last.pt resumed with no more epochs: RunFolderError on every rank, before its folder is
    touched (its results.json would be rewritten by a run that trained nothing). A run stopped after its last
    checkpoint but before its results (no results.json) goes on: it writes them, mending best.pt first."""
    if state["epoch"] + 1 < settings.epochs:
        return
    results = default_run_dir(settings) / "results.json"
    if collectives.broadcast_object(results.exists() if ctx.is_main else None, ctx):
        raise RunFolderError(
            f"{resume} holds epoch {state['epoch'] + 1} of {settings.epochs}: that run finished (its "
            f"results.json is written), so nothing is left to train, and nothing in its folder was changed. To "
            f"train it longer, resume with more epochs (--epochs N; EPOCHS in the notebook); to evaluate its "
            f"weights, add --evaluate.")


@contextlib.contextmanager
def _failing(job: Job):
    """Run a block; on any error let ``job.fail`` tell the others and leave the group."""
    try:
        yield
    except BaseException as exc:
        job.fail(exc)
        raise


def seed_settings(settings, seeds) -> list:
    """One Settings per seed, each with its own run folder ``RUN_DIR-seed<N>`` (siblings)."""
    base = settings.run_dir.rstrip("/") or str(default_run_dir(settings))
    return [settings.replace(seed=seed, run_dir=f"{base}-seed{seed}") for seed in seeds]


def run_seeds(settings, seeds, log=print) -> list[dict]:
    """``run_job`` once per seed, one after the other (every rank must pass the same seeds); the
    results of each. ``python -m ddp_utils report RUN_DIR-seed*`` gives their mean +- std."""
    out = []
    for i, one in enumerate(seed_settings(settings, seeds)):
        if settings.rank == 0:
            log(f"=== seed {one.seed} ({i + 1} of {len(seeds)}): {one.run_dir} ===")
        out.append(run_job(one, log=log))
    return out


# Settings a grid may not vary: who and where the ranks are (every rank of one job shares them), the folder
# (each grid run gets its own) and the seed (--seeds repeats a run).
NOT_IN_A_GRID = ("rank", "world_size", "local_rank", "master_addr", "master_port", "backend", "init_method",
                 "socket_ifname", "run_dir", "seed")


def grid_axes(texts) -> dict[str, list]:
    """``["bucket_mb=1,25,100", "comm=none,fp16"]`` -> ``{"bucket_mb": [1.0, 25.0, 100.0], "comm": ["none", "fp16"]}``:
    each value converted to its setting's type, every name a setting."""
    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    axes: dict[str, list] = {}
    for text in texts or []:
        name, _, values = str(text).partition("=")
        name = name.strip().replace("-", "_")
        if name not in defaults or not values.strip():
            raise ValueError(f"--grid {text!r}: write NAME=V1,V2,... with NAME a train setting (e.g. bucket_mb=1,25,100 "
                             f"or comm=none,fp16); `python -m ddp_utils train --help` lists them")
        if name in NOT_IN_A_GRID or name in axes:
            raise ValueError(f"--grid {text!r}: {name} cannot vary {'twice' if name in axes else 'within one job'} "
                             f"({'give it once' if name in axes else 'run a job per value; --seeds repeats runs'})")
        kind = field_type(name)   # the field's own: a recipe's epochs or lr default to None, yet are numbers
        try:
            axes[name] = [_grid_value(kind, v.strip()) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--grid {text!r}: {name} takes {kind.__name__} values") from None
    return axes


def _grid_value(kind, text: str):
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0", "on", "off"):
            raise ValueError(text)
        return text.lower() in ("true", "1", "on")
    return kind(text)


def grid_settings(settings, axes: dict[str, list]) -> list:
    """One Settings per combination of the ``axes`` values (the first axis slowest), each in its own run folder
    ``RUN_DIR-<name><value>...`` (siblings); every combination is checked before any run starts."""
    base = settings.run_dir.rstrip("/") or str(default_run_dir(settings))
    out = []
    for values in itertools.product(*axes.values()):
        combo = dict(zip(axes, values))
        tag = "-".join(f"{name}{format(value, 'g') if isinstance(value, float) else str(value).replace('/', '_')}"
                       for name, value in combo.items())
        out.append(settings.replace(**combo, run_dir=f"{base}-{tag}"))
    return out


def run_grid(settings, axes: dict[str, list], log=print) -> list[dict]:
    """``run_job`` once per combination, one after the other (every rank must pass the same grid): short runs
    (``--max-steps-per-epoch``) that vary one mechanism. ``python -m ddp_utils report RUN_DIR-*`` makes their table
    and grid.png."""
    runs, out = grid_settings(settings, axes), []
    for i, one in enumerate(runs):
        if settings.rank == 0:
            varied = ", ".join(f"{name}={getattr(one, name)}" for name in axes)
            log(f"=== grid run {i + 1} of {len(runs)}: {varied}: {one.run_dir} ===")
        out.append(run_job(one, log=log))
    return out


def run_job(settings, resume: str | None = None, evaluate: bool = False, log=print) -> dict:
    """``prepare`` + ``fit`` (or ``evaluate_only``), then leave the process group; the results on every rank."""
    try:
        with prepare(settings, resume=resume, evaluate=evaluate, log=log) as job:
            return evaluate_only(job) if evaluate else fit(job)
    except BaseException:
        if settings.distributed and settings.rank == 0:
            time.sleep(2.0)   # rank 0 hosts the store: let the others read why before this process exits
        raise
    finally:
        distributed.teardown()


def evaluate_only(job) -> dict:
    """Evaluate the weights of ``job.state`` (rank 0's checkpoint, sent to all ranks)."""
    settings, ctx, data, model, logger, resume = job.settings, job.ctx, job.data, job.model, job.logger, job.resume
    wait_for_the_others("evaluating", job)
    load_model_state(unwrap(model), job.state["model"])
    val = evaluate(model, data.val, settings, ctx)
    logger.info(f"evaluated {resume} on {val['count']} images: loss {val['loss']:.4f} "
                f"acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f}")
    results = summarize(settings, ctx, val, [], {"wall_time_s": 0.0, "best_acc1": val["acc1"], "parallel": job.parallel,
                                                 "comm": "none", "resumed_from": None, "cost": None})
    logger.results(results)
    return results

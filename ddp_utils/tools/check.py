"""``python -m ddp_utils check``: is this node ready to train? Prints what it found; True when ready.

Run it on every node with the same flags as ``train``. With several ranks the checks build the real process group
(``distributed.setup``: the store on master_port, every rank reaching every other on a random port as gloo and
NCCL will, ``init_process_group`` on the chosen backend), compare every node's data (images and classes per split:
NOT READY (data) on every rank, naming which node sees what, if they differ) and all-reduce payloads up to the
model's gradient size, so READY proves the collective training will run, not just a TCP hello to one port; rank 0
saves the sweep for ``report``. Flags that differ between the nodes are NOT READY (settings), a runs folder rank 0
cannot write NOT READY (local), on every rank.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from .. import collectives, datasets, distributed
from ..robust import peers
from ..datasets import DataError, check_data
from ..progress import interactive
from ..collectives import SettingsMismatch
from ..distributed import DistSetupError
from ..robust import compat
from ..data import loader_for
from ..robust.preflight import SMALL_SHM, hardware_report, preflight, resolve_backend
from . import sweep


def nvjpeg_line(settings, cuda: bool) -> str:
    """What --loader nvjpeg will do on this node: the training's own warning where the GPU has no hardware JPEG
    decoder (T4, A10), so that the check says it before the run does."""
    if not cuda:
        return "loader nvjpeg: no GPU here, so the CPU decodes (a rehearsal: --loader workers is faster on a CPU)"
    from ..speed.nvjpeg import decoder_warning
    warning = decoder_warning(torch.device("cuda", settings.local_rank))
    return warning or "loader nvjpeg: torchvision decodes the JPEGs on the GPU's hardware JPEG decoder (nvJPEG)"


def run_check(settings, log=print, verify_images: bool = False) -> bool:
    ok, network = True, True
    log = _once(log)   # setup's pre-flight repeats lines the check has printed
    log(f"== rank {settings.rank} of {settings.world_size}, master {settings.master_addr}:{settings.master_port}")
    try:
        report = preflight(settings, log=log)
        gpus = ", ".join(report["gpus"]) or "none (CPU only)"
        log(f"backend {report['backend']}; GPUs: {gpus}; NCCL {report['nccl_version'] or '-'}; torch {report['torch']}")
        paths = compat.paths(report["backend"])   # what this torch takes where releases differ
        log(f"  rank 0's store: {paths['store']}\n"
            f"  a hung collective is stopped by {paths['hung collective']}\n"
            f"  collectives wait: {paths['collective timeout']}")
        shm = report["shm_bytes"]
        log(f"/dev/shm: {shm / 2**30:.1f} GiB" if shm is not None else "/dev/shm: not present")
        if settings.distributed:
            log(f"interface {report['interface']} ({report['local_ip']}); port {settings.master_port}: "
                f"{report['port_status']}")
    except DistSetupError as exc:
        log(f"NOT READY (network): {exc}")
        ok = network = False
    for problem in hardware_problems(settings, hardware_report()):
        log(f"NOT READY (hardware): {problem}")
        ok = False
    summary, data_error = None, None
    try:
        summary = check_data(settings)
        log(f"data {settings.dataset} at {settings.data_dir}: {_splits(summary)}")
        if settings.loader == "dali":   # training would stop at its first batch without it
            from ..speed.dali import check_dali_dataset
            log(f"loader dali: NVIDIA DALI {check_dali_dataset(settings.dataset)}")
        if settings.loader == "nvjpeg":   # the same: a PNG preset or a torchvision without decoders stops it
            from ..speed.nvjpeg import check_nvjpeg_dataset
            check_nvjpeg_dataset(settings.dataset)
            log(nvjpeg_line(settings, hardware_report()["cuda"]))
        if verify_images:
            checked, bad = datasets.verify_images(settings, progress=interactive())
            if bad:
                shown = "; ".join(f"{path} ({why[:80]})" for path, why in bad[:5])
                raise DataError(f"{len(bad)} of {checked} images cannot be decoded: {shown}"
                                f"{' ...' if len(bad) > 5 else ''}. Delete them or replace them with good copies "
                                f"(every node needs its own good copy).")
            log(f"verified {checked} images: every one decodes")
    except DataError as exc:
        log(f"NOT READY (data): {exc}")
        ok, data_error = False, str(exc)
    if network and settings.distributed:   # also when this node's data is wrong: the others wait for it
        ok = _prove_collective(settings, summary, log, data_error) and ok
    log("READY" if ok else "NOT READY")
    return ok


def hardware_problems(settings, report: dict) -> list[str]:
    """What on this node would make the run other than the homework's: a GPU container without its GPU
    (training would quietly run on the CPU, hours per epoch), /dev/shm too small for the loader's workers."""
    problems = []
    ngc = os.environ.get("NVIDIA_PYTORCH_VERSION")   # set in NVIDIA's PyTorch containers (and ours, built on one)
    if ngc and not report["cuda"] and settings.backend != "gloo":
        problems.append(f"this is NVIDIA's PyTorch container {ngc}, but it sees no GPU (torch.cuda.is_available() "
                        f"is False), so training would run on the CPU. Start the container with --gpus all "
                        f"(docker/run.sh does) and check `nvidia-smi` on the node; to rehearse on a CPU on purpose, "
                        f"pass --backend gloo.")
    shm = report["shm_bytes"]
    if shm is not None and shm < SMALL_SHM and settings.workers > 0 and loader_for(settings) == "workers":
        problems.append(f"/dev/shm is only {shm >> 20} MiB, and the {settings.workers} DataLoader worker(s) per process "
                        f"pass every batch through it: they die with 'Bus error' below {SMALL_SHM >> 30} GiB. Start "
                        f"Docker with --ipc=host or --shm-size=2g (docker/run.sh passes --ipc=host), or use --workers 0.")
    return problems


def _prove_collective(settings, summary: dict | None, log, data_error: str | None = None) -> bool:
    """Join the real process group (as train does), compare every node's data, all-reduce payloads up to the model's
    gradient size, leave. Rank 0 saves the sweep under the runs folder's ``check/`` for ``report``."""
    if resolve_backend(settings) == "nccl":
        os.environ.setdefault("NCCL_DEBUG", "INFO")         # NCCL's own lines: which interface it uses (NET/Socket)
        os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    try:
        ctx = distributed.setup(settings, log=log)
    except SettingsMismatch as exc:   # the nodes were reached: their flags differ
        log(f"NOT READY (settings): {exc}")
        return False
    except DistSetupError as exc:
        log(f"NOT READY (network): {exc}")
        return False
    try:
        # First the data, with a collective whose size depends on nothing: a rank sizing the sweep from its own class
        # count would all-reduce another size than the others (gloo aborts the process, NCCL hangs)
        facts = collectives.gather_objects(_data_facts(ctx.rank, summary, data_error), ctx)
        differ = _data_differ(facts)
        if differ:
            log(f"NOT READY (data): {differ}")
            return False
        gradient_bytes = _gradient_bytes(settings, facts[0])   # rank 0's data: the same plan on every rank
        log(f"all-reduce over the process group ({ctx.backend}, {ctx.world_size} ranks), up to the "
            f"{gradient_bytes / 1e6:.1f} MB of {settings.arch}'s gradients; busbw as nccl-tests defines it:")
        rows = sweep.run(ctx, gradient_bytes)
        log(sweep.table(rows))
        # rank 0's write, told to every rank: a runs folder it cannot write is one verdict everywhere, not a network's
        wrote = collectives.gather_objects(_save_sweep(settings, ctx, rows), ctx)[0]
        if "error" in wrote:
            log(f"NOT READY (local): {wrote['error']}")
            return False
        if ctx.is_main:
            log(f"saved {wrote['path']} (`python -m ddp_utils report` shows it beside the run's link probe)")
        return True
    except sweep.WrongSum as exc:   # every rank got the same verdict (sweep.run agrees on it)
        log(f"NOT READY (network): the process group formed, but {exc}. Training would average wrong gradients: "
            f"compare the torch and NCCL versions each node printed above, then run the check again on every node.")
        return False
    except Exception as exc:   # noqa: BLE001 - a collective that fails after the group formed is the finding
        log(f"NOT READY (network): the process group formed, but an all-reduce failed: "
            f"{(str(exc).splitlines() or [type(exc).__name__])[0][:300]}. Allow all TCP between the nodes and "
            f"run the check again on every node.")
        return False
    finally:
        distributed.teardown()


def _save_sweep(settings, ctx, rows: list[dict]) -> dict | None:
    """Rank 0 saves the sweep under the runs folder's ``check/``: ``{"path": ...}``, or ``{"error": paragraph}``
    when it cannot write there; None on the other ranks."""
    if not ctx.is_main:
        return None
    folder = (Path(settings.run_dir).parent if settings.run_dir else Path("runs")) / "check"
    try:
        return {"path": str(sweep.save(folder, settings, ctx.backend, rows))}
    except OSError as exc:
        return {"error": f"rank 0{peers.where(0)} could not write the check's results to {folder} "
                         f"({exc.strerror or exc}). The network and the data are fine; the runs folder on rank 0's "
                         f"node must be writable for training too: fix its permissions or free its disk (or pass "
                         f"--run-dir to a writable place), then run the check again on every node."}


def _data_facts(rank: int, summary: dict | None, data_error: str | None) -> dict:
    """What this rank tells the others of its data: images and classes per split and the class names, or why its
    data check failed; and where it runs (hosts in namespaces share one name, so also its address)."""
    where = peers.where(rank) or f" (on {socket.gethostname()})"
    if summary is None:
        return {"rank": rank, "where": where, "error": data_error or "its data check did not run"}
    return {"rank": rank, "where": where, "splits": summary["splits"], "classes": summary.get("classes")}


def _data_differ(facts: list[dict]) -> str | None:
    """The NOT READY (data) paragraph when the ranks' data differ or a rank's check failed; None when they agree."""
    def seen(f: dict) -> tuple:
        return f.get("error"), f.get("splits"), f.get("classes")
    if all(seen(f) == seen(facts[0]) and not f.get("error") for f in facts):
        return None
    groups: dict[str, list[dict]] = {}   # the ranks that see the same, in rank order
    for f in facts:
        groups.setdefault(repr(seen(f)), []).append(f)
    said = []
    for same in groups.values():
        f, many = same[0], len(same) > 1
        if f.get("error"):   # its own output has the whole paragraph; here the first sentence says enough
            said.append(f"{_who(same)} cannot use {'their' if many else 'its'} data "
                        f"({f['error'].split('. ')[0][:300]}; {'their' if many else 'its'} own output says more)")
        else:
            said.append(f"{_who(same)} {'see' if many else 'sees'} {_splits(f)}{_other_classes(f, facts[0])}")
    return (f"the nodes' data differ: {'; '.join(said)}. Every rank must train on the same data (the model has one "
            f"output per class folder, and each step all-reduces gradients of one size on every rank). Put the same "
            f"data folder on every node (copy the full one: `rsync -a DATA_DIR/ other-node:DATA_DIR/`), then run the "
            f"check again on every node.")


def _who(same: list[dict]) -> str:
    """``rank 1 (on host-b, 10.0.0.2)``, or ``ranks 0, 1 (on host-a, 10.0.0.1)`` for ranks on one node."""
    by_node: dict[str, list[int]] = {}
    for f in same:
        by_node.setdefault(f["where"], []).append(f["rank"])
    return " and ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}{where}"
                        for where, ranks in by_node.items())


def _other_classes(f: dict, first: dict) -> str:
    """`` but class folders 'x' where rank 0 has 'y'`` when the same counts hide other class names, else ""."""
    mine, theirs = f.get("classes") or [], first.get("classes") or []
    if len(mine) != len(theirs) or mine == theirs:   # other counts say it already
        return ""
    own, others = [c for c in mine if c not in theirs][:3], [c for c in theirs if c not in mine][:3]
    return (f", but class folders {', '.join(map(repr, own)) or 'in another order'} where rank {first['rank']} has "
            f"{', '.join(map(repr, others)) or 'them in another order'}")


def _splits(summary: dict) -> str:
    """``train 900 images / 10 classes, val 50 images / 10 classes``."""
    return ", ".join(f"{name} {s['images']} images / {s['classes']} classes" for name, s in summary["splits"].items())


def _gradient_bytes(settings, summary: dict | None) -> int:
    """The fp32 gradient of ``settings.arch``: what DDP all-reduces every step."""
    from ..model import build_model
    from ..presets import PRESETS
    classes = PRESETS[settings.dataset].num_classes if settings.dataset in PRESETS else None
    if summary and summary.get("splits"):
        classes = next(iter(summary["splits"].values()))["classes"]
    size = settings.image_size or (PRESETS[settings.dataset].image_size if settings.dataset in PRESETS else 0)
    model = build_model(settings.arch, classes or 1000, image_size=size)   # a ViT's position embedding: size's
    return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def _once(log):
    """``log`` that prints a line only the first time (setup's pre-flight says again what the check said)."""
    seen: set[str] = set()

    def say(text: str) -> None:
        if text not in seen:
            seen.add(text)
            log(text)
    return say

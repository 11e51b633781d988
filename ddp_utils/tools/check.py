"""``python -m ddp_utils check``: is this node ready to train? Prints what it found; True when ready.

Run it on every node with the same flags as ``train``. With several ranks the checks build the real process group
(``distributed.setup``: the store on master_port, every rank reaching every other on a random port as gloo and
NCCL will, ``init_process_group`` on the chosen backend) and all-reduce payloads up to the model's gradient size,
so READY proves the collective training will run, not just a TCP hello to one port; rank 0 saves the sweep for
``report``.
"""
from __future__ import annotations

import os
from pathlib import Path

from .. import datasets, distributed
from ..datasets import DataError, check_data
from ..progress import interactive
from ..distributed import DistSetupError
from ..robust import compat
from ..data import loader_for
from ..robust.preflight import SMALL_SHM, hardware_report, preflight, resolve_backend
from . import sweep


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
    summary = None
    try:
        summary = check_data(settings)
        splits = ", ".join(f"{name} {s['images']} images / {s['classes']} classes"
                           for name, s in summary["splits"].items())
        log(f"data {settings.dataset} at {settings.data_dir}: {splits}")
        if settings.loader == "dali":   # training would stop at its first batch without it
            from ..speed.dali import check_dali_dataset
            log(f"loader dali: NVIDIA DALI {check_dali_dataset(settings.dataset)}")
        if settings.loader == "nvjpeg":   # the same: a PNG preset or a torchvision without decoders stops it
            from ..speed.nvjpeg import check_nvjpeg_dataset
            check_nvjpeg_dataset(settings.dataset)
            log("loader nvjpeg: torchvision decodes the JPEGs on the GPU (nvJPEG)" if hardware_report()["cuda"] else
                "loader nvjpeg: no GPU here, so the CPU decodes (a rehearsal: --loader workers is faster on a CPU)")
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
        ok = False
    if network and settings.distributed:   # also when this node's data is wrong: the others wait for it
        ok = _prove_collective(settings, summary, log) and ok
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


def _prove_collective(settings, summary: dict | None, log) -> bool:
    """Join the real process group (as train does), all-reduce payloads up to the model's gradient size, leave.
    Rank 0 saves the sweep under the runs folder's ``check/`` for ``report``."""
    if resolve_backend(settings) == "nccl":
        os.environ.setdefault("NCCL_DEBUG", "INFO")         # NCCL's own lines: which interface it uses (NET/Socket)
        os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    try:
        ctx = distributed.setup(settings, log=log)
    except DistSetupError as exc:
        log(f"NOT READY (network): {exc}")
        return False
    try:
        gradient_bytes = _gradient_bytes(settings, summary)
        log(f"all-reduce over the process group ({ctx.backend}, {ctx.world_size} ranks), up to the "
            f"{gradient_bytes / 1e6:.1f} MB of {settings.arch}'s gradients; busbw as nccl-tests defines it:")
        rows = sweep.run(ctx, gradient_bytes)
        log(sweep.table(rows))
        if ctx.is_main:
            folder = (Path(settings.run_dir).parent if settings.run_dir else Path("runs")) / "check"
            log(f"saved {sweep.save(folder, settings, ctx.backend, rows)} (`python -m ddp_utils report` shows it "
                f"beside the run's link probe)")
        return True
    except Exception as exc:   # noqa: BLE001 - a collective that fails after the group formed is the finding
        log(f"NOT READY (network): the process group formed, but an all-reduce failed: "
            f"{(str(exc).splitlines() or [type(exc).__name__])[0][:300]}. Allow all TCP between the nodes and "
            f"run the check again on every node.")
        return False
    finally:
        distributed.teardown()


def _gradient_bytes(settings, summary: dict | None) -> int:
    """The fp32 gradient of ``settings.arch``: what DDP all-reduces every step."""
    from ..model import build_model
    from ..presets import PRESETS
    classes = PRESETS[settings.dataset].num_classes if settings.dataset in PRESETS else None
    if summary and summary.get("splits"):
        classes = next(iter(summary["splits"].values()))["classes"]
    model = build_model(settings.arch, classes or 1000)
    return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def _once(log):
    """``log`` that prints a line only the first time (setup's pre-flight says again what the check said)."""
    seen: set[str] = set()

    def say(text: str) -> None:
        if text not in seen:
            seen.add(text)
            log(text)
    return say

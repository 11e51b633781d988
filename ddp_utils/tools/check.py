"""``python -m ddp_utils check``: is this node ready to train? Prints what it found; True when ready.

Run it on every node with the same flags as ``train``. With several ranks, rank 0's check listens on
master_port for up to init_timeout seconds and reports each worker whose check reaches it, so one
run proves the address, the port and the firewall before any training starts.
"""
from __future__ import annotations

import os
import socket
import time

from .. import datasets
from ..datasets import DataError, check_data
from ..progress import interactive
from ..distributed import DistSetupError
from ..robust import compat
from ..data import loader_for
from ..robust.preflight import SMALL_SHM, hardware_report, preflight

HELLO = b"ddp_utils-check rank="


def run_check(settings, log=print, verify_images: bool = False) -> bool:
    ok = True
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
        ok = False
    for problem in hardware_problems(settings, hardware_report()):
        log(f"NOT READY (hardware): {problem}")
        ok = False
    try:
        summary = check_data(settings)
        splits = ", ".join(f"{name} {s['images']} images / {s['classes']} classes"
                           for name, s in summary["splits"].items())
        log(f"data {settings.dataset} at {settings.data_dir}: {splits}")
        if settings.loader == "dali":   # training would stop at its first batch without it
            from ..speed.dali import check_dali_dataset
            log(f"loader dali: NVIDIA DALI {check_dali_dataset(settings.dataset)}")
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
    if ok and settings.distributed:
        ok = _meet_workers(settings, log) if settings.rank == 0 else _greet_master(settings, log)
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


def _meet_workers(settings, log) -> bool:
    """Rank 0: listen on master_port until every other rank's check has said hello (or time is up)."""
    expected = set(range(1, settings.world_size))
    log(f"waiting up to {settings.init_timeout:g} s for the checks of ranks {sorted(expected)} ...")
    deadline = time.monotonic() + settings.init_timeout
    with socket.create_server(("", settings.master_port), reuse_port=False) as server:
        server.settimeout(0.5)
        while expected and time.monotonic() < deadline:
            try:
                conn, (peer, _) = server.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(2.0)
                try:
                    line = conn.recv(64)
                except OSError:
                    continue
            if line.startswith(HELLO):
                rank = int(line[len(HELLO):].strip() or -1)
                expected.discard(rank)
                log(f"rank {rank} reached this node from {peer}")
    if expected:
        log(f"ranks {sorted(expected)} did not reach {settings.master_addr}:{settings.master_port} within "
            f"{settings.init_timeout:g} s: run the same check there, and see the troubleshooting table.")
        return False
    return True


def _greet_master(settings, log) -> bool:
    with socket.create_connection((settings.master_addr, settings.master_port), timeout=5) as conn:
        conn.sendall(HELLO + str(settings.rank).encode() + b"\n")
    log(f"said hello to the master's check at {settings.master_addr}:{settings.master_port}")
    return True

"""Every rank's device, compared before the process group is built, so that the ranks agree on a backend.

Each rank decides alone what ``backend="auto"`` means (nccl with a GPU, else gloo), and alone which
GPU it takes (``cuda:local_rank``). Two ways that goes wrong on the students' nodes, both seen only
after ``init_process_group`` has waited out its timeout and blamed the network:

- one node's container was started without ``--gpus``: auto gives nccl on one rank and gloo on the
  other, and the group can never form;
- both notebooks on one single-GPU machine (a rehearsal): both ranks take cuda:0, and NCCL refuses
  two ranks on one GPU ("duplicate GPU").

So each rank shares ``device_facts`` through the rendezvous store, and every rank runs
``agree_on_backend`` (and ``agree_on_precision``: amp=auto is bf16 on an A100, fp16 on a T4) on the same
list: the same answer, or the same paragraph naming the node, on every rank, before any backend starts.
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from .preflight import DistSetupError
from .threads import machine_id


def device_facts(settings, device: torch.device, precision: str) -> dict:
    """What the other ranks must know of this rank's device: its machine, its GPU (an id unique across
    machines; None without a GPU), what this rank alone would choose for backend=auto, and the ``precision`` it
    would train in ("bf16", "fp16", "fp32", or "error: ..." where amp asks for what this GPU lacks)."""
    gpu = name = None
    if device.type == "cuda":
        gpu, name = gpu_id(device), torch.cuda.get_device_name(device)
    alone = "nccl" if gpu and dist.is_nccl_available() else "gloo"
    return {"rank": settings.rank, "host": socket.gethostname(), "machine": machine_id(), "gpu": gpu,
            "gpu_name": name, "auto": alone, "precision": precision, "torch": str(torch.__version__),
            "pid": os.getpid(), "pid_space": pid_space()}


def pid_space() -> str | None:
    """This process's PID namespace: two containers on one machine (without --pid=host) share its boot id but
    number their processes apart, so a PID names a process only within one of these."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _running(pid: int) -> bool:
    """Whether process ``pid`` still runs: a zombie (ended, not yet reaped by its launcher) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # it exists (another user's: not ours to signal)
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # the state follows the command's name
    except (OSError, IndexError):
        return True


def ended_beside(peers: dict[int, dict]) -> str:
    """", after rank 7 on the same machine had ended (...)" when a rank on this machine has already ended: torchrun's
    agent SIGTERMs a machine's other ranks when one of them ends, and the ended one (killed, out of memory) reports
    nothing, so the SIGTERMed rank's report names it, or the other machines would blame the rank SIGTERMed. ""
    when none has (a scheduler's SIGTERM to every rank: they all still run)."""
    ended = []
    for rank, facts in sorted(peers.items()):
        if (facts.get("machine") != machine_id() or facts.get("pid_space") != pid_space()
                or facts.get("pid") in (None, os.getpid())):
            continue   # another machine, or another container's PIDs (its numbers mean nothing here)
        if not _running(facts["pid"]):
            ended.append(str(rank))
    if not ended:
        return ""
    which = f"rank {ended[0]}" if len(ended) == 1 else f"ranks {', '.join(ended)}"
    return (f", after {which} on the same machine had ended (a launcher stops a machine's other ranks when one of them "
            f"ends: look at {which} first)")


def torch_releases_differ(facts: list[dict]) -> str:
    """A warning when the ranks run different torch builds (say, two NGC releases), else "": the kit's paths
    for the store, the abort and the timeouts may then differ between the ranks (robust/compat.py)."""
    builds = {f.get("torch") for f in facts}
    if len(builds) < 2:
        return ""
    said = ", ".join(f"{f.get('torch')} on {_who([f])}" for f in sorted(facts, key=lambda f: f["rank"]))
    return (f"warning: the ranks run different torch builds ({said}). They may still train together, but "
            f"nothing is tested that way: use the same container image (docker/Dockerfile, one NGC_TAG) on every node")


def gpu_id(device: torch.device) -> str:
    """The GPU's UUID where torch gives it; else machine + PCI bus (the same GPU under any CUDA_VISIBLE_DEVICES)."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid:
        return str(uuid)
    bus = getattr(props, "pci_bus_id", None)
    where = f"pci {bus}" if bus is not None else f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}/{device}"
    return f"{machine_id()}/{where}"


def agree_on_backend(facts: list[dict], requested: str) -> tuple[str, str]:
    """``(backend, note)`` for every rank, from every rank's ``device_facts``; ``note`` (may be "") says
    what was decided and why. Raises DistSetupError (the same on every rank) when no backend can work."""
    ranks = sorted(facts, key=lambda f: f["rank"])
    without = [f for f in ranks if f["gpu"] is None]
    with_gpu = [f for f in ranks if f["gpu"] is not None]
    if requested in ("auto", "nccl") and without and with_gpu:
        raise DistSetupError(
            f"{_who(without)} {'has' if len(without) == 1 else 'have'} no usable GPU (PyTorch sees none there), "
            f"while {_who(with_gpu)} {'has' if len(with_gpu) == 1 else 'have'} one ({with_gpu[0]['gpu_name']}). "
            f"With backend={requested} the GPU ranks need nccl, which the others cannot join. Most likely that "
            f"node's container was started without --gpus all (run nvidia-smi inside it to see). Restart it with "
            f"--gpus all and run setup again on every node; or set backend='gloo' on every rank to train on "
            f"that node's CPU (much slower).")
    shared = _sharing(with_gpu)
    if shared and requested == "nccl":
        raise DistSetupError(
            f"{shared}: NCCL needs a GPU of its own for each rank and refuses a shared one (\"duplicate GPU\"). "
            f"On a node with several GPUs give each rank its own local_rank (0, 1, ...; `python -m ddp_utils "
            f"launch` does that); to rehearse both notebooks on one single-GPU machine use backend='auto' or "
            f"'gloo', which can share a GPU.")
    if requested == "auto":
        if shared:
            return "gloo", (f"{shared}, a rehearsal on one machine: NCCL cannot share a GPU between ranks, so "
                            f"every rank uses gloo (a slower all-reduce; nodes with a GPU each use nccl)")
        return ("nccl" if all(f["auto"] == "nccl" for f in ranks) else "gloo"), ""
    if without and with_gpu:   # gloo asked for: it works, but the CPU ranks set the pace
        return requested, (f"{_who(without)} will train on the CPU and {_who(with_gpu)} on a GPU: every step "
                           f"waits for the CPU ranks")
    return requested, ""


def agree_on_precision(facts: list[dict], amp: str) -> str:
    """The precision every rank computes in ("bf16", "fp16" or "fp32"), or DistSetupError (the same on every
    rank). With amp=auto, nodes of different GPUs (an A100 and a T4) would pick bf16 on one and fp16 with a
    scaler on the other: the scaler's skipped steps would then apply on some ranks only."""
    ranks = sorted(facts, key=lambda f: f["rank"])
    for f in ranks:
        if f.get("precision", "").startswith("error: "):
            raise DistSetupError(f"{_who([f])}: {f['precision'][len('error: '):]}")
    kinds = {f.get("precision") for f in ranks}
    if len(kinds) > 1:
        said = "; ".join(f"{f['precision']} on {_who([f])}, {f['gpu_name'] or 'no GPU'}" for f in ranks)
        fix = ("set amp=off on every rank (a rank without a GPU computes in fp32)" if any(not f.get("gpu") for f in ranks)
               else "set amp=fp16 on every rank (it runs on every GPU, with the gradient scaler), or use nodes of "
                    "one GPU type")
        raise DistSetupError(f"amp={amp} gives different precisions on the ranks ({said}). Every rank must compute "
                             f"alike: {fix}.")
    return kinds.pop() if kinds else "fp32"


def _who(facts: list[dict]) -> str:
    """"rank 1 (host node-b)" or "ranks 1, 2 (hosts b, c)"."""
    ranks = ", ".join(str(f["rank"]) for f in facts)
    hosts = ", ".join(dict.fromkeys(f["host"] for f in facts))
    return f"rank {ranks} (host {hosts})" if len(facts) == 1 else f"ranks {ranks} (hosts {hosts})"


def _sharing(with_gpu: list[dict]) -> str:
    """"ranks 0, 1 (host h) both use the GPU Tesla T4 (GPU-..)" for the first GPU used by several ranks, or ""."""
    by_gpu: dict[str, list[dict]] = {}
    for f in with_gpu:
        by_gpu.setdefault(f["gpu"], []).append(f)
    for gpu, users in by_gpu.items():
        if len(users) > 1:
            return f"{_who(users)} all use the same GPU, {users[0]['gpu_name']} ({gpu})"
    return ""

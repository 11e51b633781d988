"""CPU threads per process: ranks that share a machine share its cores instead of fighting over them.

PyTorch gives every process as many threads as the machine has cores. Two ranks rehearsed on one
machine (two notebooks, ``demo``, two network namespaces) then run 2 x cores threads on cores
cores, and DDP ends up many times slower than one process. ``set_threads`` gives each process
``cores / ranks on this machine`` threads (at least 1), once, before training, and says so.
``OMP_NUM_THREADS`` (torchrun sets it to 1) and the ``threads`` setting win over the automatic choice.
On a GPU the threads matter little (the GPU computes), so the same rule does no harm there.
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def machine_id() -> str:
    """Names this machine, not this network namespace: namespaces share the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def ranks_on_this_machine(ctx) -> int:
    """How many ranks of the job run on this machine (a collective: call it on every rank)."""
    if not ctx.distributed:
        return 1
    ids: list = [None] * ctx.world_size
    dist.all_gather_object(ids, machine_id())
    return ids.count(machine_id())


def cpu_cores() -> int:
    """The cores this process may run on (a container or taskset may allow fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def choose_threads(setting: int, cores: int, ranks_here: int, environ=None) -> tuple[int, str]:
    """(threads, why) for one process: the setting, else OMP_NUM_THREADS, else cores / ranks here."""
    env = os.environ if environ is None else environ
    if setting > 0:
        return setting, "the threads setting"
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    return max(1, cores // ranks_here), f"{cores} cores / {ranks_here} rank(s) on this machine"


def set_threads(settings, ctx, log=print) -> int:
    """Set this process's torch threads (see the module docstring); every rank must call it."""
    ranks_here = ranks_on_this_machine(ctx)
    threads, why = choose_threads(settings.threads, cpu_cores(), ranks_here)
    torch.set_num_threads(threads)
    if ctx.is_main:
        log(f"CPU threads per process: {threads} ({why})")
    return threads

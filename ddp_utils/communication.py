"""How DDP's gradients travel, as a table: one row per ``--comm`` choice (``COMMS``).

DDP all-reduces every bucket of gradients during the backward pass; a communication hook may replace that
all-reduce (``DistributedDataParallel.register_comm_hook``). Each row is a choice: its name, what it does, what
trains with it (the epoch line's algorithm), and the hook with its state for a run. speed/comm.py registers the
exact all-reduce (``none``), half precision (``fp16``, ``bf16``) and PowerSGD, speed/localsgd.py local SGD;
speed/comm.py also decides ``auto`` from the link probe, times the hook and keeps its state in the checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Comm:
    """One way DDP's gradients travel (``--comm NAME``): a row of ``COMMS``."""
    name: str
    about: str          # what it sends, for --help
    algorithm: str      # what trains, for the epoch line, results.json and the report ("DDP, bf16 gradients")
    hook: Callable      # (settings, total_steps) -> (hook, state) to register on the DDP model


COMMS: dict[str, Comm] = {}


def register_comm(comm: Comm) -> Comm:
    """Add a row: ``--comm NAME`` then sends the gradients with its hook."""
    if comm.name in COMMS or comm.name == "auto":
        raise ValueError(f"comm {comm.name!r} is registered twice (or is 'auto', which picks one)")
    COMMS[comm.name] = comm
    return comm


def describe_comms() -> str:
    """``--comm``'s help: each row, in the table's order."""
    return ", ".join(f"{name} ({row.about})" for name, row in COMMS.items())

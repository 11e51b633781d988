"""The collectives the kit uses, each a no-op with one process, so the same code runs on one rank and on many.

``agree`` (every rank passed the same values, or a paragraph on every rank), ``all_reduce_sum``, ``sync_buffers``
(rank 0's BatchNorm statistics everywhere), ``barrier``, and the object collectives (``gather_objects``,
``gather_to_main``, ``broadcast_object``) that carry figures and decisions between the ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .robust.preflight import DistSetupError


class SettingsMismatch(DistSetupError):
    """The ranks were started with different settings (say, one notebook edited and not the other)."""


# -- collectives (no-ops with one process) ----------------------------------------------------
def agree(values: dict, ctx, what: str = "settings") -> None:
    """Check that every rank passed equal ``values``; raise SettingsMismatch on every rank if not.

    The message names each differing key and every rank's value for it.
    """
    if not ctx.distributed:
        return
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, values)
    keys = dict.fromkeys(k for g in gathered for k in g)  # union, in order of appearance
    differences = []
    for key in keys:
        per_rank = [g.get(key, "<missing>") for g in gathered]
        if any(v != per_rank[0] for v in per_rank):
            values_ = ", ".join(f"rank {r} has {v!r}" for r, v in enumerate(per_rank))
            differences.append(f"{key}: {values_}")
    if differences:
        raise SettingsMismatch(
            f"rank {ctx.rank}: the ranks disagree on {what} -- {'; '.join(differences)}. Every rank "
            f"must use the same {what}, or they would silently train different things; edit the "
            f"notebooks/flags so they match (main.ipynb and worker.ipynb should differ only in the "
            f"rank) and run setup again on every node.")


def all_reduce_sum(t: torch.Tensor, ctx) -> torch.Tensor:
    """Sum ``t`` over all ranks, in place (any shape); returns ``t``. NCCL needs a CUDA copy."""
    if not ctx.distributed:
        return t
    if ctx.backend == "nccl" and t.device.type != "cuda":
        on_gpu = t.to(ctx.device)
        dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM)
        return t.copy_(on_gpu)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def sync_buffers(module: torch.nn.Module, ctx, src: int = 0) -> None:
    """Copy rank ``src``'s buffers (BatchNorm running statistics) to every rank, in place.

    During training each rank updates its BatchNorm statistics from its own batches, so after the
    last step they differ slightly; evaluation then uses rank 0's, the ones the checkpoint holds.
    """
    if ctx.distributed:
        for buffer in module.buffers():
            dist.broadcast(buffer, src)


def barrier(ctx) -> None:
    """Wait until every rank gets here."""
    if ctx.distributed:
        dist.barrier(device_ids=[ctx.local_rank] if ctx.backend == "nccl" else None)


def gather_objects(obj, ctx) -> list:
    """Every rank's ``obj`` (any picklable object), as a list by rank, on every rank."""
    if not ctx.distributed:
        return [obj]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def gather_to_main(obj, ctx) -> list | None:
    """Every rank's ``obj`` as a list by rank on rank 0 (what it alone writes), None on the others."""
    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj, ctx, src: int = 0):
    """Rank ``src``'s ``obj`` (any picklable object), returned on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=ctx.device if ctx.backend == "nccl" else None)
    return box[0]

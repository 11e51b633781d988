"""ZeRO-1 and FSDP: the next step past DDP, each rank keeping a share of what every DDP rank holds in full.

Under DDP every rank holds the whole model: its parameters, their gradients and the optimizer's state (SGD's
momentum). With P parameters in fp32 on N ranks (the ZeRO paper's accounting, Rajbhandari et al. 2020), bytes per
rank::

    ddp     4P (params) + 4P (grads) + K*P (optimizer state; SGD with momentum K = 4, Adam K = 8)
    zero1   4P + 4P + K*P/N             (--parallel zero1: DDP, and ZeroRedundancyOptimizer shards the state)
    fsdp    (4P + 4P + K*P)/N + 4B      (--parallel fsdp: FSDP2's fully_shard; B: the largest block's
                                         parameters, all-gathered while it computes)

- ``zero1``: DDP all-reduces the gradients as before; ``torch.distributed.optim.ZeroRedundancyOptimizer`` gives
  each rank whole parameters to update (about 1/N of them, by size), keeps their optimizer state only, and
  broadcasts the updated weights after each step (``optim.build_optimizer(..., zero=True)`` makes it).
- ``fsdp``: ``fully_shard`` on each block (a conv block, a ResNet stage: a child of the model with layers of its
  own) and on the root: every parameter becomes a DTensor of which each rank holds 1/N (dim 0, padded). Before a
  block computes, its shards are all-gathered; after its backward its gradients are reduce-scattered, so each rank
  keeps the gradient of its own shard, and the optimizer updates shards only. Every rank must therefore run every
  forward, evaluation included (``forwards_to_add``).

Both register in the core's table of parallel modes (parallel.py) as ``ZeRO1`` and ``FSDP``. The kit's checkpoints
stay plain whatever the mode (each mode's ``full_state``, ``load_model``, ``load_optimizer``):
rank 0 writes one process's ``model.state_dict()`` and SGD's ``state_dict()`` (ZeRO consolidates its shards on rank
0 first; FSDP gathers with ``torch.distributed.checkpoint.state_dict``, full and on the CPU), so a checkpoint resumes
in any mode and on any number of ranks. Loading converts without side effects: the state given is never
changed, then or later (torch's FSDP loader gets a copy of the mapping, which it fills with shards; SGD and ZeRO a
copy of the optimizer state, whose tensors a CPU run would otherwise step in place), and nothing of it is held
after the call but what the model and optimizer copied (tests/test_mode_matrix.py checks both). ``held_bytes``
measures what this rank holds (local shards only), ``memory_results`` puts it beside the formula in results.json. docs/zero-fsdp.md says when each wins.
"""
from __future__ import annotations

import contextlib
import copy
import weakref

import torch
from torch import nn

from .. import collectives, parallel
from ..model import unwrap
from ..observers import Observer, register
from ..parallel import Mode, drop_groups, local_part
from ..robust import compat

STATE_BYTES = {"sgd": 4, "adam": 8}   # K: optimizer state per parameter, fp32 (SGD: momentum; Adam: two moments)
NOT_ON_CPU = "not measured on CPU"    # results.json's peak on a CPU run (torch keeps no allocator peak there)

# FSDP: a meta-device copy of each sharded model, taken before sharding: the layer table's forward runs on it on
# rank 0 alone (the sharded model's forward all-gathers: the other ranks would have to join)
_BLUEPRINTS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()
# FSDP: the units a model's registry entry chose (architectures.py: a ViT's encoder blocks), by name, for the model
# and its blueprint alike
_UNITS: "weakref.WeakKeyDictionary[nn.Module, list[str]]" = weakref.WeakKeyDictionary()


# -- FSDP: sharding the model ------------------------------------------------------------------------
def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's FSDP units: those its registry entry chose when it was sharded, else its children that hold
    layers of their own and parameters (a conv block, a ResNet stage), each all-gathered for its own forward and
    backward. Single layers at the top (a stem conv, the classifier) stay with the root's unit."""
    if model in _UNITS:
        return [model.get_submodule(name) for name in _UNITS[model]]
    return [child for child in model.children()
            if next(child.children(), None) is not None and any(p.requires_grad for p in child.parameters())]


def shard_model(model: nn.Module, ctx, units=None) -> nn.Module:
    """FSDP2: ``fully_shard`` each of ``blocks(model)`` (or of ``units(model)``: a registry entry's choice), then
    the root, over all ranks of ``ctx`` (the model is on ``ctx.device``). Raises ValueError (before any collective)
    where this torch cannot run it here."""
    refusal = compat.fsdp_refusal(ctx.device.type, ctx.backend)
    if refusal:
        raise ValueError(refusal)
    from torch.distributed.device_mesh import init_device_mesh
    fully_shard = compat.fully_shard()
    # the blueprint: the module copied with meta tensors in place of its own (shapes only, no data copied)
    meta = {id(t): nn.Parameter(t.detach().to("meta"), t.requires_grad) if isinstance(t, nn.Parameter) else t.to("meta")
            for t in (*model.parameters(), *model.buffers())}
    _BLUEPRINTS[model] = copy.deepcopy(model, meta)
    if units is not None:
        names = {id(module): name for name, module in model.named_modules()}
        _UNITS[model] = _UNITS[_BLUEPRINTS[model]] = [names[id(unit)] for unit in units(model)]
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))   # the default group: no new communicator
    for block in blocks(model):
        fully_shard(block, mesh=mesh)   # FSDP: this block's parameters are split over the ranks
    fully_shard(model, mesh=mesh)       # FSDP: the root: what the blocks left (stem, classifier)
    return model


@contextlib.contextmanager
def no_sync(net: nn.Module):
    """FSDP's counterpart of DDP's ``no_sync()`` (gradient accumulation): the backward passes inside keep whole
    gradients on each rank and reduce-scatter nothing; the next one outside sends the sum. Nothing for a model
    that is not sharded."""
    if not is_fsdp(net):
        yield
        return
    net.set_requires_gradient_sync(False)   # FSDP2: for the root and every block
    try:
        yield
    finally:
        net.set_requires_gradient_sync(True)


def is_fsdp(net: nn.Module) -> bool:
    """Whether ``net`` (an unwrapped model) was sharded by ``shard_model``."""
    return net in _BLUEPRINTS


def blueprint(net: nn.Module) -> nn.Module:
    """``net`` itself, or for an FSDP model its meta-device copy from before sharding (a forward on it needs no
    other rank: the layer table)."""
    return _BLUEPRINTS.get(net, net)


def forwards_to_add(net: nn.Module, loader, ctx) -> int:
    """FSDP: how many empty forwards this rank adds after its evaluation batches so that every rank runs as many
    (a forward all-gathers each block: a collective). Exact evaluation gives the ranks shares that differ by up
    to a batch. 0 for any other model (no collective). A collective for FSDP models: call before the loop."""
    if not is_fsdp(net) or not ctx.distributed:
        return 0
    counts = collectives.gather_objects(len(loader), ctx)
    if min(counts) == 0:   # nothing to take an empty batch's shape from: said on every rank alike
        raise ValueError(f"parallel=fsdp evaluation: rank {counts.index(0)} has no validation batch (the split has "
                         f"fewer images than the {ctx.world_size} ranks); evaluate on fewer ranks")
    return max(counts) - len(loader)


# -- the optimizer and the checkpoint -------------------------------------------------------------------
def _is_zero(optimizer) -> bool:
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def _is_yours(optimizer) -> bool:
    """The ShardedOptimizer of lab/build_ddp (part f): its ``state`` holds this rank's own parameters' only."""
    return type(optimizer).__name__ == "ShardedOptimizer"


def _gathered_state(optimizer, ctx) -> dict | None:
    """Rank 0: every rank's entries of a ShardedOptimizer's ``state_dict()`` (parameters by index) in one; a
    collective. None on the other ranks."""
    mine = optimizer.state_dict()
    on_cpu = {index: {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in entry.items()}
              for index, entry in mine["state"].items()}
    rows = collectives.gather_objects(on_cpu, ctx)
    if not ctx.is_main:
        return None
    state = {index: entry for row in rows for index, entry in row.items()}
    return {"state": state, "param_groups": mine["param_groups"]}


def _by_index(state: dict) -> dict:
    """FSDP's full optimizer state (parameters by name) as SGD's ``state_dict()`` has it (by index, in the order
    of the parameter groups)."""
    by_name, groups, index = state.get("state", {}), [], 0
    out = {}
    for group in state["param_groups"]:
        ids = list(range(index, index + len(group["params"])))
        out.update({i: by_name[name] for i, name in zip(ids, group["params"]) if name in by_name})
        groups.append({**group, "params": ids})
        index += len(ids)
    return {"state": out, "param_groups": groups}


def _by_name(state: dict, net: nn.Module, optimizer) -> dict:
    """The reverse of ``_by_index`` for this model and optimizer."""
    names = {id(p): name for name, p in net.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {order[int(i)]: value for i, value in state["state"].items()},
            "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in state["param_groups"]]}


# -- the two modes, in the core's table ----------------------------------------------------------------------------
class ZeRO1(Mode):
    """``--parallel zero1``: DDP's wrap (model.py), and ZeroRedundancyOptimizer (optim.build_optimizer) or your
    ShardedOptimizer (lab/build_ddp, part f) keeping each rank's share of the optimizer state."""
    name, sharded = "zero1", True
    about = "DDP, and each rank keeps 1/N of the optimizer state (ZeroRedundancyOptimizer)"

    def holds(self, net: nn.Module, optimizer=None) -> bool:
        return _is_zero(optimizer) or _is_yours(optimizer)

    def describe(self, settings, ctx, model: nn.Module | None) -> str:
        return (f"parallel: ZeRO-1, {ctx.world_size} processes: DDP all-reduces the gradients; each rank keeps the "
                f"optimizer\n  state of about 1/{ctx.world_size} of the parameters (ZeroRedundancyOptimizer), steps "
                f"them, broadcasts them")

    def full_state(self, net: nn.Module, optimizer, ctx) -> tuple[dict | None, dict | None]:
        if _is_yours(optimizer):
            state = _gathered_state(optimizer, ctx)   # every rank's share of the state to rank 0 (a collective)
            return (net.state_dict(), state) if ctx.is_main else (None, None)
        optimizer.consolidate_state_dict(to=0)   # ZeRO: every rank's shard of the state to rank 0 (a collective)
        if not ctx.is_main:
            return None, None
        optim_state = optimizer.state_dict()
        # rank 0 keeps every rank's state after consolidating (torch's ZeRO): dropped once copied here, or rank 0
        # would hold the whole optimizer state again between checkpoints
        getattr(optimizer, "_all_state_dicts", []).clear()
        return net.state_dict(), optim_state

    def release(self, net: nn.Module, optimizer) -> None:
        drop_groups(optimizer)   # ZeRO's (or your ShardedOptimizer's) process_group

    def load_optimizer(self, net: nn.Module, optimizer, state: dict) -> None:
        if _is_yours(optimizer):   # every rank raises this: the same settings, the same checkpoint
            raise ValueError("build_ddp=f does not resume: your ShardedOptimizer (lab/build_ddp, part f) keeps its "
                             "state where the kit cannot put it back. Start a new run, or resume with parallel=zero1 "
                             "(torch's ZeRO-1 reads the same checkpoint)")
        optimizer.load_state_dict(copy.deepcopy(state))   # ZeRO blanks the other ranks' entries of what it is given
        # it also keeps a copy of its own entries in .state, which its step never reads: freed
        optimizer.state.clear()


class FSDP(Mode):
    """``--parallel fsdp``: no DDP wrapper; the model's blocks and root sharded in place (``shard_model``)."""
    name, sharded, places_model = "fsdp", True, True
    about = "FSDP2, each rank keeps 1/N of the parameters, gradients and optimizer state"

    def holds(self, net: nn.Module, optimizer=None) -> bool:
        return is_fsdp(net)

    def place(self, model: nn.Module, settings, ctx) -> nn.Module:
        from ..architectures import architecture
        return shard_model(model, ctx, architecture(settings.arch).units)

    def describe(self, settings, ctx, model: nn.Module | None) -> str:
        count = len(blocks(blueprint(unwrap(model)))) if model is not None else "its"
        return (f"parallel: FSDP (fully_shard), {ctx.world_size} processes: each rank keeps 1/{ctx.world_size} of "
                f"every parameter,\n  its gradient and its optimizer state; a block's weights are all-gathered for "
                f"its\n  forward and backward, its gradients reduce-scattered ({count} blocks and the root)")

    def no_sync(self, net: nn.Module):
        return no_sync(net)

    def forwards_to_add(self, net: nn.Module, loader, ctx) -> int:
        return forwards_to_add(net, loader, ctx)

    def blueprint(self, net: nn.Module) -> nn.Module:
        return blueprint(net)

    def release(self, net: nn.Module, optimizer) -> None:
        # each sharded block's mesh infos name the group; each parameter's device mesh keeps it in a registry
        # (torch 2.9 on; torch 2.6's mesh keeps its name only)
        for module in net.modules():
            state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
            group = getattr(state, "_fsdp_param_group", None)
            for holder in ([group, *group.fsdp_params] if group is not None else []):
                drop_groups(holder.mesh_info)
                drop_groups(holder.post_forward_mesh_info)
        for p in net.parameters():
            mesh = getattr(p, "device_mesh", None)
            drop_groups(mesh)
            drop_groups(getattr(mesh, "_root_mesh", None))

    def full_state(self, net: nn.Module, optimizer, ctx) -> tuple[dict | None, dict | None]:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)   # whole tensors, on rank 0's CPU
        model_state = get_model_state_dict(net, options=options)
        optim_state = get_optimizer_state_dict(net, optimizer, options=options) if optimizer is not None else None
        if not ctx.is_main:
            return None, None
        return model_state, _by_index(optim_state) if optim_state is not None else None

    def load_model(self, net: nn.Module, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        # a copy of the mapping: torch writes this rank's shards into the dict it is given, which the caller
        # keeps (a resume's state: mend_best would save the shards as best.pt)
        set_model_state_dict(net, dict(state), options=StateDictOptions(full_state_dict=True))

    def load_optimizer(self, net: nn.Module, optimizer, state: dict) -> None:
        if not state["state"]:   # SGD without momentum keeps none: torch's loader cannot tell on which device an
            super().load_optimizer(net, optimizer, state)   # empty state goes, and stops; the plain load takes the
            return                                           # groups' values
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        # strict=False: a parameter that no forward used has no momentum yet, and keeps none
        set_optimizer_state_dict(net, optimizer, _by_name(state, net, optimizer),
                                 options=StateDictOptions(full_state_dict=True, strict=False))
        # torch's loader first lays out a zero momentum for every parameter: one that had none when saved
        # (never used yet) goes on without, as in the run saved
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index in set(range(len(params))) - {int(i) for i in state["state"]}:
            optimizer.state.pop(params[index], None)
        _own_copies(optimizer, state)


def _own_copies(optimizer, state: dict) -> None:
    """The optimizer's own copy of every tensor it took from ``state`` as is: torch's loader keeps the caller's
    unsharded tensors (AdamW's ``step``), which each training step would then increment in the caller's state."""
    given = {id(t) for entry in state["state"].values() for t in entry.values() if torch.is_tensor(t)}
    for entry in optimizer.state.values():
        for key, value in entry.items():
            if torch.is_tensor(value) and id(value) in given:
                entry[key] = value.clone()


parallel.register(ZeRO1())
parallel.register(FSDP())


# -- memory per rank: measured and predicted -------------------------------------------------------------
def _bytes(tensors) -> int:
    return sum(local_part(t).numel() * local_part(t).element_size() for t in tensors if isinstance(t, torch.Tensor))


def held_bytes(net: nn.Module, optimizer) -> dict:
    """Bytes this rank holds now, summed over the local tensors (an FSDP DTensor counts its own shard):
    ``{"params": ..., "grads": ..., "optimizer": ...}``. DDP's gradients live in its buckets (the grads are views
    into them): counted once. ZeRO: its local optimizer's state, and anything left in its own ``.state``."""
    params = list(net.parameters())
    states = list(optimizer.state.values())
    if _is_zero(optimizer):
        states += list(optimizer.optim.state.values())
    return {"params": _bytes(params), "grads": _bytes(p.grad for p in params),
            "optimizer": _bytes(t for s in states if isinstance(s, dict) for t in s.values())}


def predicted_bytes(mode: str, params: int, ranks: int, largest_unit: int = 0, k: int = 4) -> dict:
    """The ZeRO paper's bytes per rank for ``params`` fp32 parameters on ``ranks`` ranks (see the docstring at the
    top): ``{"params", "grads", "optimizer", "working_copy"}`` (FSDP's all-gathered largest unit, else 0)."""
    full = {"params": 4 * params, "grads": 4 * params, "optimizer": k * params, "working_copy": 0}
    if mode == "zero1":
        return {**full, "optimizer": k * params / ranks}
    if mode == "fsdp":
        return {"params": 4 * params / ranks, "grads": 4 * params / ranks, "optimizer": k * params / ranks,
                "working_copy": 4 * largest_unit}
    return full


def units(net: nn.Module) -> list[int]:
    """Parameters per FSDP unit: each block's, then the root's own (what the blocks leave)."""
    plan = blueprint(net)
    inside = [sum(p.numel() for p in block.parameters()) for block in blocks(plan)]
    return inside + [sum(p.numel() for p in plan.parameters()) - sum(inside)]


def memory_results(mine: dict, net: nn.Module, mode: str, momentum: float, ctx) -> dict:
    """results.json's ``memory``: every rank's ``held_bytes`` (gathered: a collective), the formula's bytes for
    this mode, and the peak the allocator saw (GPU; on a CPU the string ``NOT_ON_CPU``)."""
    gpu = ctx.device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(ctx.device) if gpu else None
    rows = collectives.gather_objects({**mine, "peak": peak}, ctx)   # DDP: every rank's
    params = sum(p.numel() for p in blueprint(net).parameters())
    k = STATE_BYTES["sgd"] if momentum else 0   # SGD without momentum keeps no state
    largest = max(units(net)) if mode == "fsdp" else 0
    return {"mode": mode, "ranks": ctx.world_size, "params": params, "k": k, "largest_unit": largest,
            "per_rank": [{"rank": r, **{f"{key}_bytes": row[key] for key in ("params", "grads", "optimizer")},
                          "peak_bytes": row["peak"] if gpu else NOT_ON_CPU} for r, row in enumerate(rows)],
            "predicted": {f"{key}_bytes": value for key, value in
                          predicted_bytes(mode, params, ctx.world_size, largest, k).items()},
            "peak_bytes": max(row["peak"] for row in rows) if gpu else NOT_ON_CPU}


@register()
class MemoryPerRank(Observer):
    """What each rank holds (parameters, gradients, optimizer state) beside ZeRO's formula, in results.json."""

    def __init__(self, parallel: str):
        self.parallel, self.held = parallel, None

    @classmethod
    def for_loop(cls, loop, around):
        return cls(loop.meta.get("parallel", "none"))

    def epoch_trained(self, loop, stats: dict) -> None:
        self.held = held_bytes(unwrap(loop.model), loop.optimizer)   # after training: the gradients are there

    def results(self, loop, results: dict) -> None:
        held = self.held or held_bytes(unwrap(loop.model), loop.optimizer)
        results["memory"] = memory_results(held, unwrap(loop.model), self.parallel, loop.settings.momentum,
                                           loop.ctx)   # gathered: a collective

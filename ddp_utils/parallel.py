"""The parallel modes as one table: how a model trains across ranks, and how its whole state is saved and loaded.

``ddp`` (DistributedDataParallel: every rank holds the whole model and averages the gradients), ``dp``
(DataParallel: one process over a node's GPUs) and ``none`` (one process) are the core's: model.py wraps for them,
and their state is one process's ``state_dict()``. ``speed/sharding.py`` registers the modes that split what a DDP
rank holds (``zero1``: the optimizer state; ``fsdp``: everything), each a ``Mode`` that says how a model is placed,
how its gradients stay on the rank for an accumulated batch, how many empty forwards its evaluation adds, how its
whole state is gathered for a checkpoint and given back, and what it is in a line.

A checkpoint is plain whatever the mode: ``full_state``, ``load_model_state`` and ``load_optimizer_state`` ask
the mode that holds the model and optimizer (``of_state``: a sharded model or optimizer says which mode made it), so
a checkpoint written in one mode resumes in any other.
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn


class Mode:
    """A parallel mode. This class is the plain one: every rank (or the one process) holds the whole model."""
    name = "ddp"
    about = ("one process per GPU, gradients all-reduced (DistributedDataParallel, the course's way)")
    sharded = False   # a mode that splits what a DDP rank holds (speed/sharding.py); settings.parallel names it
    places_model = False   # the mode places the model itself (``place``) instead of model.py's wrap

    def __init__(self, name: str | None = None, about: str | None = None):
        self.name, self.about = name or self.name, about or self.about

    def holds(self, net: nn.Module, optimizer=None) -> bool:
        """Whether ``net`` (unwrapped) and ``optimizer`` were made by this mode (a sharded model, a ZeRO optimizer)."""
        return False

    def place(self, model: nn.Module, settings, ctx) -> nn.Module:
        """The model placed for this mode in place of model.py's wrap (FSDP shards it), where ``places_model``."""
        raise NotImplementedError

    def describe(self, settings, ctx, model: nn.Module | None) -> str:
        """What runs, in a line or two (rank 0 says it)."""
        return ""

    def no_sync(self, net: nn.Module):
        """A context in which the backward passes keep their gradients on the rank (gradient accumulation)."""
        return contextlib.nullcontext()

    def forwards_to_add(self, net: nn.Module, loader, ctx) -> int:
        """Empty forwards this rank adds after its evaluation batches, so that every rank runs as many (a sharded
        model's forward is a collective). A collective where it is not 0: call before the loop."""
        return 0

    def blueprint(self, net: nn.Module) -> nn.Module:
        """A copy whose forward needs no other rank (the layer table's), or ``net`` itself."""
        return net

    def full_state(self, net: nn.Module, optimizer, ctx) -> tuple[dict | None, dict | None]:
        """Rank 0: ``(model state, optimizer state)`` as one process holds them; ``(None, None)`` elsewhere. Every rank
        calls it (a sharded mode gathers: a collective). ``optimizer`` may be None (the weights only)."""
        if not ctx.is_main:
            return None, None
        return net.state_dict(), optimizer.state_dict() if optimizer is not None else None

    def load_model(self, net: nn.Module, state: dict) -> None:
        """Load a plain (full) model state, which every rank holds."""
        net.load_state_dict(state)

    def release(self, net: nn.Module, optimizer) -> None:
        """After a failure: let go of the process group wherever the mode's objects hold it (ZeRO's optimizer,
        FSDP's blocks), so that tearing the group down frees it while a notebook still holds them
        (``job.release_group``; DDP's own hold is let go there)."""

    def load_optimizer(self, net: nn.Module, optimizer, state: dict) -> None:
        """Load a plain optimizer state (SGD's ``state_dict()``, parameters by index)."""
        # a copy: on a CPU torch keeps the tensors it is given as the momentum, and each step would change the
        # caller's state (a resume's, which mend_best may still write)
        optimizer.load_state_dict(copy.deepcopy(state))


PLAIN = Mode()
# speed/sharding.py adds zero1 and fsdp
MODES: dict[str, Mode] = {"ddp": PLAIN,
                          "dp": Mode("dp", "DataParallel, one process driving every GPU of this node (with one GPU or "
                                           "none a rehearsal: nothing to split, torch runs the model directly)"),
                          "none": Mode("none", "one process, one device, no wrapper")}


def register(mode: Mode) -> Mode:
    """Add a mode to the table (its ``name`` becomes a ``--parallel`` choice)."""
    if mode.name in MODES:
        raise ValueError(f"parallel mode {mode.name!r} is registered twice")
    MODES[mode.name] = mode
    return mode


def describe_modes() -> str:
    """``--parallel``'s help: each row, in the table's order."""
    return "; ".join(f"{name}: {mode.about}" for name, mode in MODES.items())


def of_state(net: nn.Module, optimizer=None) -> Mode:
    """The mode that made ``net`` (unwrapped) and ``optimizer``: a sharded one that says it holds them, else the
    plain one."""
    return next((m for m in MODES.values() if m.sharded and m.holds(net, optimizer)), PLAIN)


def full_state(net: nn.Module, optimizer, ctx) -> tuple[dict | None, dict | None]:
    """Rank 0: the whole model and optimizer state as one process holds them, whatever the mode
    (``Mode.full_state``)."""
    return of_state(net, optimizer).full_state(net, optimizer, ctx)


def load_model_state(net: nn.Module, state: dict) -> None:
    """Load a plain model state into ``net``, whatever its mode (an FSDP model keeps its own shard of each tensor)."""
    of_state(net).load_model(net, state)


def load_optimizer_state(net: nn.Module, optimizer, state: dict) -> None:
    """Load a plain optimizer state into ``optimizer``, whatever its mode (ZeRO keeps its own parameters' state)."""
    of_state(net, optimizer).load_optimizer(net, optimizer, state)


def drop_groups(obj) -> None:
    """Set each attribute of ``obj`` that is a process group to None, and empty each dict attribute holding one
    (``Mode.release``: after this the object cannot run a collective again, which a failed run does not)."""
    from torch.distributed import ProcessGroup
    for name, value in list(getattr(obj, "__dict__", {}).items()):
        if isinstance(value, ProcessGroup):
            setattr(obj, name, None)
        elif isinstance(value, dict) and any(isinstance(v, ProcessGroup) for v in value.values()):
            value.clear()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor``: a DTensor's local shard (FSDP), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor

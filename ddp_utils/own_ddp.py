"""``--build-ddp a|b|c|f``: train with the DDP you wrote in ``lab/build_ddp/`` instead of torch's.

The lab's tests prove that your code computes the right gradients and weights; here it trains in the kit's own
loop, so its cost shows in the epoch line's time split. For a, b and c the loop calls ``finish_gradient_sync()``
after each backward pass and counts the time it takes as communication waited for (``comm``):

- a: ``allreduce_gradients`` after the backward pass: every all-reduce is waited for;
- b: ``OverlapDDP``: one all-reduce per parameter, started from a hook while the backward pass goes on; only the
  ones still running at its end are waited for;
- c: ``BucketDDP``: the same in buckets of ``bucket_mb``: fewer, larger messages;
- f: ``ShardedOptimizer`` (ZeRO-1) in place of torch's ZeroRedundancyOptimizer, beside torch's DDP: the run is
  ``--parallel zero1``'s, and its memory table shows your optimizer's state per rank against the formula.

Which file: ``student.py`` (yours), the kit's solution with ``BUILD_DDP=reference``, or a file's path (the lab's
adapter decides).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from torch import nn

LAB = Path(__file__).resolve().parents[1] / "lab" / "build_ddp"
PARTS = {"a": "all-reduce every gradient after the backward pass (allreduce_gradients)",
         "b": "one async all-reduce per parameter from gradient hooks (OverlapDDP)",
         "c": "async all-reduces in buckets of bucket_mb (BucketDDP)",
         "f": "each rank keeps the optimizer state of about 1/N of the parameters (ShardedOptimizer)"}
CLASSES = {"a": "allreduce_gradients", "b": "OverlapDDP", "c": "BucketDDP", "f": "ShardedOptimizer"}
WRAPPERS = ("a", "b", "c")   # the parts that replace DDP's wrapper; f replaces ZeRO-1's optimizer


def which() -> str:
    """The file that trains, as the lab's adapter picks it (BUILD_DDP): relative to lab/build_ddp/ when inside."""
    adapter = _adapter()
    path = adapter.path_of(adapter.chosen())
    return str(path.relative_to(LAB)) if path.is_relative_to(LAB) else str(path)


def whose() -> str:
    """``yours``, or ``the kit's solution`` with BUILD_DDP=reference: what the epoch line says of the class."""
    return "the kit's solution" if _adapter().chosen() == "reference" else "yours"


def named(part: str) -> str:
    """The class (or function) of ``part`` and whose it is, for the epoch line: ``OverlapDDP (yours)``."""
    return f"{CLASSES[part]} ({whose()})"


def label(settings) -> str:
    """--build-ddp: the lab's class that trains (``OverlapDDP (yours)``), for the epoch line; else empty."""
    return named(settings.build_ddp) if settings.build_ddp else ""


def implementation():
    """The lab's student.py, the kit's solution with BUILD_DDP=reference, or a named file (its adapter decides)."""
    return _adapter().implementation()


def _adapter():
    adapter = LAB / "adapter.py"
    if not adapter.is_file():
        raise FileNotFoundError(f"--build-ddp trains with the DDP written in the kit's lab/build_ddp/, but there is no "
                                f"{adapter} (an installed ddp_utils without the kit's folder): run from a checkout of "
                                f"the kit")
    if str(LAB.parent) not in sys.path:   # lab/ holds the package build_ddp (the tests import the same module)
        sys.path.insert(0, str(LAB.parent))
    return importlib.import_module("build_ddp.adapter")


def sharded_optimizer(groups: list[dict], optimizer_cls, **kwargs):
    """Part f: your ``ShardedOptimizer`` over ``groups``, stepping ``optimizer_cls``."""
    return implementation().ShardedOptimizer(groups, optimizer_cls, **kwargs)


class AfterBackward(nn.Module):
    """Part (a) as a wrapper: rank 0's weights at the start, every gradient all-reduced in finish_gradient_sync."""

    def __init__(self, module: nn.Module, impl):
        super().__init__()
        self.module, self._impl = module, impl
        impl.broadcast_parameters(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_sync(self) -> None:
        self._impl.allreduce_gradients(self.module)


def wrap(model: nn.Module, part: str, bucket_mb: float) -> nn.Module:
    """``model`` wrapped in your DDP of ``part``."""
    impl = implementation()
    if part == "a":
        wrapped = AfterBackward(model, impl)
    elif part == "b":
        wrapped = impl.OverlapDDP(model)
    else:
        wrapped = impl.BucketDDP(model, bucket_bytes=int(bucket_mb * 2**20))
    return wrapped


def is_own(model) -> bool:
    """Whether ``model`` is such a wrapper (theirs: known by what it offers, not by its class)."""
    return callable(getattr(model, "finish_gradient_sync", None)) and isinstance(getattr(model, "module", None),
                                                                                  nn.Module)

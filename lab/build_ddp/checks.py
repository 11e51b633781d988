"""What the tests watch while your code runs, and how a failure is explained. You need not read this file.

- ``AllReduceLog`` records every ``dist.all_reduce`` call (its bytes, async_op, whether backward() was running,
  and how many gradients autograd had produced by then), and hands back a work object that notes whether it was
  waited for: an all-reduce started but never waited for is reported as such, not guessed from its numbers.
- ``Arrivals`` notes the order in which backward() produces the gradients (a hook registered before yours).
- ``explain_gradients`` compares each ``.grad`` after ``finish_gradient_sync()`` with the right one (one
  process's, on the whole batch) and says how it differs: summed rather than averaged (a ratio equal to the
  world size), this rank's own gradient (never all-reduced), a gradient that should not exist, ...
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class AllReduce:
    """One ``dist.all_reduce`` call: its tensor's bytes, its async_op, whether backward() was running, how many
    gradients backward() had produced when it started, and the micro-batch it belongs to."""
    bytes: int
    async_op: bool
    in_backward: bool
    arrived: int
    micro_batch: int = 0

    def __repr__(self):
        when = f"during backward, after {self.arrived} gradient(s)" if self.in_backward else "after backward"
        return f"all_reduce({self.bytes} bytes, async_op={self.async_op}, {when})"


class TrackedWork:
    """The work ``dist.all_reduce(..., async_op=True)`` returned, noting whether anyone waited for it."""

    def __init__(self, work):
        self._work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def get_future(self):
        self.waited = True   # whoever takes the future waits on it
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self._work, name)


class AllReduceLog:
    """Records every ``dist.all_reduce`` made inside ``with log.recording(module):`` in ``log.calls``."""

    def __init__(self, arrivals: Arrivals | None = None):
        self.calls: list[AllReduce] = []
        self.works: list[TrackedWork] = []
        self.in_backward = False
        self.micro_batch = 0
        self.arrivals = arrivals

    @contextlib.contextmanager
    def recording(self, module=None):
        real = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
            arrived = len(self.arrivals.order) if self.arrivals is not None else 0
            self.calls.append(AllReduce(tensor.numel() * tensor.element_size(), async_op, self.in_backward, arrived,
                                        self.micro_batch))
            work = real(tensor, *args, **kwargs)
            if async_op and work is not None:
                work = TrackedWork(work)
                self.works.append(work)
            return work

        # dist.all_reduce, and the same function under another name in the file under test
        aliases = [name for name, value in vars(module).items() if value is real] if module is not None else []
        dist.all_reduce = all_reduce
        for name in aliases:
            setattr(module, name, all_reduce)
        try:
            yield self
        finally:
            dist.all_reduce = real
            for name in aliases:
                setattr(module, name, real)

    def take(self) -> tuple[list[AllReduce], list[TrackedWork]]:
        """This step's calls and works; the log starts empty again."""
        out = (self.calls, self.works)
        self.calls, self.works, self.micro_batch = [], [], 0
        return out


def assert_all_waited(works: list[TrackedWork], when: str) -> None:
    unwaited = [w for w in works if not w.waited]
    assert not unwaited, (
        f"rank {dist.get_rank()}, {when}: {len(unwaited)} of the {len(works)} all-reduce(s) started with "
        f"async_op=True were never waited for before optimizer.step(): an all-reduce started but not waited for "
        f"may not have finished writing its sum, so the gradient can be anything from this rank's own to the "
        f"mean. finish_gradient_sync() must wait for every one it started (README, part (b)).")


class Arrivals:
    """The order in which backward() produces the gradients of ``net``'s trainable parameters (by name).

    Registered before the wrapper under test registers its own hooks, so for each parameter this hook runs
    first: when your hook starts an all-reduce, ``order`` already counts that parameter."""

    def __init__(self, net: nn.Module):
        self.order: list[str] = []
        self.bytes = {name: p.numel() * p.element_size() for name, p in net.named_parameters() if p.requires_grad}
        for name, param in net.named_parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda _, name=name: self.order.append(name))

    def take(self) -> list[str]:
        out, self.order = self.order, []
        return out


def gradients(net: nn.Module) -> dict[str, torch.Tensor | None]:
    """``{name: a copy of .grad, or None}`` of every trainable parameter."""
    return {name: None if p.grad is None else p.grad.detach().clone()
            for name, p in net.named_parameters() if p.requires_grad}


def explain_gradients(net: nn.Module, want: dict, mine: dict, when: str, sent: str = "") -> None:
    """Assert that every trainable parameter's ``.grad`` of ``net`` equals ``want`` (one process, whole batch),
    within the tests' tolerance; else say, per parameter, how it differs. ``mine``: this rank's own gradient
    (of its shard, before any communication); ``sent``: what the all-reduces carried, for the message."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    got = gradients(net)
    problems = [f"{name}: {why}" for name in want if (why := _how_it_differs(got[name], want[name], mine[name],
                                                                              world_size))]
    if not problems:
        return
    unused = [name for name in want if want[name] is None]
    never = any("never all-reduced" in p for p in problems)
    note = ""
    if never and unused:
        note = (f"\nNot used by this step's forward pass, so without a gradient: {', '.join(unused)}. A bucket that "
                f"waits for their gradients never fills and never starts: finish_gradient_sync() must still send "
                f"the gradients it holds (README, part (c)).")
    raise AssertionError(f"rank {rank} of {world_size}, {when}: after finish_gradient_sync(), before "
                         f"optimizer.step(), {len(problems)} gradient(s) differ from one process's on the whole "
                         f"batch:\n  " + "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more"
                                                                      if len(problems) > 8 else "")
                         + note + (f"\nThis step's all-reduces: {sent}" if sent else ""))


def _how_it_differs(got, want, mine, world_size: int) -> str | None:
    if got is None and want is None:
        return None
    if got is None:
        return "has no gradient (.grad is None), where one process has one"
    if want is None:
        return ("has a gradient, where one process has none (this step did not use it): leave its .grad None, or "
                "the optimizer's momentum and weight decay move it")
    if _close(got, want):
        return None
    if world_size > 1 and _close(got, mine) and not _close(mine, want):
        return "is this rank's own gradient: never all-reduced"
    ratio = float((got * want).sum() / (want * want).sum().clamp_min(1e-30))
    if _close(got, ratio * want):
        if abs(ratio - world_size) < 1e-3 * world_size:
            return (f"is {world_size} times the right one, the world size: summed over the ranks, not averaged "
                    f"(divide by the world size)")
        if abs(ratio - 1 / world_size) < 1e-3:
            return f"is 1/{world_size} of the right one: divided by the world size twice"
        return f"is {ratio:.4g} times the right one"
    return f"differs from the mean over the ranks (largest difference {float((got - want).abs().max()):.3g})"


ATOL, RTOL = 1e-6, 1e-5   # fp32; see test_build_ddp.py's docstring for why not exact


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, atol=ATOL, rtol=RTOL))

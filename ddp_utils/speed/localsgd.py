"""Local SGD (``--comm localsgd``): all-reduce the weights every few steps instead of the gradients at every step.

DDP all-reduces every step's gradients, so every rank takes the same optimizer step. On a slow link that
all-reduce can take longer than the step. Local SGD lets each rank step on its own gradients (DDP's
``no_sync()``: nothing is sent) and averages the weights over the ranks every ``average_every`` optimizer
steps: 1/average_every of the traffic, while every rank still trains with the run's batch size and
learning rate (Lin et al., 2020, "Don't use large mini-batches, use local SGD"; PyTorch calls the variant
that starts with exact steps *post-local SGD*). The first ``localsgd_warmup_steps`` steps are plain DDP,
so the ranks leave the noisy start together. The averages send each tensor's change since the last average, in
bf16 (half the bytes, and fp32's range).

Between two averages the ranks' weights differ. At the end of every epoch the weights are averaged, so that every rank
evaluates the same model, and the optimizer's state too (SGD's momentum, which each rank built from its own
gradients; it travels while the ranks evaluate), so that the checkpoint holds the state of every rank: a resume
continues exactly.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..communication import Comm, register_comm
from ..concerns import TimeSplit
from ..observers import Ask, Observer, register
from .comm import Gradients


class LocalSGD:
    """When a step keeps its gradients local, and the averaging after it. Call ``step_done(last)`` after every
    optimizer step (skipped fp16 steps too: every rank must reach each average; ``last``: the epoch's last step),
    ``end_of_epoch()`` before the evaluation and ``finish()`` before the checkpoint."""

    def __init__(self, model, optimizer, every: int, warmup_steps: int, steps_done: int = 0, timer=None):
        self.model, self.optimizer, self.every, self.warmup = model, optimizer, every, warmup_steps
        self.steps = steps_done     # optimizer steps of the run so far (a resume starts at its scheduler's count)
        self.since = 0              # local steps since the weights were last averaged
        self.apart = False          # a local step since the optimizer states were last averaged
        self.timer = timer          # commtime.CommTimer: the averages are communication the run waited for
        self.averages = 0
        self.anchors: dict = {}     # each averaged tensor as last averaged: the same on every rank
        self.pending = None         # the optimizer state's average, in flight during the evaluation
        self.waited_s = 0.0         # for it, after the evaluation (outside the epoch's time split)
        if self.local:              # a resume: every rank holds the checkpoint's state
            self._anchor(self._params() + self._state())

    @property
    def local(self) -> bool:
        """Whether the next optimizer step keeps its gradients on this rank (no all-reduce)."""
        return self.steps >= self.warmup

    def step_done(self, last: bool = False) -> None:
        if not self.local:
            self.steps += 1
            if self.local:   # the last plain DDP step: every rank is the same here, the start of the differences
                self._anchor(self._params() + self._state())
            return
        self.steps, self.since, self.apart = self.steps + 1, self.since + 1, True
        if self.since == self.every and not last:   # the epoch's last step: end_of_epoch averages it
            self._average(self._params())

    def end_of_epoch(self) -> None:
        """Average the weights, for the evaluation, and start averaging the optimizer's state (momentum, built
        from each rank's own gradients), which travels while the ranks evaluate: ``finish()`` waits for it."""
        if self.since:
            self._average(self._params())
        state = self._state() if self.apart else []
        if state:
            self.pending = Average(state, self._anchors_of(state))
            self.averages += 1
        self.apart = False

    def finish(self) -> None:
        """Every rank holds the same weights and optimizer state from here: the checkpoint keeps every rank's."""
        if self.pending is not None:
            start = time.perf_counter()
            self.pending.wait()
            self.waited_s += time.perf_counter() - start
            self.pending = None

    def _params(self) -> list:
        return list(self.model.parameters())

    def _state(self) -> list:
        return [t for s in self.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.is_floating_point()]

    def _anchor(self, tensors: list) -> None:
        self.anchors.update({id(t): t.detach().clone() for t in tensors})

    def _anchors_of(self, tensors: list) -> list:
        # a tensor first seen now (momentum, made at the first step) started from zero on every rank
        return [self.anchors.setdefault(id(t), torch.zeros_like(t)) for t in tensors]

    def _average(self, tensors: list) -> None:
        span = self.timer.span() if self.timer is not None else None
        Average(tensors, self._anchors_of(tensors)).wait()
        if span is not None:
            self.timer.end_span(span)
        self.since, self.averages = 0, self.averages + 1


class Average:
    """Replace each tensor by its mean over the ranks, in place, with one all-reduce (started here, applied by
    ``wait()``); the anchors become the means.

    What travels is each tensor's difference from its anchor (its last mean, the same on every rank) in bf16:
    half the bytes of fp32, and a difference accumulated over a few steps is small, so bf16 keeps its
    significant digits (3) where rounding the weights themselves would not. bf16, not fp16: it has fp32's range,
    so a late update of 1e-9 (a cosine tail) is not 0 and a sum over many ranks does not overflow to inf (fp16:
    below about 6e-8 is 0, above 65504 inf), either of which would overwrite every rank's weights. Every rank
    adds the same reduced differences to the same anchors, so every rank ends with the same tensors. (PyTorch's
    ``model_averaging.utils.average_parameters`` sends fp32, waits, and rebinds ``.data`` to views of its
    flat buffer, which also turns channels_last weights into contiguous ones; copying back keeps each layout.)"""

    @torch.no_grad()
    def __init__(self, tensors: list, anchors: list, group=None):
        self.tensors, self.anchors, self.world = tensors, anchors, dist.get_world_size(group)
        delta = torch.empty(sum(t.numel() for t in tensors), dtype=torch.bfloat16, device=tensors[0].device)
        self.pieces = [piece.view(t.shape) for piece, t in zip(delta.split([t.numel() for t in tensors]), tensors)]
        for t, a, d in zip(tensors, anchors, self.pieces):
            torch.sub(t, a, out=d)   # written as bf16 straight into the message: no fp32 copy of it
        self.work = dist.all_reduce(delta, group=group, async_op=True)   # the sum of the ranks' differences

    @torch.no_grad()
    def wait(self) -> None:
        self.work.wait()
        for t, a, d in zip(self.tensors, self.anchors, self.pieces):
            a.add_(d, alpha=1 / self.world)   # the mean of the differences, in fp32
            t.copy_(a)


@register(after=(Gradients,))   # it trains the way Gradients chose (loop.comm)
class LocalSgd(Observer):
    """``--comm localsgd``: steps keep their gradients on the rank (``Ask.no_sync``), and the weights are
    averaged every few steps and at the end of each epoch (that last average counts as compute). ``sgd``: a
    ``LocalSGD`` of your own (a lab's, a test's), used whatever the run chose."""

    def __init__(self, sgd=None):
        self.sgd, self.looked = sgd, sgd is not None

    def epoch_start(self, loop) -> None:
        if self.looked:
            return
        self.looked = True   # the run's first epoch: the loop has applied what Gradients chose at its start
        comm = loop.comm
        if getattr(comm, "choice", None) == "localsgd" and loop.ctx.distributed:
            s = loop.settings   # counts optimizer steps from the schedule's (a resume's)
            self.sgd = LocalSGD(loop.model, loop.optimizer, s.average_every, s.localsgd_warmup_steps,
                                loop.scheduler.last_epoch, comm.timer)

    def before_step(self, loop) -> Ask | None:
        if self.sgd is not None and self.sgd.local:
            return Ask(no_sync=True)   # local SGD: no all-reduce at all
        return None

    def after_step(self, loop) -> None:
        if self.sgd is not None and loop.updated:
            self.sgd.step_done(loop.last)   # every average_every steps: the ranks average their weights

    def epoch_trained(self, loop, stats: dict) -> None:
        if self.sgd is not None:
            started = time.perf_counter()
            self.sgd.end_of_epoch()   # one model on every rank again: for the evaluation and the checkpoint
            split = loop.observers.find(TimeSplit)
            if split is not None:
                split.compute(time.perf_counter() - started)

    def epoch_end(self, loop, record: dict) -> None:
        if self.sgd is not None:
            self.sgd.finish()   # the optimizer state averaged while evaluating: every rank's is in the checkpoint

    def results(self, loop, results: dict) -> None:
        # waited after the evaluation for the momentum's average (not in the time split)
        results["localsgd_wait_s"] = self.sgd.waited_s if self.sgd is not None else None


# its warm-up steps are plain DDP: the exact all-reduce; the rest this module does
register_comm(Comm("localsgd", "no gradient all-reduce: each rank steps on its own gradients and the weights are "
                               "averaged every average_every steps", "local SGD (not DDP)",
                   lambda settings, steps: (default_hooks.allreduce_hook, None)))

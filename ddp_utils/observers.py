"""The training loop's one interface to everything optional in a run: observers, called at fixed points.

train.py's loop reads as the lesson: batch, forward, backward (DDP's all-reduce), optimizer step; then evaluate and
save. What a real run does besides (the kit's watch, the GPU monitor, the feed check, the profiler, local SGD,
PowerSGD's memory, the time split, the log points, memory per rank, the cost, early stop, divergence) is an
``Observer`` the loop calls at these points; ``concerns.observers_for`` registers them for a job. A hook does
nothing unless overridden:

- ``start``: before the first epoch, after a resume's restore;
- each step: ``before_step`` (a batch arrived), ``before_update`` (its gradients are ready, the optimizer steps
  next), ``after_step`` (it is done: ``loop.loss``, ``loop.logits``, ``loop.labels`` are its), ``step_end`` (the
  loop fetches the next batch next);
- each epoch: ``epoch_start`` (its first batch is fetched next), ``epoch_exit`` (its loop is left, also by an
  error), ``epoch_trained`` (figures added to the epoch's ``stats``), ``epoch_end`` (evaluated, before the
  checkpoint: checks, what the checkpoint keeps, a reason to stop early);
- ``results``: the run's figures added to results.json, and said.

``Observers`` calls several as one, listed outermost first: the hooks that open something (``start``,
``epoch_start``, ``before_step``, ``before_update``) in that order, the others innermost first, as nested ``with``
blocks would close.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Loop:
    """What the training loop and its observers share: the run's parts, and where the loop is."""
    model: object                     # DDP-wrapped with several ranks (model.prepare_model)
    data: object                      # this rank's loaders (data.build_data)
    optimizer: object
    scheduler: object
    scaler: object                    # fp16's gradient scaler (disabled otherwise)
    settings: object
    ctx: object                       # rank, world size, device
    logger: object                    # rank 0's run folder; a NullLogger elsewhere
    observers: Observer = field(default_factory=lambda: Observers())
    stepper: object = None            # optim.ScaledStep of the optimizer and scaler
    meta: dict = field(default_factory=dict)   # results.json's parallel, comm, algorithm, ...
    # where the loop is
    epoch: int = 0
    step: int = 0                     # batches trained so far in the run (the log's x axis)
    start_step: int = 0               # where this epoch started
    lr: float = 0.0                   # the lr of the current step
    keep_local: bool = False          # an observer's word: this step's gradients stay on the rank (local SGD)
    updated: bool = False             # the current step ended with an optimizer step
    skipped: bool = False             # fp16: the scaler skipped that optimizer step (its gradients overflowed)
    last: bool = False                # the current batch is the epoch's last
    loss: object = None               # the current step's loss, logits and labels (after_step)
    logits: object = None
    labels: object = None
    history: list = field(default_factory=list)   # one record per epoch trained: {"epoch", "train", "val"}
    best_acc1: float = 0.0
    stop_reason: str | None = None    # an observer's reason to stop after this epoch (early stop)
    extra_state: dict = field(default_factory=dict)   # what observers add to the checkpoint
    state: dict | None = None         # the checkpoint a resume continues from
    dtype: object = field(init=False, default=None)   # autocast's (None: fp32), decided once, not every step

    def __post_init__(self):
        from .optim import ScaledStep, amp_dtype
        if self.stepper is None:   # counts the steps fp16's scaler skips
            self.stepper = ScaledStep(self.optimizer, self.scaler)
        self.dtype = amp_dtype(self.settings, self.ctx.device)


PREFETCH_FACTOR = 2   # batches a DataLoader worker makes ahead: torch's default, which the kit keeps


def batches_made_ahead(workers: int, prefetch_factor: int = PREFETCH_FACTOR) -> int:
    """The batches a DataLoader with ``workers`` workers has made before the training asks for its first (torch's
    default prefetch_factor, 2 a worker, which the kit keeps), and one more: where a steady window starts (the time
    split's steady images/s, the feed check, the loader benchmarks). In-process loaders (0 workers): just the first."""
    return workers * prefetch_factor + 1


class Observer:
    """One optional concern of a run (see the module's docstring): override the hooks it needs."""

    def start(self, loop) -> None:
        pass

    def epoch_start(self, loop) -> None:
        pass

    def before_step(self, loop) -> None:
        pass

    def before_update(self, loop) -> None:
        pass

    def after_step(self, loop) -> None:
        pass

    def step_end(self, loop) -> None:
        pass

    def epoch_exit(self, loop) -> None:
        pass

    def epoch_trained(self, loop, stats: dict) -> None:
        pass

    def epoch_end(self, loop, record: dict) -> None:
        pass

    def results(self, loop, results: dict) -> None:
        pass


OPENING = ("start", "epoch_start", "before_step", "before_update")   # called outermost first; the rest innermost first


class Observers(Observer):
    """Several observers called as one (see the module's docstring for the order)."""

    def __init__(self, observers=()):
        self.observers = list(observers)

    def __iter__(self):
        return iter(self.observers)

    def _each(self, hook: str, *args) -> None:
        for observer in (self.observers if hook in OPENING else reversed(self.observers)):
            getattr(observer, hook)(*args)

    def start(self, loop) -> None:
        self._each("start", loop)

    def epoch_start(self, loop) -> None:
        self._each("epoch_start", loop)

    def before_step(self, loop) -> None:
        self._each("before_step", loop)

    def before_update(self, loop) -> None:
        self._each("before_update", loop)

    def after_step(self, loop) -> None:
        self._each("after_step", loop)

    def step_end(self, loop) -> None:
        self._each("step_end", loop)

    def epoch_exit(self, loop) -> None:
        self._each("epoch_exit", loop)

    def epoch_trained(self, loop, stats: dict) -> None:
        self._each("epoch_trained", loop, stats)

    def epoch_end(self, loop, record: dict) -> None:
        self._each("epoch_end", loop, record)

    def results(self, loop, results: dict) -> None:
        self._each("results", loop, results)

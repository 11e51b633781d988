"""The training loop's one interface to everything optional in a run: observers, called at fixed points.

train.py's loop reads as the lesson: batch, forward, backward (DDP's all-reduce), optimizer step; then evaluate and
save. What a real run does besides (the kit's watch, the time split, the log points, the GPU monitor, the feed check,
the profiler, how the gradients travel, local SGD, memory per rank, the cost, early stop, divergence) is an
``Observer`` beside the feature it serves (concerns.py for the core's, speed/ for the options), registered with
``@register`` and called by the loop at these points. A hook does nothing unless overridden:

- ``start``: before the first epoch, after a resume's restore; ``close``: the run ended, also by an error;
- each step: ``before_step`` (a batch arrived), ``after_backward`` (its gradients are computed: torch's DDP has
  averaged them, the DDP of lab/build_ddp finishes its all-reduces here), ``before_update`` (the optimizer steps
  next; fp16's gradients are unscaled by now), ``after_step`` (it is done: ``loop.loss``, ``loop.logits``,
  ``loop.labels`` are its), ``step_end`` (the loop fetches the next batch next);
- each epoch: ``epoch_start`` (its first batch is fetched next), ``epoch_exit`` (its loop is left, also by an
  error), ``epoch_trained`` (figures added to the epoch's ``stats``), ``epoch_end`` (evaluated, before the
  checkpoint);
- ``results``: the run's figures added to results.json, and said.

Observers read the ``Loop``; none assigns to it. What one wants changed (keep this step's gradients on the rank,
stop after this epoch, a value for the checkpoint, a new collective timeout, how the gradients travel) it returns
from the hook as an ``Ask``, and the loop applies it in a line of its own (train.py).

The order is declared, not listed: ``@register(after=(Gradients,))`` puts an observer inside ``Gradients``, as a
``with`` block nested in another: the hooks that open something (``start``, ``epoch_start``, ``before_step``,
``after_backward``, ``before_update``) run outermost first, the others innermost first (MosaicML Composer runs
its callbacks the same way). Declarations that contradict each other, or name a class that is not registered, are
refused when the module that makes them is imported. Every run's list is built from the registered observers
(``observers_of``), each deciding with ``for_loop`` whether this run needs it; the labs and tests pick a subset by
name (``only``) or hand in their own instance of a class (``given``).
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass, field

PREFETCH_FACTOR = 2   # batches a DataLoader worker makes ahead: torch's default, which the kit keeps


def batches_made_ahead(workers: int, prefetch_factor: int = PREFETCH_FACTOR) -> int:
    """The batches a DataLoader with ``workers`` workers has made before the training asks for its first (torch's
    default prefetch_factor, 2 a worker, which the kit keeps), and one more: where a steady window starts (the time
    split's steady images/s, the feed check, the loader benchmarks). In-process loaders (0 workers): just the first."""
    return workers * prefetch_factor + 1


@dataclass
class Ask:
    """What observers ask of the loop, returned from a hook; the loop applies it (train.py). Several observers'
    asks of one hook are merged: any ``no_sync``, the first ``stop`` reason, every ``keep`` and ``meta`` entry."""
    no_sync: bool = False                       # before_step: this step's gradients stay on the rank (local SGD)
    stop: str | None = None                     # epoch_end: stop after this epoch, for this reason (early stop)
    keep: dict = field(default_factory=dict)    # epoch_end: what the checkpoint keeps besides the model
    collective_timeout: float | None = None     # after_step: collectives may wait this long from now on
    comm: object = None                         # start: how the gradients travel (speed/comm.py's Communication)
    meta: dict = field(default_factory=dict)    # start: what results.json says of the run (comm, algorithm)

    def merged(self, other: "Ask | None") -> "Ask":
        if other is None:
            return self
        return Ask(self.no_sync or other.no_sync, self.stop or other.stop, {**self.keep, **other.keep},
                   self.collective_timeout or other.collective_timeout, self.comm or other.comm,
                   {**self.meta, **other.meta})


@dataclass
class Around:
    """What ``fit`` set up around the loop, for the observers that use it (none for a lab's or a test's loop)."""
    heartbeat: object = None        # the kit's watch (robust/heartbeat.py)
    started: float | None = None    # when the Train cell started (the start-up time)


@dataclass
class Loop:
    """What the training loop and its observers share: the run's parts, and where the loop is. Only the loop
    (train.py) changes it; observers read it."""
    model: object                     # DDP-wrapped with several ranks (model.prepare_model)
    data: object                      # this rank's loaders (data.build_data)
    optimizer: object
    scheduler: object
    scaler: object                    # fp16's gradient scaler (disabled otherwise)
    settings: object
    ctx: object                       # rank, world size, device
    logger: object                    # rank 0's run folder; a NullLogger elsewhere
    observers: "Observers | None" = None   # None: every registered observer this run needs (observers_of)
    stepper: object = None            # optim.ScaledStep of the optimizer and scaler
    meta: dict = field(default_factory=dict)   # results.json's parallel, comm, algorithm, ...
    state: dict | None = None         # the checkpoint a resume continues from
    log: object = print               # where the run's own notes go (rank 0 says them)
    # where the loop is
    epoch: int = 0
    step: int = 0                     # batches trained so far in the run (the log's x axis)
    start_step: int = 0               # where this epoch started
    lr: float = 0.0                   # the lr of the current step
    updated: bool = False             # the current step ended with an optimizer step
    skipped: bool = False             # fp16: the scaler skipped that optimizer step (its gradients overflowed)
    last: bool = False                # the current batch is the epoch's last
    loss: object = None               # the current step's loss, logits and labels (after_step)
    logits: object = None
    labels: object = None
    history: list = field(default_factory=list)   # one record per epoch trained: {"epoch", "train", "val"}
    best_acc1: float = 0.0
    kept: dict = field(default_factory=dict)   # what the observers asked the checkpoint to keep (Ask.keep)
    comm: object = None               # how the gradients travel, once an observer chose it (Ask.comm)
    dtype: object = field(init=False, default=None)   # autocast's (None: fp32), decided once, not every step
    around: InitVar[Around | None] = None   # what fit set up around the loop (the watch), for the observers
    given: InitVar[tuple] = ()        # observers to use in place of their class's own (a lab's, a test's)
    only: InitVar[tuple | None] = None   # the names of the registered observers to use; None: all

    def __post_init__(self, around, given, only):
        from .optim import ScaledStep, amp_dtype
        if self.stepper is None:   # counts the steps fp16's scaler skips
            self.stepper = ScaledStep(self.optimizer, self.scaler)
        self.dtype = amp_dtype(self.settings, self.ctx.device)
        if self.observers is None:
            self.observers = observers_of(self, around or Around(), given, only)


class Observer:
    """One optional concern of a run (see the module's docstring): override the hooks it needs. A hook may return
    an ``Ask``; ``for_loop`` says whether a run needs this observer at all."""

    @classmethod
    def for_loop(cls, loop: Loop, around: Around) -> "Observer | None":
        """This observer for ``loop``'s run, or None where the run does not need it (the feature is off)."""
        return cls()

    def start(self, loop) -> Ask | None:
        pass

    def epoch_start(self, loop) -> Ask | None:
        pass

    def before_step(self, loop) -> Ask | None:
        pass

    def after_backward(self, loop) -> Ask | None:
        pass

    def before_update(self, loop) -> Ask | None:
        pass

    def after_step(self, loop) -> Ask | None:
        pass

    def step_end(self, loop) -> Ask | None:
        pass

    def epoch_exit(self, loop) -> Ask | None:
        pass

    def eval_fetching(self, loop, waiting: bool) -> Ask | None:
        """The evaluation after an epoch waits for its next batch (True), or has it or has finished (False)."""

    def epoch_trained(self, loop, stats: dict) -> Ask | None:
        pass

    def epoch_end(self, loop, record: dict) -> Ask | None:
        pass

    def results(self, loop, results: dict) -> Ask | None:
        pass

    def close(self, loop) -> Ask | None:
        pass


HOOKS = ("start", "epoch_start", "before_step", "after_backward", "before_update", "after_step", "step_end",
         "epoch_exit", "eval_fetching", "epoch_trained", "epoch_end", "results", "close")
OPENING = ("start", "epoch_start", "before_step", "after_backward", "before_update")   # outermost first; the rest
                                                                                         # innermost first


class Observers(Observer):
    """Several observers called as one, in the declared order (see the module's docstring); each hook returns the
    merged ``Ask`` of all of them."""

    def __init__(self, observers=()):
        self.observers = list(observers)

    def __iter__(self):
        return iter(self.observers)

    def find(self, kind: type) -> Observer | None:
        """This run's observer of class ``kind`` (another observer may read it), or None."""
        return next((o for o in self.observers if isinstance(o, kind)), None)

    def _each(self, hook: str, *args) -> Ask:
        asked = Ask()
        for observer in (self.observers if hook in OPENING else reversed(self.observers)):
            asked = asked.merged(getattr(observer, hook)(*args))
        return asked


def _calls(hook: str):
    def call(self, *args):
        return self._each(hook, *args)
    call.__name__ = hook
    return call


for _hook in HOOKS:
    setattr(Observers, _hook, _calls(_hook))


# -- the table of observers ------------------------------------------------------------------------------------------
REGISTERED: dict[str, type[Observer]] = {}   # name -> class, in the declared order (outermost first)
_INSIDE: dict[str, set[str]] = {}            # name -> the names it runs inside of (its declared "after", and the
                                             # observers that declared "before" it)


def register(after=(), before=()):
    """Class decorator: add an Observer to the table, inside each class of ``after`` and around each of ``before``.
    Raises ValueError (so the importing module fails) when one of them is no registered observer, or when the
    declarations cannot all hold (a cycle)."""
    def add(cls: type[Observer]) -> type[Observer]:
        name = cls.__name__
        named = [*after, *before]
        unknown = [c for c in named if not (isinstance(c, type) and REGISTERED.get(c.__name__) is c)]
        if unknown:
            raise ValueError(f"observer {name}: {', '.join(getattr(c, '__name__', repr(c)) for c in unknown)} "
                             f"is not a registered observer (registered: {', '.join(REGISTERED)}); declare it with "
                             f"@register first, in a module imported before this one")
        if name in REGISTERED:
            raise ValueError(f"observer {name} is registered twice: give the new class another name")
        inside = {name: set(v) for name, v in _INSIDE.items()}
        inside[name] = {c.__name__ for c in after}
        for outer in before:
            inside[outer.__name__].add(name)
        order = _ordered(inside, [*REGISTERED, name])   # raises on a cycle, before anything is changed
        _INSIDE.clear()
        _INSIDE.update(inside)
        classes = {**REGISTERED, name: cls}
        REGISTERED.clear()
        REGISTERED.update({n: classes[n] for n in order})
        return cls
    return add


def _ordered(inside: dict[str, set[str]], names: list[str]) -> list[str]:
    """``names`` outermost first: each after everything it runs inside of, otherwise in registration order."""
    out, left = [], list(names)
    while left:
        ready = next((n for n in left if inside[n] <= set(out)), None)
        if ready is None:
            cycle = " -> ".join(_cycle(inside, left))
            raise ValueError(f"observer declarations contradict each other: {cycle} (each inside the next); drop one "
                             f"of the after=/before= declarations")
        out.append(ready)
        left.remove(ready)
    return out


def _cycle(inside: dict[str, set[str]], left: list[str]) -> list[str]:
    """One cycle among ``left`` (every one of which runs inside another of them), for the message."""
    path = [left[0]]
    while True:
        nxt = sorted(n for n in inside[path[-1]] if n in left)[0]
        if nxt in path:
            return path[path.index(nxt):] + [nxt]
        path.append(nxt)


def observers_of(loop: Loop, around: Around | None = None, given=(), only=None) -> Observers:
    """The observers of ``loop``'s run, outermost first: every registered class (``only``: those named) whose
    ``for_loop`` makes one, or the instance of it in ``given``."""
    instead = {type(o).__name__: o for o in given}
    unknown = sorted({*instead, *(only or ())} - set(REGISTERED))
    if unknown:
        raise ValueError(f"no registered observer {', '.join(unknown)} (registered: {', '.join(REGISTERED)})")
    made = []
    for name, cls in REGISTERED.items():
        if only is not None and name not in only and name not in instead:
            continue
        made.append(instead[name] if name in instead else cls.for_loop(loop, around or Around()))
    return Observers([o for o in made if o is not None])

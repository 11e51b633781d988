"""The core's observers of the training loop (observers.py): what every run reports and checks.

The run's own figures and its cost (``Results``), where each epoch's time went (``TimeSplit``), the kit's watch told
what the loop does (``Watch``), the log points (``LogPoints``), early stop (``EarlyStop``), numbers that stopped being
finite (``Divergence``), parameters the first step left without a gradient (``Unused``), and ``--compile``'s first
step (``CompileTimeout``). Each registers in the order it must run:
the time split outside everything that works in a step, so it measures all of it, and the watch outside the log
points, so it hears of a step's end after its log point. The options' observers live beside the options (speed/).
"""
from __future__ import annotations

import math
import time

import torch

from . import collectives, own_ddp
from .metrics import Diverged, Meter, check_finite
from .model import ddp_of, unwrap
from .parallel import local_part
from .observers import Ask, Observer, batches_made_ahead, register
from .progress import Progress
from .robust.threads import machine_id
from .runlog import TIME_PARTS

SKIPPED_IN_A_ROW = 20   # fp16 steps skipped one after another (scale / 2**20) before the run counts as broken
TIME_KEYS = (*TIME_PARTS, "comm_total_s", "wall_s")   # what each rank measures per epoch


def finish_queued_work(ctx) -> float:
    """On a GPU, wait for the queued steps and return how long that took (it is their compute:
    the CPU runs ahead of the GPU, and would otherwise count it where it next waits)."""
    if ctx.device.type != "cuda":
        return 0.0
    start = time.perf_counter()
    torch.cuda.synchronize(ctx.device)
    return time.perf_counter() - start


@register()
class TimeSplit(Observer):
    """Where each epoch's time went, on each rank and as the ranks' means: ``data_s`` (waiting for the next batch),
    ``compute_s`` (forward, backward, step, with the communication that overlapped the backward pass), ``comm_s``
    (the communication the step waited for after it; ``comm_total_s`` all of it), ``idle_s`` (the rest: log points,
    logging). They add up to the epoch's wall time (docs/time-split.md). Also the epoch's steady images/s: from the
    end of step ``warm`` (the batches the loader made ahead, 2 a worker, and one more) to the epoch's end."""

    def __init__(self, warm: int = 1):
        self.warm = warm

    @classmethod
    def for_loop(cls, loop, around):
        return cls(warm=batches_made_ahead(loop.settings.workers))

    def epoch_start(self, loop) -> None:
        self.data_s = self.step_s = 0.0
        self.first_step_s = None   # from the epoch's start to its first step's end: loader start-up, first batch
        self.t_epoch = self.t_end = time.perf_counter()
        self.steps = self.images = 0
        self.t_warm = self.images_warm = None   # when (and after how many images) the warm batches were used up

    def before_step(self, loop) -> None:
        self.t_data = time.perf_counter()
        self.data_s += self.t_data - self.t_end

    def after_step(self, loop) -> None:
        self.step_s += time.perf_counter() - self.t_data
        self.images += len(loop.labels)

    def compute(self, seconds: float) -> None:
        """Time that counts as compute outside a step (queued GPU work at a log point, local SGD's last average)."""
        self.step_s += seconds

    def data_share(self) -> float:
        return self.data_s / max(time.perf_counter() - self.t_epoch, 1e-9)

    def step_end(self, loop) -> None:
        self.t_end = time.perf_counter()
        if self.first_step_s is None:
            self.first_step_s = self.t_end - self.t_epoch
        self.steps += 1
        if self.steps == self.warm:
            self.t_warm, self.images_warm = self.t_end, self.images

    def epoch_trained(self, loop, stats: dict) -> None:
        self.step_s += finish_queued_work(loop.ctx)   # so the epoch's wall time includes queued GPU work
        wall = time.perf_counter() - self.t_epoch
        timer = getattr(loop.comm, "timer", None)   # how the gradients travel times them (speed/commtime.py)
        comm_s, comm_total_s = timer.take() if timer is not None else (0.0, 0.0)
        mine = {"data_s": self.data_s, "compute_s": max(0.0, self.step_s - comm_s), "comm_s": comm_s,
                "comm_total_s": comm_total_s, "idle_s": max(0.0, wall - self.data_s - self.step_s), "wall_s": wall}
        extra = stats.pop("gather", {})   # inner observers' per-rank figures (the feed check's): the same gather
        per_rank, gathered = gather_times(mine, loop.ctx, extra)   # DDP: a small collective; every rank gets all
        # DDP: the epoch took as long as its slowest rank; every rank computes the same global figures from the
        # gathered times, so every rank prints the same line. Same steps on every rank (drop_last): images/s add up.
        wall = max(r["wall_s"] for r in per_rank)
        means = {key: sum(r[key] for r in per_rank) / len(per_rank) for key in mine}   # the ranks' means
        means["wall_mean_s"] = means.pop("wall_s")
        if extra:
            stats["gathered"] = gathered   # each rank's, for the observer that asked (it takes them at epoch_end)
        stats.update(means, per_rank=per_rank, wall_s=wall, first_step_s=self.first_step_s,
                     images_per_s_rank=stats["count"] / loop.ctx.world_size / max(wall, 1e-9),
                     images_per_s=stats["count"] / max(wall, 1e-9))
        if self.t_warm is not None and self.steps > self.warm:   # this rank's window, times the ranks (same steps)
            steady = (self.images - self.images_warm) * loop.ctx.world_size / max(
                time.perf_counter() - self.t_warm, 1e-9)
            stats.update(steady_after_batches=self.warm, steady_steps=self.steps - self.warm,
                         steady_images_per_s=steady)


def gather_times(mine: dict, ctx, extra: dict | None = None) -> tuple[list[dict], list[dict]]:
    """Every rank's time split, and every rank's ``extra`` figures (the same keys on every rank), on every rank:
    one row per rank each, in one all-reduce of a table with a row per rank."""
    extra = extra or {}
    keys = (*TIME_KEYS, *sorted(extra))
    table = torch.zeros(ctx.world_size, len(keys), dtype=torch.float64)
    table[ctx.rank] = torch.tensor([float({**mine, **extra}[key]) for key in keys], dtype=torch.float64)
    collectives.all_reduce_sum(table, ctx)
    rows = [dict(zip(keys, map(float, row))) for row in table]
    return ([{"rank": r, **{k: row[k] for k in TIME_KEYS}} for r, row in enumerate(rows)],
            [{k: row[k] for k in sorted(extra)} for row in rows])


@register(after=(TimeSplit,))
class Watch(Observer):
    """The kit's watch (robust/heartbeat.py) told what the loop does: a rank waiting for its data is told apart
    from one waiting in a collective, so a stuck loader is named as such."""

    def __init__(self, heartbeat=None):
        self.heartbeat = heartbeat

    @classmethod
    def for_loop(cls, loop, around):
        return cls(around.heartbeat) if around.heartbeat is not None else None

    def epoch_start(self, loop) -> None:
        if self.heartbeat is not None:
            self.heartbeat.fetching(True)

    def before_step(self, loop) -> None:
        if self.heartbeat is not None:
            self.heartbeat.fetching(False)

    def step_end(self, loop) -> None:
        if self.heartbeat is not None:
            self.heartbeat.step()   # it fetches the next batch now
            if loop.last:   # none: from here on this rank waits in collectives (local SGD's average), not for data
                self.heartbeat.fetching(False)

    def epoch_exit(self, loop) -> None:
        if self.heartbeat is not None:
            self.heartbeat.fetching(False)

    def eval_fetching(self, loop, waiting: bool) -> None:
        if self.heartbeat is not None:
            self.heartbeat.fetching(waiting, "validation")


@register(after=(Watch, TimeSplit))   # the watch hears of a step's end after its log point
class LogPoints(Observer):
    """Every ``log_every`` steps the loss and accuracy since the last log point, all-reduced (a collective every
    rank reaches at the same step), to the progress line and TensorBoard; the lr every step; the epoch's loss and
    accuracy at its end. Every rank shows its own bar and the same global lines; rank 0 also writes them."""

    split = None

    def epoch_start(self, loop) -> None:
        self.split = loop.observers.find(TimeSplit)   # the log point's queued GPU work is compute
        s = loop.settings
        self.epoch_meter, self.window = Meter(loop.ctx.device), Meter(loop.ctx.device)
        self.progress = Progress(s.progress, len(loop.data.train), f"epoch {loop.epoch + 1}/{s.epochs}", show=True,
                                 print_line=loop.logger.info, rank=loop.ctx.rank if loop.ctx.distributed else None)

    def after_step(self, loop) -> None:
        # loss and hits stay on the device between log points: the GPU is never forced to sync per step
        self.window.update(loop.loss.detach() * loop.labels.shape[0], loop.logits, loop.labels)
        loop.logger.scalars({"lr": loop.lr}, loop.step - 1)   # every step (rank 0 only, cheap): the schedule's shape

    def step_end(self, loop) -> None:
        if loop.step % loop.settings.log_every == 0:
            queued = finish_queued_work(loop.ctx)
            if self.split is not None:
                self.split.compute(queued)
            stats = self.window.reduced(loop.ctx)   # DDP: a collective, reached by every rank at the same step
            self.epoch_meter.add(self.window)
            self.window.reset()
            check_finite(stats["loss"], "the training loss", loop.step, loop.lr)   # global: every rank stops alike
            loop.logger.scalars({"Loss/train": stats["loss"], "acc1/train": stats["acc1"],
                                 "acc5/train": stats["acc5"]}, loop.step)
            self.progress.log_point(loop.step - loop.start_step, stats["loss"], stats["acc1"], loop.lr)
        self.progress.update(self.split.data_share() if self.split is not None else None)

    def epoch_exit(self, loop) -> None:
        self.progress.close()   # also when a step fails: no half-drawn bar left behind

    def epoch_trained(self, loop, stats: dict) -> None:
        self.epoch_meter.add(self.window)   # the steps since the last log point
        stats.update(self.epoch_meter.reduced(loop.ctx))
        check_finite(stats["loss"], "the training loss of the epoch", loop.step, loop.scheduler.get_last_lr()[0])


@register(after=(LogPoints,))
class EarlyStop(Observer):
    """``--patience N``: stop after N epochs in a row without a better validation Acc@1."""

    @classmethod
    def for_loop(cls, loop, around):
        return cls() if loop.settings.patience > 0 else None

    def epoch_end(self, loop, record: dict) -> Ask:
        return Ask(stop=early_stop(loop.history, loop.settings.patience, loop.ctx))


def early_stop(history: list[dict], patience: int, ctx) -> str | None:
    """Why to stop now, or None: ``patience`` epochs in a row without a better validation Acc@1.

    Validation numbers are all-reduced, hence the same on every rank; the decision is still taken
    by rank 0 and sent to all, so that no rank can stop alone and leave the others waiting.
    """
    if patience <= 0 or not history:
        return None
    accs = [h["val"]["acc1"] for h in history]
    best = max(range(len(accs)), key=lambda i: (accs[i], -i))   # the first epoch with the best Acc@1
    reason = (f"no better validation Acc@1 for {patience} epoch(s) (best {accs[best]:.2f} % at epoch "
              f"{history[best]['epoch']}, kept in best.pt)") if len(accs) - 1 - best >= patience else None
    return collectives.broadcast_object(reason, ctx)   # DDP: rank 0 decides for all


@register(after=(LogPoints,))
class Divergence(Observer):
    """Numbers that stopped being finite stop the run on every rank alike (metrics.Diverged): fp16 steps skipped
    too many times in a row, a validation loss or weights that are not finite."""

    def after_step(self, loop) -> None:
        # the same step on every rank: the gradients, hence the scalers, are the same; not with local SGD, whose
        # local steps see each rank's own gradients (a rank that stops alone is reported by the watch)
        if loop.skipped and loop.stepper.in_a_row >= SKIPPED_IN_A_ROW:
            raise Diverged(f"the fp16 gradient scaler skipped the last {loop.stepper.in_a_row} steps (their gradients "
                           f"overflowed; its scale fell to {loop.stepper.scaler.get_scale():.3g})", loop.step, loop.lr)

    def epoch_end(self, loop, record: dict) -> None:
        lr = loop.scheduler.get_last_lr()[0]
        check_finite(record["val"]["loss"], "the validation loss", loop.step, lr)
        if not weights_finite(loop.model, loop.ctx):
            raise Diverged("some weights are not finite", loop.step, lr)


def weights_finite(model, ctx) -> bool:
    """Whether every parameter and buffer is finite on every rank (one small collective per epoch)."""
    net = unwrap(model)
    tensors = map(local_part, (*net.parameters(), *net.buffers()))   # FSDP: this rank's shards
    bad = sum(int(not torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
    return collectives.all_reduce_sum(torch.tensor([float(bad)], device=ctx.device), ctx).item() == 0


class UnusedParameters(ValueError):
    """Parameters that got no gradient in DDP's first step, with find_unused_parameters off: DDP would stop at the
    next step with torch's "Expected to have finished reduction in the prior iteration"."""


@register(after=(Divergence,))
class Unused(Observer):
    """At the run's first optimizer step, every rank's parameters that got no gradient: DDP waits for every
    parameter's gradient before it all-reduces its bucket, so without ``find_unused_parameters`` (or
    ``static_graph``) it stops at the next step with a sentence that names no parameter. The kit names them, on
    every rank, at the first step; FSDP needs no setting and is told so."""
    checked = False

    @classmethod
    def for_loop(cls, loop, around):
        return cls() if loop.ctx.distributed else None

    def after_backward(self, loop) -> None:
        if self.checked:
            return
        self.checked = True
        net, mode = unwrap(loop.model), loop.meta.get("parallel")
        if mode not in ("ddp", "zero1", "fsdp") or (mode != "fsdp" and ddp_of(loop.model) is None):
            return   # your own DDP (--build-ddp a/b/c) has no such setting
        mine = [name for name, p in net.named_parameters() if p.requires_grad and p.grad is None]
        every = collectives.gather_objects(mine, loop.ctx)   # the same list on every rank (a collective)
        names = sorted(set().union(*every))
        if names:
            said = unused_said(names, every, loop.settings, mode)
            if mode == "fsdp" or loop.settings.find_unused_parameters or loop.settings.static_graph:
                loop.logger.info(said)
            else:
                raise UnusedParameters(said)


def unused_said(names: list[str], every: list[list[str]], settings, mode: str) -> str:
    """The paragraph for parameters ``names`` that got no gradient (``every``: each rank's own list)."""
    ranks = [r for r, mine in enumerate(every) if mine]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    head = (f"{len(names)} parameter(s) got no gradient in the first step on rank(s) {', '.join(map(str, ranks))}: "
            f"{shown}. The model's forward did not use them")
    if mode == "fsdp":
        return (f"{head}; FSDP reduce-scatters the gradients that exist and the optimizer leaves these as they are: "
                f"nothing to set.")
    if settings.find_unused_parameters or settings.static_graph:
        how = "find_unused_parameters" if settings.find_unused_parameters else "static_graph"
        return f"{head}; DDP handles them ({how}=True)."
    return (f"{head}, and DDP waits for every parameter's gradient before it all-reduces its bucket: it would stop at "
            f"the next step (\"Expected to have finished reduction in the prior iteration\"). Either make the forward "
            f"use them (or delete them, or freeze them with requires_grad=False), or set find_unused_parameters=True "
            f"(--find-unused-parameters; in a notebook, Settings(find_unused_parameters=True) on every rank): DDP "
            f"then finds the unused ones after every forward, an extra walk of the autograd graph each step; or "
            f"static_graph=True when the same ones go unused at every step (no such walk; it rules out accumulate > 1 "
            f"and local SGD).")


@register(after=(Unused,))
class CompileTimeout(Observer):
    """``--compile``: the short collective timeout starts after the first step, whose compilation can take minutes."""

    @classmethod
    def for_loop(cls, loop, around):
        return cls() if loop.settings.compile and loop.ctx.distributed else None

    def after_step(self, loop) -> Ask | None:
        if loop.step == loop.start_step + 1:
            return Ask(collective_timeout=loop.settings.collective_timeout)
        return None


@register(before=(TimeSplit,))
class Results(Observer):
    """The run's own figures in results.json, and said: start-up, the cost, the link probe's prediction."""

    def __init__(self, join_s: float, started: float | None):
        self.join_s, self.started, self.t0 = join_s, started, None

    @classmethod
    def for_loop(cls, loop, around):
        return cls(loop.ctx.join_s, around.started)

    def epoch_start(self, loop) -> None:
        if self.t0 is None:   # the first epoch's start
            self.t0 = time.perf_counter()

    def results(self, loop, results: dict) -> None:
        s, ctx = loop.settings, loop.ctx
        results.update(run_cost(s, ctx, results["wall_time_s"], results["epochs_run"]))
        # Start-up, which wall_time_s (from the first epoch's start) leaves out: joining, and from the Train cell's
        # start to its first step's end. Rank 0's figures, as every figure of results.json.
        trained = results["epochs_run"] and len(loop.history) >= results["epochs_run"]
        first = loop.history[-results["epochs_run"]]["train"].get("first_step_s") if trained else None
        mine = {"join_s": self.join_s, "startup_s": (self.t0 - self.started + first)
                if self.started is not None and first is not None else None}
        results.update(collectives.broadcast_object(mine, ctx))
        if results["startup_s"] is not None:
            # lines under 100 characters: a notebook wraps longer ones mid-word
            loop.logger.info(f"start-up: {results['startup_s']:.1f} s from the start of training to the end of its "
                             f"first step,\n  besides {results['join_s']:.1f} s to join the process group "
                             f"(wall_time_s leaves both out)")
        if results["cost"] is not None:
            loop.logger.info(describe_cost(results))
        if results.get("probe") and results["measured_step_s"]:
            loop.logger.info(predicted_vs_measured(results["probe"], results,
                                                   own=s.build_ddp in own_ddp.WRAPPERS))


def run_cost(settings, ctx, wall_s: float, epochs: int) -> dict:
    """What this run cost, all nodes together: ``cost`` (None without a price) and its parts."""
    nodes = len(set(collectives.gather_objects(machine_id(), ctx)))   # DDP: ranks sharing a machine pay once
    if not settings.price_per_hour:
        return {"cost": None, "cost_per_epoch": None, "nodes": nodes, "price_per_hour": None}
    cost = wall_s / 3600 * nodes * settings.price_per_hour
    return {"cost": cost, "cost_per_epoch": cost / epochs if epochs else None, "nodes": nodes,
            "price_per_hour": settings.price_per_hour}


def money(amount: float) -> str:
    """An amount with three significant digits, at least two decimals: 0.00123, 0.0456, 0.526, 12.35."""
    if amount <= 0 or amount >= 1:
        return f"{amount:.2f}"
    return f"{amount:.{max(2, 2 - math.floor(math.log10(amount)))}f}"


def describe_cost(results: dict) -> str:
    per_epoch = f", {money(results['cost_per_epoch'])} per epoch" if results["cost_per_epoch"] is not None else ""
    shared = (f";\n  its {results['world_size']} ranks shared {results['nodes']} machine(s): a rehearsal, priced as "
              f"what it used (the GPU nodes pay for {results['world_size']})"
              if results["nodes"] < results["world_size"] else "")
    return (f"cost: {money(results['cost'])} for this run ({results['wall_time_s'] / 3600:.4f} h x {results['nodes']} "
            f"node(s) x {results['price_per_hour']:g} per node-hour){per_epoch}{shared}")


def predicted_vs_measured(probe: dict, results: dict, own: bool = False) -> str:
    """The link probe's prediction next to what the run measured, per step. ``own``: your DDP (lab/build_ddp) trained,
    of which only the wait in ``finish_gradient_sync()`` is timed (what overlapped the backward pass is not seen)."""
    steps = results["steps"]
    comm = probe.get("predicted_comm", "none")
    sends = (f"all-reduce {1e3 * probe['allreduce_s']:.0f}" if comm == "none" else
             f"{comm} {1e3 * probe['comm_s']:.0f} (fp32 all-reduce {1e3 * probe['allreduce_s']:.0f})")
    how = (f"a DDP step of a copy: compute {1e3 * probe['compute_s']:.0f}, {sends}"
           if probe.get("ddp_step_s") is not None else
           f"compute {1e3 * probe['compute_s']:.0f} + {sends}")
    if probe.get("loader_timed"):   # the loader's wait, which the step does not hide
        how += f", + loader {1e3 * probe['loader_s']:.0f}"
    return (f"per step: predicted {1e3 * probe['predicted_step_s']:.0f} ms ({how});\n  measured "
            f"{1e3 * results['measured_step_s']:.0f} ms "
            f"(data {1e3 * results['data_s'] / steps:.0f}, compute {1e3 * results['compute_s'] / steps:.0f}, "
            + (f"comm waited in finish_gradient_sync() {1e3 * results['comm_s'] / steps:.0f}" if own else
               f"comm waited for {1e3 * results['comm_s'] / steps:.0f} of {1e3 * results['comm_total_s'] / steps:.0f} "
               f"in flight") + f", idle {1e3 * results['idle_s'] / steps:.0f});\n  predicted speed-up over one rank "
            f"{probe['predicted_speedup']:.2f}x (compare with a 1-rank run in the report)")

"""The feed check: does the data loader keep every rank's GPU busy? Judged at every epoch's end, for every rank.

Each rank times its own window each epoch: past the batches its loader made before the clock could see it wait
(``batches_made_ahead``), ``window(workers)`` steps (workers deliver in rounds, one batch each: the window holds a
few rounds), each step's wall time (from the previous step's end: the wait for the next batch, then the step)
against the device's own time for the step (CUDA events around it on a GPU; the same clock on a CPU, where the step
runs in the calling thread). A rank's loader bounds the run when the images/s it delivered are under ``FED`` of
what its step alone trains and its wait for data took at least ``WAITED`` of the time. Each rank judges its own
loader: over NCCL a peer's stall shows up inside rank 0's step (rank 0 waits in the all-reduce) and would read as
compute there.

The ranks' figures travel in the epoch's one gather of the time split (concerns.TimeSplit gathers what inner
observers put in ``stats["gather"]``: no collective of their own); at the epoch's end every rank decides the same,
and the slowest-fed rank is named. On a GPU, rank 0 says so in a paragraph with what to do (how many workers the
measured step needs against that node's CPUs; what a resized copy gives, measured); every run keeps the figures in
results.json as ``feed`` (the last epoch's verdict: the slowest rank's figures, ``rank``, ``per_rank``) and each
epoch's record its own.
"""
from __future__ import annotations

import math
import os
import time

import torch

from ..concerns import TimeSplit
from ..observers import Observer, batches_made_ahead, register

MIN_STEPS = 20    # steps timed at least: a T4 fed 300 img/s at batch 500 decides in about 40 s
ROUNDS = 3        # ... and at least this many rounds of the workers (each delivers one batch a round)
FED = 0.85        # delivered / the step alone, under which the loader is named
WAITED = 0.10     # the share of the time spent waiting for data, from which the wait is what bounds
# The kit's loader on a copy of ImageNet resized once (short side 288) against the originals, images per core:
# benchmarks/results/imagenet_input.json, 817 / 560 img/s per core (tests/test_feed.py holds the two equal).
RESIZED_PER_CORE = 1.46
# What each rank puts in the epoch's gather (the same keys on every rank; zeros where it timed nothing)
KEYS = ("feed_images", "feed_wall_s", "feed_step_s", "feed_wait_s", "feed_steps", "feed_cpus")


def window(workers: int) -> int:
    """The steps a rank times: at least MIN_STEPS, and ROUNDS rounds of its workers."""
    return max(MIN_STEPS, ROUNDS * workers)


def says(ctx) -> bool:
    """The paragraph is for GPU runs, on rank 0 (a CPU rehearsal keeps the figures only)."""
    return ctx.device.type == "cuda" and ctx.is_main


@register(after=(TimeSplit,))   # inside it: its figures are in stats before TimeSplit gathers the epoch's
class FeedCheck(Observer):
    """Times ``steps`` steady steps of every epoch on every rank, and judges them at the epoch's end (see the
    module's docstring)."""

    def __init__(self, workers: int, steps: int | None = None):
        self.workers, self.steps = workers, steps or window(workers)
        self.after = batches_made_ahead(workers)
        self.rows, self.result, self.seen, self.t_end, self.said = [], None, 0, None, None

    @classmethod
    def for_loop(cls, loop, around):
        return cls(loop.settings.workers)

    def epoch_start(self, loop) -> None:   # every epoch: its workers start again and make their batches ahead again
        self.t_end, self.seen, self.rows = time.perf_counter(), 0, []

    def timing(self) -> bool:
        return len(self.rows) < self.steps

    def before_step(self, loop) -> None:
        if self.timing():
            self.t_batch = time.perf_counter()
            self.events = _events(loop.ctx)

    def after_step(self, loop) -> None:
        if self.timing():
            if self.events:
                self.events[1].record()
            self.t_stepped, self.images = time.perf_counter(), len(loop.labels)

    def step_end(self, loop) -> None:
        if not self.timing():
            return
        now = time.perf_counter()
        self.seen += 1
        if self.seen > self.after:
            self.rows.append({"wall": now - self.t_end, "wait": self.t_batch - self.t_end, "images": self.images,
                              "host_step": self.t_stepped - self.t_batch, "events": self.events})
        self.t_end = now

    def epoch_trained(self, loop, stats: dict) -> None:
        """This rank's window, for TimeSplit's gather (a short epoch: what it had, if at least half a window)."""
        rows = self.rows if len(self.rows) >= max(5, self.steps // 2) else []
        if rows and loop.ctx.device.type == "cuda":
            torch.cuda.synchronize(loop.ctx.device)
        step_s = sum(r["events"][0].elapsed_time(r["events"][1]) / 1e3 if r["events"] else r["host_step"] for r in rows)
        stats.setdefault("gather", {}).update(zip(KEYS, (
            sum(r["images"] for r in rows), sum(r["wall"] for r in rows), step_s, sum(r["wait"] for r in rows),
            len(rows), os.cpu_count() or 0)))
        self.rows = []

    def epoch_end(self, loop, record: dict) -> None:
        alone = record["train"].pop("gather", None)   # no TimeSplit in this run (a lab's subset): this rank's own
        gathered = record["train"].pop("gathered", None) or ([alone] if alone else [])
        first = loop.ctx.rank if alone else 0
        ranks = [(first + i, row) for i, row in enumerate(gathered) if row["feed_steps"]]
        if not ranks:
            return
        judged = [{"rank": rank, **verdict(row["feed_images"] / max(row["feed_wall_s"], 1e-9),
                                           row["feed_images"] / max(row["feed_step_s"], 1e-9),
                                           row["feed_wait_s"] / max(row["feed_wall_s"], 1e-9)),
                   "steps": int(row["feed_steps"]), "cpus": int(row["feed_cpus"])} for rank, row in ranks]
        slowest = min(judged, key=lambda r: (r["fed"] if r["bound"] == "loader" else 2.0, -r["wait_share"]))
        self.result = {**slowest, "after_batches": self.after, "device": str(loop.ctx.device),
                       "epoch": record["epoch"], "per_rank": judged}
        record["train"]["feed"] = self.result
        if slowest["bound"] == "loader" and says(loop.ctx) and self.said != slowest["rank"]:
            self.said = slowest["rank"]   # said again only when another rank is the slowest
            loop.logger.info(describe(self.result, self.workers, slowest["cpus"]))

    def results(self, loop, results: dict) -> None:
        if self.result is not None:
            results["feed"] = self.result


def _events(ctx):
    """A started pair of CUDA events on a GPU (the step's own time, whatever the host does meanwhile), else None."""
    if ctx.device.type != "cuda":
        return None
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    return begin, end


def verdict(delivered: float, alone: float, waited: float) -> dict:
    """What bounds the run: ``loader`` when it delivered under FED of the step alone's images/s and the wait for
    data took at least WAITED of the time; else ``compute`` (the step, with its communication)."""
    fed = delivered / max(alone, 1e-9)
    bound = "loader" if fed < FED and waited >= WAITED else "compute"
    return {"delivered_img_s": delivered, "step_alone_img_s": alone, "fed": min(fed, 1.0), "wait_share": waited,
            "bound": bound}


def workers_needed(result: dict, workers: int) -> int:
    """Loader processes the step needs at the images/s each delivered (an in-process loader counts as one)."""
    each = result["delivered_img_s"] / max(workers, 1)
    return math.ceil(result["step_alone_img_s"] / max(each, 1e-9))


def describe(result: dict, workers: int, cpus: int | None) -> str:
    """The paragraph for a loader-bound run: the slowest rank's figures, the workers its step needs against the
    CPUs its node has, and what a resized copy gives (lines under 100 characters: a notebook wraps longer ones
    mid-word)."""
    need, rank = workers_needed(result, workers), result.get("rank", 0)
    spare = (cpus or 0) - 1   # one CPU runs the training process itself
    more = (f"  at that rate about {need} would feed it; this node has {cpus} CPUs, one for training:\n  "
            + ("set WORKERS to " + str(need) if need <= spare else "more workers cannot feed it here") + ".")
    return (f"feed check: the data loader bounds this run on rank {rank}. Over {result['steps']} steps it delivered "
            f"{result['delivered_img_s']:.0f} img/s,\n  where this GPU trains {result['step_alone_img_s']:.0f} "
            f"img/s when fed (its own time for those steps): it waited for data\n  "
            f"{100 * result['wait_share']:.0f} % of the time. {workers} worker(s) gave "
            f"{result['delivered_img_s'] / max(workers, 1):.0f} img/s each:\n{more}\n"
            f"  A copy resized once, on the local disk (lab/data.md), decodes {RESIZED_PER_CORE:.2f}x the images per\n"
            f"  core (measured: docs/benchmarks.md, ImageNet input).")

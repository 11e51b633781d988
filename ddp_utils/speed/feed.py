"""The feed check: in a run's first steps, does the data loader keep the GPU busy?

Past the batches the loader made before the clock could see it wait (each worker's two prefetched batches, and one
more), it times ``STEPS`` steps: each step's wall time (from the previous step's end: the wait for the next batch,
then the step) against the device's own time for the step (CUDA events around it on a GPU; the same clock on a
CPU, where the step runs in the calling thread). The loader bounds the run when the images/s it delivered are under
``FED`` of what the step alone trains and the wait for data took at least ``WAITED`` of the time. On a GPU, rank 0
then says so in a paragraph with what to do; every run keeps the figures in results.json as ``feed`` (rank 0's).
"""
from __future__ import annotations

import os
import time

import torch

from ..observers import Observer, batches_made_ahead, register

STEPS = 20        # steps timed: a T4 fed 300 img/s at batch 500 decides in about 40 s
FED = 0.85        # delivered / the step alone, under which the loader is named
WAITED = 0.10     # the share of the time spent waiting for data, from which the wait is what bounds


def says(ctx) -> bool:
    """The paragraph is for GPU runs, on rank 0 (a CPU rehearsal keeps the figures only)."""
    return ctx.device.type == "cuda" and ctx.is_main


@register()
class FeedCheck(Observer):
    """Times the first ``steps`` steady steps of the run once, then decides (see the module's docstring)."""

    def __init__(self, workers: int, steps: int = STEPS):
        self.workers, self.steps = workers, steps
        self.after = batches_made_ahead(workers)
        self.rows, self.result, self.seen, self.t_end = [], None, 0, None

    @classmethod
    def for_loop(cls, loop, around):
        return cls(loop.settings.workers)

    def epoch_start(self, loop) -> None:
        if self.result is None:   # a new epoch: the workers start again and make their batches ahead again
            self.t_end, self.seen, self.rows = time.perf_counter(), 0, []

    def before_step(self, loop) -> None:
        if self.result is None:
            self.t_batch = time.perf_counter()
            self.events = _events(loop.ctx)

    def after_step(self, loop) -> None:
        if self.result is None:
            if self.events:
                self.events[1].record()
            self.t_stepped, self.images = time.perf_counter(), len(loop.labels)

    def step_end(self, loop) -> None:
        if self.result is not None:
            return
        now = time.perf_counter()
        self.seen += 1
        if self.seen > self.after:
            self.rows.append({"wall": now - self.t_end, "wait": self.t_batch - self.t_end, "images": self.images,
                              "host_step": self.t_stepped - self.t_batch, "events": self.events})
        self.t_end = now
        if len(self.rows) >= self.steps:
            self.decide(loop)

    def epoch_trained(self, loop, stats: dict) -> None:
        if self.result is None and len(self.rows) >= max(5, self.steps // 2):   # a short epoch: what it had
            self.decide(loop)

    def decide(self, loop) -> None:
        if loop.ctx.device.type == "cuda":
            torch.cuda.synchronize(loop.ctx.device)
        step_s = sum(r["events"][0].elapsed_time(r["events"][1]) / 1e3 if r["events"] else r["host_step"]
                     for r in self.rows)
        wall = sum(r["wall"] for r in self.rows)
        images = sum(r["images"] for r in self.rows)
        self.result = verdict(images / max(wall, 1e-9), images / max(step_s, 1e-9),
                              sum(r["wait"] for r in self.rows) / max(wall, 1e-9))
        self.result.update(after_batches=self.after, steps=len(self.rows), device=str(loop.ctx.device))
        self.rows = []
        if self.result["bound"] == "loader" and says(loop.ctx):
            loop.logger.info(describe(self.result, self.workers, os.cpu_count()))

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


def describe(result: dict, workers: int, cpus: int | None) -> str:
    """The paragraph for a loader-bound run: the figures, and the three ways to feed the GPU (lines under 100
    characters: a notebook wraps longer ones mid-word)."""
    return (f"feed check: the data loader bounds this run. Over {result['steps']} steps it delivered "
            f"{result['delivered_img_s']:.0f} img/s,\n  where this GPU trains {result['step_alone_img_s']:.0f} "
            f"img/s when fed (its own time for those steps): it waited for data\n  "
            f"{100 * result['wait_share']:.0f} % of the time. To feed it: a copy of the data resized once, on the "
            f"local disk\n  (lab/data.md), more loader workers (now {workers}; this node has {cpus or '?'} CPUs),\n"
            f"  or a GPU decoder (--loader dali).")

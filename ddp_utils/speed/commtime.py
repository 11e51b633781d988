"""How long each training step spent on gradient communication, measured with a DDP comm hook.

DDP calls a communication hook once per gradient bucket, as soon as the bucket's gradients are
ready during the backward pass; the hook starts the all-reduce and returns a future. ``CommTimer``
wraps the hook in use (PyTorch's default, average the bucket over the ranks, or a compression hook
of ``comm.py``), notes when each bucket was handed over and when its all-reduce finished, and
splits the step's communication in two:

- ``comm_s``, *waited for*: from the moment the last bucket was ready (the backward pass had
  computed every gradient) until the last all-reduce finished. The step could do nothing else
  then; this is what a slow link adds to every step.
- ``comm_total_s``, *in flight*: all the time at least one all-reduce was running, including the
  part that overlapped the backward pass. That overlapped part cost no time of its own (the
  backward pass was computing anyway), so the time split counts it as compute.

On a GPU the times come from CUDA events in stream order (GPU time, resolved without forcing a
synchronisation per step); on a CPU from ``time.perf_counter``. Waiting for a slower rank shows up
as communication too: an all-reduce ends when the last rank has sent its part.
"""
from __future__ import annotations

import threading
import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook


class CommTimer:
    """Register with ``attach(ddp_model)``; call ``step_done()`` after each optimizer step and
    ``take()`` at the end of an epoch for the epoch's ``(waited_s, in_flight_s)``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._lock = threading.Lock()   # the futures' callbacks run on the backend's thread
        self._buckets: list = []        # this step's (ready, done) pairs: floats, or CUDA events
        self._pending: list = []        # CUDA: finished steps whose events are not resolved yet
        self.waited_s = self.in_flight_s = 0.0
        self.steps = 0
        self.blocking = False
        self.state = None               # the hook's state, once attached (PowerSGD's memory)

    def attach(self, ddp_model, hook=allreduce_hook, state=None) -> None:
        """Time ``hook`` (DDP's default all-reduce, or a compression hook from ``comm.py``) on ``ddp_model``."""
        self._inner, self.state = hook, state
        self.blocking = getattr(hook, "blocking", False)   # a hook that waits blocks the backward pass
        ddp_model.register_comm_hook(state=None, hook=self._hook)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()   # on the current stream: in the callback, the stream the all-reduce ran on
        return event

    def _hook(self, state, bucket):
        ready = self._now()
        future = self._inner(self.state, bucket)   # e.g. DDP's default: all-reduce the bucket, average

        def done(fut):
            with self._lock:
                self._buckets.append((ready, self._now()))
            return fut.value()
        return future.then(done)

    def step_done(self) -> None:
        """After ``optimizer.step()``: DDP has waited for every bucket of this step by now."""
        with self._lock:
            buckets, self._buckets = self._buckets, []
        if not buckets:
            return
        self.steps += 1
        if self.cuda:
            self._pending.append(buckets)
            self._resolve(block=False)   # only steps the GPU has finished: no synchronisation
        else:
            self._add(buckets)

    def span(self):
        """Start timing communication outside the hook (local SGD's weight averaging): ``end_span(span)`` after it.
        Nothing overlaps it, so all of it counts as waited for."""
        return self._now()

    def end_span(self, start) -> None:
        interval = [(start, self._now())]
        if self.cuda:
            self._pending.append(interval)
            self._resolve(block=False)
        else:
            self._add(interval)

    def take(self) -> tuple[float, float]:
        """``(waited_s, in_flight_s)`` since the last call; waits for the GPU to finish queued steps."""
        self._resolve(block=True)
        out = (self.waited_s, self.in_flight_s)
        self.waited_s = self.in_flight_s = 0.0
        return out

    def _resolve(self, block: bool) -> None:
        while self._pending:
            buckets = self._pending[0]
            if not block and not all(done.query() for _, done in buckets):
                return
            origin = buckets[0][0]
            for ready, done in buckets:   # elapsed_time needs both events complete, on whichever stream
                ready.synchronize()
                done.synchronize()
            self._add([(origin.elapsed_time(r) / 1e3, origin.elapsed_time(d) / 1e3) for r, d in buckets])
            self._pending.pop(0)

    def _add(self, buckets: list[tuple[float, float]]) -> None:
        waited, in_flight = split(buckets)
        self.waited_s += in_flight if self.blocking else waited
        self.in_flight_s += in_flight


def split(buckets: list[tuple[float, float]]) -> tuple[float, float]:
    """``(waited, in_flight)`` of one step from its buckets' ``(ready, done)`` times.

    waited = last done - last ready (never negative); in_flight = length of the union of the intervals.
    """
    waited = max(0.0, max(d for _, d in buckets) - max(r for r, _ in buckets))
    in_flight, reach = 0.0, float("-inf")
    for ready, done in sorted(buckets):
        start = max(ready, reach)
        if done > start:
            in_flight += done - start
        reach = max(reach, done)
    return waited, in_flight

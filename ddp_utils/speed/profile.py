"""``--profile-steps A:B``: a ``torch.profiler`` trace of optimizer steps A to B-1 on every rank, in rank 0's run folder.

The trace shows what the time split only sums up: the forward and backward operators, the gradient all-reduce
DDP starts during the backward pass (``gloo:all_reduce``, ``nccl:all_reduce`` and its GPU kernel
``ncclDevKernel_AllReduce...``), what it overlaps and what waits for it. Every rank records its own steps; at step B
the ranks send their traces to rank 0 (a gather: the ranks step in lock-step, so all of them get there), which
writes ``RUN_DIR/profile/rank<N>.pt.trace.json``: Chrome's trace format, opened by https://ui.perfetto.dev or
chrome://tracing (drag the file in). Profiling slows the traced steps; the epoch's figures include that.
"""
from __future__ import annotations

import gzip
import os
import tempfile
from pathlib import Path

import torch

from .. import collectives
from ..observers import Observer, register
from ..robust import peers
from ..robust.files import atomic_write
from ..robust.stderr import HeldStderr, profiler_noise


def parse_window(text: str) -> tuple[int, int] | None:
    """``"20:25"`` -> (20, 25): optimizer steps 20 to 24 (counted from 0 over the whole run); ``""`` -> None."""
    if not str(text).strip():
        return None
    try:
        a, b = (int(part) for part in str(text).split(":"))
    except ValueError:
        raise ValueError(f"profile_steps={text!r}: write it as A:B, the optimizer steps to trace, e.g. 20:25 "
                         f"(steps 20 to 24)") from None
    if not 0 <= a < b:
        raise ValueError(f"profile_steps={text!r}: A:B needs 0 <= A < B (A the first step traced, B the one after "
                         f"the last), e.g. 20:25")
    return a, b


class StepProfiler:
    """``before(step)`` at the start of each optimizer step, ``after(step)`` once ``step`` (the run's step count)
    went up; ``finish()`` at the end of an epoch closes a window that the epoch's end cut short."""

    def __init__(self, window: tuple[int, int] | None, ctx, run_dir, log=print, wait_s: float = 300.0):
        self.window, self.ctx, self.log = window, ctx, log
        self.wait_s = wait_s   # how long the other ranks wait for rank 0 to write the traces
        self.folder = Path(run_dir) / "profile" if run_dir else None
        self._prof = None
        self.done = False     # one window per run (every rank alike: the gather at its end is a collective)
        self.steps = 0        # steps traced
        self.written: list[Path] = []   # rank 0: the traces it wrote

    @classmethod
    def from_settings(cls, settings, ctx, run_dir, log=print) -> StepProfiler | None:
        window = parse_window(settings.profile_steps)
        return cls(window, ctx, run_dir, log, settings.init_timeout) if window else None

    def before(self, step: int) -> None:
        if self._prof is None and not self.done and self.window[0] <= step < self.window[1]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.ctx.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")   # the profiler library's own notes: errors only
            self._prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
            with HeldStderr(profiler_noise):   # its C++ start/stop lines (robust/stderr.py)
                self._prof.start()
            self._first = step

    def after(self, step: int) -> None:
        if self._prof is not None:
            self.steps += 1
            if step >= self.window[1]:
                self.finish()

    def abandon(self) -> None:
        """Stop a window the run left without finishing (an error, Ctrl-C, a stop): no gather (the other ranks may be
        gone), no trace; only so that the profiler stops recording in a notebook's process."""
        if self._prof is None:
            return
        prof, self._prof, self.done = self._prof, None, True
        with HeldStderr(profiler_noise):
            prof.stop()
        self.log(f"profile: the run ended inside the traced window (from step {self._first}); the profiler is "
                 f"stopped and no trace is written")

    def finish(self) -> None:
        """Stop, and send every rank's trace to rank 0, which writes them (a collective: every rank calls it)."""
        if self._prof is None:
            return
        prof, self._prof, self.done = self._prof, None, True
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        with HeldStderr(profiler_noise):
            prof.stop()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as f:
                mine = gzip.compress(f.read(), compresslevel=1)   # a few MB of JSON, sent once
        traces = collectives.gather_to_main(mine, self.ctx)   # every rank's, in rank order, on rank 0 alone
        if self.ctx.is_main and self.folder is not None:
            self._write(traces)
        # the others wait here, not in the next collective, whose short timeout a slow disk would trip
        peers.wait_for_all("let rank 0 write the profiler's traces", self.ctx, self.wait_s, self.log)

    def _write(self, traces: list[bytes]) -> None:
        for rank, data in enumerate(traces):
            target = self.folder / f"rank{rank}.pt.trace.json"
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(target, lambda f, data=data: f.write(gzip.decompress(data)))
            self.written.append(target)
        self.log(f"profile: training steps {self._first} to {self._first + self.steps - 1} traced on "
                 f"{len(traces)} rank(s): {self.folder}/rank<N>.pt.trace.json (open them in https://ui.perfetto.dev "
                 f"or chrome://tracing; find the all-reduce and what it overlaps)")


@register()
class Profiling(Observer):
    """``--profile-steps A:B``: steps A to B-1 traced, every rank's trace gathered to rank 0."""
    profiler = None

    @classmethod
    def for_loop(cls, loop, around):
        return cls() if parse_window(loop.settings.profile_steps) else None

    def start(self, loop) -> None:
        self.profiler = StepProfiler.from_settings(loop.settings, loop.ctx, loop.logger.run_dir, loop.logger.info)

    def before_step(self, loop) -> None:
        if self.profiler is not None:
            self.profiler.before(loop.step)

    def step_end(self, loop) -> None:
        if self.profiler is not None:
            self.profiler.after(loop.step)   # at the window's end: every rank's trace to rank 0 (a collective)

    def epoch_trained(self, loop, stats: dict) -> None:
        if self.profiler is not None:
            self.profiler.finish()   # a window the epoch's end cut short

    def close(self, loop) -> None:
        if self.profiler is not None:
            self.profiler.abandon()   # any other way out of the run: a profiler left on records the notebook's next run

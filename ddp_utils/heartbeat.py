"""A sign of life from every rank during training, so a silent rank is named and a wait is never mute.

A daemon thread per rank writes ``alive/<rank>`` (a time) into the rendezvous store every few seconds
and reads the others'. The training loop only bumps a counter per step (no store call, no sync). When
this rank has made no step for ``note_after`` seconds, which means it waits in a collective for a slower
or silent rank, the thread says so and names the ranks whose sign of life is old; after a failure the
same ages go into the message ("rank 1's last sign of life: 63 s ago").
"""
from __future__ import annotations

import threading
import time

from . import distributed


class Heartbeat:
    def __init__(self, ctx, log=print, every: float = 2.0, note_after: float = 30.0):
        self.ctx, self.log, self.every, self.note_after = ctx, log, every, note_after
        self.steps = 0
        self.seen: dict[int, tuple[str, float]] = {}   # rank -> (its last beat, when we saw it change)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddp_utils-heartbeat", daemon=True)

    def __enter__(self) -> "Heartbeat":
        if self.ctx.distributed and distributed._store is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def step(self) -> None:
        """Called by the training loop once per step (a counter: costs nothing)."""
        self.steps += 1

    def silent(self, older_than: float = 0.0) -> list[tuple[int, float]]:
        """(rank, seconds since its last sign of life) for the peers silent longer than ``older_than``."""
        now = time.monotonic()
        return [(r, now - seen) for r, (_, seen) in sorted(self.seen.items()) if now - seen > older_than]

    def describe(self) -> str:
        """"rank 1's last sign of life: 63 s ago", for the peers that went quiet (beats are every 2 s)."""
        quiet = self.silent(older_than=2.5 * self.every)
        return "; ".join(f"rank {r}'s last sign of life: {age:.0f} s ago" for r, age in quiet)

    def _run(self) -> None:
        store, me = distributed._store, self.ctx.rank
        start = time.monotonic()
        for r in range(self.ctx.world_size):
            if r != me:
                self.seen[r] = ("", start)
        last_steps, since, noted = -1, start, start
        while not self._stop.wait(self.every):
            try:
                store.set(f"alive/{me}", str(time.time()))
                for r in self.seen:
                    if store.check([f"alive/{r}"]):
                        beat = store.get(f"alive/{r}").decode()
                        if beat != self.seen[r][0]:
                            self.seen[r] = (beat, time.monotonic())
            except Exception:   # noqa: BLE001 - the store (rank 0) is gone: the main thread will hear it
                pass
            now = time.monotonic()
            if self.steps != last_steps:
                last_steps, since = self.steps, now
            elif now - since >= self.note_after and now - noted >= self.note_after:
                quiet = self.describe() or "every rank still gives signs of life"
                self.log(f"rank {me}: no training step for {now - since:.0f} s: waiting for the other ranks ({quiet})")
                noted = now

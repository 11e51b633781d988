"""The kit's own watch over the other ranks during training, the same on every backend.

Why it exists: a collective waiting for a rank that froze, crashed or lost the network raises nothing
under NCCL (the others block in a host sync such as ``.item()`` until NCCL's watchdog ends the whole
process at the collective timeout; a notebook kernel dies) and only at the collective timeout under
gloo. The store the ranks met through (rendezvous.py) is a second channel, and two daemon threads per
rank use it:

- the **beat** thread writes ``alive/<rank>`` every ``every`` s and reads the others' beats and the
  failures they reported (``peers.report_failure``);
- the **judge** thread never touches the store itself, so a dead link cannot block it. When a rank
  reported a failure, or no beat of a rank has changed for ``silent_after`` s (rank 0's store giving no
  answer counts as rank 0's silence), it aborts the process group (``peers.abort_group``, by the
  path this torch and backend allow: rank 0 names it when the watch starts): the main thread's blocked
  collective returns now, and ``train.fit`` raises ``PeerLost`` with this
  ``verdict``. A rank that finished writes ``done`` instead of a beat and is never judged silent.

The training loop only bumps a counter per step and marks when it starts waiting for its next batch (no store
call, no sync); each beat carries both. When this rank has made no step for ``note_after`` s (it waits for a slower
rank), the judge says so and names the quiet ranks. A rank that beats but makes no progress is found too: when one
has waited for its next batch for ``stall_after()`` s (well inside the collective timeout) while this rank made no
step either, the others wait for it in a collective: every rank aborts naming it, and that rank, whose main
thread is stuck in its data loader, is interrupted there (SIGINT, as the notebook's Stop button) after saying
where it is.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

from . import peers
from . import guard
from .stderr import quietly

SILENT_AFTER = 15.0   # seconds without a beat before a rank counts as gone (beats come every 2 s)


class Heartbeat:
    def __init__(self, ctx, log=print, every: float = 2.0, note_after: float = 30.0,
                 silent_after: float = SILENT_AFTER, stall_after=None):
        self.ctx, self.log, self.every, self.note_after = ctx, log, every, note_after
        self.silent_after = silent_after
        self.stall_after = stall_after   # a function: seconds (None: progress is not judged)
        self.steps = 0
        self.fetching_since: float | None = None   # when the training loop started waiting for its next batch
        self.fetching_what = "training"            # which loader it waits for (or last waited for)
        self.progress_at = time.monotonic()        # when this rank last finished a step (the judge tracks it)
        self.stalled: int | None = None   # the rank the judge found stuck waiting for its next batch
        self.interrupted = False   # this rank's stalled main thread was interrupted by its own watch
        self._main = None          # the thread that trains (the judge interrupts it only if it is the main one)
        self.seen: dict[int, tuple[str, float]] = {}   # rank -> (its last beat, when we saw it change)
        self.changes: dict[int, int] = {}              # rank -> how many changes of its beat we have seen
        self.verdict: str | None = None   # why the judge aborted the process group; None while all is well
        self._store_ok = 0.0     # when the beat thread last finished a round with the store
        self._failure: str | None = None   # a failure another rank reported
        self._all_beat = False   # every other rank's beat key exists: one multi_get reads them all
        self._finished = False
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat, name="ddp_utils-heartbeat", daemon=True),
                         threading.Thread(target=self._judge, name="ddp_utils-watch", daemon=True)]

    def __enter__(self) -> "Heartbeat":
        if self.ctx.distributed and peers._store is not None:
            self._keys = peers.watch_store()   # this fit's own keys: a re-run fit starts clean
            start = self._store_ok = self.progress_at = time.monotonic()
            self._main = threading.current_thread()
            if guard.current() is not None:   # the self-interrupt of a stalled loop below must raise (robust/guard.py)
                guard.current().interruptible()
            self.seen = {r: ("", start) for r in range(self.ctx.world_size) if r != self.ctx.rank}
            for thread in self._threads:
                thread.start()
            if self.ctx.is_main:   # the path depends on the backend and on torch's release (robust/compat.py)
                self.log(f"rank 0: the kit's watch is on: a rank silent for {self.silent_after:g} s is named, and a "
                         f"hung collective is stopped by\n  {peers.abort_path()}")
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._finished = exc_type is None   # a finished rank says "done": its silence is no failure
        self._stop.set()
        if self._finished and self._threads[0].is_alive():
            self._threads[0].join(timeout=2.0)   # the "done" is written before the others can miss a beat

    def step(self) -> None:
        """Called by the training loop once per step (a counter: costs nothing); it fetches the next batch now."""
        self.steps += 1
        self.fetching_since = time.monotonic()

    def fetching(self, waiting: bool, what: str = "training") -> None:
        """The loop waits for its next ``what`` batch (True: training, or validation after an epoch) or has it, or
        left the loop (False)."""
        self.fetching_since = time.monotonic() if waiting else None
        self.fetching_what = what

    def silent(self, older_than: float = 0.0) -> list[tuple[int, float]]:
        """(rank, seconds since its last sign of life) for the peers silent longer than ``older_than``."""
        now = time.monotonic()
        return [(r, now - seen) for r, (beat, seen) in sorted(self.seen.items())
                if beat != "done" and now - seen > older_than]

    def describe(self) -> str:
        """"rank 1's last sign of life: 63 s ago (on node-b, 10.0.0.2)", for the peers that went quiet (beats are
        every 2 s)."""
        store_quiet = time.monotonic() - self._store_ok
        if self.ctx.rank != 0 and store_quiet > 2.5 * self.every:   # then every beat looks old: rank 0 is the one
            return f"rank 0's store gave no answer for {store_quiet:.0f} s{peers.where(0)}"
        quiet = self.silent(older_than=2.5 * self.every)
        # the lost ones are the quietest: on a loaded machine a live peer's beat can be late by a beat or two (at
        # 16 ranks on 2 cores, ranks still beating were named beside the killed one)
        oldest = max((age for _, age in quiet), default=0.0)
        return "; ".join(f"rank {r}'s last sign of life: {age:.0f} s ago{peers.where(r)}" for r, age in quiet
                         if age >= oldest - self.every)

    def name_the_lost(self, timeout: float) -> str:
        """After a collective broke, maybe because a peer went away: wait (up to ``timeout`` s; the watch goes on)
        until the watch has a verdict, a peer's reported failure or a peer that stopped beating, and return the
        quiet ones ("" if none). A rank far from the lost one (rank 1 of 16 when rank 7 died) gets only its
        neighbour's broken connection from the collective: this names the rank that died, not the neighbour.
        Returns "" as soon as every peer has beaten again since the break: then none went away, and the error
        (an NCCL or connection error of this rank's own) is this rank's to report."""
        start = time.monotonic()
        deadline = start + timeout
        before = dict(self.changes)
        while time.monotonic() < deadline and not (self.verdict or self._failure or self.describe()):
            if self._everyone_beat_since(start, before):
                return ""
            time.sleep(0.2)
        return self.describe()

    def _everyone_beat_since(self, start: float, before: dict[int, int]) -> bool:
        """Whether the store answered and every peer's beat changed twice (or it finished) after ``start``: the
        first change seen after the break may be the last beat a peer wrote before it died (seen late on a busy
        machine), a second one it wrote afterwards."""
        return self._store_ok > start and all(
            beat == "done" or self.changes.get(r, 0) - before.get(r, 0) >= 2 for r, (beat, _) in self.seen.items())

    # -- the beat thread: all the store calls (any of them may block while a link is down) --------
    def _beat(self) -> None:
        me = self.ctx.rank
        while True:
            stopping = self._stop.is_set()
            try:
                if stopping:
                    if self._finished:
                        self._keys.set(f"alive/{me}", "done")
                    return
                quietly(self._round)   # a dead store's C++ frames (~25 lines a call) kept from the student's output
            except Exception:   # noqa: BLE001 - the store (rank 0) is gone or unreachable: the judge decides
                if stopping:
                    return
            self._stop.wait(self.every)

    def _round(self) -> None:
        """One beat: this rank's, then every other rank's and any reported failure, in a few requests to the
        store, whatever the number of ranks (a request per peer would put N x N requests on rank 0's store)."""
        me = self.ctx.rank
        since = self.fetching_since
        fetching = -1.0 if since is None else time.monotonic() - since
        self._keys.set(f"alive/{me}", f"{time.time():.3f}|{self.steps}|{fetching:.1f}|{self.fetching_what}")
        keys = [f"alive/{r}" for r in self.seen]
        # a key per rank, each written by its rank; multi_get would wait for a missing one, so read them
        # one by one until every rank has beaten once (the first seconds)
        self._all_beat = self._all_beat or self._keys.check(keys)
        if self._all_beat:
            beats = [b.decode() for b in self._keys.multi_get(keys)]
        else:
            beats = [self._keys.get(k).decode() if self._keys.check([k]) else "" for k in keys]
        for r, beat in zip(list(self.seen), beats):
            if beat and beat != self.seen[r][0]:
                self.seen[r] = (beat, time.monotonic())
                self.changes[r] = self.changes.get(r, 0) + 1
        self._failure = self._failure or peers._failure_in_store(self.ctx)
        self._store_ok = time.monotonic()

    # -- the judge thread: decides from what the beat thread saw, never blocks -----------------------
    def _judge(self) -> None:
        me = self.ctx.rank
        last_steps = -1
        noted = time.monotonic()
        while not self._stop.wait(min(1.0, self.every)):
            now = time.monotonic()
            if self.steps != last_steps:
                last_steps, self.progress_at = self.steps, now
            since = self.progress_at
            verdict = self.judgement()
            if verdict:
                self.verdict = verdict
                stalled_here = self.stalled == me
                if stalled_here:   # the others read why in the store before their collective breaks
                    peers.report_failure(self.ctx, verdict)
                self.log(f"rank {me}: the kit's watch stops this rank's collectives: {verdict}")
                done = peers.abort_group(verdict)
                self.log(f"rank {me}: the kit's watch: {done}")
                if stalled_here:
                    self._interrupt_the_stalled_loop()
                return
            if now - since >= self.note_after and now - noted >= self.note_after:
                quiet = self.describe() or "every rank still gives signs of life"
                self.log(f"rank {me}: no training step for {now - since:.0f} s: waiting for the other ranks ({quiet})")
                noted = now

    def judgement(self) -> str | None:
        """Why training cannot go on (another rank's reported failure, or its silence), or None."""
        if self._failure:
            return self._failure
        store_quiet = time.monotonic() - self._store_ok
        quiet = self.silent(older_than=self.silent_after)
        # only a rank > 0 can lose the store (it lives in rank 0); then every peer looks silent, and a peer's beat
        # can be up to a beat older than the last answer, so its silence crosses the limit first: while the store
        # has not answered for a while, the store is the cause to name (at 16 ranks a rank behind a cut link named
        # rank 11, whose beat had last changed a beat before the store's last answer)
        if store_quiet > self.silent_after or (quiet and store_quiet > 2.5 * self.every):
            return (f"another rank stopped answering (rank 0's store gave no answer for {store_quiet:.0f} s; "
                    f"rank 0's last sign of life: {self._age(0):.0f} s ago{peers.where(0)})")
        if quiet:
            named = "; ".join(f"rank {r}'s last sign of life: {age:.0f} s ago{peers.where(r)}" for r, age in quiet)
            return f"another rank stopped answering ({named})"
        return self.stall()

    def stall(self) -> str | None:
        """A rank stuck waiting for its next batch while this one waits too (for it, in a collective), or None."""
        if self.stall_after is None:
            return None
        limit, now = self.stall_after(), time.monotonic()
        if now - self.progress_at < limit:
            return None   # this rank made a step lately: nobody holds it up
        # only a fresh beat tells how long a peer has waited: an old one is silence (a cut link, a frozen host),
        # which judgement() names as such, not as a stuck loader
        fresh = 2.5 * self.every
        waits = {r: self._fetching(beat, seen, now) for r, (beat, seen) in self.seen.items() if now - seen <= fresh}
        waits[self.ctx.rank] = None if self.fetching_since is None else now - self.fetching_since
        if all(w is not None for w in waits.values()):
            return None   # every rank waits for its own data (cold storage): none waits in a collective for another
        stuck = sorted((r for r, w in waits.items() if w is not None and w >= limit), key=lambda r: -waits[r])
        if not stuck:
            return None
        r = self.stalled = stuck[0]
        what = self.fetching_what if r == self.ctx.rank else self._what(self.seen[r][0])
        return (f"rank {r}{peers.where(r)} has waited {waits[r]:.0f} s for its next {what} batch (its data "
                f"loader) while the other ranks wait for it in a collective: a stuck DataLoader worker, a stalled "
                f"disk or network file system, or a deadlock in the dataset's code")

    @staticmethod
    def _what(beat: str) -> str:
        """Which loader a peer waits for, from its last beat (``time|steps|waiting|what``)."""
        parts = beat.split("|")
        return parts[3] if len(parts) > 3 else "training"

    @staticmethod
    def _fetching(beat: str, seen: float, now: float) -> float | None:
        """How long a peer has waited for its next batch, from its last beat (``time|steps|waiting|what``), or
        None."""
        try:
            waiting = float(beat.split("|")[2])
        except (IndexError, ValueError):   # "done", or no beat yet
            return None
        return None if waiting < 0 else waiting + (now - seen)

    def _interrupt_the_stalled_loop(self) -> None:
        """This rank is the stalled one: say where its training thread is, and interrupt it if it is the main
        thread (a KeyboardInterrupt that ``train.fit`` turns into the verdict; a blocked wait returns for a signal)."""
        frame = sys._current_frames().get(self._main.ident) if self._main is not None else None
        if frame is not None:
            where = "; ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                              for f in traceback.extract_stack(frame)[-3:])
            self.log(f"rank {self.ctx.rank}: its training thread is at: {where}")
        workers = child_states(os.getpid())
        if workers:   # D (disk wait) in an nfs_* or io_* wait channel: the file system, not the code
            self.log(f"rank {self.ctx.rank}: its child processes (DataLoader workers): {workers}")
        if self._main is threading.main_thread():
            self.interrupted = True
            os.kill(os.getpid(), signal.SIGINT)

    def _age(self, rank: int) -> float:
        return time.monotonic() - self.seen.get(rank, ("", self._store_ok))[1]


STATES = {"R": "running", "S": "sleeping", "D": "waiting for a disk or network file system", "Z": "ended, not reaped",
          "T": "stopped", "t": "stopped by a debugger"}


def child_states(pid: int) -> str:
    """"pid 812 sleeping in pipe_read; pid 813 waiting for a disk or network file system in nfs_wait_bit_killable"
    for the children of ``pid`` (a rank's DataLoader workers), from /proc: what a stuck worker is doing; "" when
    it has none or /proc cannot tell."""
    try:
        import psutil
        children = psutil.Process(pid).children(recursive=True)
    except Exception:   # noqa: BLE001 - only for the message
        return ""
    said = []
    for child in children:
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{child.pid}/wchan") as f:
                channel = f.read().strip()
        except (OSError, IndexError):
            continue
        where = f" in {channel}" if channel not in ("", "0") else ""
        said.append(f"pid {child.pid} {STATES.get(state, state)}{where}")
    return "; ".join(said)

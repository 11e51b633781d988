"""While the ranks build the process group, a rank that fails tells the others, and they stop at once.

``init_process_group``, the first barrier and the settings agreement wait in C++ for every rank; a rank that fails
there (Stop pressed, a GPU error, a broken link on its side) used to leave the others waiting until init_timeout,
with a connection error that names nobody. Now the failing rank leaves its paragraph in the rendezvous generation's
keys (``report``: robust/failures.py, the channel training uses too), and on every other rank a thread with a store
connection of its own looks for it twice a second (``SetupWatch``). When one comes, the thread shuts down the
connections this rank's wait is blocked on (its store requests, gloo's new connections) and aborts NCCL's
communicators: the wait fails at once. Every rank then names the rank that failed first, and why: the failures that
follow (a connection the first one closed) are its consequences.
"""
from __future__ import annotations

import contextlib
import threading

import torch.distributed as dist

from . import compat, failures, rendezvous, sockets
from .stderr import HeldStderr, store_noise

POLL_S = 0.5   # how often the watch looks: a peer's failure is known here within this
FIRST_S = 5.0  # how long a rank that failed second waits to read who failed first


def report(keys, rank: int, text: str) -> str | None:
    """Leave this rank's reason for failing its setup where the others read it (robust/failures.py). Returns the
    first failure's text when another rank failed before this one (this rank's error is then most likely its
    consequence: a connection it closed), else None. Best effort and bounded: None where the store is gone or
    does not answer within REPORT_S (then FIRST_S more to read the first)."""
    def write_then_read() -> str | None:
        if failures.report(keys, rank, text) == 1:
            return None
        found = failures.first(keys, wait=FIRST_S)   # the first rank writes its place next (or died first)
        return found[1] if found and found[0] != rank else None
    return failures.within(failures.REPORT_S + FIRST_S, write_then_read)


class SetupWatch:
    """``with SetupWatch(settings, keys) as watch:`` around this rank's part of setup. ``watch.cut``: whether the
    watch ended this rank's waits because another rank failed first; ``watch.keys``: the generation's keys
    through a connection that is still open."""

    def __init__(self, settings, keys: rendezvous.Keys):
        self.settings, self.keys = settings, keys
        self.cut = False
        self._held = HeldStderr(store_noise)   # C++'s frames of the cut waits, held back until they have failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SetupWatch:
        if self.settings.world_size < 2:
            return self
        self._before = sockets.tcp_connections()
        try:
            self._own = rendezvous.second_client(self.settings, self.keys)
        except Exception:   # noqa: BLE001 - no second connection: setup goes on unwatched, as before
            return self
        self._mine = sockets.tcp_connections() - self._before   # the watch's connection (rank 0: both its ends)
        self._thread = threading.Thread(target=self._watch, name="ddp_utils-setup-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if not self.cut:
                self._own = None   # closes the watch's connection (once cut, it is the one left: self.keys)
        self._held.release()   # the waits have failed: what was written meanwhile, but C++'s frames, comes out

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                found = failures.first(self._own)   # one request per look while none failed, whatever the ranks
            except Exception:   # noqa: BLE001 - the store is gone (rank 0 stopped): this rank's own wait fails too
                return
            if found is None:
                continue
            if found[0] != self.settings.rank and not self._stop.is_set():
                self._cut()
            return

    def _cut(self) -> None:
        """End this rank's waits: its store requests and gloo's connections (not the store's listening end on
        rank 0: the other ranks read the failure through it), and NCCL's communicators."""
        port = self.settings.master_port
        now = sockets.tcp_connections() - self._mine
        waits = {c for c in now if c[1][1] != port and (c[2][1] == port or c not in self._before)}
        self.keys, self.cut = self._own, True   # this rank's own connection to the store is cut next
        # until the cut waits have failed (__exit__): torch's store client logs a failed read with some 40 lines of
        # C++ frames, in front of the paragraph that explains it
        self._held.hold()
        sockets.shut_down(waits)
        if dist.is_initialized() and dist.get_backend() == "nccl":
            _, abort = compat.abort_path("nccl", dist.distributed_c10d._get_default_group())
            with contextlib.suppress(Exception):   # a communicator already broken by the failure
                abort()

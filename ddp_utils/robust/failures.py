"""One failure channel for the whole life of a process group: the rendezvous, the setup and training.

A rank that stops leaves its paragraph in its generation's keys (rendezvous.py) and takes a place in the store's
count of reports: the store counts atomically, so exactly one report is the first. Every reader names the first
reported failure, not the lowest rank's: a rank stopped as a consequence (its connections cut by the first one's
exit, a launcher's SIGTERM) reports after the rank that caused it. Readers poll the count: one store request per
look while nobody failed, whatever the number of ranks.
"""
from __future__ import annotations

import threading
import time

from .stderr import quietly

COUNT = "failures"
REPORT_S = 5.0   # seconds the main thread gives its failure report before it goes on without it


def within(seconds: float, call, default=None):
    """``call()``'s answer, or ``default`` when it raised or has not answered in ``seconds``: over a link that just
    went down a store call blocks far longer than any timeout set on the store, and a rank that is failing must
    still say so and exit (or give a notebook's cell back) in time. The call goes on, on a daemon thread."""
    got = {}

    def run() -> None:
        try:
            got["answer"] = quietly(call)
        except Exception:   # noqa: BLE001 - the store may be what failed
            pass
    thread = threading.Thread(target=run, daemon=True, name="store-report")
    thread.start()
    thread.join(seconds)
    return got.get("answer", default)


def report(keys, rank: int, text: str) -> int:
    """Leave ``text`` as rank ``rank``'s reason for stopping; its place among the reports (1: the first)."""
    keys.set(f"failed/{rank}", text)
    place = int(keys.add(COUNT, 1))
    keys.set(f"failed/order/{place}", str(rank))
    return place


def first(keys, skip: int | None = None, wait: float = 0.0, world_size: int = 0) -> tuple[int, str] | None:
    """``(rank, text)`` of the first failure reported by a rank other than ``skip``, or None.

    ``wait``: seconds to give a report whose place is counted but not written yet (its rank writes it next; it
    may also have died between the two). ``world_size``: then a report written before its place is counted is
    found too."""
    count = int(keys.add(COUNT, 0))
    if not count:
        return None
    deadline = time.monotonic() + wait
    for place in range(1, count + 1):
        key = f"failed/order/{place}"
        while not keys.check([key]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if keys.check([key]):
            rank = int(keys.get(key))
            if rank != skip:
                return rank, keys.get(f"failed/{rank}").decode()
    for rank in range(world_size):   # a report whose place is not written yet
        if rank != skip and keys.check([f"failed/{rank}"]):
            return rank, keys.get(f"failed/{rank}").decode()
    return None

"""The store requests the kit's watch makes, counted: each would be a round trip to rank 0's store.

    requests_per_beat_round(16)   # every rank's one beat, summed over the 16 ranks
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_utils import distributed
from ddp_utils.robust import peers


class CountingStore(dist.Store):
    """An in-memory store that counts the requests made to it."""

    def __init__(self):
        super().__init__()
        self.store, self.requests = dist.HashStore(), 0

    def _counted(self, name, *args):
        self.requests += 1
        return getattr(self.store, name)(*args)

    def set(self, key, value):
        return self._counted("set", key, value)

    def get(self, key):
        return self._counted("get", key)

    def add(self, key, value):
        return self._counted("add", key, value)

    def check(self, keys):
        return self._counted("check", keys)

    def multi_get(self, keys):
        return self._counted("multi_get", keys)


def context(rank: int, world_size: int) -> distributed.DistContext:
    return distributed.DistContext(rank=rank, world_size=world_size, local_rank=0, device=torch.device("cpu"),
                                   backend="gloo")


def requests_per_beat_round(world_size: int) -> list[int]:
    """The requests of one beat of each rank (every rank has beaten before), by rank; uses ``peers._store``
    (the caller sets it to a CountingStore and restores it)."""
    from ddp_utils.robust.heartbeat import Heartbeat
    store = peers._store
    beats = []
    for rank in range(world_size):
        beat = Heartbeat(context(rank, world_size), log=lambda *_: None)
        beat._keys = dist.PrefixStore("watch/1", store)
        beat.seen = {r: ("", 0.0) for r in range(world_size) if r != rank}
        store.set(f"watch/1/alive/{rank}", "1.0|0|-1.0")
        beats.append(beat)
    counts = []
    for beat in beats:
        store.requests = 0
        beat._round()
        counts.append(store.requests)
    return counts

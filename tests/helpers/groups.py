"""A process group of the test process alone, and what runs on it: SyncBatchNorm, the link probe's collectives and
DDP's hooks need one; ``gpu_only`` marks a test that needs a GPU."""
from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.distributed as dist

from tests.helpers.procs import free_port


def gpu_only(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


@contextlib.contextmanager
def one_rank_group(backend="gloo", device=None):
    """A process group of this test process alone (SyncBatchNorm and the probe's collectives need one).

    Garbage is collected here, on the main thread, before and after: an earlier test's group left in a reference
    cycle was otherwise freed whenever the collector next ran, once inside a PowerSGD callback on a gloo thread,
    where freeing a group joins threads and aborted the process ("Resource deadlock avoided", seen under xdist)."""
    gc.collect()
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **({"device_id": device} if device else {}))
    try:
        yield
    finally:
        with contextlib.suppress(Exception):   # an aborted group may refuse to be destroyed cleanly
            dist.destroy_process_group()
        gc.collect()


def count_all_reduces(model) -> list:
    """Register DDP's own all-reduce on ``model``, counted: the bucket index of each, in order (bucket 0 once per
    backward pass that syncs)."""
    rounds = []

    def counted(state, bucket):
        rounds.append(bucket.index())
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    model.register_comm_hook(None, counted)
    return rounds

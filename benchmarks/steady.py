"""The steady state of a loader: what a training run sees once the batches made ahead of the clock are used up.

A DataLoader with W workers has made W x prefetch_factor batches before the first is asked for, so a short timed
window measures the prefetch, not the loader (15 workers x 2 = 30 batches made during a 4 s first step made 31
"steady" steps of a 16-core run look fed). Every loader benchmark therefore starts its clock after
``warm_batches(workers)`` batches and times at least ``MIN_STEPS`` more, and records both in its JSON as
``steady_after_batches`` and ``steady_steps`` (tests/test_figures.py refuses a quoted figure without them).

    batches = stream(loader)                                   # epoch after epoch, as training takes them
    window = time_steady(batches, warm_batches(workers), 200)  # {"images", "seconds", "cpu_seconds", ...}
"""
from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_utils.observers import PREFETCH_FACTOR, batches_made_ahead  # noqa: E402

MIN_STEPS = 200        # steps a quoted figure's window holds at least


def warm_batches(workers: int, prefetch_factor: int = PREFETCH_FACTOR) -> int:
    """Batches taken before the clock starts: the ones made ahead (``workers`` x ``prefetch_factor``) and one more
    (in-process loaders, ``workers`` 0, make none ahead: only the first batch, with its start-up, is left out): the
    kit's own rule, which its time split and feed check use too."""
    return batches_made_ahead(workers, prefetch_factor)


def stream(loader, first_epoch: int = 0) -> Iterator:
    """Batches of ``loader.epoch(e)`` for e = first_epoch, first_epoch + 1, ...: a window longer than an epoch goes
    on into the next one, as training does (the workers start again there: part of the steady state)."""
    for epoch in itertools.count(first_epoch):
        yield from loader.epoch(epoch)


def time_steady(batches: Iterable, warm: int, steps: int, on_batch=None) -> dict:
    """Takes ``warm`` batches, then times ``steps`` more: images, wall and CPU seconds (this process's, all its
    threads) of the window, and how long the training process waited inside the loader. ``on_batch(batch)`` runs
    on each timed batch (a training step, a device sync) and counts in the window."""
    batches = iter(batches)
    for _ in range(warm):
        next(batches)
    images, inside = 0, 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        t = time.perf_counter()
        batch = next(batches)
        inside += time.perf_counter() - t
        images += len(batch[1])   # (images, labels): labels count the images whatever form the images take
        if on_batch is not None:
            on_batch(batch)
    return {"images": images, "seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
            "inside_s": inside, "steady_after_batches": warm, "steady_steps": steps}

"""A training loop that failed after its first batch, and whether the kit then let the loader's workers go."""
from __future__ import annotations

import pytest

from ddp_utils import loaders


def released(error: BaseException, alive, seconds: float = 10.0) -> bool:
    """``release_workers(error)``, then whether ``alive()`` (the workers or threads still there) empties within
    ``seconds``."""
    import time
    loaders.release_workers(error)
    deadline = time.monotonic() + seconds
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive()


def failed_after_one_batch(epoch_batches) -> RuntimeError:
    """The error of a training loop that took one batch of ``epoch_batches`` through an explicit iterator (as a
    prefetcher or a lab's loop keeps one) and then failed in its own code (a model's forward); caught, with its
    traceback, as a notebook keeps it. The loop's frame is the traceback's second."""
    def training_loop():
        step, batches = 0, iter(epoch_batches)
        images, _ = next(batches)
        step += 1
        raise RuntimeError(f"the model's forward failed at step {step}")
    with pytest.raises(RuntimeError) as caught:
        training_loop()
    return caught.value

"""The DataLoader workers a traceback keeps alive, ended without clearing the frames a debugger wants.

A Stop or an error that comes while the loader's iterator is alive leaves it referenced by the traceback, which a
notebook keeps: its worker processes live on (after a Ctrl-C, as zombies under the kernel). The iterator may sit in
any frame: the loop's own (``for ... in loader``, on the frame's value stack), a generator that wraps it (the kit's
``epoch()``), or a loader's own code. ``end_workers_in`` finds the iterators that frames and generators reach and
shuts their workers down; the frames keep their locals. The same holds for a loader's decode thread (the nvjpeg
loader's, which holds the batches it made ahead on the GPU): its pool is shut down too.
"""
from __future__ import annotations

import gc
import itertools
import sys
import types
from concurrent.futures import ThreadPoolExecutor

from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

# the kit's own thread pools (their threads' name prefix): a user's pool a frame happens to reach is left alone
KIT_THREADS = ("nvjpeg-decode",)

# the objects looked into on the way from a frame to an iterator: frames, generators and the iterator wrappers
# of a for loop (enumerate, zip, islice: the kit's EpochLoader), never a model's or a data set's insides
_PASSAGES = (types.FrameType, types.GeneratorType, types.TracebackType, enumerate, zip, map, filter,
             itertools.islice, itertools.chain)


def end_workers_in(tb: types.TracebackType | None) -> int:
    """Shut down the workers of every DataLoader iterator (and the kit's decode threads) that ``tb``'s frames reach;
    how many iterators and pools."""
    todo, seen, ended = [tb], set(), 0
    frame = sys._getframe()
    while frame is not None:   # frames still running (the one that caught the error, its callers): theirs stay
        seen.add(id(frame))
        frame = frame.f_back
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, _MultiProcessingDataLoaderIter):
            obj._shutdown_workers()   # joins them; the iterator then ends like one that ran out
            ended += 1
        elif isinstance(obj, ThreadPoolExecutor) and obj._thread_name_prefix.startswith(KIT_THREADS):
            obj.shutdown(wait=True, cancel_futures=True)   # the batch in the making finishes; the others are dropped
            ended += 1
        elif isinstance(obj, types.FrameType):   # not its caller's frame: an outer loop's iterator is still in use
            todo.extend(r for r in gc.get_referents(obj) if r is not obj.f_back)
        elif isinstance(obj, _PASSAGES):
            todo.extend(gc.get_referents(obj))
        elif isinstance(obj, (list, tuple, dict)) and len(obj) < 64:   # a frame's locals and cells
            todo.extend(obj.values() if isinstance(obj, dict) else obj)
    return ended

"""C++ noise kept off a student's output without losing anything else written meanwhile.

torch's store client logs a failed read with some 40 lines of C++ frames, and the profiler library prints
"USDT: profiler_start" lines at every start and stop. They write to file descriptor 2 from C++, past Python's
``sys.stderr``, so only the descriptor itself can be turned away, and it is the whole process's: any other
thread's output goes with it. ``HeldStderr`` therefore holds fd 2's output in a temporary file instead of
dropping it, and on release writes back to the real stderr every line that ``is_noise`` does not match. A hold
still on when its run ends (robust/guard.py) is released there: fd 2 never stays turned away from the student.
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
from typing import Callable

_holding: list = []   # the HeldStderr now holding fd 2, in the order they took it (release_all's)
# One hold at a time in the process: two threads' holds released out of order would leave fd 2 turned to a closed
# temporary file. A hold that cannot have it soon goes without (the noise then passes): never a thread stuck here.
_fd2 = threading.Lock()


class HeldStderr:
    """``hold()`` ... ``release()`` (or ``with HeldStderr(is_noise):``): fd 2's output in between is held, and
    written back on release but for the lines ``is_noise`` matches. Hold and release may come from two threads.
    ``wait``: how long ``hold`` waits while another hold is on before it goes without."""

    def __init__(self, is_noise: Callable[[str], bool], wait: float = 1.0):
        self.is_noise, self.wait = is_noise, wait
        self._lock = threading.Lock()
        self._saved: int | None = None   # the real fd 2 while held
        self._file = None

    def hold(self) -> None:
        with self._lock:
            if self._saved is not None or not _fd2.acquire(timeout=self.wait):
                return
            try:
                self._file = tempfile.TemporaryFile()
                self._saved = os.dup(2)
                os.dup2(self._file.fileno(), 2)
                _holding.append(self)
            except OSError:
                self._saved = None
                _fd2.release()

    def release(self) -> None:
        with self._lock:
            if self._saved is None:
                return
            os.dup2(self._saved, 2)
            os.close(self._saved)
            self._saved = None
            _holding.remove(self)
            _fd2.release()
            self._file.seek(0)
            kept = [line for line in self._file.read().decode(errors="replace").splitlines(keepends=True)
                    if not self.is_noise(line)]
            self._file.close()
        if kept:
            with contextlib.suppress(OSError):
                os.write(2, "".join(kept).encode())

    def __enter__(self) -> HeldStderr:
        self.hold()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _after_fork_in_child() -> None:
    """A process forked while a hold was on (a DataLoader worker started while the watch asked the store) holds a
    copy of the turned-away fd 2, and the parent's release never reaches it: everything the worker wrote afterwards
    (a warning, a crash's message) went into a temporary file nobody reads. The child takes the real fd 2 back, and
    the locks the parent's threads held start free."""
    global _fd2
    for held in reversed(_holding):
        held._lock = threading.Lock()
        with contextlib.suppress(OSError):
            os.dup2(held._saved, 2)
            os.close(held._saved)
        held._saved = None
        with contextlib.suppress(OSError):
            held._file.close()   # the child's descriptor; the parent's copy stays open
    _holding.clear()
    _fd2 = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def release_all() -> None:
    """Every hold still on released, the last one first (each restores the fd 2 it found)."""
    for held in reversed(list(_holding)):
        held.release()


# the profiler library's lines ("USDT:2026-11-28 20:05:21 20305:20305 SyncActivityProfilerHandler.cpp:39]
# profiler_start"; on a CUDA build without a GPU an "ERROR:... gpuGetDeviceCount" that is none)
_KINETO = re.compile(r"^\s*[A-Z]*:?\s*\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\]")
# torch's C++ log lines ("[W1128 20:05:21.123456 12345 TCPStore.cpp:123] ...") and an exception's C++ frames
# ("[rank1]:[W1202 ...": the c10d logger's, which names the rank first), whose Python part torch writes as one
# "<omitting python frames>" line (one per failed request: the count varies with the threads that asked)
_CPP = re.compile(r"^(\[rank\d+\]:)?(\[[WEIF]\d{4} |frame #\d+:|Exception raised from |\s*<omitting python frames>|\s*$)")


def profiler_noise(line: str) -> bool:
    return bool(_KINETO.match(line)) or "gpuGetDeviceCount" in line


def store_noise(line: str) -> bool:
    return bool(_CPP.match(line))


def quietly(call, *args):
    """``call(*args)`` (a store request) with the C++ frames torch's store client logs when it fails kept off the
    output: ~25 lines a failed request, from every thread that asks a dead master's store, in front of the
    paragraph that explains it. Goes without the hold when another one is on (never waits)."""
    with HeldStderr(store_noise, wait=0.0):
        return call(*args)

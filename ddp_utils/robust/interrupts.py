"""A Stop that Python drops, in the notebooks.

Jupyter's Stop sends SIGINT to the kernel's process group: the kernel and its DataLoader workers. When the
KeyboardInterrupt is raised where Python cannot pass it on (a DataLoader iterator's destructor joining its workers
at an epoch's end, logging's at-fork handler as a loader forks them), Python prints "Exception ignored in ..." and
drops it: training goes on (seen in tests/test_real_processes.py), or, where the same signal ended the loader's
workers, the rank stops at "DataLoader worker ... exited unexpectedly" and tells the others that instead of the
Stop. While ``fit`` runs, ``stops_kept`` keeps such a Stop: nothing printed, SIGINT sent again a moment later (where
it stops the run as any Stop does), and what breaks meanwhile turned back into the Stop (``Kept.dropped``). The
command line has a hook of its own for the whole command, SIGTERM included (tools/cli.py): under it this does
nothing.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from .. import distributed

RESEND_S = 0.1   # a dropped Stop is delivered again this much later


def resend_later(signum: int) -> threading.Timer:
    """``signum`` sent to this process again ``RESEND_S`` from now, where its exception can be raised (a daemon
    timer: cancel it once what it would stop has stopped)."""
    timer = threading.Timer(RESEND_S, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()
    return timer


class Kept:
    """What ``stops_kept`` saw: ``dropped`` once Python dropped a Stop; ``cancel()`` the resend it scheduled."""

    def __init__(self):
        self.dropped = False
        self.timers: list = []

    def cancel(self) -> None:
        for timer in self.timers:
            timer.cancel()


@contextlib.contextmanager
def stops_kept():
    """``with stops_kept() as kept:`` around a training loop: a KeyboardInterrupt Python drops is kept (see above)."""
    kept = Kept()
    if getattr(sys.unraisablehook, "keeps_stops", False):   # the command line's: it handles them itself
        yield kept
        return
    previous, before = sys.unraisablehook, distributed.stop_signal

    def hook(unraisable):
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous(unraisable)
            return
        kept.dropped = True
        distributed.stop_signal = distributed.stop_signal or distributed.INTERRUPTED   # the cause, for the others
        kept.timers.append(resend_later(signal.SIGINT))
    hook.keeps_stops = True
    sys.unraisablehook = hook
    try:
        yield kept
    finally:
        sys.unraisablehook = previous
        kept.cancel()   # the run has stopped (or ended): a Stop arriving later would land in the next cell
        distributed.stop_signal = before   # the kernel lives on: the next run starts with no cause of this one's

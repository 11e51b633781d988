"""One guard per run: what a run changes in the whole process, set in one place and put back in one place.

A run (``fit`` in a notebook, a command of ``python -m ddp_utils``) changes things that belong to the process: signal
handlers, ``sys.unraisablehook``, timers that send a signal again, the cause of a stop that the other ranks are told
(``peers.stop_signal``) and fd 2 while C++ noise is held (robust/stderr.py). ``RunGuard`` is the only place
that sets them, and when the run ends, whichever way, it puts each one back: a notebook's kernel lives on after the
cell, and the next run starts clean. ``guarded()`` gives the run its guard: a new one for the outermost run, the same
one for a ``fit`` inside a command.

A Stop that Python drops. Jupyter's Stop sends SIGINT to the kernel's process group: the kernel and its DataLoader
workers. When the KeyboardInterrupt is raised where Python cannot pass it on (a DataLoader iterator's destructor
joining its workers at an epoch's end, logging's at-fork handler as a loader forks them), Python prints "Exception
ignored in ..." and drops it: training goes on (seen in tests/test_real_processes.py), or, where the same signal
ended the loader's workers, the rank stops at "DataLoader worker ... exited unexpectedly" and tells the others that
instead of the Stop. The guard keeps such a Stop: nothing printed, the cause kept, the signal sent again a moment
later (where it stops the run as any Stop does), and what breaks meanwhile turned back into the Stop (``dropped``).

SIGTERM (a scheduler, ``kill``, the container stopping), for a command (``RunGuard(sigterm=True)``): it stops the run
as an interrupt does, telling the others, and a SIGTERM that Python drops is kept the same way.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from . import peers
from . import stderr

RESEND_S = 0.1   # a dropped stop is delivered again this much later


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, `kill`, the container stopping): stop like an interrupt, telling the others."""
    description = "SIGTERM (the process was told to stop)"   # what the other ranks are told


_active: RunGuard | None = None   # the run now guarded, if any


def current() -> RunGuard | None:
    return _active


class RunGuard:
    """``with RunGuard(sigterm=...) as run:`` around a run; see the module's docstring."""

    def __init__(self, *, sigterm: bool = False):
        self.sigterm = sigterm   # the command line's: SIGTERM stops the run as a Stop does
        self.dropped = False     # Python dropped a stop during the run
        self.terminated = False  # a SIGTERM stopped the run: the process is on its way out
        self._resends: list = []   # every dropped stop's resend timer, all cancelled once the stop is made
        self._signals: dict = {}   # signal -> its handler before this run

    def __enter__(self) -> RunGuard:
        global _active
        self._before = (sys.unraisablehook, peers.stop_signal, _active)
        sys.unraisablehook = self._unraisable
        if self.sigterm:   # without it SIGTERM ends the process with no word to the others
            self.handle(signal.SIGTERM, on_sigterm)
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        self.cancel_resends()   # the run has stopped (or ended): a stop arriving later would land in what runs next
        stderr.release_all()
        if self.terminated:   # the process is ending: a later SIGTERM must not cut its exit short (exit 143), nor
            self._signals.pop(signal.SIGCHLD, None)   # a loader worker's end raise in torch's SIGCHLD handler
            self._signals.pop(signal.SIGTERM, None)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)   # also where a dropped one re-armed the handler
        for signum, handler in self._signals.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(signum, handler)
        self._signals.clear()
        sys.unraisablehook, peers.stop_signal, _active = self._before

    def handle(self, signum: int, handler) -> None:
        """``handler`` for ``signum`` until the run ends; the handler before it comes back then."""
        previous = signal.signal(signum, handler)
        self._signals.setdefault(signum, previous if previous is not None else signal.SIG_DFL)

    def interruptible(self) -> None:
        """A process started with SIGINT ignored (``cmd &`` from a script, ssh without a terminal) gets Python's
        KeyboardInterrupt for the run: the watch's self-interrupt of a stalled loop would do nothing otherwise."""
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
            self.handle(signal.SIGINT, signal.default_int_handler)

    def stopped_by(self, cause: str, *, first: bool = True) -> None:
        """The cause of this stop, for this rank and the others, whatever breaks next (the first one, unless not)."""
        peers.stop_signal = (peers.stop_signal or cause) if first else cause

    def stop(self) -> KeyboardInterrupt:
        """The exception of the stop whose cause is kept: what to raise in place of what broke after it."""
        return Terminated("SIGTERM") if peers.stop_signal == Terminated.description else KeyboardInterrupt()

    def resend(self, signum: int) -> None:
        """``signum`` sent to this process again ``RESEND_S`` from now, where its exception can be raised."""
        timer = threading.Timer(RESEND_S, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        self._resends.append(timer)

    def cancel_resends(self) -> None:
        """The stop is made (by what broke after it): no second one."""
        while self._resends:
            self._resends.pop().cancel()

    def _unraisable(self, unraisable) -> None:
        """``sys.unraisablehook`` during the run: a stop Python dropped is kept (see the module's docstring)."""
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            self._before[0](unraisable)
            return
        self.dropped = True
        if isinstance(unraisable.exc_value, Terminated):
            signal.signal(signal.SIGTERM, on_sigterm)   # on_sigterm ignored further ones: the resend must be handled
            self.resend(signal.SIGTERM)
        else:
            self.stopped_by(peers.INTERRUPTED)
            self.resend(signal.SIGINT)


@contextlib.contextmanager
def guarded(*, sigterm: bool = False):
    """``with guarded() as run:``: the guard of the run already guarded (a ``fit`` inside a command), or a new one."""
    if _active is not None:
        yield _active
        return
    with RunGuard(sigterm=sigterm) as run:
        yield run


def on_sigterm(signum, frame):
    """The SIGTERM handler of a guarded command."""
    run = _active or RunGuard()   # RunGuard() unentered: only its methods, for a SIGTERM landing after the run
    # A SIGTERM to the process group (scancel, a job's end, `kill -- -PGID`) ends this rank's DataLoader workers too,
    # and torch's SIGCHLD handler would then raise "DataLoader worker ... is killed by signal" at any point of the
    # clean stop, in place of its paragraph. Their end is part of this stop: the iterator's shutdown reaps them.
    # A Python no-op, not SIG_DFL: a SIGCHLD already pending (a worker just ended) would then raise "Signal 17
    # ignored due to race condition" at the next bytecode (seen on the floor torch's Python).
    with contextlib.suppress(ValueError, OSError):
        run.handle(signal.SIGCHLD, _no_op)
    # The exception below may land where Python drops it, and what breaks next (the workers the same SIGTERM ended)
    # would be reported instead: the cause is kept, for this rank and the others.
    run.stopped_by(Terminated.description, first=False)
    run.terminated = True
    # One is enough. A second SIGTERM (the launcher's death signal and a scheduler's, say) must not cut the clean
    # stop short: telling the others and writing why to log.txt take a moment. A dropped one re-arms it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated("SIGTERM")


def _no_op(signum, frame) -> None:
    pass

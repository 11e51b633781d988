"""The run guard (ddp_utils/robust/guard.py): what a run changes in the whole process is put back when it ends."""
import os
import signal
import sys

import pytest

from ddp_utils.robust import peers
from ddp_utils.robust import guard
from ddp_utils.robust.stderr import HeldStderr
from ddp_utils.tools import cli


def process_settings() -> dict:
    return {"SIGTERM": signal.getsignal(signal.SIGTERM), "SIGCHLD": signal.getsignal(signal.SIGCHLD),
            "SIGINT": signal.getsignal(signal.SIGINT), "unraisablehook": sys.unraisablehook,
            "stop_signal": peers.stop_signal, "fd 2": os.fstat(2).st_ino, "guard": guard.current()}


@pytest.mark.parametrize("ending", ["returns", "sigterm", "error"])
def test_a_command_puts_back_every_process_wide_setting_it_changed(monkeypatch, capsys, ending):
    """Issue 43 (one run guard): cli.main left its SIGTERM handler installed after it returned, a SIGTERM stop left
    SIGCHLD a no-op, and a hold of fd 2 that a run did not release (an exception between hold and release in a
    thread) kept the student's error output in a temporary file. A command run in a process that lives on (tests,
    a notebook calling cli.main) must find the process as it was."""
    import ddp_utils.job
    monkeypatch.setattr(peers, "stop_signal", None)
    before = process_settings()
    sigterm, sigchld = before["SIGTERM"], before["SIGCHLD"]
    seen = {}

    def run_job(*args, **kwargs):
        seen["during"] = process_settings()
        HeldStderr(lambda line: False).hold()   # never released by the run itself
        if ending == "sigterm":
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)   # the handler, as the signal would call it
        if ending == "error":
            raise RuntimeError("a collective broke")
    monkeypatch.setattr(ddp_utils.job, "run_job", run_job)
    try:
        code = cli.main(["train", "--dataset", "fake"])
        assert code == {"returns": 0, "sigterm": 143, "error": 2}[ending]
        after = process_settings()
        if ending == "sigterm":   # the process is ending: a second SIGTERM must not cut its exit short, nor a
            assert after.pop("SIGTERM") is signal.SIG_IGN and before.pop("SIGTERM") is not signal.SIG_IGN
            no_op = after.pop("SIGCHLD")   # worker's end raise in torch's SIGCHLD handler
            assert callable(no_op) and no_op is not before.pop("SIGCHLD")
        assert after == before
        assert seen["during"]["SIGTERM"] is guard.on_sigterm and seen["during"]["guard"] is not None
        print("fd 2 is the terminal's again", file=sys.stderr, flush=True)
        assert "fd 2 is the terminal's again" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        signal.signal(signal.SIGCHLD, sigchld)


def test_a_fit_in_a_process_started_with_sigint_ignored_can_be_interrupted_until_it_ends():
    """``cmd &`` from a script starts the process with SIGINT ignored: the watch's self-interrupt of a stalled loop
    would do nothing. The run makes SIGINT raise KeyboardInterrupt and gives the ignoring back at its end; a fit
    inside a command uses the command's guard (one owner, one restore)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with guard.guarded() as run:
            run.interruptible()
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            with guard.guarded() as inner:
                assert inner is run
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # the inner one put back nothing
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and guard.current() is None
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_stop_python_dropped_is_raised_as_what_it_was(monkeypatch):
    """What broke after a dropped stop is replaced by the stop: a SIGTERM's as Terminated (exit 143 and "SIGTERM" to
    the others), a Ctrl-C's as KeyboardInterrupt, and the cause leaves with the run."""
    import types
    monkeypatch.setattr(peers, "stop_signal", None)
    monkeypatch.setattr(guard, "RESEND_S", 60.0)   # cancelled before it fires
    before = signal.getsignal(signal.SIGTERM)
    try:
        for exc, raised in ((KeyboardInterrupt(), KeyboardInterrupt), (guard.Terminated("SIGTERM"), guard.Terminated)):
            with guard.RunGuard(sigterm=True) as run:
                if isinstance(exc, guard.Terminated):
                    run.stopped_by(guard.Terminated.description, first=False)
                run._unraisable(types.SimpleNamespace(exc_value=exc))
                assert run.dropped and type(run.stop()) is raised
            assert peers.stop_signal is None and signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, before)

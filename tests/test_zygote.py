"""The fork server (tests/helpers/zygote.py) against real processes: the same probe (tests/helpers/zygote_probe.py), started both
ways, must see the same start (argv, sys.path, folder, environment, streams, signal handlers, session) and end the
same way (exit codes, a signal, an exception's traceback, atexit, unflushed output). The differences it keeps are
listed here, each asserted as it is, so that a new one fails (issue 37)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import zygote
from tests.helpers.procs import REPO, base_env, popen, stop

pytestmark = pytest.mark.skipif(not zygote.enabled(), reason="DDP_KIT_ZYGOTE=0: every command is a real process "
                                                              "already, there is no fork server to compare")
PROBE = ["tests/helpers/zygote_probe.py"]


def run(how: list[str], real: bool, env: dict | None = None, timeout: float = 60, probe=PROBE) -> tuple[int, str, str]:
    env = {**base_env(PROBE_VAR="from the test"), **(env or {})}
    proc = popen([sys.executable, *probe, *how], env, real=real, cwd=REPO, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop([proc])
    return proc.returncode, out, err


def facts(out: str) -> dict:
    return json.loads(out.splitlines()[0])


@pytest.mark.parametrize("how, code", [(["exit", "0"], 0), (["exit", "3"], 3), (["signal"], -signal.SIGTERM),
                                       (["killed"], -signal.SIGKILL), (["raise"], 1), (["unflushed"], 0)])
@pytest.mark.parametrize("probe", [PROBE, ["-m", "tests.helpers.zygote_probe"]], ids=["script", "module"])
def test_a_forked_command_starts_and_ends_as_a_real_one(how, code, probe):
    real, forked = run(how, real=True, probe=probe), run(how, real=False, probe=probe)
    assert real[0] == forked[0] == code, (real, forked)
    a, b = facts(real[1]), facts(forked[1])
    # documented: forked commands share the server's string-hash seed, a fresh interpreter draws its own
    a.pop("hash"), b.pop("hash")
    assert a == b, (a, b)
    assert real[1].splitlines()[1:] == forked[1].splitlines()[1:], (real[1], forked[1])   # atexit, unflushed
    if how == ["raise"]:
        for _, _, err in (real, forked):
            assert "Traceback (most recent call last)" in err and "ValueError: the probe's own error" in err, err
    if how == ["unflushed"]:   # written, never flushed: the exit writes it out (before atexit's line, whose print flushes)
        assert real[1].splitlines()[1] == "the last words, no newline, not flushedatexit ran", real[1]


def test_servers_are_keyed_on_every_variable_but_those_a_child_reads_after_start():
    """A variable nobody listed (a native library's, an allocator's, inductor's cache) gets a server of its own: the
    server read its own value at start-up. What ranks, torchrun and pytest set per command does not."""
    base = base_env()
    later = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29555", "TORCHELASTIC_RUN_ID": "x", "NCCL_DEBUG": "INFO",
             "PYTEST_CURRENT_TEST": "another test", "WANDB_MODE": "offline", "PATH": "/somewhere:" + base["PATH"]}
    assert zygote._startup({**base, **later}) == zygote._startup(base)
    for var in ("TORCHINDUCTOR_CACHE_DIR", "MALLOC_ARENA_MAX", "OPENBLAS_NUM_THREADS", "KINETO_LOG_LEVEL",
                "A_VARIABLE_NOBODY_LISTED", "PYTHONHASHSEED", "OMP_NUM_THREADS"):
        assert zygote._startup({**base, var: "3"}) != zygote._startup(base), var


def test_with_a_hash_seed_set_forked_commands_hash_as_real_ones():
    """PYTHONHASHSEED is read at start-up: a server of its own is started for it, so the one documented difference
    goes where a test pins the seed."""
    env = {"PYTHONHASHSEED": "7"}
    assert facts(run(["exit", "0"], True, env)[1])["hash"] == facts(run(["exit", "0"], False, env)[1])["hash"]


@pytest.mark.slow   # it starts processes (pytest.ini's slow)
def test_a_group_sigint_stops_the_command_as_it_stops_a_real_one_and_the_difference_it_keeps(monkeypatch):
    """Ctrl-C in a terminal sends SIGINT to the whole process group. Both ways the command dies of it with
    Python's traceback; a real command's children in the group get it too, a forked command's do not (the client
    forwards the signal to its command only): documented in tests/helpers/zygote.py, and why the signal tests that
    need the group's children (DataLoader workers) run real processes."""
    got = {}
    # a server of its own even where earlier tests on this worker took every place (MAX_SERVERS): beyond them a
    # command runs as a real process (an environment refused is kept as None), and the difference shown here is gone
    for key in [key for key, server in zygote._servers.items() if server is None]:
        monkeypatch.delitem(zygote._servers, key)
    monkeypatch.setattr(zygote, "MAX_SERVERS", len(zygote._servers) + 1)
    for real in (True, False):
        env = base_env(PROBE_VAR="from the test")
        proc = popen([sys.executable, *PROBE, "wait"], env, real=real, cwd=REPO, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        try:
            lines, deadline = [], time.monotonic() + 60
            while "ready" not in lines and time.monotonic() < deadline:
                lines.append(proc.stdout.readline().strip())
            assert "ready" in lines, lines
            os.killpg(proc.pid, signal.SIGINT)   # the group: what a terminal's Ctrl-C reaches
            out, err = proc.communicate(timeout=60)
        finally:
            stop([proc])
        got[real] = (proc.returncode, "\n".join(lines) + out, err)
    for real, (code, out, err) in got.items():
        assert code == -signal.SIGINT and "KeyboardInterrupt" in err, (real, code, err)
    assert "grandchild got SIGINT" in got[True][1], got[True]
    assert "grandchild got SIGINT" not in got[False][1], got[False]   # the documented difference

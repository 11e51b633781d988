"""Run several processes (one per rank) with a hard time bound, and always clean them up."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from tests.helpers import zygote

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    argv: list
    returncode: int | None  # None = killed at the time bound
    output: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def base_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")  # two ranks on two cores: no oversubscription
    env["WANDB_SILENT"] = "true"
    if zygote.enabled():   # torchrun's workers (torchrun and launch tests) from the fork server as well
        env["PYTHON_EXEC"] = zygote.python_exec()
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
                "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "WANDB_API_KEY"):
        env.pop(var, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_all(argvs: list[list[str]], timeout: float, env: dict | None = None, cwd: str | None = None,
            stagger: float = 0.0, prefix: list[list[str]] | None = None, real: bool = False) -> list[Result]:
    """Start every argv at once (optionally ``stagger`` seconds apart), wait at most ``timeout`` s.

    Each process gets its own session so that it and all its children can be killed together.
    ``prefix`` (per process, e.g. ``["ip", "netns", "exec", "h1"]``) runs the command elsewhere; ``real``
    starts fresh interpreters instead of forking from the test fork server.
    """
    env = env or base_env()
    procs = []
    try:
        for i, argv in enumerate(argvs):
            if i and stagger:
                time.sleep(stagger)
            procs.append(popen((prefix[i] if prefix else []) + argv, env, real=real, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, cwd=cwd or REPO, text=True))
        deadline = time.monotonic() + timeout
        outputs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                outputs.append((p.returncode, out))
            except subprocess.TimeoutExpired:
                _kill(p)
                out, _ = p.communicate()
                outputs.append((None, out))
        return [Result(a, rc, out) for a, (rc, out) in zip(argvs, outputs)]
    finally:
        stop(procs)


def stop(procs) -> None:
    """End processes this test started (each in its own session: ``start_new_session=True``), with
    whatever they started, also a stopped (SIGSTOP) one; then reap them. Safe to call twice."""
    for p in procs:
        _kill(p)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        zygote.kill(p.pid)   # a fork server's client: its command first
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def popen(argv: list, env: dict, real: bool = False, **kwargs) -> subprocess.Popen:
    """Popen in a session of its own; a plain ``python -m ...`` / ``python script.py`` starts from the fork server
    (zygote.py: no 8-s import). Its client forwards SIGINT/SIGTERM and dies with its command, but SIGSTOP would
    stop the client only: a test that freezes a process asks for a ``real`` one."""
    return subprocess.Popen(argv if real else zygote.wrap(argv, env), env=env, start_new_session=True, **kwargs)


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def describe(results: list[Result]) -> str:
    """Everything the processes printed, for assertion messages."""
    return "\n".join(f"--- {' '.join(map(str, r.argv))} -> rc={r.returncode}\n{r.output[-4000:]}" for r in results)

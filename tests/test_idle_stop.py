"""lab/scripts/idle_stop.py, the node's idle stop (issue 57): with the GPU idle, no kernel busy and no training or
data command running for the idle time, it warns every terminal and then shuts the node down (an AWS node launched
with shutdown behaviour stop then stops); a busy GPU, a busy or recently active kernel, a training process, or
anything it cannot read keeps the node up. The GPU's answers are a stand-in nvidia-smi, the kernels a stand-in
JupyterLab on loopback, the processes a stand-in /proc, and shutdown, wall and systemctl stand-ins that record."""
from __future__ import annotations

import http.server
import json
import os
import stat
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.helpers.page_commands import page_commands
from tests.helpers.procs import REPO

SCRIPT = Path(REPO) / "lab" / "scripts" / "idle_stop.py"
RECORDER = '#!/bin/sh\necho "$(basename "$0") $*" >> "{log}"\n[ -t 0 ] || cat >> "{log}"\n'


class Node:
    """A stand-in node: its GPUs' utilization, its processes, JupyterLab's kernels, and what was run."""

    def __init__(self, tmp: Path):
        self.tmp, self.bin, self.proc, self.log = tmp, tmp / "bin", tmp / "proc", tmp / "calls.log"
        self.bin.mkdir()
        self.proc.mkdir()
        self.gpus("0\n0")
        for name in ("shutdown", "wall", "systemctl"):
            path = self.bin / name
            path.write_text(RECORDER.format(log=self.log))
            path.chmod(0o755)
        self.state, self.config = tmp / "state.json", tmp / "config.json"
        self.config.write_text(json.dumps({"shutdown": f"{self.bin}/shutdown -h now", "wall": f"{self.bin}/wall",
                                           "proc_dir": str(self.proc), "load_average": 1000,
                                           "server_file": str(tmp / "jupyter_server.json")}))

    def gpus(self, answer: str | None) -> None:
        """What nvidia-smi answers (one utilization a line), or no nvidia-smi at all (None)."""
        path = self.bin / "nvidia-smi"
        if answer is None:
            path.unlink(missing_ok=True)
            return
        path.write_text(f"#!/bin/sh\nprintf '{answer}\\n'\n")
        path.chmod(0o755)

    def process(self, pid: int, *argv: str) -> None:
        (self.proc / str(pid)).mkdir()
        (self.proc / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")

    def idle_for(self, minutes: float) -> None:
        """As if the checks had found the node idle since ``minutes`` ago."""
        state = json.loads(self.state.read_text()) if self.state.exists() else {}
        self.state.write_text(json.dumps({**state, "idle_since": time.time() - 60 * minutes}))

    def run(self, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}", "DDP_IDLE_STOP_CONFIG": str(self.config),
               "DDP_IDLE_STOP_STATE": str(self.state), "DDP_IDLE_STOP_UNITS": str(self.tmp / "units"),
               "SYSTEMCTL": str(self.bin / "systemctl")}
        done = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    def calls(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


@pytest.fixture
def node(tmp_path):
    return Node(tmp_path)


def test_an_idle_node_is_warned_and_then_shut_down_after_the_idle_time_and_counts_again_after(node):
    assert "idle for 0 min: stops in 60 min" in node.run("check").stdout and node.calls() == ""
    node.idle_for(56)
    assert "stops in 4 min" in node.run("check").stdout
    assert node.calls().startswith("wall \nddp-idle-stop: this node has been idle for 56 minutes and stops in 4")
    node.run("check")
    assert node.calls().count("wall") == 1   # warned once
    node.idle_for(61)
    assert "idle for 61 min: shutting down" in node.run("check").stdout
    assert node.calls().splitlines()[-1] == "shutdown -h now"
    assert json.loads(node.state.read_text())["idle_since"] is None   # after the start, from zero again


@pytest.mark.parametrize("busy, said", [
    ("gpu", "busy: GPU utilization 87 %"),
    ("training", "busy: a command runs: python -m ddp_utils train --dataset imagenet"),
    ("torchrun", "busy: a command runs: /usr/bin/python /usr/local/bin/torchrun --nproc-per-node 2"),
    ("untar", "busy: a command runs: tar -xf ILSVRC2012_img_train.tar"),
    ("no nvidia-smi", "busy: nvidia-smi did not answer"),
])
def test_a_busy_gpu_a_training_or_data_command_or_an_unreadable_gpu_keeps_the_node_up(node, busy, said):
    if busy == "gpu":
        node.gpus("0\n87")
    elif busy == "training":
        node.process(4242, "python", "-m", "ddp_utils", "train", "--dataset", "imagenet")
    elif busy == "torchrun":
        node.process(4242, "/usr/bin/python", "/usr/local/bin/torchrun", "--nproc-per-node", "2")
    elif busy == "untar":
        node.process(4242, "tar", "-xf", "ILSVRC2012_img_train.tar")
    else:
        node.gpus(None)
    node.process(17, "/usr/lib/systemd/systemd", "--user")   # what every node runs: not work
    node.idle_for(120)
    assert node.run("check").stdout.startswith(said)
    assert "shutdown" not in node.calls() and json.loads(node.state.read_text())["idle_since"] is None


class Kernels(http.server.BaseHTTPRequestHandler):
    token, kernels = "secret", []

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path != "/api/kernels" or self.headers.get("Authorization") != f"token {self.token}":
            self.send_error(403)
            return
        body = json.dumps(self.kernels).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def jupyter(node):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Kernels)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (node.tmp / "jupyter_server.json").write_text(json.dumps({"url": f"http://127.0.0.1:{server.server_port}",
                                                              "token": "secret"}))
    yield Kernels
    server.shutdown()
    server.server_close()


def ago(minutes: float) -> str:
    return datetime.fromtimestamp(time.time() - 60 * minutes, timezone.utc).isoformat().replace("+00:00", "Z")


def test_a_busy_or_recently_active_kernel_keeps_the_node_up_and_an_idle_one_does_not(node, jupyter):
    node.idle_for(120)
    jupyter.kernels = [{"name": "python3", "execution_state": "busy", "last_activity": ago(200)}]
    assert node.run("check").stdout.startswith("busy: a notebook kernel is running a cell")
    node.idle_for(120)
    jupyter.kernels = [{"name": "python3", "execution_state": "idle", "last_activity": ago(10)}]
    assert node.run("check").stdout.startswith("busy: a notebook kernel was active at")
    node.idle_for(120)
    jupyter.kernels = [{"name": "python3", "execution_state": "idle", "last_activity": ago(90)}]
    assert "shutting down" in node.run("check").stdout and "shutdown -h now" in node.calls()


def test_a_jupyterlab_that_refuses_the_token_counts_as_busy_and_none_running_as_idle(node, jupyter):
    (node.tmp / "jupyter_server.json").write_text(json.dumps({**json.loads((node.tmp / "jupyter_server.json")
                                                                           .read_text()), "token": "stale"}))
    node.idle_for(120)
    out = node.run("check").stdout
    assert out.startswith("busy: JupyterLab at http://127.0.0.1:") and "counted as busy" in out
    (node.tmp / "jupyter_server.json").write_text(json.dumps({"url": "http://127.0.0.1:9", "token": "x"}))
    node.idle_for(120)   # port 9 (discard) refuses: the container stopped, no kernel to wait for
    assert "shutting down" in node.run("check").stdout


def test_pause_and_disable_hold_the_stop_and_resume_and_enable_give_it_back(node):
    node.idle_for(120)
    assert node.run("pause", "30").stdout.startswith("paused: no stop before")
    assert "paused: no stop" in node.run("check").stdout and "shutdown" not in node.calls()
    node.run("resume")
    node.run("disable")
    node.idle_for(120)
    assert "disabled: no stop" in node.run("check").stdout and "shutdown" not in node.calls()
    assert "; disabled" in node.run("status").stdout
    node.run("enable")
    assert "shutting down" in node.run("check").stdout and "shutdown -h now" in node.calls()


def test_install_writes_its_settings_a_service_and_a_timer_every_minute_and_enables_it(node):
    node.config.unlink()
    out = node.run("install", "--idle-minutes", "45").stdout
    assert "the node stops after 45 idle minutes" in out
    assert json.loads(node.config.read_text())["idle_minutes"] == 45
    service = (node.tmp / "units" / "ddp-idle-stop.service").read_text()
    assert f"ExecStart={sys.executable} {SCRIPT} check" in service and "Type=oneshot" in service
    assert "OnUnitActiveSec=1min" in (node.tmp / "units" / "ddp-idle-stop.timer").read_text()
    assert node.calls().splitlines() == ["systemctl daemon-reload", "systemctl enable --now ddp-idle-stop.timer"]


def test_start_jupyter_leaves_the_idle_stop_its_address_and_token_readable_by_root_only(tmp_path):
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    (stand_in / "jupyter").write_text("#!/bin/sh\nexit 0\n")
    (stand_in / "jupyter").chmod(0o755)
    env = {**os.environ, "PATH": f"{stand_in}:{os.environ['PATH']}", "KIT_DIR": str(tmp_path), "PORT": "8890",
           "JUPYTER_TOKEN": "abc123"}
    done = subprocess.run(["bash", str(Path(REPO) / "docker" / "start-jupyter.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    written = tmp_path / ".jupyter_server.json"
    assert json.loads(written.read_text()) == {"url": "http://127.0.0.1:8890", "token": "abc123"}
    assert stat.S_IMODE(written.stat().st_mode) == 0o600


def test_every_idle_stop_command_the_pages_give_runs_as_typed(node):
    """Issue 57's Done-when: the idle stop's commands on the pages (install in step 2, status, pause, resume,
    disable) run as typed, sudo aside (this test runs as whoever runs the suite)."""
    commands = page_commands("idle_stop.py", inline=True)
    assert [c[0] for c in commands] == ["install", "install", "status", "pause", "resume", "disable"], commands
    node.config.unlink()
    for command in commands[1:]:   # the same install twice (step 2, and nodes.md's sentence about it)
        node.run(*command)
    assert json.loads(node.state.read_text())["disabled"] is True and "ddp-idle-stop.timer" in node.calls()

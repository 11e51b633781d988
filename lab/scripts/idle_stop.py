"""Stop this node when nothing has worked on it for a while: a GPU node left on costs its hourly price for nothing.

    sudo python3 lab/scripts/idle_stop.py install              # once per node (step 2): a check every minute
    python3 lab/scripts/idle_stop.py status                    # what it sees now, and when it would stop the node
    sudo python3 lab/scripts/idle_stop.py pause 180            # no stop for the next 180 minutes (default 120)
    sudo python3 lab/scripts/idle_stop.py resume               # the pause ends now
    sudo python3 lab/scripts/idle_stop.py disable              # never stop (enable: again)

The node is idle when, at a check, all of these hold: every GPU's utilization is at most --gpu-percent (nvidia-smi);
no JupyterLab kernel is busy or was active within the idle time (JupyterLab's /api/kernels, at the address and
with the token docker/start-jupyter.sh writes to the kit's folder, .jupyter_server.json, readable by root only); no training or data command runs (a process whose command
line holds one of WORK: the kit's commands, torchrun, the data scripts, tar, unzip, rsync, aws s3); and the load
average is under --load-average (default 1: something else is computing). When it has been idle for --idle-minutes (default 60), every
terminal gets a warning (wall) --warn-minutes before (default 5), then the node shuts down. Launched with
``--instance-initiated-shutdown-behavior stop`` (lab/nodes.md), an AWS node then stops: its EBS disk stays, the
NVMe scratch is erased, and it costs only its disk until you start it again. Anything it cannot read (no
nvidia-smi, JupyterLab not answering) counts as busy: it never stops a node it cannot see.

``install`` writes a systemd service and timer (ddp-idle-stop) that run ``check`` every minute as root, and its
settings (the options above) to /etc/ddp-idle-stop.json; ``check`` is one look, for the timer.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CONFIG = Path(os.environ.get("DDP_IDLE_STOP_CONFIG", "/etc/ddp-idle-stop.json"))
STATE = Path(os.environ.get("DDP_IDLE_STOP_STATE", "/var/lib/ddp-idle-stop/state.json"))
UNITS = Path(os.environ.get("DDP_IDLE_STOP_UNITS", "/etc/systemd/system"))
KIT = Path(__file__).resolve().parents[2]
WORK = ("ddp_utils", "torchrun", "bench.py", "resize_imagenet", "prepare_cinic10", "make_imagenet_subset",
        "sort_imagenet_val", "tar ", "unzip", "rsync", "aws s3", "kaggle")
DEFAULTS = {"idle_minutes": 60, "warn_minutes": 5, "gpu_percent": 5, "server_file": str(KIT / ".jupyter_server.json"),
            "shutdown": "shutdown -h now", "wall": "wall", "load_average": 1.0, "proc_dir": "/proc"}
FRESH = {"idle_since": None, "warned": False, "paused_until": 0, "disabled": False}   # the state before any check


def load(path: Path, default: dict) -> dict:
    try:
        return {**default, **json.loads(path.read_text())}
    except FileNotFoundError:
        return dict(default)


def save(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1))
    partial.replace(path)   # a check that dies mid-write leaves the old file, never half of one


# -- what is working -----------------------------------------------------------------------------------------------
def gpu_busy(config: dict) -> str | None:
    """Why the GPUs count as busy, or None when every one is at most gpu_percent utilized."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        percents = [float(line) for line in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        return f"nvidia-smi did not answer ({error}): counted as busy"
    busy = [p for p in percents if p > config["gpu_percent"]]
    return f"GPU utilization {', '.join(f'{p:g} %' for p in busy)}" if busy else None


def kernels_busy(config: dict, now: float) -> str | None:
    """Why JupyterLab counts as busy: a kernel executing, or active within the idle time; None when none is.
    Its address and token come from the file docker/start-jupyter.sh writes into the kit's folder."""
    try:
        server = json.loads(Path(config["server_file"]).read_text())
    except FileNotFoundError:
        return None   # no JupyterLab started by docker/run.sh on this node: no kernel to wait for
    except (OSError, ValueError) as error:
        return f"{config['server_file']} cannot be read ({error}; run with sudo): counted as busy"
    request = urllib.request.Request(server["url"].rstrip("/") + "/api/kernels",
                                     headers={"Authorization": f"token {server['token']}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            kernels = json.load(answer)
    except OSError as error:
        if isinstance(getattr(error, "reason", None), ConnectionRefusedError):
            return None   # JupyterLab is not running (the container stopped): nothing to wait for
        return f"JupyterLab at {server['url']} did not answer ({error}): counted as busy"
    limit = config["idle_minutes"] * 60
    for kernel in kernels:
        if kernel.get("execution_state") == "busy":
            return f"a notebook kernel is running a cell ({kernel.get('name', 'kernel')})"
        last = kernel.get("last_activity", "")
        if last and now - iso_seconds(last) < limit:
            return f"a notebook kernel was active at {last}"
    return None


def iso_seconds(stamp: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def work_running(proc_dir: str) -> str | None:
    """A training or data command, by its command line (/proc); None when none runs."""
    for proc in Path(proc_dir).iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "idle_stop.py" not in line and any(word in line for word in WORK):
            return f"a command runs: {line.strip()[:100]} (pid {proc.name})"
    return None


def why_busy(config: dict, now: float) -> str | None:
    load1 = os.getloadavg()[0]
    return (gpu_busy(config) or kernels_busy(config, now) or work_running(config["proc_dir"])
            or (f"the load average is {load1:.1f}: something computes" if load1 >= config["load_average"] else None))


# -- the check the timer runs --------------------------------------------------------------------------------------
def check(config: dict, now: float | None = None) -> str:
    """One look: update the idle clock; warn, then shut down, when idle long enough. Returns what it did."""
    now = time.time() if now is None else now
    state = load(STATE, FRESH)
    busy = why_busy(config, now)
    if busy:
        state.update(idle_since=None, warned=False)
        save(STATE, state)
        return f"busy: {busy}"
    state["idle_since"] = state["idle_since"] or now
    idle = (now - state["idle_since"]) / 60
    left = config["idle_minutes"] - idle
    if state["disabled"] or now < state["paused_until"]:
        save(STATE, state)
        return f"idle for {idle:.0f} min; {'disabled' if state['disabled'] else 'paused'}: no stop"
    if left <= 0:
        save(STATE, {**state, "idle_since": None, "warned": False})   # after a start, count again from zero
        run(config["shutdown"])
        return f"idle for {idle:.0f} min: shutting down"
    if left <= config["warn_minutes"] and not state["warned"]:
        run(config["wall"], f"ddp-idle-stop: this node has been idle for {idle:.0f} minutes and stops in "
                            f"{left:.0f}. Keep it: sudo python3 {Path(__file__).resolve()} pause\n")
        state["warned"] = True
    save(STATE, state)
    return f"idle for {idle:.0f} min: stops in {left:.0f} min"


def run(command: str, stdin: str | None = None) -> None:
    subprocess.run(shlex.split(command), input=stdin, stdin=None if stdin else subprocess.DEVNULL, text=True,
                   timeout=60, check=False)


# -- installing and steering it ------------------------------------------------------------------------------------
def install(config: dict, units: Path = UNITS) -> list[Path]:
    """The settings file, a oneshot service that runs ``check`` and a timer that starts it every minute."""
    save(CONFIG, config)
    script = Path(__file__).resolve()
    service = units / "ddp-idle-stop.service"
    timer = units / "ddp-idle-stop.timer"
    units.mkdir(parents=True, exist_ok=True)
    service.write_text(f"[Unit]\nDescription=Stop this node when it has been idle (ddp kit)\n\n[Service]\n"
                       f"Type=oneshot\nEnvironment=DDP_IDLE_STOP_CONFIG={CONFIG}\n"
                       f"ExecStart={sys.executable} {script} check\n")
    timer.write_text("[Unit]\nDescription=Look every minute whether this node is idle (ddp kit)\n\n[Timer]\n"
                     "OnBootSec=2min\nOnUnitActiveSec=1min\n\n[Install]\nWantedBy=timers.target\n")
    for args in (["daemon-reload"], ["enable", "--now", "ddp-idle-stop.timer"]):
        subprocess.run([os.environ.get("SYSTEMCTL", "systemctl"), *args], check=True, timeout=60)
    return [CONFIG, service, timer]


def steer(command: str, minutes: float | None, now: float) -> str:
    state = load(STATE, FRESH)
    if command == "pause":
        state["paused_until"] = now + 60 * (minutes or 120)
        said = f"paused: no stop before {time.strftime('%H:%M', time.localtime(state['paused_until']))}"
    elif command == "resume":
        state["paused_until"], said = 0, "resumed: the idle stop counts again"
    else:
        state["disabled"] = command == "disable"
        said = ("disabled: this node never stops by itself now (stop it yourself: lab/nodes.md)" if state["disabled"]
                else "enabled")
    save(STATE, {**state, "warned": False})
    return said


def status(config: dict, now: float) -> str:
    state = load(STATE, FRESH)
    busy = why_busy(config, now)
    idle = f"idle for {(now - state['idle_since']) / 60:.0f} min" if state["idle_since"] else "not idle at the last check"
    return (f"now: {busy or 'idle'}; {idle}; stops after {config['idle_minutes']:g} idle minutes"
            + ("; disabled" if state["disabled"] else "")
            + (f"; paused until {time.strftime('%H:%M', time.localtime(state['paused_until']))}"
               if state["paused_until"] > now else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("command", choices=("install", "check", "status", "pause", "resume", "disable", "enable"))
    parser.add_argument("minutes", nargs="?", type=float, help="pause: for how long (default 120)")
    parser.add_argument("--idle-minutes", type=float, help="install: stop after this many idle minutes (default 60)")
    parser.add_argument("--warn-minutes", type=float, help="install: warn this many minutes before (default 5)")
    parser.add_argument("--gpu-percent", type=float, help="install: a GPU busier than this works (default 5)")
    parser.add_argument("--load-average", type=float, help="install: a load at least this works (default 1)")
    parser.add_argument("--server-file", help="install: JupyterLab's address and token (default the kit's "
                                               ".jupyter_server.json, which docker/start-jupyter.sh writes)")
    parser.add_argument("--shutdown", help="install: the command that stops the node (default shutdown -h now)")
    parser.add_argument("--wall", help="install: the command that warns every terminal (default wall)")
    parser.add_argument("--proc-dir", help=argparse.SUPPRESS)   # tests: a stand-in /proc
    args = parser.parse_args(argv)
    config = load(CONFIG, DEFAULTS)
    config.update({k: v for k, v in vars(args).items() if k in DEFAULTS and v is not None})
    now = time.time()
    try:
        if args.command == "install":
            written = install(config)
            print(f"installed: {', '.join(map(str, written))}; the node stops after {config['idle_minutes']:g} idle "
                  f"minutes (status, pause, disable: python3 {Path(__file__).resolve()} --help)")
        elif args.command == "check":
            print(check(config, now))
        elif args.command == "status":
            print(status(config, now))
        else:
            print(steer(args.command, args.minutes, now))
    except PermissionError as error:
        print(f"idle_stop: {error.filename} cannot be written: run it with sudo", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

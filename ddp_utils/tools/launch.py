"""``launch``: one training process per GPU of this node, from one command or one notebook cell.

Command line, with torchrun's flag names followed by the ``train`` flags::

    python -m ddp_utils launch --nproc-per-node 4 --dataset imagenet --data-dir /data/imagenet
    node0$ python -m ddp_utils launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 ...same flags...
    node1$ python -m ddp_utils launch --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 ...same flags...

From a notebook (processes, not a fork of the kernel, which may have initialised CUDA)::

    from ddp_utils.tools.launch import launch
    results = launch(settings, nproc_per_node=2)   # rank 0's lines appear as they come; rank 0's results

The processes are started, watched and restarted (``--max-restarts``) by torch's own elastic agent: the launcher
runs ``torchrun`` (``python -m torch.distributed.run``, static rendezvous on master_addr:master_port) with
``python -m ddp_utils train`` and the shared flags; each process takes its rank, world size and local rank from
torchrun's environment. What the launcher adds: the layout checked before anything starts (``plan``), this node's
first rank streamed as its lines come (torchrun's ``--tee`` with ``--local-ranks-filter 0``), every rank's output
in ``rank<N>.log``, and a ``LaunchError`` naming the rank whose failure started it all, with its reason and last
lines (torchrun's "Root Cause", followed through the kit's own "stopped because rank N stopped"). Ctrl-C (the
notebook's Stop) or the launcher's death sends SIGTERM to torchrun, which stops every process the kit's clean way.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..robust import peers
from .. import settings as settings_module

TERM_S = 40.0    # after SIGTERM to torchrun: how long before SIGKILL (torchrun gives its processes 30 s)
TAIL_LINES = 15  # lines of a failed rank's output shown in the error
ORPHAN_TERM_S = 15.0   # torchrun gone, its workers still running: SIGTERM, this long, then SIGKILL
PARENT_VAR = "DDP_UTILS_LAUNCHER_PID"
# Variables that would tell a child another place in the job than the flags the launcher gives it.
IDENTITY_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
SET_BY_LAUNCH = ("rank", "world_size", "local_rank", "init_method")
# torchrun, started like ``torchrun ...`` after asking to be told (SIGTERM) when the launcher dies.
BOOT = ("import sys; from ddp_utils.tools.launch import as_child; as_child(); "
        "from torch.distributed.run import main; sys.exit(main())")
STREAMED = re.compile(r"^\[default0\]:(.*)$")   # torchrun's prefix of local rank 0's lines (--tee)
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])   # the folder holding ddp_utils/


class LaunchError(RuntimeError):
    """A launched process failed (or the run was stopped): the text names the rank and its reason."""


# -- the plan: which processes, with which settings ------------------------------------------------
def local_gpus() -> int:
    """GPUs this node shows to this process (no CUDA context is made)."""
    import torch
    return torch.cuda.device_count()


def plan(settings, nproc_per_node: int | None = None, nnodes: int = 1, node_rank: int = 0,
         share_gpu: bool = False) -> list:
    """The Settings of each process this node starts, by local rank; refuses a layout that cannot work.

    ``share_gpu``: on a node with one GPU, let several processes share it (every local_rank 0), a rehearsal on
    gloo (lab 4 on the homework's one-GPU nodes): the ranks find that they share it and agree on gloo."""
    gpus = local_gpus()
    nproc = nproc_per_node if nproc_per_node is not None else max(gpus, 1)
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"--nproc-per-node {nproc} --nnodes {nnodes}: both must be at least 1")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} with --nnodes {nnodes}: the node rank must be in 0..{nnodes - 1} "
                         f"(0 on the node whose address is --master-addr)")
    shared = share_gpu and gpus == 1 and nproc > 1
    if shared and settings.backend == "nccl":
        raise ValueError(f"{nproc} processes sharing this node's one GPU need gloo: NCCL refuses two ranks on one "
                         f"GPU (\"duplicate GPU\"). Use backend 'auto' (it then picks gloo) or 'gloo'.")
    if gpus and nproc > gpus and not shared:
        raise ValueError(f"--nproc-per-node {nproc}, but this node has {gpus} GPU(s): DDP runs one process per GPU. "
                         f"Use --nproc-per-node {gpus} (or leave it out: the number of GPUs)"
                         + (", or share_gpu=True to rehearse several processes on its one GPU over gloo."
                            if gpus == 1 else "."))
    if nnodes > 1 and settings.master_addr in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"--nnodes {nnodes} with --master-addr {settings.master_addr}: the other nodes cannot reach "
                         f"a loopback address. Set --master-addr to the private IP of the node with --node-rank 0, "
                         f"the same on every node.")
    world = nnodes * nproc
    return [settings.replace(rank=node_rank * nproc + local, world_size=world, local_rank=0 if shared else local,
                             init_method="tcp") for local in range(nproc)]


def shares_a_gpu(plans: list) -> bool:
    """Whether this node's processes all use one GPU (``plan(..., share_gpu=True)``): their command then names
    ``--local-rank``, which wins over the LOCAL_RANK that torchrun gives each process."""
    return len(plans) > 1 and len({s.local_rank for s in plans}) == 1


def child_argv(settings, resume: str | None = None, evaluate: bool = False, seeds=None, grid=None) -> list[str]:
    """What every process runs: ``train`` and the shared flags (through ``to_argv``); its rank, world size and
    local rank come from torchrun's environment."""
    argv = settings.to_argv(skip=(*SET_BY_LAUNCH, "master_addr", "master_port"))
    if resume:
        argv += ["--resume", str(resume)]
    if evaluate:
        argv.append("--evaluate")
    if seeds:
        argv += ["--seeds", ",".join(str(s) for s in seeds)]
    for axis in grid or []:
        argv += ["--grid", axis]
    return ["train", *argv]


def torchrun_argv(plans: list, train: list[str], log_dir: Path, max_restarts: int = 0) -> list[str]:
    """torchrun's flags for this node (static rendezvous on the master), then ``-m ddp_utils`` and ``train``."""
    first = plans[0]
    nproc = len(plans)
    return ["--nnodes", str(first.world_size // nproc), "--nproc-per-node", str(nproc),
            "--node-rank", str(first.rank // nproc), "--master-addr", first.master_addr,
            "--master-port", str(first.master_port), "--max-restarts", str(max_restarts),
            "--log-dir", str(log_dir / "torchrun"), "--redirects", "3", "--tee", "3", "--local-ranks-filter", "0",
            "-m", "ddp_utils", *train]


def child_env(environ=None) -> dict:
    """The launcher's environment, without the variables that would give a child another identity, and with the
    kit's NCCL error handling unless the user chose one: torchrun gives its workers the agent's value of
    TORCH_NCCL_ASYNC_ERROR_HANDLING or else 1, which SIGABRTs every survivor of a dead peer before the kit's watch
    can name it (distributed.NCCL_ENV)."""
    from ..distributed import NCCL_ENV
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in IDENTITY_VARS}
    for var, value in NCCL_ENV.items():
        env.setdefault(var, value)
    env["PYTHONUNBUFFERED"] = "1"     # lines arrive as they are printed, not in 8 KB blocks
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
    env[PARENT_VAR] = str(os.getpid())
    return env


def as_child() -> None:
    """First thing in a launched process: get SIGTERM when the launcher dies, even by SIGKILL (Linux)."""
    parent = os.environ.pop(PARENT_VAR, "")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):   # the launcher died before the line above
        sys.exit("launch: the launcher is gone; not starting")


# -- why a process stopped ---------------------------------------------------------------------------
_CONSEQUENCE = re.compile(r"stopped because (?:rank (\d+) (stopped.*)|another rank stopped answering)", re.S)


def reason_of(returncode: int, lines) -> str:
    """One process's own account of why it stopped: the kit's ``error:`` paragraph, else the last line of
    a traceback, else the signal or exit code."""
    lines = [line.rstrip() for line in lines]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("error: "):
            return " ".join(x.strip() for x in lines[i:] if x.strip())[len("error: "):][:1500]
    for line in reversed(lines):
        if line.startswith(("terminated (SIGTERM)", "interrupted:")):   # cli.main's words for a signal
            return line.split(":", 1)[0] + " (a signal from outside the launcher)"
        if re.match(r"^([\w.]+\.)?\w*(Error|Exception|Interrupt|Exit)\b", line) or ": error: " in line:
            return line.strip()[:1500]
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}" + (" (the out-of-memory killer, or someone's kill -9)"
                                             if returncode == -signal.SIGKILL else "")
    return f"exited with code {returncode} without saying why"


def root_cause(exits: list[tuple[int, int, list]]) -> tuple[int, str, bool]:
    """``(rank, reason, reported_by_another)`` of the failure that started it all.

    ``exits``: ``(rank, returncode, last lines)`` of the processes that failed on their own, in the order
    they stopped. A process that only says another rank stopped (the store's failure channel) points at
    that rank, which may run on another node."""
    told, stopped = [], []
    for rank, code, lines in exits:
        reason = reason_of(code, lines)
        consequence = _CONSEQUENCE.search(reason)
        if consequence:
            if consequence.group(1) is not None:
                told.append((int(consequence.group(1)), consequence.group(2).strip()))
        elif reason.startswith("terminated (SIGTERM)") or code == -signal.SIGTERM:
            # torchrun's agent SIGTERMs the rest once one process ended: a rank that learnt another's failure
            # may end first, and this one never got to say its own; what the others were told comes first
            stopped.append((rank, reason))
        else:
            return rank, reason, False
    if told:
        return told[0][0], told[0][1], True
    if stopped:
        return stopped[0][0], stopped[0][1], False
    rank, code, lines = exits[0]
    return rank, reason_of(code, lines), False


# -- torchrun and its processes ------------------------------------------------------------------------------
_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


@dataclass(frozen=True)
class LaunchOptions:
    """What ``launch`` takes besides the settings and where this node is, each a keyword of ``launch``."""
    master_addr: str | None = None   # node 0's private IP (the same on every node), in place of the settings'
    master_port: int | None = None
    resume: str | None = None        # as train's --resume, --evaluate, --seeds and --grid
    evaluate: bool = False
    seeds: list | None = None
    grid: list | None = None
    log_dir: str | None = None       # where torchrun writes every process's output (default: a new temporary one)
    on_line: Callable = print        # each line of this node's first rank, as it comes
    timeout: float | None = None     # seconds, then every process is stopped
    environ: dict | None = None      # the processes' environment (default: this one's)
    max_restarts: int = 0            # torchrun restarts every process of the job this many times after a failure
    share_gpu: bool = False          # several processes on this node's one GPU, over gloo (``plan``)


class Launcher:
    """torchrun for this node's processes of one run: start, stream, stop. ``launch()`` drives it."""

    def __init__(self, plans: list, options: LaunchOptions = LaunchOptions()):
        self.plans = plans
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_dir = (Path(options.log_dir) if options.log_dir else
                        Path(tempfile.mkdtemp(prefix=f"ddp_utils-launch-{stamp}-")))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = child_env(options.environ)
        self.train = child_argv(plans[0], options.resume, options.evaluate, options.seeds, options.grid)
        if shares_a_gpu(plans):   # every process on GPU 0, whatever torchrun's LOCAL_RANK says
            self.train += ["--local-rank", str(plans[0].local_rank)]
        self.argv = [sys.executable, "-c", BOOT, *torchrun_argv(plans, self.train, self.log_dir, options.max_restarts)]
        self.lines: queue.Queue = queue.Queue()
        self.torchrun_lines: list[str] = []   # torchrun's own (its summary names the failed ranks)
        self.run_dirs: list[str] = []
        self.popen: subprocess.Popen | None = None
        self.reader: threading.Thread | None = None
        self.termed_at: float | None = None
        self.timed_out = False
        self.workers: dict = {}   # pid -> psutil.Process: torchrun's processes and theirs, seen while it ran
        self._looked_at = 0.0      # when remember_workers last looked

    def describe(self) -> list[str]:
        first = self.plans[0]
        nproc, ranks = len(self.plans), f"{self.plans[0].rank}..{self.plans[-1].rank}"
        where = ("all on GPU 0, shared: a rehearsal on gloo" if shares_a_gpu(self.plans)
                 else f"local_rank 0..{nproc - 1}")
        return [f"launch: {first.world_size // nproc} node(s) x {nproc} process(es) = world size "
                f"{first.world_size}; this node runs ranks {ranks} ({where}); master "
                f"{first.master_addr}:{first.master_port}",
                f"launch: rank {first.rank}'s output follows; every rank's output is in {self.log_dir}/rank<N>.log"]

    def start(self) -> None:
        with open(self.log_dir / "commands.txt", "w") as f:
            f.write(f"torchrun: python -m torch.distributed.run {shlex.join(self.argv[3:])}\n")
            for s in self.plans:   # what torchrun's environment tells each process, as flags
                f.write(f"rank {s.rank}: python -m ddp_utils {shlex.join(self.train)} (from torchrun: --rank "
                        f"{s.rank} --world-size {s.world_size} --local-rank {s.local_rank})\n")
        self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, errors="replace", env=self.env,
                                      start_new_session=True)   # Ctrl-C reaches the launcher, which stops it
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        prefix = "" if self.plans[0].rank == 0 else f"[rank {self.plans[0].rank}] "
        with open(self.log_dir / "torchrun.log", "w", encoding="utf-8", buffering=1) as log:
            for line in self.popen.stdout:
                line = line.rstrip("\n")
                mine = STREAMED.match(line)
                if not mine:
                    log.write(line + "\n")
                    self.torchrun_lines.append(line)
                    continue
                line = mine.group(1)
                found = re.match(r"Run folder: (.+?)  \(TensorBoard", line)
                if found:
                    self.run_dirs.append(found.group(1))
                self.lines.put(prefix + line)

    def lines_until_done(self, timeout: float | None = None):
        """Yield the streamed lines as they come until torchrun has stopped (it stops every process after a
        failure); at ``timeout`` seconds, stop it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while self.popen.poll() is None or not self.lines.empty():
                try:
                    yield self.lines.get(timeout=0.1)
                except queue.Empty:
                    pass
                now = time.monotonic()
                if now - self._looked_at >= 1.0:
                    self.remember_workers()
                if deadline is not None and now > deadline and self.termed_at is None:
                    self.timed_out = True
                    self.terminate()
                if self.termed_at is not None and now - self.termed_at > TERM_S:
                    self.kill()
            self.reader.join(timeout=5)
            yield from self.drain()
        finally:
            self.stop()

    def remember_workers(self) -> None:
        """Note torchrun's processes and theirs (DataLoader workers), each worker in a session of its own that no
        signal to torchrun's group reaches: kept while torchrun lives, so that ``stop`` can end them even when
        torchrun itself was killed (they would train on as orphans, holding the GPU and the port)."""
        import psutil
        self._looked_at = time.monotonic()
        # what ended is forgotten: a run with restarts makes new workers each attempt (and PIDs come back)
        self.workers = {pid: child for pid, child in self.workers.items() if child.is_running()}
        try:
            for child in psutil.Process(self.popen.pid).children(recursive=True):
                self.workers.setdefault(child.pid, child)
        except psutil.Error:   # torchrun has exited: what was seen is all there is
            pass

    def _end_workers(self, patience: float = 0.0) -> None:
        """End every remembered process still running (psutil checks it is the same process, not a reused pid):
        SIGTERM first when ``patience`` allows (the kit's clean stop: each rank says why, last.pt stays whole),
        then SIGKILL to what is left and to its process group (a worker leads its session's: its loaders too)."""
        import psutil
        alive = [c for c in self.workers.values() if c.is_running()]
        if alive and patience > 0:
            for child in alive:
                with contextlib.suppress(psutil.Error):
                    child.terminate()
            _, alive = psutil.wait_procs(alive, timeout=patience)
        for child in alive:
            with contextlib.suppress(psutil.Error, OSError):
                if child.is_running():
                    if os.getpgid(child.pid) == child.pid:
                        _send(child.pid, signal.SIGKILL, group=True)
                    child.kill()

    def drain(self) -> list[str]:
        """The streamed lines not yet taken."""
        out = []
        while not self.lines.empty():
            out.append(self.lines.get())
        return out

    def terminate(self) -> None:
        """SIGTERM to torchrun: it sends SIGTERM to every process, which stops cleanly and tells the others."""
        if self.popen is not None and self.popen.poll() is None:
            self.termed_at = time.monotonic()
            _send(self.popen.pid, signal.SIGTERM, group=False)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.remember_workers()
            _send(self.popen.pid, signal.SIGKILL, group=True)
        self._end_workers()   # torchrun's SIGKILL ends torchrun only: its workers run in sessions of their own

    def stop(self, patience: float = TERM_S) -> None:
        """Leave nothing behind: SIGTERM to torchrun, up to ``patience`` s, then SIGKILL; then the logs."""
        if self.popen is None:
            return
        self.remember_workers()
        if self.popen.poll() is None:
            self.terminate()
            try:
                self.popen.wait(timeout=patience)
            except subprocess.TimeoutExpired:
                self.kill()
        _send(self.popen.pid, signal.SIGKILL, group=True)   # anything torchrun left in its session
        self._end_workers(ORPHAN_TERM_S)   # and in their own sessions (torchrun killed from outside left them)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.reader is not None:
            self.reader.join(timeout=5)
        self.collect_logs()

    def collect_logs(self) -> None:
        """``rank<N>.log``: each process's output (torchrun keeps stdout and stderr per attempt and local rank)."""
        attempts = sorted(self.log_dir.glob("torchrun/*/attempt_*"), key=lambda a: int(a.name.split("_")[1]))
        for s in self.plans:
            parts = []
            for attempt in attempts:
                for stream in ("stdout", "stderr"):
                    path = attempt / str(s.local_rank) / f"{stream}.log"
                    if path.is_file():
                        text = path.read_text(errors="replace")
                        parts.append(f"=== {attempt.name}, {stream} ===\n{text}" if len(attempts) > 1 else text)
            (self.log_dir / f"rank{s.rank}.log").write_text("".join(parts))

    # -- the verdict -----------------------------------------------------------------------------------------
    def failure(self) -> str | None:
        """None when every process finished; else the paragraph naming the failed rank and its reason."""
        if self.popen.returncode == 0:
            return None
        if self.termed_at is not None:   # the launcher stopped it (a timeout, Ctrl-C)
            why = "the run took longer than the launcher's timeout" if self.timed_out else "the launcher was stopped"
            return f"launch: {why}; every process was stopped (their output: {self.log_dir})"
        summary = "\n".join(self.torchrun_lines)
        # torchrun's summary: the root cause first ("first observed failure"), then the others
        root = summary.split("Root Cause", 1)
        ordered = _FAILURE.findall(root[1]) + _FAILURE.findall(root[0]) if len(root) == 2 else _FAILURE.findall(summary)
        exits, seen = [], set()
        for rank, code in ordered:
            if int(rank) not in seen:
                seen.add(int(rank))
                exits.append((int(rank), int(code), self._lines(int(rank))))
        if not exits:
            return (f"launch: torchrun ended with exit code {self.popen.returncode} (its output: "
                    f"{self.log_dir / 'torchrun.log'}; every rank's: {self.log_dir})")
        rank, reason, told = root_cause(exits)
        here = {s.rank for s in self.plans}
        text = f"rank {rank} failed: {reason}"
        if rank in here:
            code = dict((r, c) for r, c, _ in exits)[rank]
            lines = self._lines(rank)
            said = [i for i, line in enumerate(lines) if line.startswith("error: ")]
            before = [line for line in lines[:said[-1] if said else None] if line.strip()][-TAIL_LINES:]
            shown = "".join(f"\n    {line}" for line in before)   # the lines before its error paragraph
            text += f"\nIts exit code: {code}. Its last lines ({self.log_dir / f'rank{rank}.log'}):{shown}"
        elif told:
            text += f"\n(rank {rank} runs on another node: its own output is there.)"
        return text + f"\nEvery rank's output on this node: {self.log_dir}"

    def _lines(self, rank: int) -> list[str]:
        path = self.log_dir / f"rank{rank}.log"
        return path.read_text(errors="replace").splitlines()[-200:] if path.is_file() else []

    def results(self):
        """Rank 0's results.json (a list of them with seeds); None on a node without rank 0."""
        import json
        if self.plans[0].rank != 0 or not self.run_dirs:
            return None
        found = [json.loads(Path(d, "results.json").read_text()) for d in self.run_dirs
                 if Path(d, "results.json").is_file()]
        return found if len(self.run_dirs) > 1 else (found[0] if found else None)


def _send(pid: int, sig: int, group: bool) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- the entry points ---------------------------------------------------------------------------------------
def launch(settings=None, nproc_per_node: int | None = None, nnodes: int = 1, node_rank: int = 0, **options):
    """Run ``nproc_per_node`` training processes on this node and wait for them; rank 0's results.

    ``settings``: a Settings, or ``train`` flags as a list (``["--dataset", "demo", "--epochs", "2"]``).
    ``nproc_per_node``: default the number of GPUs, 1 without a GPU. ``options``: ``LaunchOptions``' fields, as
    keywords: ``master_addr`` / ``master_port`` replace the settings' (needed with ``nnodes > 1``: node 0's private
    IP, the same on every node). Each line of this node's first rank (rank 0 on node 0) goes to ``on_line`` as it
    comes (``print`` shows it in a notebook cell). Returns rank 0's results.json as a dict (a list with ``seeds``;
    None on the other nodes); raises LaunchError naming the rank that failed and why. ``max_restarts``: torchrun
    restarts every process of the job this many times after a failure (with ``resume="auto"`` the run continues
    from its last checkpoint). ``share_gpu``: several processes on a node's one GPU, over gloo (``plan``).
    ``grid``: ``["bucket_mb=1,25"]``, one run per value (``train --grid``; a list of results).
    """
    opts = LaunchOptions(**options)   # a TypeError names an option launch does not take
    if settings is None or isinstance(settings, (list, tuple)):
        settings, parsed = parse_train_argv(list(settings or []))
        opts = replace(opts, resume=opts.resume or parsed.resume, evaluate=opts.evaluate or parsed.evaluate,
                       seeds=opts.seeds or parsed.seeds, grid=opts.grid or parsed.grid)
    changes = {k: v for k, v in (("master_addr", opts.master_addr), ("master_port", opts.master_port)) if v is not None}
    if changes:
        settings = settings.replace(**changes)
    launcher = Launcher(plan(settings, nproc_per_node, nnodes, node_rank, opts.share_gpu), opts)
    on_line, timeout = opts.on_line, opts.timeout
    for line in launcher.describe():
        on_line(line)
    launcher.start()
    try:
        for line in launcher.lines_until_done(timeout):
            on_line(line)
    except KeyboardInterrupt:
        launcher.stop()   # SIGTERM: each process stops cleanly and says so
        for line in launcher.drain():
            on_line(line)
        on_line(f"launch: interrupted; every process was sent SIGTERM and has stopped (output: {launcher.log_dir})")
        raise
    finally:
        launcher.stop()   # also after an error in on_line: nothing is left running
    failure = launcher.failure()
    if failure:
        raise LaunchError(failure)
    return launcher.results()


def parse_train_argv(argv: list[str]):
    """``train`` flags as a list -> (Settings, the parsed namespace with resume / evaluate / seeds)."""
    parser = argparse.ArgumentParser(prog="launch", add_help=False)
    settings_module.add_arguments(parser)
    parser.add_argument("--resume")
    parser.add_argument("--evaluate", action="store_true")
    parser.add_argument("--seeds", type=lambda text: [int(s) for s in text.split(",") if s.strip()])
    parser.add_argument("--grid", action="append")
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit:   # argparse has printed what is wrong; a notebook should get an exception, not an exit
        raise ValueError(f"cannot read these train flags: {' '.join(argv)} (see the message above)") from None
    if unknown:
        raise ValueError(f"not train flags: {' '.join(unknown)} (python -m ddp_utils train --help lists them)")
    return settings_from_args(args), args


def settings_from_args(args: argparse.Namespace):
    """The shared settings of every process, from the flags only (the launcher's own environment, say
    a SLURM task's, does not decide the ranks: its flags do)."""
    given = [f"--{name.replace('_', '-')}" for name in SET_BY_LAUNCH if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"launch sets {', '.join(given)} of each process itself (rank = node_rank x nproc_per_node "
                         f"+ local_rank, world size = nnodes x nproc_per_node): leave "
                         f"{'them' if len(given) > 1 else 'it'} out and give --nproc-per-node, --nnodes and "
                         f"--node-rank instead")
    return settings_module.from_args(args, environ={})


def main(args: argparse.Namespace) -> int:
    """``python -m ddp_utils launch ...`` (cli.py parses the flags)."""
    try:
        results = launch(settings_from_args(args), args.nproc_per_node, args.nnodes, args.node_rank,
                         resume=args.resume, evaluate=args.evaluate, seeds=args.seeds, log_dir=args.log_dir,
                         grid=args.grid, on_line=lambda line: print(line, flush=True), max_restarts=args.max_restarts)
    except KeyboardInterrupt:   # launch() has said what it did (every process stopped): no rank's paragraph
        return 143 if peers.stop_signal else 130   # the CLI's SIGTERM handler sets it
    done = "" if results is None else " (rank 0's results.json is in the run folder named above)"
    print(f"launch: every process of this node finished{done}", flush=True)
    return 0

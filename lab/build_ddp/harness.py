"""Runs a test's ``check_...`` function on every rank of a fresh process group, with a hard time bound, and
raises the first rank's exception again in pytest's process. You need not read this file to do the lab.

On one machine (the default), every rank is a process of this machine and the ranks meet on 127.0.0.1
with gloo. Across nodes, run the same pytest command on every node, e.g. two nodes, 10.0.0.1 being node 0:

    BUILD_DDP_NODES=2 BUILD_DDP_NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 python -m pytest lab/build_ddp
    BUILD_DDP_NODES=2 BUILD_DDP_NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 python -m pytest lab/build_ddp

A test's ranks are then split over the nodes in blocks (3 ranks on 2 nodes: ranks 0 and 1 on node 0, rank 2
on node 1), and the k-th group of the session meets at MASTER_ADDR:MASTER_PORT+k (a port of its own, so that
a node running ahead never joins the group of the test before). BUILD_DDP_BACKEND=nccl gives every rank the
GPU cuda:<its rank on the node>; a world size needing more GPUs than a node has is skipped.

Each rank's output (prints, warnings, and where it was if it hung) is printed after the test, so pytest
shows it under "Captured stdout call" when the test fails.
"""
from __future__ import annotations

import faulthandler
import importlib.util
import multiprocessing
import os
import pickle
import re
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

TIME_LIMIT_S = 60.0          # a test takes a second or two on a laptop: a rank still running after this hangs
NODES_TIME_LIMIT_S = 300.0   # across nodes a test may also wait for the other node's pytest to get there
GRACE_S = 3.0                # after a rank failed, how long the others get to report their own error

_groups_started = 0          # across nodes: the port offset of the next group


@dataclass(frozen=True)
class Launch:
    """Where the ranks run and meet: this machine only, or this node's share of several nodes."""
    nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0     # across nodes, the first group's port; on one machine a free port per group
    backend: str = "gloo"

    @classmethod
    def from_environment(cls) -> Launch:
        env = os.environ
        backend = env.get("BUILD_DDP_BACKEND") or "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"BUILD_DDP_BACKEND={backend!r}: say gloo (CPU, the default) or nccl (GPUs)")
        nodes = int(env.get("BUILD_DDP_NODES") or 1)
        if nodes == 1:
            return cls(backend=backend)
        missing = [var for var in ("BUILD_DDP_NODE_RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(var)]
        if missing:
            raise ValueError(f"BUILD_DDP_NODES={nodes} needs {', '.join(missing)} too (lab/build_ddp/README.md)")
        node_rank = int(env["BUILD_DDP_NODE_RANK"])
        if not 0 <= node_rank < nodes:
            raise ValueError(f"BUILD_DDP_NODE_RANK={node_rank}: with {nodes} nodes it is 0 to {nodes - 1}")
        return cls(nodes, node_rank, env["MASTER_ADDR"], int(env["MASTER_PORT"]), backend)

    def describe(self) -> str:
        if self.nodes == 1:
            return f"{self.backend}, every rank a process of this machine (127.0.0.1)"
        return (f"{self.backend}, node {self.node_rank} of {self.nodes}, groups meet at "
                f"{self.master_addr}:{self.master_port} and the ports after it")

    def ranks_per_node(self, world_size: int) -> int:
        return -(-world_size // self.nodes)

    def local_ranks(self, world_size: int) -> list[int]:
        per_node = self.ranks_per_node(world_size)
        return [rank for rank in range(world_size) if rank // per_node == self.node_rank]

    @property
    def time_limit(self) -> float:
        return TIME_LIMIT_S if self.nodes == 1 else NODES_TIME_LIMIT_S


@dataclass(frozen=True)
class _Job:
    """What every rank process needs to know (pickled to it)."""
    fn_file: str
    fn_name: str
    world_size: int
    ranks_per_node: int
    backend: str
    init_method: str
    ifname: str | None
    log_dir: str
    time_limit: float
    build_ddp: str | None    # the file under test (adapter.py) as this pytest process chose it: the fork server
                             # keeps the environment it started with, so a later BUILD_DDP must reach the ranks here


class RankTraceback(Exception):
    """The traceback of a rank's exception as that rank saw it: the cause of the exception raised in pytest."""


def run_ranks(fn, world_size: int) -> None:
    """Run ``fn(rank, world_size, device)`` on every rank of a new process group of ``world_size`` ranks.

    Returns when every rank's ``fn`` returned. Otherwise raises the exception of the first rank that failed
    (its traceback as the cause), or TimeoutError when a rank was still running after the time bound; the
    rank processes are killed either way. ``fn`` is a module-level function of a test file.
    """
    __tracebackhide__ = True
    global _groups_started
    launch = Launch.from_environment()
    offset, _groups_started = _groups_started, _groups_started + 1
    per_node = launch.ranks_per_node(world_size)
    if launch.backend == "nccl" and per_node > torch.cuda.device_count():
        pytest.skip(f"{world_size} ranks on {launch.nodes} node(s) need {per_node} GPUs per node; "
                    f"this one has {torch.cuda.device_count()}")
    port = launch.master_port + offset if launch.nodes > 1 else _free_port()
    ranks = launch.local_ranks(world_size)
    if not ranks:
        return   # a world smaller than the number of nodes: nothing runs here

    context = _process_context()
    with tempfile.TemporaryDirectory(prefix="build_ddp-") as log_dir:
        job = _Job(fn_file=str(Path(fn.__code__.co_filename).resolve()), fn_name=fn.__name__,
                   world_size=world_size, ranks_per_node=per_node, backend=launch.backend,
                   init_method=f"tcp://{launch.master_addr}:{port}", ifname=_interface_towards(launch.master_addr),
                   log_dir=log_dir, time_limit=launch.time_limit, build_ddp=os.environ.get("BUILD_DDP"))
        processes, readers, results, seconds = {}, {}, {}, {}
        try:
            for rank in ranks:
                reader, writer = context.Pipe(duplex=False)
                processes[rank] = context.Process(target=_rank_main, args=(job, rank, writer),
                                                  name=f"build_ddp rank {rank}", daemon=True)
                processes[rank].start()
                writer.close()
                readers[rank] = reader
            results = _collect(processes, readers, launch.time_limit, seconds)
        finally:
            for process in processes.values():
                if process.is_alive():
                    process.kill()
            for process in processes.values():
                process.join(timeout=10)
            for reader in readers.values():
                reader.close()
            logs = {rank: _read(Path(log_dir, f"rank{rank}.log")) for rank in ranks}
        for rank in ranks:
            if logs[rank].strip():
                print(f"----- rank {rank} of {world_size}: its output -----\n{logs[rank].rstrip()}")
    _raise_first_failure(results, ranks, world_size, launch.time_limit, logs, seconds)


def _collect(processes: dict, readers: dict, time_limit: float, seconds: dict) -> dict:
    """``{rank: (status, pickled exception, traceback)}`` as the ranks report; ranks still running are absent.
    ``seconds``: filled with ``{rank: seconds from now until its report}``."""
    results: dict[int, tuple] = {}
    started = time.monotonic()
    deadline = started + time_limit
    while len(results) < len(processes):
        now = time.monotonic()
        if now >= deadline:
            break
        waiting = {readers[r]: r for r in processes if r not in results}
        waiting.update({processes[r].sentinel: r for r in processes if r not in results})
        for ready in wait(list(waiting), timeout=deadline - now):
            rank = waiting[ready]
            if rank in results:
                continue
            reader = readers[rank]
            try:   # a rank that ended has either sent its result or nothing at all
                results[rank] = reader.recv() if ready is reader or reader.poll() else _no_result(processes[rank])
            except EOFError:
                processes[rank].join(timeout=1)
                results[rank] = _no_result(processes[rank])
            seconds[rank] = time.monotonic() - started
            if results[rank][0] != "ok":   # one failed: the others get GRACE_S to say why they failed too
                deadline = min(deadline, time.monotonic() + GRACE_S)
    return results


def _no_result(process) -> tuple:
    return ("ended", None, f"the process ended without a result (exit code {process.exitcode})")


def _raise_first_failure(results: dict, ranks: list, world_size: int, time_limit: float, logs: dict,
                         seconds: dict) -> None:
    __tracebackhide__ = True
    failed = [rank for rank in results if results[rank][0] == "error"] or \
             [rank for rank in results if results[rank][0] == "ended"]
    hung = [rank for rank in ranks if rank not in results]
    if failed:
        rank = failed[0]   # the first to report: the others usually failed because of it
        _, payload, text = results[rank]
        error = _unpickled(payload) or RuntimeError(text.strip().splitlines()[-1])
        error.__cause__ = RankTraceback(f"rank {rank} of {world_size}:\n{text}")
        if hasattr(error, "add_note"):   # Python 3.11+
            others = f"; rank(s) {', '.join(map(str, hung))} were still running and were stopped" if hung else ""
            output = "; the ranks' output is printed under 'Captured stdout call'" if any(logs.values()) else ""
            error.add_note(f"(raised on rank {rank} of {world_size}, {seconds[rank]:.1f} s after the ranks started"
                           f"{others}{output})")
        raise error
    if hung:
        where = "".join(f"\n  rank {rank} was waiting at {_where(logs[rank])}" for rank in hung)
        raise TimeoutError(
            f"rank(s) {', '.join(map(str, hung))} of {world_size} still running after {time_limit:.0f} s, the "
            f"time bound of lab/build_ddp/harness.py: a rank that waits for ever is usually waiting in a "
            f"collective that another rank never started (or started in another order), or for an async "
            f"all-reduce that was never waited for.{where}\nEach rank's stack is printed under 'Captured stdout "
            f"call'.")


def _where(log: str) -> str:
    """The innermost line of the file under test (student.py, reference.py) in a rank's hang dump."""
    frames = re.findall(r'File "([^"]*)", line (\d+) in (\S+)', log.split("Timeout (", 1)[-1])
    mine = [f for f in frames if Path(f[0]).name in ("student.py", "reference.py")] or frames[:1]
    return f"{Path(mine[0][0]).name} line {mine[0][1]} ({mine[0][2]})" if mine else "an unknown place"


def _rank_main(job: _Job, rank: int, conn) -> None:
    """One rank: join the group, run the test's function, report ``("ok" | "error", exception, traceback)``."""
    with open(Path(job.log_dir, f"rank{rank}.log"), "w") as log:   # this rank's output, printed by the test
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    faulthandler.dump_traceback_later(max(1.0, job.time_limit - 2), exit=False)   # where it is, if it hangs
    try:
        if job.ifname:   # unless the user chose: the interface that routes to the master
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                os.environ.setdefault(var, job.ifname)
        if job.build_ddp is None:
            os.environ.pop("BUILD_DDP", None)
        else:
            os.environ["BUILD_DDP"] = job.build_ddp
        torch.set_num_threads(1)   # several ranks share the laptop's cores; the test's model is tiny
        device = torch.device("cpu")
        if job.backend == "nccl":
            device = torch.device("cuda", rank % job.ranks_per_node)
            torch.cuda.set_device(device)
        dist.init_process_group(job.backend, init_method=job.init_method, rank=rank, world_size=job.world_size,
                                timeout=timedelta(seconds=job.time_limit + 60))   # the harness's bound comes first
        _load(job.fn_file, job.fn_name)(rank, job.world_size, device)
        dist.barrier()   # nobody leaves while another rank still needs it
        conn.send(("ok", None, ""))
        # No destroy_process_group: the process ends with os._exit (multiprocessing), and before torch 2.8
        # destroying a gloo group right after a collective could deadlock.
    except BaseException as error:   # noqa: B036 (KeyboardInterrupt and SystemExit are reported too)
        conn.send(("error", _pickled(error), traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _load(path: str, name: str):
    """The function ``name`` of the file ``path``, loaded in this process whatever pytest's import mode was."""
    lab = str(Path(__file__).resolve().parents[1])   # the test file imports build_ddp.<module>: lab/ holds the package
    if lab not in sys.path:
        sys.path.insert(0, lab)
    spec = importlib.util.spec_from_file_location(f"build_ddp_{Path(path).stem}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # registered, as an import would
    spec.loader.exec_module(module)
    return getattr(module, name)


def _pickled(error: BaseException) -> bytes | None:
    try:
        payload = pickle.dumps(error)
        pickle.loads(payload)
        return payload
    except Exception:   # an exception that does not survive pickling: the parent shows its traceback's text
        return None


def _unpickled(payload: bytes | None) -> BaseException | None:
    try:
        return pickle.loads(payload) if payload else None
    except Exception:
        return None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _interface_towards(master_addr: str) -> str | None:
    """The network interface that routes to ``master_addr`` (the kit's pre-flight), or None without the kit."""
    try:
        from ddp_utils.robust.preflight import choose_interface
    except ImportError:
        return None
    return choose_interface(master_addr)[0]


def _process_context():
    """Rank processes forked from a server that imported torch once (seconds saved per rank); spawn on Windows."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # torch._dynamo: the optimizer's first step imports it (about 900 modules, a second of CPU per rank)
    context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.testing", "pytest"])
    return context

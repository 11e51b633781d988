"""What this torch offers where its releases differ, and the path the kit takes for each: the one module that knows.

The kit supports torch from FLOOR (2.6, the torch of the NGC 25.01 container that docker/Dockerfile builds on)
to the newest release; CI runs every test on the newest and the version-dependent ones on the floor
(tests/floor.sh). Whatever is newer than the floor is used only after it is found here, with a path that
works on the floor, and no other module branches on torch's version:

- **rank 0's store** listens on master_addr only, on a socket the kit binds and hands over by its file
  descriptor. torch's default (libuv) store takes such a socket from 2.8 on; 2.6 and 2.7 refuse it
  (NotImplementedError), and their legacy store takes it (``master_store``; a build that refuses it
  although its release should not is caught by that error too).
- **a hung collective** is stopped from the watch's thread: ``ProcessGroup.abort()`` (2.7 on), else the
  NCCL backend's own ``abort()`` (2.6), else ``_abort_process_group``. gloo has no call that reaches a
  collective already waiting, so the kit shuts its connections down instead (``peers.abort_group``).
- **destroying a gloo group** right after a collective can deadlock on the GIL before 2.8 (its destructor
  holds the GIL while a worker thread needs it): the kit lets the workers finish first (``destroy_process_group``).
- **the collective timeout**: NCCL takes a new one after init on every supported torch; gloo only from
  2.9 (before, its collectives keep the timeout the group was made with), so there the kit makes the
  group with the collective timeout, or init_timeout where that is smaller (``timeout_at_init``).
- **FSDP2** (``--parallel fsdp``): ``fully_shard`` is ``torch.distributed.fsdp.fully_shard`` in PyPI's 2.6 and later,
  ``torch.distributed._composable.fsdp.fully_shard`` in builds before that move (``fully_shard``). On a CPU it runs
  from 2.7 (pytorch#145935: CPU streams record and wait for events): 2.6's gloo has the collectives it needs
  (``all_gather_into_tensor``, ``reduce_scatter_tensor``), but its first forward fails on a CPU, so the kit refuses
  it there before training, saying what to use (``fsdp_refusal``); on GPUs it runs over nccl.

``paths()`` names what this torch takes: ``check`` prints it, the watch logs its abort path, docs/gpu.md
has the table for the supported releases.
"""
from __future__ import annotations

import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist

FLOOR = (2, 6)             # also in requirements.txt, docker/Dockerfile and the README (tests/test_compat.py)
GLOO_NEW_TIMEOUT = (2, 9)    # gloo collectives honour a timeout changed after init (pytorch#158128)


def release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.6.0', NGC's '2.6.0a0+ecf3bae40a.nv25.01', '2.14.1+cu130'."""
    found = re.match(r"(\d+)\.(\d+)", str(version or torch.__version__))
    if not found:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found[1]), int(found[2])


def has(since: tuple[int, int], version: str | None = None) -> bool:
    """Whether this torch has a change that came in release ``since``. NGC builds of that release are pre-release
    snapshots (``2.8.0a0+...``) that may predate the change: they count as the release before, the safe side of
    every check that asks (a moment's wait, a timeout not trusted to change, a mode refused)."""
    version = str(version or torch.__version__)
    now = release(version)
    if now != since:
        return now > since
    return not re.match(r"\d+\.\d+\.\d+(a|b|rc|\.dev)", version)


def below_floor(version: str | None = None) -> str | None:
    """A paragraph when this torch is older than the kit's floor, else None."""
    version = str(version or torch.__version__)
    if release(version) >= FLOOR:
        return None
    floor = ".".join(map(str, FLOOR))
    return (f"torch {version} is older than {floor}, the oldest release this kit supports and tests (the NGC "
            f"25.01 container's). Use the NGC PyTorch container 25.01 or later (docker/Dockerfile's default), "
            f"or `pip install 'torch>={floor}.0a0'` outside a container.")


# -- rank 0's store ---------------------------------------------------------------------------------
LIBUV_TAKES_A_SOCKET = (2, 8)   # the libuv store's master_listen_fd (pytorch#150215)
# Whether the libuv store takes the kit's socket: known from the release, and corrected by the first store
# made in this process if a build says otherwise (an NGC pre-release snapshot taken before that change).
_libuv_takes_a_socket: bool | None = None


def master_store(host: str, port: int, world_size: int, timeout: timedelta, listen_fd: int | None,
                 log=print) -> dist.TCPStore:
    """Rank 0's TCPStore (multi-tenant, not waiting for workers) on ``listen_fd``, a socket the caller bound
    and listens on (None: this process's store already holds the port, and is reused). Where the default
    (libuv) store refuses such a socket (torch 2.6, 2.7), the legacy store takes it."""
    global _libuv_takes_a_socket
    common = dict(world_size=world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                  multi_tenant=True)
    if listen_fd is None:
        return dist.TCPStore(host, port, **common)
    if _libuv_takes_a_socket is None:   # not asking a release known to refuse: it would print a C++ error line
        _libuv_takes_a_socket = release() >= LIBUV_TAKES_A_SOCKET
    if _libuv_takes_a_socket:
        try:
            return dist.TCPStore(host, port, master_listen_fd=listen_fd, **common)
        except NotImplementedError:   # "The libuv TCPStore backend does not support initialization with an listen fd"
            _libuv_takes_a_socket = False
            log(f"torch {torch.__version__}: this build's libuv store cannot take the socket the kit listens on; "
                f"rank 0's store is the legacy TCPStore, on the same socket (the error line above is handled)")
    return dist.TCPStore(host, port, master_listen_fd=listen_fd, use_libuv=False, **common)


def store_path() -> str:
    """Which store rank 0 makes on this torch."""
    if _libuv_takes_a_socket is None:
        takes = release() >= LIBUV_TAKES_A_SOCKET
    else:
        takes = _libuv_takes_a_socket
    if takes:
        return "libuv TCPStore on a socket bound to master_addr only"
    return "legacy TCPStore on a socket bound to master_addr only (the libuv one takes no such socket before torch 2.8)"


# -- stopping a hung collective ---------------------------------------------------------------------
def abort_path(backend: str, group=None):
    """``(how, call)``: how this torch stops a collective that waits for a lost rank, from another thread, and
    the call that does it for ``group`` (None without a group; None for gloo, whose connections
    ``peers.abort_group`` shuts down itself)."""
    if backend != "nccl":
        return "shutting down gloo's connections (gloo has no abort that reaches a waiting collective)", None
    if hasattr(dist.ProcessGroup, "abort"):   # torch 2.7 on
        return "ProcessGroup.abort()", None if group is None else group.abort
    if hasattr(getattr(dist, "ProcessGroupNCCL", None), "abort"):   # torch 2.6
        return ("the NCCL backend's abort() (torch 2.6 has no ProcessGroup.abort)",
                None if group is None else group._get_backend(torch.device("cuda")).abort)
    return ("_abort_process_group()",
            None if group is None else lambda: dist.distributed_c10d._abort_process_group(group))


# -- destroying a group ----------------------------------------------------------------------------
SETTLE_S = 0.2   # seconds with the GIL free before a gloo group is destroyed


def destroy_process_group(backend: str) -> None:
    """``dist.destroy_process_group()`` after a moment with the GIL free for gloo's worker threads. Each frees a
    finished collective's tensors just after the collective returned, and that needs the GIL: (1) before torch
    2.8 a gloo group's destructor holds the GIL while it waits for its workers, and both then wait forever (seen
    on torch 2.6 in about 1 of 25 two-rank setups that stopped right after a collective, on a loaded machine);
    (2) on every release, where the group lives on after this call (a DDP model or a comm hook still holds it), a
    worker that has not yet freed its last collective's tensors when the interpreter exits is ended inside a C++
    destructor, and the process aborts with "terminate called without an active exception" (pytorch#190489; seen
    in 3 of 20 three-rank runs on torch 2.14 that ended right after a broadcast, as fresh interpreters)."""
    if backend == "gloo":
        time.sleep(SETTLE_S)
    dist.destroy_process_group()


def destroy_path(backend: str) -> str:
    if backend == "gloo":
        return f"after {SETTLE_S:g} s for gloo's workers to let go of their last tensors"
    return "at once"


# -- the collective timeout -------------------------------------------------------------------------
def timeout_changes_after_init(backend: str, version: str | None = None) -> bool:
    """Whether collectives of ``backend`` honour a timeout set after the group was made."""
    return backend == "nccl" or has(GLOO_NEW_TIMEOUT, version)


def timeout_at_init(settings, backend: str) -> float:
    """The timeout to make the process group with. Where it can be changed later: init_timeout (joining may
    take long), lowered to collective_timeout once joined. Where it cannot (gloo before torch 2.9) it bounds
    both the joining and every later collective, so: the smaller of the two (the ranks already met in the
    kit's store, so joining is quick, and neither wait exceeds what was asked); with --compile, init_timeout
    for the whole run (its first step may compile for minutes). The watch still names a silent rank within
    seconds either way."""
    if timeout_changes_after_init(backend) or settings.compile:
        return settings.init_timeout
    return min(settings.init_timeout, settings.collective_timeout)


def set_collective_timeout(seconds: float, backend: str) -> bool:
    """Set how long the group's collectives may wait from now on; False where this torch's backend keeps the
    timeout it was made with (nothing is changed then)."""
    if not timeout_changes_after_init(backend):
        return False
    c10d = dist.distributed_c10d
    set_timeout = c10d.set_timeout if hasattr(c10d, "set_timeout") else c10d._set_pg_timeout   # public in newer releases
    set_timeout(timedelta(seconds=seconds))
    return True


def timeout_path(backend: str) -> str:
    if timeout_changes_after_init(backend):
        return "init_timeout while the ranks join, then collective_timeout"
    return "collective_timeout from the start (gloo keeps its first timeout before torch 2.9)"


# -- FSDP2 ------------------------------------------------------------------------------------------
FSDP_ON_CPU = (2, 7)   # FSDP2 trains on a CPU (gloo): the CPU stream's record_event / wait_event (pytorch#145935)


def fully_shard():
    """FSDP2's ``fully_shard``, where this build keeps it."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:   # a build from before 2.6 made it public (NGC's 2.6.0a0 snapshot may be one)
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def fsdp_refusal(device_type: str, backend: str | None, version: str | None = None) -> str | None:
    """One sentence when this torch cannot train ``--parallel fsdp`` on ``device_type`` over ``backend``, naming the
    version and what to do; None where it can."""
    version = str(version or torch.__version__)
    if device_type != "cuda" and not has(FSDP_ON_CPU, version):
        floor = ".".join(map(str, FSDP_ON_CPU))
        return (f"parallel=fsdp cannot train on a CPU with torch {version}: its FSDP2 (fully_shard) fails in the first "
                f"forward there (gloo has the all-gather and reduce-scatter it needs; the CPU stream events came in "
                f"torch {floor}), so use torch {floor} or newer for a CPU run, or GPUs with nccl, or parallel=zero1 "
                f"(which shards the optimizer state on any torch)")
    if device_type == "cuda" and backend != "nccl":
        return (f"parallel=fsdp on GPUs runs over nccl only, not {backend} (torch {version}; FSDP2's all-gathers of "
                f"CUDA tensors over gloo are untried by the kit): use --backend nccl (auto picks it where each rank has "
                f"a GPU), or parallel=zero1 or ddp for ranks that share one GPU over gloo")
    return None


def paths(backend: str = "gloo") -> dict[str, str]:
    """What this torch takes, in words: for ``check`` and the docs' table."""
    return {"torch": str(torch.__version__), "store": store_path(), "hung collective": abort_path(backend)[0],
            "collective timeout": timeout_path(backend), "gloo group destroyed": destroy_path("gloo")}

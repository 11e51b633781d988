"""The process group: set it up, check that every rank agrees, tear it down; and the collectives the kit uses.

In a notebook or script::

    ctx = distributed.setup(settings)        # DDP: pre-flight checks, init, settings agreement
    ...                                      # train; ctx.rank, ctx.device, ctx.is_main
    distributed.teardown()                   # DDP: always, also after an error

or ``with distributed.session(settings) as ctx: ...``, which tears down on errors and interrupts.
Re-running the setup cell is safe: the same settings return the same context, changed settings
tear the old group down and build a new one. With ``world_size == 1`` no process group is created
and the collectives below do nothing, so the same training code runs on one process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .robust import compat, failures, mesh, rendezvous, setup_watch, sockets
from . import settings as settings_module
from .robust.devices import agree_on_backend, agree_on_precision, device_facts, ended_beside, torch_releases_differ
from .robust.preflight import DistSetupError, choose_interface, port_holder, preflight, resolve_backend

__all__ = ["DistContext", "DistSetupError", "PeerLost", "SettingsMismatch", "agree", "all_reduce_sum", "barrier",
           "broadcast_object", "sync_buffers", "choose_interface", "port_holder", "preflight", "resolve_backend",
           "session", "setup", "teardown"]


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job. Pass it to helpers instead of reading the environment."""
    rank: int                  # 0 .. world_size-1; 0 is the master, which prints and writes
    world_size: int            # number of processes in the job
    local_rank: int            # GPU index on this node
    device: torch.device       # cuda:local_rank when CUDA is available, else cpu
    backend: str | None        # "nccl" or "gloo"; None when world_size == 1 (no process group)
    join_s: float = 0.0        # seconds setup took: pre-flight, waiting for the other ranks, init_process_group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


class SettingsMismatch(DistSetupError):
    """The ranks were started with different settings (say, one notebook edited and not the other)."""


class PeerLost(RuntimeError):
    """Another rank stopped answering in the middle of training."""


_PEER_SIGNS = ("connection", "closed", "reset", "peer", "timed out", "timeout", "broken pipe", "nccl")


def lost_a_peer(exc: BaseException) -> bool:
    """Whether a collective's error means another rank went away (its text is all PyTorch gives)."""
    text = str(exc).lower()
    return any(sign in text for sign in _PEER_SIGNS)


def peer_lost_text(ctx, kept: str, exc: BaseException | None = None, what: str | None = None) -> str:
    """The paragraph a surviving rank prints: what happened (``what``, the watch's verdict; else the other
    rank's own reason when it left one in the store; else the collective's error), what is saved (``kept``,
    only what exists), how to continue."""
    if what is None:
        what = peer_failure(ctx)
    if what is None:
        first_line = re.sub(r"^\[[^\]]*\.(cc|cpp|hpp):\d+\]\s*", "", (str(exc).strip().splitlines() or ["?"])[0])[:200]
        what = f"another rank stopped answering ({first_line})"
    if what.startswith("another rank stopped answering"):
        what += ". Its node may have crashed, been stopped or lost the network"
    kept = f" {kept[0].upper()}{kept[1:]}." if kept else ""
    return (f"rank {ctx.rank}: training stopped because {what}.{kept} Restart every rank with --resume pointing at "
            f"rank 0's last.pt, if there is one (in the notebooks: RESUME); rank 0 sends it to the others, so the "
            f"nodes need no shared folder.")


# Settings whose change needs a new process group: where the ranks meet, who they are, and what
# they agreed on. Others (run_dir, wandb, workers, ...) can change without rebuilding the group.
GROUP_FIELDS = tuple(dict.fromkeys(("master_addr", "master_port", "rank", "world_size", "local_rank", "backend",
                                    "init_timeout", "collective_timeout", "socket_ifname", "init_method",
                                    *settings_module.MUST_AGREE)))

# The settings the current context was built from: setup() compares against them (idempotency).
_active: tuple | None = None  # (settings, DistContext)
_store = None   # the kit's own client of the rendezvous store (failures, explicit waits), kept after teardown
_group_store = None   # torch's group's keys; on rank 0 the store's server, kept so the others can read its failure
_waits = 0   # explicit waits made in this process group (their keys in the store)
_watches = 0  # training runs watched in this process group (heartbeat.py; their keys in the store)
# What the watch may cut to end a collective from another thread (abort_group): gloo's connections to
# the other ranks, as (fd, local address, remote address); and why it did, once it has.
_group_sockets: set = set()
_aborted: str | None = None
stop_signal: str | None = None   # set by the CLI's signal handling: what stopped this process, whatever broke next
INTERRUPTED = "KeyboardInterrupt (Stop pressed in the notebook, or Ctrl-C)"   # what the others are told of one
_collective_s = 60.0   # how long a collective may wait now (the group's timeout, or set_collective_timeout's)
_peers: dict[int, dict] = {}   # rank -> its facts from the rendezvous: host, address, machine, pid


def where(rank: int) -> str:
    """``" (on node-b, 10.0.0.2)"``: where a rank runs, as it said when it joined ("" if unknown)."""
    return f" (on {_peers[rank].get('host')}, {_peers[rank].get('addr')})" if rank in _peers else ""


# -- setup and teardown -----------------------------------------------------------------------
def setup(settings, log=print) -> DistContext:
    """Join the process group: this rank's device, then ``init_process_group``, then a settings agreement.

    A plain script (pytorch/examples ``imagenet/main.py``) joins with::

        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size)

    ``init_method="tcp://..."`` makes a ``TCPStore`` on master_addr:master_port (rank 0 listens, the
    others connect) and builds the group on it. The kit does exactly that, in two visible steps: it
    opens the store itself (``robust/rendezvous.py``), then calls ``init_process_group(backend,
    store=store, rank=rank, world_size=world_size)`` (``_init_process_group`` below). Its own store
    listens on master_addr only, can be opened again when a notebook cell is re-run, and carries the
    ranks' failure messages and explicit waits. Around it: pre-flight network checks
    (``robust/preflight.py``), one backend agreed by every rank (``robust/devices.py``), and after it
    ``agree`` on the settings that must match.

    Safe to call again: the same settings return the existing context without re-initialising;
    changed settings tear the old process group down first. Raises DistSetupError (or
    SettingsMismatch) with a readable paragraph; nothing is left half set up after an error.
    """
    global _active
    if _active is not None:
        old, ctx = _active
        changed = ", ".join(f"{name} {getattr(old, name)!r} -> {getattr(settings, name)!r}"
                            for name in GROUP_FIELDS if getattr(old, name) != getattr(settings, name))
        if not changed and (not ctx.distributed or dist.is_initialized()):
            _active = (settings, ctx)   # e.g. only run_dir or wandb changed: the group stays
            return ctx
        log(f"rank {settings.rank}: settings changed ({changed or 'process group gone'}); "
            f"tearing down the old process group and initialising again")
        teardown()
    elif dist.is_initialized():  # e.g. a notebook cell called init_process_group by hand
        log(f"rank {settings.rank}: a process group not made by ddp_utils exists; destroying it first")
        teardown()

    started = time.monotonic()
    report = preflight(settings, log)
    ctx = DistContext(settings.rank, settings.world_size, settings.local_rank, _device(settings), None)
    if ctx.distributed:
        must_agree = settings.agreed()
        try:
            backend = _join_process_group(settings, ctx, report, device_facts(settings, ctx.device), must_agree, log)
            ctx = dataclasses.replace(ctx, backend=backend)   # the backend every rank agreed on
            ctx = dataclasses.replace(ctx, join_s=round(time.monotonic() - started, 2))
        except BaseException as e:  # also KeyboardInterrupt: never leave a half-made process group
            teardown()
            if isinstance(e, KeyboardInterrupt):
                log(f"rank {settings.rank}: interrupted during setup; process group torn down")
            raise
        # the address joined, also under torchrun (whose env:// names none): the store on master_addr:master_port
        log(f"rank {ctx.rank}: joined tcp://{settings.master_addr}:{settings.master_port} as rank {ctx.rank} of "
            f"{ctx.world_size} "
            f"({backend}, {ctx.device}) in {ctx.join_s:.1f} s")
    _active = (settings, ctx)
    return ctx


def _device(settings) -> torch.device:
    """This rank's GPU (made the current one, as NCCL needs) or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if settings.local_rank >= torch.cuda.device_count():
        raise DistSetupError(f"rank {settings.rank}: local_rank={settings.local_rank} but this node "
                             f"has only {torch.cuda.device_count()} GPU(s); local_rank counts the GPUs "
                             f"of one node from 0.")
    torch.cuda.set_device(settings.local_rank)
    return torch.device("cuda", settings.local_rank)


def _join_process_group(settings, ctx: DistContext, report: dict, facts: dict, must_agree: dict, log) -> str:
    """``init_process_group`` with a bounded wait, on the backend every rank agreed on (returned), then
    ``agree`` on ``must_agree``. A failure becomes one readable DistSetupError here, and the other ranks
    hear of it: they stop within a second, every rank naming the first rank that failed and why
    (robust/setup_watch.py)."""
    global _peers
    # Keys of this setup's own on the store on master_port (rank 0's, or torchrun's agent's), so that re-running a
    # notebook cell, or torchrun restarting the training processes, never reads an earlier attempt's (rendezvous.py)
    keys, everyone = rendezvous.join(settings, log, {**facts, "addr": report.get("local_ip")})
    # where each rank runs, for the paragraphs that name a lost rank (hosts in namespaces share one name)
    _peers = {f["rank"]: f for f in everyone or []}
    watch = setup_watch.SetupWatch(settings, keys)
    try:
        backend = _agree_on_backend(settings, everyone, report, log)   # the same answer (or error) on every rank
        with watch:
            try:
                # every rank can reach every other on a random port, as gloo and NCCL will (seconds, not their retries)
                mesh.probe(keys, settings.rank, settings.world_size, report.get("local_ip"), settings.master_port,
                           settings.init_timeout)
                _init_process_group(settings, keys, backend, report, log)
                agree({**must_agree, "backend": backend}, dataclasses.replace(ctx, backend=backend))
            except SettingsMismatch:   # every rank found the same difference
                raise
            except mesh.Blocked as e:   # every rank read the same results; tell one whose results came late
                setup_watch.report(watch.keys, settings.rank, str(e))
                raise
            except BaseException as e:
                first = setup_watch.report(watch.keys, settings.rank, f"rank {settings.rank}{where(settings.rank)} "
                                                                      f"failed during setup: {describe_failure(e)}")
                if isinstance(e, KeyboardInterrupt):
                    raise
                if first:   # another rank failed before this one: this rank's error is its consequence
                    raise DistSetupError(f"rank {settings.rank}: setup stopped because {first}. Deal with that "
                                         f"rank's problem, then run setup again on every rank.") from None
                if not isinstance(e, DistSetupError):
                    raise DistSetupError(f"rank {settings.rank}: setup failed: {describe_failure(e)}") from e
                raise
        return backend
    finally:
        if settings.rank == 0:  # joined or failed: no more ranks may join it
            rendezvous.close_generation(watch.keys)   # (the watch's connection, if it cut this one's)


def _agree_on_backend(settings, everyone: list, report: dict, log) -> str:
    """The backend every rank can run, from every rank's devices: the same backend, or the same error, everywhere."""
    backend, note = report["backend"], ""
    try:
        if everyone:
            backend, note = agree_on_backend(everyone, settings.backend)
            agree_on_precision(everyone, settings.amp)
            if torch_releases_differ(everyone):
                log(f"rank {settings.rank}: {torch_releases_differ(everyone)}")
    except DistSetupError as e:
        raise DistSetupError(f"rank {settings.rank}: {e}") from None
    report["backend"] = backend
    if note:
        log(f"rank {settings.rank}: {note}")
    return backend


def _init_process_group(settings, keys, backend: str, report: dict, log) -> None:
    """``init_process_group`` on the generation's ``keys`` and a first barrier; raises DistSetupError with a
    readable paragraph."""
    global _store, _group_store, _waits, _watches, _group_sockets, _aborted, _collective_s
    if backend == "nccl":
        _set_nccl_env(log)
    # Joining may take long (the other ranks start late): made with init_timeout, lowered below -- except
    # where this torch's backend keeps the timeout it is made with (gloo before 2.9: robust/compat.py)
    timeout = timedelta(seconds=compat.timeout_at_init(settings, backend))
    try:
        before = sockets.tcp_connections()
        # DDP: the process group. With the kit's store this is what init_method="tcp://ADDR:PORT" does.
        dist.init_process_group(backend, rank=settings.rank, world_size=settings.world_size,
                                timeout=timeout, store=keys)
        # NCCL connects lazily: a first collective makes its network problems show up here.
        dist.barrier(device_ids=[settings.local_rank] if backend == "nccl" else None)
        # The kit's own messages (failures, explicit waits, the watch's beats) go through a connection of their
        # own with a short timeout: a lost link must not block a rank's look at the store for minutes. torch's
        # group keeps its connection and init_timeout (NCCL makes later communicators through it).
        _store = rendezvous.second_client(settings, keys, timeout=STORE_TIMEOUT_S)
        _group_store = keys
        _waits = _watches = 0
        _aborted = None
        # gloo's connections to the other ranks are the ones init made (the store's use master_port)
        _group_sockets = {c for c in sockets.tcp_connections() - before
                          if settings.master_port not in (c[1][1], c[2][1])}
        # From now on a collective waits at most collective_timeout: a silent rank is named within a
        # minute. Longer waits (the others reading their data, rank 0 starting W&B or writing a
        # checkpoint) are explicit store waits (wait_for_all), bounded by init_timeout. With --compile
        # the first step compiles for minutes on a cold cache: the short timeout starts after it (train.py).
        _collective_s = timeout.total_seconds()
        if not set_collective_timeout(settings.init_timeout if settings.compile else settings.collective_timeout) \
                and timeout.total_seconds() != settings.collective_timeout:   # gloo before torch 2.9 (compat.py)
            why = ("its first step may compile for minutes" if settings.compile else
                   "and joining may not wait longer than init_timeout")
            log(f"rank {settings.rank}: collectives may wait up to {timeout.total_seconds():g} s, not collective_timeout "
                f"({settings.collective_timeout:g} s): {backend} on torch {torch.__version__} keeps the timeout its "
                f"group was made with, {why}; the kit's watch still names a silent rank within seconds")
    except Exception as e:
        raise DistSetupError(_init_failure(settings, backend, report, e)) from e


# NCCL's own error handling, set before the group exists unless the user chose: 2 = on a failure NCCL aborts
# its communicators and the waiting call raises, but the process lives (the default, 3, ends it with
# SIGABRT: a notebook kernel dies without a word). The kit's watch (heartbeat.py) acts well before then.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def _set_nccl_env(log) -> None:
    for var, value in NCCL_ENV.items():
        if os.environ.setdefault(var, value) != value:
            log(f"keeping {var}={os.environ[var]} from the environment (the kit would set {value})")


def set_collective_timeout(seconds: float) -> bool:
    """How long a collective of the process group may wait from now on; False where this torch's backend
    keeps the timeout the group was made with (gloo before torch 2.9)."""
    global _collective_s
    done = compat.set_collective_timeout(seconds, dist.get_backend())
    if done:
        _collective_s = seconds
    return done


def stall_limit() -> float:
    """Seconds a rank may wait for its next batch while the others wait for it in a collective, before the watch
    names it (heartbeat.py): well inside the collective timeout in force, so that the kit's paragraph comes first."""
    return max(_collective_s / 2, _collective_s - 20, 10.0)   # 10: a loader's slow moment is no stall


def _init_failure(settings, backend, report: dict, error: BaseException) -> str:
    """The paragraph explaining a failed init_process_group on this rank."""
    said = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    if settings.rank == 0:
        causes = ("the other ranks did not all join: are they started, with the same master_addr, "
                  "master_port and world_size, and can they reach this node (firewall / security "
                  "group, a container without --net=host)?")
    else:
        causes = ("the master answered on its port, so the address is right, but the ranks could not "
                  "connect to each other: NCCL and Gloo open further random ports between the nodes, "
                  "so allow all TCP between them; and check that the chosen interface reaches the "
                  "other nodes (set socket_ifname or GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME if not).")
    return (f"rank {settings.rank} could not join the process group at {settings.url} (world_size "
            f"{settings.world_size}, backend {backend}, interface {report.get('interface')}) within "
            f"init_timeout={settings.init_timeout:g} s. Most likely {causes} Start every rank within "
            f"init_timeout of each other and run setup again. (PyTorch said: {said})")


def teardown(abort: bool = False) -> None:
    """Destroy the process group if there is one. Safe to call any time, any number of times.

    ``abort`` (after an error or an interrupt): the others' next collective fails now. NCCL: aborted; gloo: its
    connections shut down (ZeRO's and FSDP's C++ objects keep a freed group alive while the process holds them).
    """
    global _active
    _active = None
    if dist.is_available() and dist.is_initialized():
        if abort:
            _, call = compat.abort_path(dist.get_backend(), dist.distributed_c10d._get_default_group())
            with contextlib.suppress(RuntimeError):   # an NCCL communicator already broken by the failure
                call() if call is not None else sockets.shut_down(_group_sockets)
        with contextlib.suppress(Exception):  # a broken group (a peer died) must not stop the cleanup
            compat.destroy_process_group(dist.get_backend())   # torch 2.6 and 2.7's gloo need a moment first


@contextlib.contextmanager
def session(settings, log=print):
    """``with session(settings) as ctx:`` -- set up, and always tear down (errors, interrupts)."""
    ctx = setup(settings, log)
    try:
        yield ctx
    finally:
        teardown()


# -- the watch's tools (heartbeat.py) -------------------------------------------------------------
def watch_store():
    """Keys of their own for each watched training run in this process group (every rank counts alike)."""
    global _watches
    _watches += 1
    return dist.PrefixStore(f"watch/{_watches}", _store)


def abort_path() -> str:
    """How ``abort_group`` will stop a hung collective of this process group, on this torch (the watch says it)."""
    return compat.abort_path(dist.get_backend())[0] if dist.is_initialized() else "no process group"


def abort_group(reason: str) -> str:
    """End the process group's pending collectives from another thread (the watch's), so that a main
    thread blocked in one, waiting for a rank that is gone, raises now instead of at the collective
    timeout. NCCL: abort its communicators (``compat.abort_path``: the call this torch has). gloo has no
    such call that reaches a pending collective, so its connections to the other ranks are shut down: the
    waiting read fails at once ("Connection closed"). ``reason`` is kept: the explicit waits stop with it
    too. Returns what was done, for the log."""
    global _aborted
    _aborted = reason
    if not dist.is_initialized():
        return "no process group to stop"
    how, call = compat.abort_path(dist.get_backend(), dist.distributed_c10d._get_default_group())
    if call is not None:
        try:
            call()
        except RuntimeError as e:   # said, not swallowed: the collective then ends at its timeout
            return f"{how} failed ({(str(e).splitlines() or [type(e).__name__])[0][:120]})"
        return how
    return f"shut down {sockets.shut_down(_group_sockets)} gloo connection(s) to the other ranks"


# -- collectives (no-ops with one process) ----------------------------------------------------
def agree(values: dict, ctx: DistContext, what: str = "settings") -> None:
    """Check that every rank passed equal ``values``; raise SettingsMismatch on every rank if not.

    The message names each differing key and every rank's value for it.
    """
    if not ctx.distributed:
        return
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, values)
    keys = dict.fromkeys(k for g in gathered for k in g)  # union, in order of appearance
    differences = []
    for key in keys:
        per_rank = [g.get(key, "<missing>") for g in gathered]
        if any(v != per_rank[0] for v in per_rank):
            values_ = ", ".join(f"rank {r} has {v!r}" for r, v in enumerate(per_rank))
            differences.append(f"{key}: {values_}")
    if differences:
        raise SettingsMismatch(
            f"rank {ctx.rank}: the ranks disagree on {what} -- {'; '.join(differences)}. Every rank "
            f"must use the same {what}, or they would silently train different things; edit the "
            f"notebooks/flags so they match (main.ipynb and worker.ipynb should differ only in the "
            f"rank) and run setup again on every node.")


def all_reduce_sum(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum ``t`` over all ranks, in place (any shape); returns ``t``. NCCL needs a CUDA copy."""
    if not ctx.distributed:
        return t
    if ctx.backend == "nccl" and t.device.type != "cuda":
        on_gpu = t.to(ctx.device)
        dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM)
        return t.copy_(on_gpu)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def sync_buffers(module: torch.nn.Module, ctx: DistContext, src: int = 0) -> None:
    """Copy rank ``src``'s buffers (BatchNorm running statistics) to every rank, in place.

    During training each rank updates its BatchNorm statistics from its own batches, so after the
    last step they differ slightly; evaluation then uses rank 0's, the ones the checkpoint holds.
    """
    if ctx.distributed:
        for buffer in module.buffers():
            dist.broadcast(buffer, src)


def barrier(ctx: DistContext) -> None:
    """Wait until every rank gets here."""
    if ctx.distributed:
        dist.barrier(device_ids=[ctx.local_rank] if ctx.backend == "nccl" else None)


def wait_for_all(what: str, ctx: DistContext, timeout: float, log=print) -> None:
    """An explicit barrier through the store, for waits longer than a collective may take (a rank still
    reading its data, rank 0 starting W&B or writing a checkpoint, a notebook whose student still reads
    the cell before). ``what`` completes "waiting for 1 other rank(s) to ...": "finish reading the data".
    Says every ~30 s whom it waits for, and stops at once with the other rank's reason if that rank
    failed meanwhile."""
    if not ctx.distributed or _store is None:
        return
    global _waits
    _waits += 1   # every rank makes the same waits in the same order: the n-th wait has one key
    key = f"wait/{_waits}"
    count = _ask_store(ctx, what, _store.add, key, 1)   # arrivals, counted by the store itself
    start = time.monotonic()
    next_note, pause = start + 30.0, 0.005
    while count < ctx.world_size:
        time.sleep(pause)
        pause = min(0.2, pause * 2)   # quick when the others are already there, 5 polls a second after that
        if _aborted:   # the watch found a rank gone (the store may be out of reach too)
            raise PeerLost(f"rank {ctx.rank}: training stopped because {_aborted}")
        count, failure = _ask_store(ctx, what, lambda: (int(_store.add(key, 0)), _failure_in_store(ctx)))
        if failure:   # a stop during the epoch's save or evaluation is a stop in training: say how to go on
            raise PeerLost(f"rank {ctx.rank}: stopped because {failure.rstrip().rstrip('.')}. Restart every rank "
                           f"(with --resume pointing at rank 0's last.pt, if there is one; in the notebooks: RESUME).")
        now = time.monotonic()
        if count < ctx.world_size and now - start > timeout:
            raise PeerLost(f"rank {ctx.rank}: waited {timeout:g} s for the other ranks to {what} and "
                           f"{ctx.world_size - count} did not. Look at the other nodes' output; restart every "
                           f"rank (with --resume RUN/last.pt if a checkpoint exists).")
        if now >= next_note and count < ctx.world_size:
            log(f"rank {ctx.rank}: waiting for {ctx.world_size - count} other rank(s) to {what} "
                f"({now - start:.0f} s)")
            next_note += 30.0


STORE_TIMEOUT_S = 10.0   # the kit's own store connection: a request waits this long at most
STORE_PATIENCE = 15.0   # seconds a store call may take before rank 0's node counts as unreachable


def _ask_store(ctx: DistContext, what: str, call, *args):
    """``call(*args)`` on the store, given up after STORE_PATIENCE s: a store call over a link that went
    down blocks far longer than any timeout set on the store, so it runs in a thread of its own."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(_try(call, *args)), daemon=True)
    thread.start()
    thread.join(STORE_PATIENCE)
    if not box:
        raise PeerLost(f"rank {ctx.rank}: training stopped because another rank stopped answering (rank 0's "
                       f"store{where(0)} gave no answer for {STORE_PATIENCE:g} s while this rank waited for "
                       f"{what}). Its node may have crashed, been stopped or lost the network. Restart every rank with "
                       f"--resume pointing at rank 0's last.pt, if there is one.")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _try(call, *args):
    try:
        return True, call(*args)
    except Exception as e:   # noqa: BLE001 - handed to the caller's thread
        return False, e


REPORT_S = 5.0   # seconds the main thread gives its failure report before it goes on without it


def report_failure(ctx: DistContext, text: str) -> None:
    """Leave this rank's reason for stopping in the store, where the others read it (best effort, bounded: over a
    link that just went down a store call blocks far longer than any timeout set on the store, and the client is
    shared with the watch's beat thread, so the writes run on a thread the caller waits for REPORT_S at most;
    Stop pressed then must not hang the cell for minutes)."""
    if not (ctx.distributed and _store is not None):
        return
    store = _store

    def write():
        with contextlib.suppress(Exception):
            failures.report(store, ctx.rank, text)
    thread = threading.Thread(target=write, daemon=True, name="report-failure")
    thread.start()
    thread.join(REPORT_S)


def describe_failure(exc: BaseException) -> str:
    """``KeyboardInterrupt (Stop pressed, or Ctrl-C)`` or ``DataError: /data/...`` (first line only)."""
    if stop_signal or getattr(exc, "description", None):   # cli.Terminated says what it is; and who ended before
        return (stop_signal or exc.description) + ended_beside(_peers)
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@contextlib.contextmanager
def leaving_on_error(ctx: DistContext):
    """Run one step of preparing a run (a notebook cell); on any error, also an interrupt, tell the
    other ranks why and leave the process group, so that they stop now instead of waiting in their
    next collective, and running the cells again starts cleanly."""
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, PeerLost):   # this rank's own failure: tell the others
            report_failure(ctx, f"rank {ctx.rank} stopped while preparing the run: {describe_failure(exc)}")
        teardown(abort=True)
        raise


def peer_failure(ctx: DistContext) -> str | None:
    """The first reason another rank left in the store, or None (also when the store is gone)."""
    if not ctx.distributed or _store is None:
        return None
    try:
        return _ask_store(ctx, "the other ranks' news", _failure_in_store, ctx)
    except Exception:   # noqa: BLE001 - rank 0's store went away with rank 0, or the link is down
        return None


def _failure_in_store(ctx: DistContext) -> str | None:
    """The first failure another rank reported, or None (robust/failures.py: one store request while none did)."""
    found = failures.first(_store, skip=ctx.rank, world_size=ctx.world_size)
    return found[1] if found else None


def gather_objects(obj, ctx: DistContext) -> list:
    """Every rank's ``obj`` (any picklable object), as a list by rank, on every rank."""
    if not ctx.distributed:
        return [obj]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def gather_to_main(obj, ctx: DistContext) -> list | None:
    """Every rank's ``obj`` as a list by rank on rank 0 (what it alone writes), None on the others."""
    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj, ctx: DistContext, src: int = 0):
    """Rank ``src``'s ``obj`` (any picklable object), returned on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=ctx.device if ctx.backend == "nccl" else None)
    return box[0]

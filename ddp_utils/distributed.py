"""The process group: set it up, check that every rank agrees, tear it down.

In a notebook or script::

    ctx = distributed.setup(settings)        # DDP: pre-flight checks, init, settings agreement
    ...                                      # train; ctx.rank, ctx.device, ctx.is_main
    distributed.teardown()                   # DDP: always, also after an error

or ``with distributed.session(settings) as ctx: ...``, which tears down on errors and interrupts.
Re-running the setup cell is safe: the same settings return the same context, changed settings
tear the old group down and build a new one. With ``world_size == 1`` no process group is created
and the collectives (``collectives.py``) do nothing, so the same training code runs on one process. How the kit
hears of the other ranks besides (their failures, explicit waits, a lost peer) is ``robust/peers.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import collectives, settings as settings_module
from .collectives import SettingsMismatch
from .optim import precision_name
from .robust import compat, mesh, peers, rendezvous, setup_watch, sockets
from .robust.devices import agree_on_backend, agree_on_precision, device_facts, torch_releases_differ
from .robust.peers import PeerLost, describe_failure, report_failure, where
from .robust.preflight import DistSetupError, preflight

__all__ = ["DistContext", "DistSetupError", "leaving_on_error", "session", "setup", "teardown"]


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


# Settings whose change needs a new process group: where the ranks meet, who they are, and what
# they agreed on. Others (run_dir, wandb, workers, ...) can change without rebuilding the group.
GROUP_FIELDS = tuple(dict.fromkeys(("master_addr", "master_port", "rank", "world_size", "local_rank", "backend",
                                    "init_timeout", "collective_timeout", "socket_ifname", "init_method",
                                    *settings_module.MUST_AGREE)))

# The settings the current context was built from: setup() compares against them (idempotency).
_active: tuple | None = None  # (settings, DistContext)
_collective_s = 60.0   # how long a collective may wait now (the group's timeout, or set_collective_timeout's)


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
            facts = device_facts(settings, ctx.device, _precision(settings, ctx.device))
            backend = _join_process_group(settings, ctx, report, facts, must_agree, log)
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


def _precision(settings, device: torch.device) -> str:
    """What this rank would train in, for the others to compare (robust/devices.py: agree_on_precision)."""
    try:
        return precision_name(settings, device)
    except ValueError as e:   # amp=bf16 on a GPU without it: every rank says so
        return f"error: {e}"


def _join_process_group(settings, ctx: DistContext, report: dict, facts: dict, must_agree: dict, log) -> str:
    """``init_process_group`` with a bounded wait, on the backend every rank agreed on (returned), then
    ``agree`` on ``must_agree``. A failure becomes one readable DistSetupError here, and the other ranks
    hear of it: they stop within a second, every rank naming the first rank that failed and why
    (robust/setup_watch.py)."""
    # Keys of this setup's own on the store on master_port (rank 0's, or torchrun's agent's), so that re-running a
    # notebook cell, or torchrun restarting the training processes, never reads an earlier attempt's (rendezvous.py)
    keys, everyone = rendezvous.join(settings, log, {**facts, "addr": report.get("local_ip")})
    # where each rank runs, for the paragraphs that name a lost rank (hosts in namespaces share one name)
    peers.remember(everyone)
    watch = setup_watch.SetupWatch(settings, keys)
    try:
        backend = _agree_on_backend(settings, everyone, report, log)   # the same answer (or error) on every rank
        with watch:
            try:
                # every rank can reach every other on a random port, as gloo and NCCL will (seconds, not their retries)
                mesh.probe(keys, settings.rank, settings.world_size, report.get("local_ip"), settings.master_port,
                           settings.init_timeout)
                _init_process_group(settings, keys, backend, report, log)
                collectives.agree({**must_agree, "backend": backend}, dataclasses.replace(ctx, backend=backend))
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
    global _collective_s
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
        # gloo's connections to the other ranks are the ones init made (the store's use master_port)
        peers.attach(rendezvous.second_client(settings, keys, timeout=peers.STORE_TIMEOUT_S), keys,
                     {c for c in sockets.tcp_connections() - before if settings.master_port not in (c[1][1], c[2][1])})
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
    connections shut down, whoever still holds the group (job.release_group first lets the model and optimizer go of it).
    """
    global _active
    _active = None
    if dist.is_available() and dist.is_initialized():
        if abort:
            _, call = compat.abort_path(dist.get_backend(), dist.distributed_c10d._get_default_group())
            with contextlib.suppress(RuntimeError):   # an NCCL communicator already broken by the failure
                call() if call is not None else peers.shut_down_connections()
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



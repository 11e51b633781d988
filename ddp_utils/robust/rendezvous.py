"""The re-runnable rendezvous behind ``distributed.setup``: a key-value store on master_port.

Why not simply ``init_method="tcp://addr:port"``? Because of re-running a notebook cell. Rank 0
hosts a key-value store (TCPStore) on master_port; a process group that is still referenced (say by
a DDP model) keeps it alive after teardown, so the port cannot be bound again, and a worker that
re-runs setup first would join the old group. So: rank 0 reuses its live store (multi_tenant=True),
each setup gets a fresh "generation" of keys in it, and a generation is closed once formed; workers
only join an open one. Students need not read this to follow the DDP lesson.

Under torchrun the store is its agent's, on MASTER_ADDR:MASTER_PORT, and outlives the attempts of a run with
``--max-restarts``: every attempt is a new generation there too, so no attempt reads an earlier one's keys (its
failures, its waits, gloo's addresses). A new generation closes the earlier ones, so a rank restarted into a
generation whose rank 0 died before it formed moves on to the new one instead of waiting out init_timeout.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import compat, failures
from .preflight import DistSetupError, port_holder

GENERATION = "ddp_utils/generation"
NOTE_EVERY = 30.0   # seconds between "still waiting" lines
READ_WITHIN = 10.0   # seconds rank 0 waits for every worker to have read the facts of all


def torchrun_store() -> bool:
    """Whether torchrun's agent serves the store on MASTER_ADDR:MASTER_PORT for its workers (static and c10d
    rendezvous, unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 leaves the port to rank 0)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


class Keys(dist.PrefixStore):
    """One generation's keys in the store (``prefix``: ``ddp_utils/<generation>``)."""

    def __init__(self, prefix: str, store):
        super().__init__(prefix, store)
        self.prefix = prefix


def second_client(settings, keys: Keys, timeout: float = 10.0) -> Keys:
    """The same generation's keys through a connection of their own: another thread can read them while this
    one's requests wait in C++ (a store client serves one request at a time)."""
    return Keys(keys.prefix, _client_store(settings, timedelta(seconds=timeout)))


class Reopen(Exception):
    """The generation this rank waits in was closed before it formed: join the current one."""


def join(settings, log, facts: dict) -> tuple[Keys, list[dict]]:
    """The keys of the generation every rank joined, and every rank's ``facts``, by rank."""
    while True:
        keys = open_store(settings, log)
        try:
            return keys, wait_for_all_ranks(keys, settings, log, facts)
        except Reopen:
            log(f"rank {settings.rank}: rank 0 started a new rendezvous; joining it")


def open_store(settings, log) -> Keys:
    """The keys of a new (rank 0) or the currently open (ranks > 0) generation."""
    deadline, said = time.monotonic() + settings.init_timeout, None
    agent = settings.init_method == "env" and torchrun_store()
    while True:
        left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
        try:
            if settings.rank == 0:
                store = _client_store(settings, left) if agent else _master_store(settings, left, log)
                generation = store.add(GENERATION, 1)  # counts up, also across reused stores
                with contextlib.suppress(Exception):   # an earlier generation that never formed: its ranks move on
                    store.set(f"ddp_utils/{generation - 1}/closed", "1")
                # the line to compare with when another node cannot reach this one
                log(f"rank 0: rendezvous {generation} in torchrun's store on {settings.master_addr}:"
                    f"{settings.master_port}" if agent else
                    f"rank 0: listening on {settings.master_addr}:{settings.master_port} (every node's "
                    f"master_addr and master_port must be these)")
                return Keys(f"ddp_utils/{generation}", store)
            store = _client_store(settings, left)
            generation = int(store.get(GENERATION))  # waits for rank 0 to publish one
            formed = store.check([f"ddp_utils/{generation}/arrived/{r}" for r in range(settings.world_size)])
            closed = store.check([f"ddp_utils/{generation}/closed"])
            if not formed and not closed:
                return Keys(f"ddp_utils/{generation}", store)
            # closed: rank 0 formed its group and runs it (this worker re-ran setup alone); formed and not closed:
            # rank 0 stopped before it closed it (killed hard in that window): a restarted one opens the next
            why = ("still runs an earlier process group (has rank 0 re-run setup?)" if closed and not agent else
                   "has not opened this attempt's rendezvous yet")
        except DistSetupError:   # rank 0's own paragraph (it subclasses RuntimeError): no retry
            raise
        except (RuntimeError, ValueError) as e:  # DistError subclasses RuntimeError
            why = f"did not answer ({(str(e).splitlines() or ['?'])[0][:120]})"  # old store closing?
        if time.monotonic() > deadline:
            raise DistSetupError(
                f"rank {settings.rank}: the master at {settings.master_addr}:{settings.master_port} "
                f"{why}, for {settings.init_timeout:g} s (init_timeout). When settings change, every "
                f"rank must run setup again; if rank 0 is stuck, run distributed.teardown() there (or "
                f"restart its kernel) and then setup on all nodes.")
        if why != said:  # say it once, not every half second
            log(f"rank {settings.rank}: the master {why}; retrying until init_timeout")
            said = why
        time.sleep(0.5)


def _client_store(settings, timeout: timedelta) -> dist.TCPStore:
    """A client of the store on master_addr:master_port (rank 0's, or torchrun's agent's)."""
    return dist.TCPStore(settings.master_addr, settings.master_port, settings.world_size, is_master=False,
                         timeout=timeout, wait_for_workers=False)


def _master_store(settings, timeout: timedelta, log) -> dist.TCPStore:
    """Rank 0's store on master_addr:master_port, or a DistSetupError that tells a busy port (naming its
    holder) from a store that failed on a free one."""
    fd = _listen_on(settings)
    try:
        return compat.master_store(settings.master_addr, settings.master_port, settings.world_size, timeout, fd, log)
    except (RuntimeError, ValueError) as e:  # DistError and NotImplementedError subclass RuntimeError
        said = (str(e).splitlines() or ["?"])[0][:160]
        if fd is None:   # the kit could not bind the port, and no store of this process holds it
            raise DistSetupError(
                f"rank 0 could not listen on master_port {settings.master_port} ({said}); held by: "
                f"{port_holder(settings.master_port)}. Free the port or choose another one on ALL nodes.") from e
        with contextlib.suppress(OSError):   # the port was free and bound by the kit: give it back
            os.close(fd)
        raise DistSetupError(
            f"rank 0 could not start its key-value store on {settings.master_addr}:{settings.master_port}, "
            f"although the port is free (the kit had bound it): {said}. This is torch "
            f"{torch.__version__}'s store failing, not the network; run `python -m ddp_utils check` and report "
            f"its output with this message.") from e


def _listen_on(settings) -> int | None:
    """A socket listening on master_addr only (PyTorch's own store would listen on every interface),
    handed to the store by its file descriptor; None when the port cannot be bound: this process's store
    already holds it (a re-run setup: multi_tenant reuses it), or another process does."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # like PyTorch: TIME_WAIT is fine
    try:
        sock.bind((settings.master_addr, settings.master_port))
        sock.listen(1024)
    except OSError:
        sock.close()
        return None
    return sock.detach()   # the store owns it now


def wait_for_all_ranks(keys: dist.PrefixStore, settings, log=print, facts: dict | None = None) -> list[dict]:
    """Announce this rank with its ``facts`` (devices.device_facts), then wait until all have; every
    rank's facts, by rank. The wait is a Python loop, so a notebook interrupt (Ctrl-C) stops it at once,
    it says every ~30 s whom it waits for, and a timeout can say which ranks never came. When rank 0
    gives up, it leaves its reason in the store, so every rank that did come stops with the same
    paragraph instead of a store error."""
    keys.set(f"arrived/{settings.rank}", json.dumps(facts or {"rank": settings.rank}))
    everyone = [f"arrived/{r}" for r in range(settings.world_size)]
    start = time.monotonic()
    deadline, next_note = start + settings.init_timeout, start + NOTE_EVERY
    while True:
        try:
            if keys.check(everyone):
                facts_of_all = [json.loads(keys.get(key)) for key in everyone]
                _everyone_read(keys, settings)
                return facts_of_all
            gave_up = settings.rank != 0 and failures.first(keys)   # rank 0's paragraph (below)
            if gave_up:
                raise DistSetupError(f"rank {settings.rank}: {gave_up[1]}")
            if settings.rank != 0 and keys.check(["closed"]):   # a new rank 0 opened the next generation
                raise Reopen()
        except DistSetupError:
            raise
        except RuntimeError as e:   # the master's store went away: rank 0 stopped waiting
            raise DistSetupError(
                f"rank {settings.rank}: the master at {settings.master_addr}:{settings.master_port} closed the "
                f"rendezvous while this rank waited for all {settings.world_size} ranks (rank 0 gave up or was "
                f"stopped; {(str(e).splitlines() or ['?'])[0][:100]}). Start every rank within init_timeout of "
                f"each other, with the same world_size, and run setup again.") from None
        now = time.monotonic()
        missing = [r for r, key in enumerate(everyone) if not keys.check([key])]
        if now > deadline:
            text = (f"rank(s) {', '.join(map(str, missing))} of world_size {settings.world_size} did not arrive "
                    f"at {settings.url} within init_timeout={settings.init_timeout:g} s. Most likely they are not "
                    f"started yet, or were started with a different master_addr, master_port or world_size, or "
                    f"cannot reach the master (firewall / security group, a container without --net=host). "
                    f"Start every rank within init_timeout of each other, with the same master settings, and run "
                    f"setup again.")
            if settings.rank == 0:   # tell the ranks that did come, then give them a moment to read it
                failures.report(keys, 0, f"rank 0 stopped waiting: {text}")
                time.sleep(1.0)
            raise DistSetupError(f"rank {settings.rank}: {text}")
        if now >= next_note:
            log(f"rank {settings.rank}: waiting for rank(s) {', '.join(map(str, missing))} to join "
                f"({now - start:.0f} s of init_timeout={settings.init_timeout:g} s)")
            next_note += NOTE_EVERY
        time.sleep(0.2)


def _everyone_read(keys: dist.PrefixStore, settings) -> None:
    """Each worker says it has read every rank's facts; rank 0 waits for that (a few seconds at most) before it
    goes on. Without it, rank 0 could find the ranks disagree (two ranks on one GPU), stop, and close its store
    while a worker sleeps between two looks: that worker would then blame a closed rendezvous, not the GPU."""
    if settings.rank != 0:
        keys.set(f"read/{settings.rank}", "1")
        return
    read = [f"read/{r}" for r in range(1, settings.world_size)]
    deadline = time.monotonic() + min(READ_WITHIN, settings.init_timeout)
    while read and not keys.check(read) and time.monotonic() < deadline:
        time.sleep(0.02)   # a worker that died after arriving is found by the steps that follow


def close_generation(keys: dist.PrefixStore) -> None:
    """Mark rank 0's generation as formed (or failed): late workers must wait for the next one."""
    with contextlib.suppress(Exception):  # the store may be gone with the failure being reported
        keys.set("closed", "1")

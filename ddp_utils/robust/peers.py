"""The other ranks, as the kit hears of them: where each runs, the reasons they leave when they stop, explicit waits
through the rendezvous store, and ending a collective that waits for a rank that is gone.

torch's process group knows its peers only through its collectives: a rank that stops, or waits minutes for its data,
is seen as a timeout. The kit keeps a connection of its own to the rendezvous store (``attach``, called when the
group is made: ``distributed.setup``), with a short timeout, through which

- every rank leaves its reason when it stops (``report_failure``) and reads the first one reported (``peer_failure``);
- a wait longer than a collective may take (the other notebook still at an earlier cell, rank 0 writing a
  checkpoint) is an explicit barrier that says whom it waits for and stops at once with a peer's reason
  (``wait_for_all``);
- the watch (heartbeat.py) beats and, when a rank goes silent, ends the hung collective from its own thread
  (``abort_group``).

It knows nothing of training: the core's setup attaches it, and the core's steps call it.
"""
from __future__ import annotations

import re
import threading
import time

import torch.distributed as dist

from . import compat, failures, sockets
from .devices import ended_beside
from .stderr import quietly


def attach(store, group_store, group_sockets: set) -> None:
    """A new process group: the kit's own store client (``store``), torch's group's keys (``group_store``; on rank 0
    the store's server, kept so the others can read its failure) and gloo's connections to the other ranks (what
    ``abort_group`` cuts). Every count starts again."""
    global _store, _group_store, _waits, _watches, _group_sockets, _aborted
    _store, _group_store, _group_sockets = store, group_store, group_sockets
    _waits = _watches = 0
    _aborted = None


def remember(everyone: list) -> None:
    """Where each rank runs, as it said when it joined (hosts in namespaces share one name): its host, address,
    machine and pid, for the paragraphs that name a lost rank."""
    global _peers
    _peers = {f["rank"]: f for f in everyone or []}


def shut_down_connections() -> int:
    """Shut gloo's connections to the other ranks down: their next read or write fails at once (teardown(abort))."""
    return sockets.shut_down(_group_sockets)


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
_peers: dict[int, dict] = {}   # rank -> its facts from the rendezvous: host, address, machine, pid


def where(rank: int) -> str:
    """``" (on node-b, 10.0.0.2)"``: where a rank runs, as it said when it joined ("" if unknown)."""
    return f" (on {_peers[rank].get('host')}, {_peers[rank].get('addr')})" if rank in _peers else ""


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


def wait_for_all(what: str, ctx, timeout: float, log=print) -> None:
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


def _ask_store(ctx, what: str, call, *args):
    """``call(*args)`` on the store, given up after STORE_PATIENCE s: a store call over a link that went
    down blocks far longer than any timeout set on the store, so it runs in a thread of its own."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(_try(quietly, call, *args)), daemon=True)
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


REPORT_S = failures.REPORT_S   # seconds the main thread gives its failure report before it goes on without it


def report_failure(ctx, text: str) -> None:
    """Leave this rank's reason for stopping in the store, where the others read it (best effort, bounded: over a
    link that just went down a store call blocks far longer than any timeout set on the store, and the client is
    shared with the watch's beat thread, so the writes run on a thread the caller waits for REPORT_S at most;
    Stop pressed then must not hang the cell for minutes)."""
    if not (ctx.distributed and _store is not None):
        return
    store = _store
    failures.within(REPORT_S, lambda: failures.report(store, ctx.rank, text))


def describe_failure(exc: BaseException) -> str:
    """``KeyboardInterrupt (Stop pressed, or Ctrl-C)`` or ``DataError: /data/...`` (first line only)."""
    if stop_signal or getattr(exc, "description", None):   # cli.Terminated says what it is; and who ended before
        return (stop_signal or exc.description) + ended_beside(_peers)
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def peer_failure(ctx) -> str | None:
    """The first reason another rank left in the store, or None (also when the store is gone)."""
    if not ctx.distributed or _store is None:
        return None
    try:
        return _ask_store(ctx, "the other ranks' news", _failure_in_store, ctx)
    except Exception:   # noqa: BLE001 - rank 0's store went away with rank 0, or the link is down
        return None


def _failure_in_store(ctx) -> str | None:
    """The first failure another rank reported, or None (robust/failures.py: one store request while none did)."""
    found = failures.first(_store, skip=ctx.rank, world_size=ctx.world_size)
    return found[1] if found else None

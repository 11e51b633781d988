"""What surrounds a run of the training loop, and the one place that says why it broke.

``watched(job)`` puts the run under its guard (robust/guard.py: signals, a Stop Python drops) and the kit's watch
(robust/heartbeat.py), and gives the loop's observers what it set up (``observers.Around``). When the run breaks,
``what_broke`` turns the exception into the paragraph that names its cause: a peer that went (and which), the
watch's verdict, a Stop, an unreadable image, a divergence; the rank's own error stays as it is, and ``Job.fail``
tells the others.
"""
from __future__ import annotations

import contextlib
import time

from . import distributed
from .checkpoint import kept_checkpoint
from .datasets import DataError
from .loaders import release_workers
from .metrics import Diverged
from .observers import Around
from .robust import peers
from .robust.guard import guarded
from .robust.heartbeat import Heartbeat


@contextlib.contextmanager
def watched(job):
    """``with watched(job) as around:`` around the loop of ``fit``; see the module's docstring."""
    with guarded() as run:   # what the run sets in the process (signals, a Stop Python drops): put back at its end
        heartbeat = Heartbeat(job.ctx, log=print, stall_after=distributed.stall_limit)   # the watch
        # DDP: the other notebook's Train cell may start minutes later: wait for it (up to init_timeout) before the
        # watch starts, so that a rank that has not started yet is never counted as one that stopped answering
        wait_for_the_others("training (the Train cell)", job)
        started = time.perf_counter()   # start-up from here: the gradient communication's choice, loaders, first step
        try:
            with heartbeat:
                try:
                    yield Around(heartbeat, started)
                except RuntimeError as exc:   # a collective broke: a peer went, but which? (the watch goes on)
                    if (job.ctx.distributed and not heartbeat.verdict and peers.lost_a_peer(exc)
                            and not peers.peer_failure(job.ctx)):
                        heartbeat.name_the_lost(heartbeat.silent_after + 2 * heartbeat.every)
                    raise
        except BaseException as exc:
            said = what_broke(exc, job, heartbeat, run)
            if said is exc:
                raise
            raise said from None


def what_broke(exc: BaseException, job, heartbeat, run) -> BaseException:
    """The exception to raise for ``exc``: the paragraph that names why the run broke, or ``exc`` itself."""
    ctx = job.ctx
    if isinstance(exc, KeyboardInterrupt):
        release_workers(exc)   # a notebook keeps the traceback, which would keep the loader's workers
        if heartbeat.interrupted:   # this rank's own watch stopped its stalled data loader: say why
            kept = kept_checkpoint(job.logger.run_dir, ctx)
            return peers.PeerLost(peers.peer_lost_text(ctx, kept, what=heartbeat.verdict))
        return exc
    if not isinstance(exc, Exception):
        return exc
    run.cancel_resends()   # a Stop that Python dropped is made here, by what broke after it: no second one
    release_workers(exc)
    if ctx.distributed and heartbeat.verdict:   # the watch ended the group: whatever broke next, this is why
        return peers.PeerLost(peers.peer_lost_text(ctx, kept_checkpoint(job.logger.run_dir, ctx),
                                                               what=heartbeat.verdict))
    if run.dropped:   # what broke after a Stop that Python dropped (the workers the Stop ended): the Stop
        return run.stop()
    if isinstance(exc, DataError):   # an unreadable image met in a worker process: the paragraph, not a traceback
        return exc.plain()
    if isinstance(exc, Diverged):    # the same paragraph on every rank, naming what rank 0 kept
        return Diverged(exc.what, exc.step, exc.lr, exc.explain(ctx.rank, kept_checkpoint(job.logger.run_dir, ctx)))
    broken = ctx.distributed and isinstance(exc, RuntimeError) and not isinstance(exc, peers.PeerLost)
    failure = peers.peer_failure(ctx) if broken else None   # a store call: asked once
    quiet = heartbeat.describe() if broken and not failure and peers.lost_a_peer(exc) else ""
    if failure or quiet:   # another rank reported why it stopped, or went quiet: that is the cause to name
        what = failure or f"another rank stopped answering ({quiet})"
        return peers.PeerLost(peers.peer_lost_text(ctx, kept_checkpoint(job.logger.run_dir, ctx), exc,
                                                               what=what))
    return exc   # this rank's own error (every peer still beats): Job.fail reports it to the others


def wait_for_the_others(what: str, job) -> None:
    """Every rank reaches the cell before its first collective (``with job:`` tells the others of an error)."""
    peers.wait_for_all(f"start {what}", job.ctx, job.settings.init_timeout, job.log)

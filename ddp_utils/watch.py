"""What surrounds a run of the training loop, and the one place that says why it broke.

``watched(job)`` puts the run under its guard (robust/guard.py: signals, a Stop Python drops), the kit's watch
(robust/heartbeat.py) and the GPU monitor, decides once how the gradients travel (speed/comm.py), and gives the
loop its observers (concerns.py) and results.json's description of the run. When the run breaks, ``what_broke``
turns the exception into the paragraph that names its cause: a peer that went (and which), the watch's verdict, a
Stop, an unreadable image, a divergence; the rank's own error stays as it is, and ``Job.fail`` tells the others.
"""
from __future__ import annotations

import contextlib
import time

from . import distributed, own_ddp
from .checkpoint import kept_checkpoint
from .concerns import observers_for
from .datasets import DataError, release_workers
from .metrics import Diverged
from .model import devices_used
from .optim import optimizer_steps
from .robust.guard import guarded
from .robust.heartbeat import Heartbeat
from .speed.comm import algorithm, gradient_communication
from .speed.gpu_monitor import GpuMonitor


@contextlib.contextmanager
def watched(job):
    """``with watched(job) as (observers, meta):`` around the loop of ``fit``; see the module's docstring."""
    with guarded() as run:   # what the run sets in the process (signals, a Stop Python drops): put back at its end
        heartbeat = Heartbeat(job.ctx, log=print, stall_after=distributed.stall_limit)   # the watch
        # DDP: the other notebook's Train cell may start minutes later: wait for it (up to init_timeout) before the
        # watch starts, so that a rank that has not started yet is never counted as one that stopped answering
        wait_for_the_others("training (the Train cell)", job)
        started = time.perf_counter()   # start-up from here: the gradient communication's choice, loaders, first step
        try:
            # dp: every GPU it drives, each GPU's figures kept (is GPU 0 busier and fuller than the others?)
            with heartbeat, GpuMonitor(devices_used(job.parallel, job.ctx), per_device=job.parallel == "dp") as gpu:
                comm = communication(job)   # before the observers: they time and keep what it chose
                try:
                    yield observers_for(job, heartbeat, gpu, started), describe_run(job, comm)
                except RuntimeError as exc:   # a collective broke: a peer went, but which? (the watch goes on)
                    if (job.ctx.distributed and not heartbeat.verdict and distributed.lost_a_peer(exc)
                            and not distributed.peer_failure(job.ctx)):
                        heartbeat.name_the_lost(heartbeat.silent_after + 2 * heartbeat.every)
                    raise
        except BaseException as exc:
            said = what_broke(exc, job, heartbeat, run)
            if said is exc:
                raise
            raise said from None


def communication(job):
    """How the gradients travel (all_reduce, or compressed), timed: decided once, before the first step."""
    if job.communication is None:
        kept = ((job.state or {}).get("comm") or {}).get("choice")   # a resume: comm=auto's choice at the start
        steps = job.settings.epochs * optimizer_steps(len(job.data.train), job.settings.accumulate)
        job.communication = gradient_communication(job.model, job.settings, job.ctx, job.data.num_classes,
                                                   job.data.image_size, job.log, kept, steps, job.data.train)
    return job.communication


def describe_run(job, comm) -> dict:
    """What results.json says of how the run trained: the parallel mode and how its gradients travelled."""
    return {"parallel": job.parallel, "comm": comm.choice, "comm_reason": comm.reason,
            "algorithm": algorithm(comm.choice, job.ctx.world_size, job.parallel, own_ddp.label(job.settings)),
            "resumed_from": job.resume if job.state is not None else None}


def what_broke(exc: BaseException, job, heartbeat, run) -> BaseException:
    """The exception to raise for ``exc``: the paragraph that names why the run broke, or ``exc`` itself."""
    ctx = job.ctx
    if isinstance(exc, KeyboardInterrupt):
        release_workers(exc)   # a notebook keeps the traceback, which would keep the loader's workers
        if heartbeat.interrupted:   # this rank's own watch stopped its stalled data loader: say why
            kept = kept_checkpoint(job.logger.run_dir, ctx)
            return distributed.PeerLost(distributed.peer_lost_text(ctx, kept, what=heartbeat.verdict))
        return exc
    if not isinstance(exc, Exception):
        return exc
    run.cancel_resends()   # a Stop that Python dropped is made here, by what broke after it: no second one
    release_workers(exc)
    if ctx.distributed and heartbeat.verdict:   # the watch ended the group: whatever broke next, this is why
        return distributed.PeerLost(distributed.peer_lost_text(ctx, kept_checkpoint(job.logger.run_dir, ctx),
                                                               what=heartbeat.verdict))
    if run.dropped:   # what broke after a Stop that Python dropped (the workers the Stop ended): the Stop
        return run.stop()
    if isinstance(exc, DataError):   # an unreadable image met in a worker process: the paragraph, not a traceback
        return exc.plain()
    if isinstance(exc, Diverged):    # the same paragraph on every rank, naming what rank 0 kept
        return Diverged(exc.what, exc.step, exc.lr, exc.explain(ctx.rank, kept_checkpoint(job.logger.run_dir, ctx)))
    broken = ctx.distributed and isinstance(exc, RuntimeError) and not isinstance(exc, distributed.PeerLost)
    failure = distributed.peer_failure(ctx) if broken else None   # a store call: asked once
    quiet = heartbeat.describe() if broken and not failure and distributed.lost_a_peer(exc) else ""
    if failure or quiet:   # another rank reported why it stopped, or went quiet: that is the cause to name
        what = failure or f"another rank stopped answering ({quiet})"
        return distributed.PeerLost(distributed.peer_lost_text(ctx, kept_checkpoint(job.logger.run_dir, ctx), exc,
                                                               what=what))
    return exc   # this rank's own error (every peer still beats): Job.fail reports it to the others


def wait_for_the_others(what: str, job) -> None:
    """Every rank reaches the cell before its first collective (``with job:`` tells the others of an error)."""
    distributed.wait_for_all(f"start {what}", job.ctx, job.settings.init_timeout, job.log)

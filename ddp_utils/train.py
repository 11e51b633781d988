"""The training loop: ``fit(job)`` = train epochs + exact evaluation + checkpoints + logs.

``job`` comes from ``job.prepare()``, which every entry point (command line, notebooks, labs,
benchmarks) calls the same way. The same code runs on one process and on many: with one rank the
model is not wrapped and every collective is a no-op. The DDP-specific lines are tagged ``# DDP:``.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.nn.functional as F

from . import checkpoint, distributed, own_ddp
from .datasets import DataError, release_workers
from .speed.gpu_monitor import GpuMonitor, reduce_summaries
from .speed.gpu_monitor import describe as describe_gpu
from .robust.heartbeat import Heartbeat
from .robust.guard import guarded
from .metrics import Meter
from .model import devices_used, unwrap
from .speed.comm import algorithm, forget_overflow, gradient_communication
from .speed.localsgd import LocalSGD
from .speed.powersgd import Memory as PowerSGDMemory
from .speed.profile import StepProfiler
from .speed import sharding
from .optim import (ScaledStep, amp_dtype, autocast, build_optimizer, build_scheduler, make_scaler, optimizer_steps,
                    to_device)
from .progress import Progress
from .runlog import TIME_PARTS, summarize
from .robust.devices import gpu_id
from .robust.threads import machine_id
from .settings import describe_batch

# ---------------------------------------------------------------------------------------------
# one epoch of training, exact evaluation


class Diverged(RuntimeError):
    """The loss (or the weights) stopped being finite numbers: training cannot recover by itself.

    Raised on every rank at once: the values checked are the global, all-reduced ones.
    """

    def __init__(self, what: str, step: int, lr: float, message: str = ""):
        self.what, self.step, self.lr = what, step, lr
        super().__init__(message or f"training diverged at step {step}: {what} with lr {lr:.4g}.")

    def explain(self, rank: int, kept: str) -> str:
        kept = (f"{kept}, the last one with finite numbers" if "holds epoch" in kept
                else kept or "rank 0's last.pt, if there is one, holds the last epoch with finite numbers")
        return (f"rank {rank}: training diverged at step {self.step}: {self.what} with lr {self.lr:.4g}. "
                f"Nothing of this epoch was saved; {kept}. Try a smaller lr (a tenth), a longer warm-up "
                f"(--warmup-epochs / WARMUP_EPOCHS), or, if fp16 overflowed, no AMP (--amp off) or bf16 on a GPU "
                f"that has it (compute capability 8.0+, not a T4: --amp bf16; in a notebook amp= in the Settings "
                f"cell); then start again (or resume from that checkpoint with the smaller lr).")


def _check_finite(value: float, what: str, step: int, lr: float) -> None:
    if not math.isfinite(value):
        raise Diverged(f"{what} is {value}", step, lr)


def train_one_epoch(model, data, optimizer, scheduler, scaler, epoch: int, settings, ctx, logger,
                    start_step: int = 0, heartbeat=None, comm=None, stepper=None, local_sgd=None,
                    profiler=None) -> dict:
    """Train one pass over this rank's shard. Returns global metrics and timing for the epoch.

    Time split (seconds, each rank's own in ``per_rank``, their mean at the top level); they add up
    to the epoch's wall time:

    - ``data_s``: waiting for the next batch;
    - ``compute_s``: forward, backward, optimizer step, including gradient communication that
      overlapped the backward pass (on a GPU also the work still queued at a log point);
    - ``comm_s``: gradient communication the step waited for after the backward pass (``comm``, a
      ``CommTimer`` on the DDP model; ``comm_total_s`` is all of it, overlapped or not);
    - ``idle_s``: the rest: log-point reductions (which wait for the slowest rank), logging, progress.

    Loss and hits stay on the device between log points so the GPU is never forced to sync per step.
    ``stepper`` (an ``optim.ScaledStep`` of this optimizer and scaler, made here if not given) counts the
    steps the fp16 scaler skips. ``local_sgd`` (``--comm localsgd``, a ``localsgd.LocalSGD``): steps keep
    their gradients on the rank, and the weights are averaged every few steps and at the end of the epoch.
    ``profiler`` (``--profile-steps A:B``, a ``profile.StepProfiler``) traces steps A to B-1.
    """
    stepper = stepper or ScaledStep(optimizer, scaler)
    own = own_ddp.is_own(model)   # --build-ddp: your DDP, which the loop must ask to finish its all-reduces
    model.train()
    dtype = amp_dtype(settings, ctx.device)
    epoch_meter, window = Meter(ctx.device), Meter(ctx.device)
    data_s = step_s = 0.0
    first_step_s = None   # from the epoch's start to its first step's end: loader start-up, first batch, first step
    step = start_step
    # Every rank shows its own bar (its steps, its data wait) and the same global lines; rank 0 also writes them.
    progress = Progress(settings.progress, len(data.train), f"epoch {epoch + 1}/{settings.epochs}",
                        show=True, print_line=logger.info, rank=ctx.rank if ctx.distributed else None)
    t_epoch = t_end = time.perf_counter()
    batches, k = len(data.train), settings.accumulate   # k batches per optimizer step (the last group maybe fewer)
    if heartbeat is not None:
        heartbeat.fetching(True)   # the watch knows when this rank waits for its data (a stuck loader is named)
    try:
        for i, (images, labels) in enumerate(data.train.epoch(epoch)):   # DDP: set_epoch happens inside .epoch()
            t_data = time.perf_counter()
            if heartbeat is not None:
                heartbeat.fetching(False)
            data_s += t_data - t_end
            if profiler is not None:
                profiler.before(step)
            images, labels = to_device(images, labels, settings, ctx.device)
            lr = scheduler.get_last_lr()[0]   # the lr this step uses
            first = i - i % k
            group = min(k, batches - first)   # batches in this optimizer step
            syncs = i == first + group - 1    # its last batch: all-reduce, then the optimizer step
            if i == first:
                optimizer.zero_grad(set_to_none=True)
            local = not syncs or (local_sgd is not None and local_sgd.local)   # local SGD: no all-reduce at all
            with _local_gradients(model, local):   # DDP: no_sync() for the group's other batches
                with autocast(dtype, ctx.device):
                    logits = model(images)
                    loss = F.cross_entropy(logits, labels)
                scaler.scale(loss if group == 1 else loss / group).backward()   # DDP: gradients are all-reduced
            if syncs:                             # (averaged) during the backward of the group's last batch
                if own:                           # --build-ddp: your DDP waits for its all-reduces here
                    started = comm.span()
                    model.finish_gradient_sync()
                    comm.end_span(started)
                if not stepper():                 # fp16: the scaler skipped the step, its gradients overflowed
                    _after_a_skipped_step(stepper, comm, step, lr)
                scheduler.step()
                if comm is not None:
                    comm.step_done()
                if local_sgd is not None:
                    local_sgd.step_done(i == batches - 1)   # every average_every steps: the ranks average their weights
            if settings.compile and step == start_step and ctx.distributed:   # compiled now: the short wait from here on
                distributed.set_collective_timeout(settings.collective_timeout)
            window.update(loss.detach() * labels.shape[0], logits, labels)
            step_s += time.perf_counter() - t_data
            logger.scalars({"lr": lr}, step)   # every step (rank 0 only, cheap): the schedule's exact shape
            step += 1
            if profiler is not None:
                profiler.after(step)   # at the window's end: every rank's trace to rank 0 (a collective)
            if step % settings.log_every == 0:
                step_s += _finish_queued_work(ctx)
                stats = window.reduced(ctx)   # DDP: a collective, reached by every rank at the same step
                epoch_meter.add(window)
                window.reset()
                _check_finite(stats["loss"], "the training loss", step, lr)   # global: every rank stops alike
                logger.scalars({"Loss/train": stats["loss"], "acc1/train": stats["acc1"], "acc5/train": stats["acc5"]},
                               step)
                progress.log_point(step - start_step, stats["loss"], stats["acc1"], lr)
            progress.update(data_s / max(time.perf_counter() - t_epoch, 1e-9))
            if heartbeat is not None:
                heartbeat.step()
            t_end = time.perf_counter()
            if first_step_s is None:
                first_step_s = t_end - t_epoch
        if heartbeat is not None:   # out of the loop: from here on this rank waits in collectives, not for data
            heartbeat.fetching(False)
        if profiler is not None:
            profiler.finish()   # a window the epoch's end cut short
        if local_sgd is not None:
            t_sync = time.perf_counter()
            local_sgd.end_of_epoch()   # one model on every rank again: for the evaluation and the checkpoint
            step_s += time.perf_counter() - t_sync
    finally:
        progress.close()   # also when a step fails: no half-drawn bar left behind
        if heartbeat is not None:
            heartbeat.fetching(False)
    step_s += _finish_queued_work(ctx)   # so the epoch's wall time includes queued GPU work
    wall = time.perf_counter() - t_epoch
    comm_s, comm_total_s = comm.take() if comm is not None else (0.0, 0.0)
    mine = {"data_s": data_s, "compute_s": max(0.0, step_s - comm_s), "comm_s": comm_s,
            "comm_total_s": comm_total_s, "idle_s": max(0.0, wall - data_s - step_s), "wall_s": wall}
    per_rank = _gather_times(mine, ctx)   # DDP: a small collective; every rank gets every rank's split
    epoch_meter.add(window)           # the steps since the last log point
    stats = epoch_meter.reduced(ctx)
    _check_finite(stats["loss"], "the training loss of the epoch", step, scheduler.get_last_lr()[0])
    # DDP: the epoch took as long as its slowest rank; every rank computes the same global figures from the
    # gathered times, so every rank prints the same line. Same steps on every rank (drop_last): images/s add up.
    wall = max(r["wall_s"] for r in per_rank)
    rank_ips = stats["count"] / ctx.world_size / max(wall, 1e-9)
    means = {key: sum(r[key] for r in per_rank) / len(per_rank) for key in mine}   # the ranks' means
    means["wall_mean_s"] = means.pop("wall_s")
    stats.update(means, per_rank=per_rank, epoch=epoch, step=step, steps=step - start_step, wall_s=wall,
                 lr=scheduler.get_last_lr()[0], images_per_s_rank=rank_ips,
                 images_per_s=stats["count"] / max(wall, 1e-9), first_step_s=first_step_s)
    return stats


SKIPPED_IN_A_ROW = 20   # fp16 steps skipped one after another (scale / 2**20) before the run counts as broken


def _local_gradients(model, local: bool):
    """DDP's ``no_sync()`` (FSDP: ``sharding.no_sync``) while ``local``: this batch's gradients are added to the
    ones already there, not all-reduced (gradient accumulation). Nothing for one process or DataParallel."""
    if not local:
        return contextlib.nullcontext()
    return model.no_sync() if hasattr(model, "no_sync") else sharding.no_sync(unwrap(model))


def _after_a_skipped_step(stepper, comm, step: int, lr: float) -> None:
    """The scaler skipped this step: clear what the gradient compression carried over from it, and stop
    when steps keep being skipped (the same step on every rank: the gradients, hence the scalers, are the
    same; not with local SGD, whose local steps see each rank's own gradients: a rank that stops alone is
    reported to the others by the watch)."""
    if comm is not None:
        forget_overflow(comm.state)   # PowerSGD's memory of this step is inf now: it would poison every later one
    if stepper.in_a_row >= SKIPPED_IN_A_ROW:
        raise Diverged(f"the fp16 gradient scaler skipped the last {stepper.in_a_row} steps (their gradients "
                       f"overflowed; its scale fell to {stepper.scaler.get_scale():.3g})",
                       step + 1, lr)


TIME_KEYS = (*TIME_PARTS, "comm_total_s", "wall_s")   # what each rank measures per epoch


def _gather_times(mine: dict, ctx) -> list[dict]:
    """Every rank's time split, on every rank: one row per rank, summed over the ranks."""
    table = torch.zeros(ctx.world_size, len(TIME_KEYS), dtype=torch.float64)
    table[ctx.rank] = torch.tensor([mine[key] for key in TIME_KEYS], dtype=torch.float64)
    distributed.all_reduce_sum(table, ctx)
    return [{"rank": r, **dict(zip(TIME_KEYS, map(float, row)))} for r, row in enumerate(table)]


def _finish_queued_work(ctx) -> float:
    """On a GPU, wait for the queued steps and return how long that took (it is their compute:
    the CPU runs ahead of the GPU, and would otherwise count it where it next waits)."""
    if ctx.device.type != "cuda":
        return 0.0
    start = time.perf_counter()
    torch.cuda.synchronize(ctx.device)
    return time.perf_counter() - start


@torch.no_grad()
def evaluate(model, loader, settings, ctx) -> dict:
    """Exact evaluation: each sample of the split counted once across ranks, sums all-reduced.

    Runs on the unwrapped module (no DDP forward, so ranks with fewer batches cannot deadlock; an FSDP
    model's forward all-gathers, so there they add empty batches), and returns the same global {loss, acc1,
    acc5, count} on every rank.
    """
    net = unwrap(model)
    distributed.sync_buffers(net, ctx)   # DDP: every rank evaluates rank 0's model, the one saved
    was_training = net.training
    net.eval()
    dtype = amp_dtype(settings, ctx.device)
    meter = Meter(ctx.device)
    padding = sharding.forwards_to_add(net, loader, ctx)   # FSDP: as many forwards on every rank
    for images, labels in loader:
        images, labels = to_device(images, labels, settings, ctx.device)
        with autocast(dtype, ctx.device):
            logits = net(images)
        meter.update(F.cross_entropy(logits.float(), labels, reduction="sum"), logits.float(), labels)
    for _ in range(padding):
        net(images[:0])   # FSDP: an empty batch, counted nowhere
    net.train(was_training)
    return meter.reduced(ctx)   # DDP: sums and counts added over ranks


# ---------------------------------------------------------------------------------------------
# the whole run


def fit(job) -> dict:
    """Train ``settings.epochs`` epochs, evaluate after each, checkpoint on rank 0, return the results.

    ``job`` comes from ``prepare()``: its model is DDP-wrapped when there are several ranks, and
    ``job.state`` (a checkpoint that rank 0 read and sent to every rank) makes training continue
    after the saved epoch. Returns the dict also written to ``results.json`` (accuracies in
    percent), the same on every rank. When another rank stops answering, raises
    ``distributed.PeerLost`` with a paragraph that says what was saved and how to resume.
    """
    with guarded() as run:   # what the run sets in the process (signals, a Stop Python drops): put back at its end
        return _watched_fit(job, run)


def _watched_fit(job, run) -> dict:
    """``fit`` under the kit's watch, turning each way a run breaks into the paragraph that names its cause."""
    heartbeat = Heartbeat(job.ctx, log=print, stall_after=distributed.stall_limit)   # the watch (robust/heartbeat.py)
    # DDP: the other notebook's Train cell may start minutes later: wait for it (up to init_timeout) before the
    # watch starts, so that a rank that has not started yet is never counted as one that stopped answering
    _wait_for_the_others("training (the Train cell)", job)
    started = time.perf_counter()   # start-up from here: the gradient communication's choice, loaders, first step
    try:
        # dp: every GPU it drives, each GPU's figures kept (is GPU 0 busier and fuller than the others?)
        with heartbeat, GpuMonitor(devices_used(job.parallel, job.ctx), per_device=job.parallel == "dp") as gpu:
            if job.communication is None:   # DDP: how the gradients travel (all_reduce, or compressed), timed
                kept = ((job.state or {}).get("comm") or {}).get("choice")   # a resume: comm=auto's choice at the start
                steps = job.settings.epochs * optimizer_steps(len(job.data.train), job.settings.accumulate)
                job.communication = gradient_communication(job.model, job.settings, job.ctx, job.data.num_classes,
                                                           job.data.image_size, job.log, kept, steps)
            comm = job.communication
            try:
                return _fit(job.settings, job.ctx, job.data, job.model, job.logger, job.state, job.resume, heartbeat,
                            comm.timer, comm.probe, gpu, {"parallel": job.parallel, "comm": comm.choice,
                                                          "algorithm": algorithm(comm.choice, job.ctx.world_size,
                                                                                 job.parallel, own_ddp.label(job.settings)),
                                                          "comm_reason": comm.reason,
                                                          "resumed_from": job.resume if job.state is not None else None},
                            started)
            except RuntimeError as exc:   # a collective broke: a peer went, but which? (the watch goes on meanwhile)
                if (job.ctx.distributed and not heartbeat.verdict and distributed.lost_a_peer(exc)
                        and not distributed.peer_failure(job.ctx)):
                    heartbeat.name_the_lost(heartbeat.silent_after + 2 * heartbeat.every)
                raise
    except KeyboardInterrupt as exc:
        release_workers(exc)   # a notebook keeps the traceback, which would keep the loader's workers
        if heartbeat.interrupted:   # this rank's own watch stopped its stalled data loader: say why
            kept = kept_checkpoint(job.logger.run_dir, job.ctx)
            raise distributed.PeerLost(distributed.peer_lost_text(job.ctx, kept, what=heartbeat.verdict)) from None
        raise
    except Exception as exc:
        run.cancel_resends()   # a Stop that Python dropped is made here, by what broke after it: no second one
        release_workers(exc)
        if job.ctx.distributed and heartbeat.verdict:   # the watch ended the group: whatever broke next, this is why
            kept = kept_checkpoint(job.logger.run_dir, job.ctx)
            raise distributed.PeerLost(distributed.peer_lost_text(job.ctx, kept, what=heartbeat.verdict)) from None
        if run.dropped:   # what broke after a Stop that Python dropped (the workers the Stop ended): the Stop
            raise run.stop() from None
        if isinstance(exc, DataError):   # an unreadable image met in a worker process: the paragraph, not a traceback
            raise exc.plain() from None
        if isinstance(exc, Diverged):    # the same paragraph on every rank, naming what rank 0 kept
            kept = kept_checkpoint(job.logger.run_dir, job.ctx)
            raise Diverged(exc.what, exc.step, exc.lr, exc.explain(job.ctx.rank, kept)) from None
        broken = (job.ctx.distributed and isinstance(exc, RuntimeError)
                  and not isinstance(exc, distributed.PeerLost))   # a collective that broke, maybe for a peer
        failure = distributed.peer_failure(job.ctx) if broken else None   # a store call: asked once
        quiet = heartbeat.describe() if broken and not failure and distributed.lost_a_peer(exc) else ""
        if failure or quiet:   # another rank reported why it stopped, or went quiet: that is the cause to name
            kept = kept_checkpoint(job.logger.run_dir, job.ctx)
            what = failure or f"another rank stopped answering ({quiet})"
            raise distributed.PeerLost(distributed.peer_lost_text(job.ctx, kept, exc, what=what)) from None
        raise   # this rank's own error (every peer still beats): Job.fail reports it to the others


def _wait_for_the_others(what: str, job) -> None:
    """Every rank reaches the cell before its first collective (``with job:`` tells the others of an error)."""
    distributed.wait_for_all(f"start {what}", job.ctx, job.settings.init_timeout, job.log)


def _fit(settings, ctx, data, model, logger, state, resume, heartbeat=None, comm=None, probe=None,
         gpu=None, meta=None, started=None) -> dict:
    optimizer = build_optimizer(model, settings, zero=(meta or {}).get("parallel") == "zero1")   # ZeRO-1: state sharded
    per_epoch = optimizer_steps(len(data.train), settings.accumulate)
    scheduler = build_scheduler(optimizer, settings, per_epoch)
    dtype = amp_dtype(settings, ctx.device)
    scaler = make_scaler(dtype, ctx.device)
    stepper = ScaledStep(optimizer, scaler)
    start_epoch, step, best_acc1, history = 0, 0, 0.0, []
    memory = comm.state if comm is not None and isinstance(comm.state, PowerSGDMemory) else None
    if state is not None:
        checkpoint.restore(state, model, optimizer, scheduler, scaler, ctx)
        _continue_the_schedule(scheduler, state, per_epoch, settings, logger)
        # The schedule continues at its step, but from this run's lr: resuming with a smaller lr after
        # a divergence must take effect (the scheduler's saved state holds the old one).
        scheduler.base_lrs = [settings.effective_lr] * len(optimizer.param_groups)
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)
        start_epoch, step, best_acc1 = state["epoch"] + 1, state["step"], state["best_acc1"]
        history = state.get("history", [])   # results then cover the epochs before the interruption too
        logger.info(f"resumed from {resume}: continuing at epoch {start_epoch + 1}")
        saved = (state.get("comm") or {}).get("powersgd")
        if memory is not None and saved:   # its error feedback and warm start: the resume is exact
            logger.info(memory.load_state_dict(saved, ctx))
        if checkpoint.mend_best(state, logger.run_dir, ctx, settings.init_timeout):
            logger.info(f"best.pt was older than the best epoch ({state['epoch'] + 1}) that last.pt records (a stop "
                        f"between the two writes): written again from it")
    logger.info(f"{describe_batch(settings)}; precision {dtype or 'fp32'}; device {ctx.device}")
    local_sgd = None
    if (meta or {}).get("comm") == "localsgd" and ctx.distributed:   # counts optimizer steps from the schedule's
        local_sgd = LocalSGD(model, optimizer, settings.average_every, settings.localsgd_warmup_steps,
                             scheduler.last_epoch, comm)

    last_path, best_path = (checkpoint.checkpoint_paths(logger.run_dir) if logger.run_dir else (None, None))
    profiler = StepProfiler.from_settings(settings, ctx, logger.run_dir, logger.info)   # --profile-steps A:B
    val, trained_now, stopped_early, stop_reason = None, 0, None, None
    t0 = time.perf_counter()
    for epoch in range(start_epoch, settings.epochs):
        if gpu is not None:
            gpu.phase("train")
        train = train_one_epoch(model, data, optimizer, scheduler, scaler, epoch, settings, ctx, logger, step,
                                heartbeat, comm, stepper, local_sgd, profiler)
        step = train["step"]
        held = sharding.held_bytes(unwrap(model), optimizer)   # this rank's parameters, gradients, optimizer state
        if gpu is not None:
            gpu.phase("val")
        val = evaluate(model, data.val, settings, ctx)
        lr = scheduler.get_last_lr()[0]
        _check_finite(val["loss"], "the validation loss", step, lr)
        if not _weights_finite(model, ctx):
            raise Diverged("some weights are not finite", step, lr)
        logger.scalars({"Loss/val": val["loss"], "acc1/val": val["acc1"], "acc5/val": val["acc5"],
                        "throughput/images_per_s": train["images_per_s"],
                        "throughput/images_per_s_rank": train["images_per_s_rank"],
                        **{f"time/{key}": train[key] for key in ("data_s", "compute_s", "comm_s", "idle_s")}}, step)
        is_best = val["acc1"] > best_acc1 or epoch == 0   # epoch 0 always gives a first best.pt
        best_acc1 = max(best_acc1, val["acc1"])
        history.append({"epoch": epoch + 1, "train": train, "val": val})
        trained_now += 1
        paths = [last_path, best_path] if is_best else [last_path]
        if local_sgd is not None:
            local_sgd.finish()   # the optimizer state averaged while evaluating: every rank's is in the checkpoint
        checkpoint.save_state([p for p in paths if p], model, optimizer, scheduler, scaler, epoch, step,
                              best_acc1, history, settings, ctx,
                              {"choice": (meta or {}).get("comm", "none"),
                               "powersgd": memory.state_dict(ctx) if memory is not None else None})   # a collective
        # DDP: rank 0 may write for a while; the others wait for it here, not in a collective that times out
        distributed.wait_for_all(f"finish saving epoch {epoch + 1}", ctx, settings.init_timeout, logger.info)
        logger.info(epoch_line(settings, train, val, epoch, (meta or {}).get("algorithm", "")))
        stop_reason = early_stop(history, settings.patience, ctx)
        if stop_reason and epoch + 1 < settings.epochs:
            stopped_early = epoch + 1
            logger.info(f"early stop after epoch {stopped_early} of {settings.epochs}: {stop_reason}")
            break
        stop_reason = None
    wall = time.perf_counter() - t0
    if val is None:                    # nothing left to train (resumed after the last epoch)
        val = evaluate(model, data.val, settings, ctx)
    meta = {"parallel": "none", "comm": "none", "comm_reason": "", "algorithm": algorithm("none", ctx.world_size),
            **(meta or {})}
    gpu_use = _gpu_results(gpu, ctx, logger, step) if gpu is not None else {}
    gpu_ranks = gpu_use.pop("per_rank", [])
    gpus = len(devices_used(meta["parallel"], ctx)) if ctx.device.type == "cuda" else 0   # per process
    extra = {**meta, "gpus": gpus, "job_gpus": job_gpus(meta["parallel"], ctx),   # this process's, the job's
             "stopped_early": stopped_early, "stop_reason": stop_reason,
             "skipped_steps": stepper.skipped,   # fp16: steps the gradient scaler skipped (overflow)
             "link_gbit_s": probe["link_gbit_s"] if probe else None,
             "predicted_speedup": probe["predicted_speedup"] if probe else None, "probe": probe, **gpu_use,
             # localsgd: waited after the evaluation for the momentum's average (not in the time split)
             "localsgd_wait_s": local_sgd.waited_s if local_sgd is not None else None,
             "memory": sharding.memory_results(held if trained_now else sharding.held_bytes(unwrap(model), optimizer),
                                               unwrap(model), meta["parallel"], settings.momentum, ctx)}   # gathered
    extra.update(run_cost(settings, ctx, wall, trained_now))
    # Start-up, which wall_time_s (from the first epoch's start) leaves out: joining, and from the Train cell's
    # start to its first step's end. This rank's figures (results are rank 0's).
    first = history[-trained_now]["train"].get("first_step_s") if trained_now else None
    extra.update(join_s=ctx.join_s, startup_s=(t0 - started + first) if started is not None and first is not None
                 else None)
    # DDP: rank 0's run folder, named in every rank's results (the worker notebook's table shows it)
    extra["run_dir"] = distributed.broadcast_object(str(logger.run_dir) if ctx.is_main else None, ctx)
    results = summarize(settings, ctx, val, history, wall, best_acc1, epochs_run=trained_now, extra=extra)
    for row, mine in zip(results["per_rank"], gpu_ranks):   # one row per rank: its time split and its GPU use
        row.update({key: mine.get(key) for key in ("gpu_util", "gpu_util_peak", "gpu_mem_peak_mb")})
    results = distributed.broadcast_object(results, ctx)   # DDP: rank 0's timings on every rank: one table
    if results["startup_s"] is not None:
        # lines under 100 characters: a notebook wraps longer ones mid-word
        logger.info(f"start-up: {results['startup_s']:.1f} s from the start of training to the end of its first "
                    f"step,\n  besides {results['join_s']:.1f} s to join the process group (wall_time_s leaves both "
                    f"out)")
    if results["cost"] is not None:
        logger.info(describe_cost(results))
    if probe and results["measured_step_s"]:
        logger.info(predicted_vs_measured(probe, results, own=settings.build_ddp in own_ddp.WRAPPERS))
    logger.results(results)
    return results


def _continue_the_schedule(scheduler, state: dict, per_epoch: int, settings, logger) -> None:
    """Resumed with other steps per epoch than the checkpoint's (another world size, batch size or
    max_steps: a node lost or added), the learning-rate schedule continues at the same share of the run:
    epochs done x this run's steps per epoch. (The step count in the logs keeps counting on.)"""
    done = state["epoch"] + 1
    if scheduler.last_epoch == done * per_epoch:
        return
    before = state.get("settings", {}).get("world_size", "?")
    logger.info(f"the checkpoint took {scheduler.last_epoch} steps for {done} epoch(s) (world size {before}); this run "
                f"takes {per_epoch} per epoch (world size {settings.world_size}): the learning-rate schedule "
                f"continues at step {done * per_epoch} of {settings.epochs * per_epoch}, the same share of the run")
    scheduler.last_epoch = done * per_epoch


def _gpu_results(gpu, ctx, logger, step: int) -> dict:
    """Every rank's GPU use, gathered and reduced: the same dict on every rank ("no GPU" on CPUs)."""
    gpu.stop()
    summary = reduce_summaries(distributed.gather_objects(gpu.summary(), ctx))   # DDP: every rank's sampler
    logger.info(describe_gpu(summary))
    if isinstance(summary.get("gpu_util"), (int, float)):
        logger.scalars({"gpu/util_mean": summary["gpu_util"], "gpu/mem_peak_mb": summary["gpu_mem_peak_mb"] or 0},
                       step)
    return summary


def job_gpus(parallel: str, ctx) -> int:
    """GPUs the whole job trained on, all ranks together (``gpus`` counts one process's): DataParallel's
    every GPU, one per DDP rank, and a GPU that several ranks share (a rehearsal on gloo, lab 4 on a
    one-GPU node) once. 0 on CPUs."""
    if parallel == "dp":
        return len(devices_used(parallel, ctx)) if ctx.device.type == "cuda" else 0
    mine = gpu_id(ctx.device) if ctx.device.type == "cuda" else None
    return len({g for g in distributed.gather_objects(mine, ctx) if g is not None})   # DDP: every rank's GPU


def run_cost(settings, ctx, wall_s: float, epochs: int) -> dict:
    """What this run cost, all nodes together: ``cost`` (None without a price) and its parts."""
    nodes = len(set(distributed.gather_objects(machine_id(), ctx)))   # DDP: ranks sharing a machine pay once
    if not settings.price_per_hour:
        return {"cost": None, "cost_per_epoch": None, "nodes": nodes, "price_per_hour": None}
    cost = wall_s / 3600 * nodes * settings.price_per_hour
    return {"cost": cost, "cost_per_epoch": cost / epochs if epochs else None, "nodes": nodes,
            "price_per_hour": settings.price_per_hour}


def money(amount: float) -> str:
    """An amount with three significant digits, at least two decimals: 0.00123, 0.0456, 0.526, 12.35."""
    if amount <= 0 or amount >= 1:
        return f"{amount:.2f}"
    return f"{amount:.{max(2, 2 - math.floor(math.log10(amount)))}f}"


def describe_cost(results: dict) -> str:
    per_epoch = f", {money(results['cost_per_epoch'])} per epoch" if results["cost_per_epoch"] is not None else ""
    shared = (f";\n  its {results['world_size']} ranks shared {results['nodes']} machine(s): a rehearsal, priced as "
              f"what it used (the GPU nodes pay for {results['world_size']})"
              if results["nodes"] < results["world_size"] else "")
    return (f"cost: {money(results['cost'])} for this run ({results['wall_time_s'] / 3600:.4f} h x {results['nodes']} "
            f"node(s) x {results['price_per_hour']:g} per node-hour){per_epoch}{shared}")


def epoch_line(settings, train: dict, val: dict, epoch: int, algorithm: str = "") -> str:
    """The console line at each epoch end, with where the epoch's time went (and, with several ranks, the
    ``algorithm``: DDP, how its gradients travel, or local SGD)."""
    wall = train.get("wall_mean_s", train["wall_s"])   # the parts are the ranks' means: so is this wall time
    shares = " ".join(f"{name} {100 * train[key] / max(wall, 1e-9):.0f}%" for name, key in
                      (("data", "data_s"), ("compute", "compute_s"), ("comm", "comm_s"), ("idle", "idle_s")))
    # Two lines of under 100 characters: one line of 165 wrapped mid-word in a notebook ("pe" / "r rank").
    return (f"epoch {epoch + 1}/{settings.epochs}: train loss {train['loss']:.4f} acc1 {train['acc1']:.2f} | "
            f"val loss {val['loss']:.4f} acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f}\n"
            f"  {train['images_per_s']:.0f} img/s global, {train['images_per_s_rank']:.0f} per rank | "
            f"time: {shares} | {train['wall_s']:.1f}s" + (f" | {algorithm}" if settings.world_size > 1 else ""))


def predicted_vs_measured(probe: dict, results: dict, own: bool = False) -> str:
    """The link probe's prediction next to what the run measured, per step. ``own``: your DDP (lab/build_ddp) trained,
    of which only the wait in ``finish_gradient_sync()`` is timed (what overlapped the backward pass is not seen)."""
    steps = results["steps"]
    how = (f"a DDP step of a copy: compute {1e3 * probe['compute_s']:.0f}, all-reduce {1e3 * probe['allreduce_s']:.0f}"
           if probe.get("ddp_step_s") is not None else
           f"compute {1e3 * probe['compute_s']:.0f} + all-reduce {1e3 * probe['allreduce_s']:.0f}")
    return (f"per step: predicted {1e3 * probe['predicted_step_s']:.0f} ms ({how});\n  measured "
            f"{1e3 * results['measured_step_s']:.0f} ms "
            f"(data {1e3 * results['data_s'] / steps:.0f}, compute {1e3 * results['compute_s'] / steps:.0f}, "
            + (f"comm waited in finish_gradient_sync() {1e3 * results['comm_s'] / steps:.0f}" if own else
               f"comm waited for {1e3 * results['comm_s'] / steps:.0f} of {1e3 * results['comm_total_s'] / steps:.0f} "
               f"in flight") + f", idle {1e3 * results['idle_s'] / steps:.0f});\n  predicted speed-up over one rank "
            f"{probe['predicted_speedup']:.2f}x (compare with a 1-rank run in the report)")


def early_stop(history: list[dict], patience: int, ctx) -> str | None:
    """Why to stop now, or None: ``patience`` epochs in a row without a better validation Acc@1.

    Validation numbers are all-reduced, hence the same on every rank; the decision is still taken
    by rank 0 and sent to all, so that no rank can stop alone and leave the others waiting.
    """
    if patience <= 0 or not history:
        return None
    accs = [h["val"]["acc1"] for h in history]
    best = max(range(len(accs)), key=lambda i: (accs[i], -i))   # the first epoch with the best Acc@1
    reason = (f"no better validation Acc@1 for {patience} epoch(s) (best {accs[best]:.2f} % at epoch "
              f"{history[best]['epoch']}, kept in best.pt)") if len(accs) - 1 - best >= patience else None
    return distributed.broadcast_object(reason, ctx)   # DDP: rank 0 decides for all


def _weights_finite(model, ctx) -> bool:
    """Whether every parameter and buffer is finite on every rank (one small collective per epoch)."""
    net = unwrap(model)
    tensors = map(sharding.local, (*net.parameters(), *net.buffers()))   # FSDP: this rank's shards
    bad = sum(int(not torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
    return distributed.all_reduce_sum(torch.tensor([float(bad)], device=ctx.device), ctx).item() == 0


def kept_checkpoint(run_dir, ctx) -> str:
    """What rank 0's run folder holds now, said only if it exists; "" on other ranks (they cannot see it)."""
    if not ctx.is_main:
        return ""
    last = checkpoint.checkpoint_paths(run_dir)[0] if run_dir else None
    if last is None or not last.exists():
        return "no checkpoint was written yet"
    try:
        epoch = checkpoint.load_checkpoint(last)["epoch"] + 1
    except Exception:   # noqa: BLE001 - only for the message
        return f"the checkpoint {last} is kept as it was"
    return f"the checkpoint {last} holds epoch {epoch}"   # a sentence may start with it: never capitalise a path


def evaluate_only(job) -> dict:
    """Evaluate the weights of ``job.state`` (rank 0's checkpoint, sent to all ranks)."""
    settings, ctx, data, model, logger, resume = job.settings, job.ctx, job.data, job.model, job.logger, job.resume
    _wait_for_the_others("evaluating", job)
    sharding.load_model_state(unwrap(model), job.state["model"])
    val = evaluate(model, data.val, settings, ctx)
    logger.info(f"evaluated {resume} on {val['count']} images: loss {val['loss']:.4f} "
                f"acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f}")
    results = summarize(settings, ctx, val, [], 0.0, val["acc1"],
                        extra={"parallel": job.parallel, "comm": "none", "resumed_from": None, "cost": None})
    logger.results(results)
    return results

"""The training loop: ``fit(job)`` = train epochs + exact evaluation + checkpoints + logs.

``job`` comes from ``job.prepare()``, which every entry point (command line, notebooks, labs,
benchmarks) calls the same way. The same code runs on one process and on many: with one rank the
model is not wrapped and every collective is a no-op. The DDP-specific lines are tagged ``# DDP:``.

Read it top to bottom: ``fit`` -> ``train_epochs`` (each epoch: train, evaluate, save) -> ``train_one_epoch``
(each batch: forward, backward, optimizer step). Everything else a run does (the watch, the time split, log
points, the GPU monitor, the profiler, how the gradients travel, local SGD, memory per rank, the cost, early stop,
divergence) is an observer of this loop, called at fixed points (observers.py): it names none. What an observer
wants changed comes back from its hook as an ``Ask``, applied here in a line of its own.
"""
from __future__ import annotations

import time
import weakref

import torch
import torch.nn.functional as F

from . import checkpoint, collectives, distributed
from .metrics import Meter
from .model import forwards_to_add, local_gradients, unwrap
from .observers import Around, Loop
from .optim import (amp_dtype, autocast, build_optimizer, build_scheduler, make_scaler, optimizer_steps, precision_note,
                    to_device)
from .robust import peers
from .runlog import epoch_line, summarize
from .settings import describe_batch
from .watch import watched


def fit(job) -> dict:
    """Train ``settings.epochs`` epochs, evaluate after each, checkpoint on rank 0, return the results.

    ``job`` comes from ``prepare()``: its model is DDP-wrapped when there are several ranks, and
    ``job.state`` (a checkpoint that rank 0 read and sent to every rank) makes training continue
    after the saved epoch. Returns the dict also written to ``results.json`` (accuracies in
    percent), the same on every rank. When another rank stops answering, raises
    ``peers.PeerLost`` with a paragraph that says what was saved and how to resume.
    """
    with watched(job) as around:   # the run's guard and watch; what broke, said (watch.py)
        loop = new_loop(job, around)
        job.state = None   # the loop holds the checkpoint now, and lets go of it once restored (a model's size)
        return train_epochs(loop)


def new_loop(job, around: Around | None = None, **chosen) -> Loop:
    """The run's optimizer, learning-rate schedule and fp16 scaler, in a Loop with the observers the run needs
    (``train_one_epoch(new_loop(job), 0)`` trains one epoch; ``chosen``: the Loop's ``given`` / ``only``)."""
    settings, ctx = job.settings, job.ctx
    optimizer = build_optimizer(job.model, settings, zero=job.parallel == "zero1")   # ZeRO-1: state sharded
    job.optimizer = weakref.ref(optimizer)   # for job.release_group after a failure; the loop owns the optimizer
    scheduler = build_scheduler(optimizer, settings, optimizer_steps(len(job.data.train), settings.accumulate))
    scaler = make_scaler(amp_dtype(settings, ctx.device), ctx.device)
    meta = {"parallel": job.parallel, "resumed_from": job.resume if job.state is not None else None}
    return Loop(job.model, job.data, optimizer, scheduler, scaler, settings, ctx, job.logger, meta=meta,
                state=job.state, log=job.log, around=around, **chosen)


def train_epochs(loop: Loop) -> dict:
    """Each epoch: train, evaluate, save; then the run's results (results.json), the same on every rank."""
    try:
        asked = loop.observers.start(loop)   # how the gradients travel is decided here (speed/comm.py)
        loop.comm, loop.meta = asked.comm, {**loop.meta, **asked.meta}
        if loop.state is not None:
            resume(loop, loop.meta.get("resumed_from"))
        return _train_epochs(loop)
    finally:
        loop.observers.close(loop)   # what the observers started (the GPU monitor's thread), also after an error


def _train_epochs(loop: Loop) -> dict:
    settings, logger = loop.settings, loop.logger
    if loop.state is not None and checkpoint.mend_best(loop.state, logger.run_dir, loop.ctx, settings.init_timeout):
        logger.info(f"best.pt was older than the best epoch ({loop.state['epoch'] + 1}) that last.pt records (a stop "
                    f"between the two writes): written again from it")
    loop.state = None   # restored: its CPU copy of the weights and optimizer state is freed for the run
    precision = amp_dtype(settings, loop.ctx.device) or "fp32"
    logger.info(f"{describe_batch(settings)}; precision {precision}; device {loop.ctx.device}")
    if precision_note(settings, loop.ctx.device):
        logger.info(precision_note(settings, loop.ctx.device))
    val, trained_now, started = None, 0, time.perf_counter()
    for epoch in range(loop.epoch, settings.epochs):
        record, asked = train_and_evaluate(loop, epoch)
        loop.kept.update(asked.keep)   # what the observers keep in the checkpoint (PowerSGD's memory)
        save(loop, record)
        val, trained_now = record["val"], trained_now + 1
        logger.info(epoch_line(settings, record["train"], val, epoch, loop.meta.get("algorithm", "")))
        if asked.stop and epoch + 1 < settings.epochs:   # an observer's reason to stop early (--patience)
            loop.meta.update(stopped_early=epoch + 1, stop_reason=asked.stop)
            logger.info(f"early stop after epoch {epoch + 1} of {settings.epochs}: {asked.stop}")
            break
    wall = time.perf_counter() - started
    if val is None:                    # nothing left to train (resumed after the last epoch)
        val = evaluate(loop.model, loop.data.val, settings, loop.ctx)
    return results(loop, val, trained_now, wall)


def train_and_evaluate(loop: Loop, epoch: int):
    """One epoch's record (its training figures and the exact evaluation after it), and what the observers ask
    at its end: what the checkpoint keeps, a reason to stop early."""
    train = train_one_epoch(loop, epoch)
    val = evaluate(loop.model, loop.data.val, loop.settings, loop.ctx,
                   fetching=lambda waiting: loop.observers.eval_fetching(loop, waiting))   # the watch hears of it
    record = {"epoch": epoch + 1, "train": train, "val": val}
    loop.history.append(record)
    asked = loop.observers.epoch_end(loop, record)   # checks; what the checkpoint keeps; a reason to stop early
    loop.logger.epoch(record, loop.step)   # TensorBoard's and W&B's scalars of the epoch, from the record
    return record, asked


def save(loop: Loop, record: dict) -> None:
    """last.pt every epoch, best.pt when the validation Acc@1 is the best yet (rank 0 writes; a collective)."""
    is_best = record["val"]["acc1"] > loop.best_acc1 or record["epoch"] == 1   # the first epoch gives a best.pt
    loop.best_acc1 = max(loop.best_acc1, record["val"]["acc1"])
    last, best = checkpoint.checkpoint_paths(loop.logger.run_dir) if loop.logger.run_dir else (None, None)
    paths = [p for p in ([last, best] if is_best else [last]) if p]
    checkpoint.save_state(paths, loop)   # with what the observers keep (how the gradients travel)
    # DDP: rank 0 may write for a while; the others wait for it here, not in a collective that times out
    peers.wait_for_all(f"finish saving epoch {record['epoch']}", loop.ctx, loop.settings.init_timeout, loop.logger.info)


def train_one_epoch(loop: Loop, epoch: int) -> dict:
    """Train one pass over this rank's shard; the epoch's global loss, accuracy and time split.

    Each step: a batch, forward, backward (DDP all-reduces the gradients during it), optimizer step. With
    ``settings.accumulate`` K, the gradients of K batches are added up on each rank (DDP's ``no_sync()``) and
    all-reduced once, during the K-th batch's backward pass.
    """
    model, settings, ctx = loop.model, loop.settings, loop.ctx
    model.train()
    loop.epoch, loop.start_step = epoch, loop.step
    batches, k = len(loop.data.train), settings.accumulate   # k batches per optimizer step (the last group maybe fewer)
    loop.observers.epoch_start(loop)
    try:
        for i, (images, labels) in enumerate(loop.data.train.epoch(epoch)):   # DDP: set_epoch happens inside .epoch()
            loop.last, loop.lr = i == batches - 1, loop.scheduler.get_last_lr()[0]   # the lr this step uses
            asked = loop.observers.before_step(loop)
            images, labels = to_device(images, labels, settings, ctx.device)
            first = i - i % k
            group = min(k, batches - first)   # batches in this optimizer step
            loop.updated = i == first + group - 1   # its last batch: all-reduce, then the optimizer step
            if i == first:
                loop.optimizer.zero_grad(set_to_none=True)
            train_step(loop, images, labels, group, send=loop.updated and not asked.no_sync)   # local SGD: no
    finally:                                                                                   # all-reduce at all
        loop.observers.epoch_exit(loop)   # also when a step fails: no half-drawn progress bar left behind
    stats = {}
    loop.observers.epoch_trained(loop, stats)   # the epoch's loss, accuracy and time split, over every rank
    stats.update(epoch=epoch, step=loop.step, steps=loop.step - loop.start_step, lr=loop.lr)   # the last step's lr
    return stats


def train_step(loop: Loop, images, labels, group: int, send: bool) -> None:
    """One training step on one batch: forward, backward (``send``: with DDP's all-reduce), and (for the group's
    last batch) the optimizer step."""
    with local_gradients(loop.model, not send):   # DDP: no_sync() for the group's other batches
        with autocast(loop.dtype, loop.ctx.device):
            logits = loop.model(images)
            loss = F.cross_entropy(logits, labels)
        loop.scaler.scale(loss if group == 1 else loss / group).backward()   # DDP: gradients all-reduced
    loop.skipped = False                                                      # (averaged) during backward
    if loop.updated:
        loop.observers.after_backward(loop)   # --build-ddp: your DDP waits for its all-reduces here
        loop.scaler.unscale_(loop.optimizer)   # fp16: the observers and the optimizer see the true gradients
        loop.observers.before_update(loop)
        loop.skipped = not loop.stepper()   # fp16: the scaler skips a step whose gradients overflowed
        loop.scheduler.step()
    loop.loss, loop.logits, loop.labels, loop.step = loss, logits, labels, loop.step + 1
    asked = loop.observers.after_step(loop)
    if asked.collective_timeout:   # --compile: the short timeout from the second step on (the first compiles)
        distributed.set_collective_timeout(asked.collective_timeout)
    loop.observers.step_end(loop)


def resume(loop: Loop, path) -> None:
    """Continue after the checkpoint's epoch: weights, optimizer, scaler, the schedule at its step but from this
    run's lr (resuming with a smaller lr after a divergence must take effect), best Acc@1 and history."""
    state, settings = loop.state, loop.settings
    checkpoint.restore(state, loop.model, loop.optimizer, loop.scheduler, loop.scaler, loop.ctx)
    per_epoch = optimizer_steps(len(loop.data.train), settings.accumulate)
    _continue_the_schedule(loop.scheduler, state, per_epoch, settings, loop.logger)
    loop.scheduler.base_lrs = [settings.effective_lr] * len(loop.optimizer.param_groups)
    for group, base, factor in zip(loop.optimizer.param_groups, loop.scheduler.base_lrs, loop.scheduler.lr_lambdas):
        group["lr"] = base * factor(loop.scheduler.last_epoch)
    loop.epoch, loop.step, loop.best_acc1 = state["epoch"] + 1, state["step"], state["best_acc1"]
    loop.history = state.get("history", [])   # results then cover the epochs before the interruption too
    loop.logger.info(f"resumed from {path}: continuing at epoch {loop.epoch + 1}")


def results(loop: Loop, val: dict, trained_now: int, wall: float) -> dict:
    """results.json: the evaluation, speed and time split, and every observer's figures; rank 0's on every rank."""
    settings, ctx = loop.settings, loop.ctx
    extra = {"stopped_early": None, "stop_reason": None, **loop.meta,
             "skipped_steps": loop.stepper.skipped}   # fp16: steps the gradient scaler skipped (overflow)
    # DDP: rank 0's run folder, named in every rank's results (the worker notebook's table shows it)
    extra["run_dir"] = collectives.broadcast_object(str(loop.logger.run_dir) if ctx.is_main else None, ctx)
    out = summarize(settings, ctx, val, loop.history, {"wall_time_s": wall, "best_acc1": loop.best_acc1,
                                                       "epochs_run": trained_now, **extra})
    out = collectives.broadcast_object(out, ctx)   # DDP: rank 0's timings on every rank: one table
    loop.observers.results(loop, out)   # GPU use, memory per rank, cost, start-up, the link probe (collectives)
    loop.logger.results(out)
    return out


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


@torch.no_grad()
def evaluate(model, loader, settings, ctx, fetching=None) -> dict:
    """Exact evaluation: each sample of the split counted once across ranks, sums all-reduced.

    Runs on the unwrapped module (no DDP forward, so ranks with fewer batches cannot deadlock; an FSDP
    model's forward all-gathers, so there they add empty batches), and returns the same global {loss, acc1,
    acc5, count} on every rank. ``fetching(waiting)``: told when this rank waits for its next batch (the kit's
    watch then names a rank stuck in its validation loader while the others wait for it in the sums).
    """
    net = unwrap(model)
    collectives.sync_buffers(net, ctx)   # DDP: every rank evaluates rank 0's model, the one saved
    was_training = net.training
    net.eval()
    dtype = amp_dtype(settings, ctx.device)
    meter = Meter(ctx.device)
    padding = forwards_to_add(net, loader, ctx)   # FSDP: as many forwards on every rank
    fetching = fetching or (lambda waiting: None)
    batches = iter(loader)
    while True:
        fetching(True)
        batch = next(batches, None)
        fetching(False)
        if batch is None:
            break
        images, labels = to_device(*batch, settings, ctx.device)
        with autocast(dtype, ctx.device):
            logits = net(images)
        meter.update(F.cross_entropy(logits.float(), labels, reduction="sum"), logits.float(), labels)
    for _ in range(padding):
        net(images[:0])   # FSDP: an empty batch, counted nowhere
    net.train(was_training)
    return meter.reduced(ctx)   # DDP: sums and counts added over ranks

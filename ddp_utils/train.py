"""The training loop: ``fit`` = train epochs + exact evaluation + checkpoints + logs.

The same code runs on one process and on many: with one rank, ``prepare_model`` does not wrap the
model and every collective is a no-op. The DDP-specific lines are tagged ``# DDP:``.
"""
from __future__ import annotations

import contextlib
import math
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import checkpoint, distributed
from .metrics import Meter
from .model import unwrap

# ---------------------------------------------------------------------------------------------
# optimiser, schedule, precision


def build_optimizer(model: torch.nn.Module, settings) -> torch.optim.SGD:
    """SGD with momentum; no weight decay on biases and normalisation weights (1-D tensors)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    return torch.optim.SGD([{"params": decay, "weight_decay": settings.weight_decay},
                            {"params": no_decay, "weight_decay": 0.0}],
                           lr=settings.effective_lr, momentum=settings.momentum)


def lr_factor(step: int, total_steps: int, warmup_steps: int) -> float:
    """Linear warm-up from ~0 to 1, then cosine decay to 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(optimizer, settings, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step schedule: ``settings.warmup_epochs`` of warm-up, cosine over the rest."""
    total = settings.epochs * steps_per_epoch
    warmup = int(settings.warmup_epochs * steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, warmup))


def amp_dtype(settings, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for full fp32. auto: bf16 where the GPU has it, else fp16; off on CPU."""
    mode = settings.amp
    if mode == "auto":
        if device.type != "cuda":
            return None
        mode = "bf16" if torch.cuda.is_bf16_supported() else "fp16"  # the T4 has no bf16
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[mode]


def make_scaler(dtype, device: torch.device):
    """A gradient scaler, active only for fp16 (bf16 has fp32's range and needs none)."""
    enabled = dtype == torch.float16
    if hasattr(torch.amp, "GradScaler"):       # torch >= 2.3
        return torch.amp.GradScaler(device.type, enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled and device.type == "cuda")


def _autocast(dtype, device):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _to_device(images, labels, settings, device):
    non_blocking = device.type == "cuda"
    images = images.to(device, non_blocking=non_blocking)
    if settings.channels_last and device.type == "cuda":
        images = images.contiguous(memory_format=torch.channels_last)
    return images, labels.to(device, non_blocking=non_blocking)


# ---------------------------------------------------------------------------------------------
# one epoch of training, exact evaluation


def train_one_epoch(model, data, optimizer, scheduler, scaler, epoch: int, settings, ctx, logger,
                    start_step: int = 0) -> dict:
    """Train one pass over this rank's shard. Returns global metrics and timing for the epoch.

    Timing: ``data_s`` is time spent waiting for the next batch, ``compute_s`` the rest of the step.
    Loss and hits stay on the device between log points so the GPU is never forced to sync per step.
    """
    from tqdm.auto import tqdm

    model.train()
    dtype = amp_dtype(settings, ctx.device)
    epoch_meter, window = Meter(ctx.device), Meter(ctx.device)
    data_s = compute_s = 0.0
    step = start_step
    bar = tqdm(total=len(data.train), desc=f"epoch {epoch + 1}/{settings.epochs}", disable=not ctx.is_main,
               leave=True, dynamic_ncols=True)
    t_epoch = t_end = time.perf_counter()
    for images, labels in data.train.epoch(epoch):   # DDP: set_epoch happens inside .epoch()
        t_data = time.perf_counter()
        data_s += t_data - t_end
        images, labels = _to_device(images, labels, settings, ctx.device)
        with _autocast(dtype, ctx.device):
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()     # DDP: gradients are all-reduced (averaged) during backward
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        step += 1
        window.update(loss.detach() * labels.shape[0], logits, labels)
        if step % settings.log_every == 0:
            stats = window.reduced(ctx)   # DDP: a collective, reached by every rank at the same step
            epoch_meter.add(window)
            window.reset()
            logger.scalars({"Loss/train": stats["loss"], "acc1/train": stats["acc1"], "acc5/train": stats["acc5"],
                            "lr": scheduler.get_last_lr()[0]}, step)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", acc1=f"{stats['acc1']:.1f}")
        bar.update(1)
        t_end = time.perf_counter()
        compute_s += t_end - t_data
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)    # so the epoch's wall time includes queued GPU work
    wall = time.perf_counter() - t_epoch
    bar.close()
    epoch_meter.add(window)           # the steps since the last log point
    stats = epoch_meter.reduced(ctx)
    # DDP: every rank saw the same number of steps (drop_last), so images/s adds up across ranks.
    rank_ips = stats["count"] / ctx.world_size / max(wall, 1e-9)
    stats.update(epoch=epoch, step=step, wall_s=wall, data_s=data_s, compute_s=compute_s,
                 images_per_s_rank=rank_ips, images_per_s=stats["count"] / max(wall, 1e-9))
    return stats


@torch.no_grad()
def evaluate(model, loader, settings, ctx) -> dict:
    """Exact evaluation: each sample of the split counted once across ranks, sums all-reduced.

    Runs on the unwrapped module (no DDP forward, so ranks with fewer batches cannot deadlock),
    and returns the same global {loss, acc1, acc5, count} on every rank.
    """
    net = unwrap(model)
    distributed.sync_buffers(net, ctx)   # DDP: every rank evaluates rank 0's model, the one saved
    was_training = net.training
    net.eval()
    dtype = amp_dtype(settings, ctx.device)
    meter = Meter(ctx.device)
    for images, labels in loader:
        images, labels = _to_device(images, labels, settings, ctx.device)
        with _autocast(dtype, ctx.device):
            logits = net(images)
        meter.update(F.cross_entropy(logits.float(), labels, reduction="sum"), logits.float(), labels)
    net.train(was_training)
    return meter.reduced(ctx)   # DDP: sums and counts added over ranks


# ---------------------------------------------------------------------------------------------
# checkpoints that work without a shared filesystem


def _gather_rng(ctx) -> list:
    """Every rank's RNG state, gathered so rank 0 can store them all in one file."""
    state = checkpoint.rng_state()
    if not ctx.distributed:
        return [state]
    states = [None] * ctx.world_size
    dist.all_gather_object(states, state)   # DDP: collective
    return states


def save_state(paths, model, optimizer, scheduler, scaler, epoch, step, best_acc1, history, settings,
               ctx) -> None:
    """Write the full training state to each of ``paths`` (rank 0 only; every rank must call this)."""
    rngs = _gather_rng(ctx)   # collective, so that resuming restores each rank's own RNG
    if ctx.is_main:
        state = {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                 "epoch": epoch, "step": step, "best_acc1": best_acc1, "history": history,
                 "settings": settings.to_dict(),
                 "rng": rngs, "torch_version": str(torch.__version__)}
        for path in paths:
            checkpoint.save_checkpoint(path, state)


def load_state(path, ctx) -> dict | None:
    """Rank 0 reads the checkpoint and sends it to the others: the nodes need no shared folder."""
    state = checkpoint.load_checkpoint(path) if ctx.is_main and path else None
    if ctx.distributed:
        state = distributed.broadcast_object(state, ctx)   # DDP: worker nodes get rank 0's file
    return state


def restore(state, model, optimizer, scheduler, scaler, ctx) -> None:
    unwrap(model).load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
    rngs = state["rng"]
    checkpoint.set_rng_state(rngs[ctx.rank] if ctx.rank < len(rngs) else rngs[0])


# ---------------------------------------------------------------------------------------------
# the whole run


def describe_batch(settings) -> str:
    """The effective global batch and lr, which users should always see."""
    lr = (f"{settings.lr} x {settings.global_batch_size}/{settings.lr_reference_batch} = {settings.effective_lr:.4g}"
          if settings.scale_lr else f"{settings.effective_lr:.4g} (not scaled)")
    return (f"global batch {settings.global_batch_size} = {settings.batch_size} per rank x "
            f"{settings.world_size} rank(s); lr {lr}")


def fit(settings, ctx, data, model, logger, resume: str | None = None) -> dict:
    """Train ``settings.epochs`` epochs, evaluate after each, checkpoint on rank 0, return the results.

    ``model`` comes from ``prepare_model`` (DDP-wrapped when several ranks). With ``resume`` (a path
    to last.pt or best.pt on rank 0), training continues after the saved epoch.
    Returns the dict also written to ``results.json`` (accuracies in percent).
    """
    optimizer = build_optimizer(model, settings)
    scheduler = build_scheduler(optimizer, settings, len(data.train))
    dtype = amp_dtype(settings, ctx.device)
    scaler = make_scaler(dtype, ctx.device)
    start_epoch, step, best_acc1, history = 0, 0, 0.0, []
    # DDP: loading is a collective (rank 0 sends its file), so every rank must resume or none.
    distributed.agree({"resume": bool(resume)}, ctx, what="whether to resume")
    state = load_state(resume, ctx) if resume else None
    if state is not None:
        restore(state, model, optimizer, scheduler, scaler, ctx)
        start_epoch, step, best_acc1 = state["epoch"] + 1, state["step"], state["best_acc1"]
        history = state.get("history", [])   # results then cover the epochs before the interruption too
        logger.info(f"resumed from {resume}: continuing at epoch {start_epoch + 1}")
    logger.info(f"{describe_batch(settings)}; precision {dtype or 'fp32'}; device {ctx.device}")

    last_path, best_path = (checkpoint.checkpoint_paths(logger.run_dir) if logger.run_dir else (None, None))
    val, trained_now = None, 0
    t0 = time.perf_counter()
    for epoch in range(start_epoch, settings.epochs):
        train = train_one_epoch(model, data, optimizer, scheduler, scaler, epoch, settings, ctx, logger, step)
        step = train["step"]
        val = evaluate(model, data.val, settings, ctx)
        logger.scalars({"Loss/val": val["loss"], "acc1/val": val["acc1"], "acc5/val": val["acc5"],
                        "throughput/images_per_s": train["images_per_s"],
                        "throughput/images_per_s_rank": train["images_per_s_rank"],
                        "time/data_s": train["data_s"], "time/compute_s": train["compute_s"]}, step)
        is_best = val["acc1"] > best_acc1 or epoch == 0   # epoch 0 always gives a first best.pt
        best_acc1 = max(best_acc1, val["acc1"])
        history.append({"epoch": epoch + 1, "train": train, "val": val})
        trained_now += 1
        paths = [last_path, best_path] if is_best else [last_path]
        save_state([p for p in paths if p], model, optimizer, scheduler, scaler, epoch, step, best_acc1,
                   history, settings, ctx)
        logger.info(f"epoch {epoch + 1}/{settings.epochs}: train loss {train['loss']:.4f} acc1 {train['acc1']:.2f} | "
                    f"val loss {val['loss']:.4f} acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f} | "
                    f"{train['images_per_s']:.0f} img/s global, {train['images_per_s_rank']:.0f} per rank, "
                    f"data wait {100 * train['data_s'] / max(train['wall_s'], 1e-9):.0f}% | {train['wall_s']:.1f}s")
    wall = time.perf_counter() - t0
    if val is None:                    # nothing left to train (resumed after the last epoch)
        val = evaluate(model, data.val, settings, ctx)
    results = summarize(settings, ctx, val, history, wall, best_acc1, epochs_run=trained_now)
    logger.results(results)
    return results


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        return platform.processor() or "unknown CPU"


def summarize(settings, ctx, val, history, wall, best_acc1, epochs_run=None) -> dict:
    """The results dict: final evaluation, speed over every trained epoch, and the hardware."""
    trained = [h["train"] for h in history]
    images = sum(t["count"] for t in trained)
    return {
        "acc1": val["acc1"], "acc5": val["acc5"], "loss": val["loss"], "best_acc1": best_acc1,
        "val_images": val["count"], "epochs": settings.epochs,
        "epochs_run": len(history) if epochs_run is None else epochs_run,
        "world_size": settings.world_size, "global_batch_size": settings.global_batch_size,
        "lr": settings.effective_lr, "wall_time_s": wall,
        "train_time_s": sum(t["wall_s"] for t in trained),
        "images_per_s": images / max(sum(t["wall_s"] for t in trained), 1e-9) if trained else 0.0,
        "data_wait_fraction": (sum(t["data_s"] for t in trained) / max(sum(t["wall_s"] for t in trained), 1e-9)
                               if trained else 0.0),
        "dataset": settings.dataset, "arch": settings.arch, "device": str(ctx.device),
        "device_name": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "backend": ctx.backend or "none", "host": socket.gethostname(), "cpus": os.cpu_count(),
        "cpu_name": _cpu_name(),
        "history": history,
    }


def evaluate_only(settings, ctx, data, model, logger, resume: str) -> dict:
    """Load weights from ``resume`` (rank 0's file, sent to all ranks) and evaluate them."""
    state = load_state(resume, ctx)
    unwrap(model).load_state_dict(state["model"])
    val = evaluate(model, data.val, settings, ctx)
    logger.info(f"evaluated {resume} on {val['count']} images: loss {val['loss']:.4f} "
                f"acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f}")
    results = summarize(settings, ctx, val, [], 0.0, val["acc1"])
    logger.results(results)
    return results

"""Optimiser, learning-rate schedule and mixed precision: the parts of a step that are not DDP.

The same on one process and on many: DDP only changes how the gradients are made, not how the
optimiser uses them.
"""
from __future__ import annotations

import contextlib
import math

import torch
# imported before any process group exists (``import ddp_utils`` comes first): its module gives a helper the
# group of the moment as a default argument, which would keep that group alive for the life of the process
# (a notebook's kernel), and a failed run's teardown could not free it (job.release_group)
from torch.distributed.optim import ZeroRedundancyOptimizer


def build_optimizer(model: torch.nn.Module, settings, zero: bool = False) -> torch.optim.Optimizer:
    """SGD with momentum, or AdamW (``settings.optimizer``); no weight decay on biases and normalisation weights
    (1-D tensors) nor on what the model's registry entry exempts (a ViT's position embedding and class token).
    ``zero`` (parallel=zero1): the same optimizer inside ZeroRedundancyOptimizer, each rank keeping the state of its
    share, or inside the ShardedOptimizer you wrote (build_ddp=f: lab/build_ddp, part f)."""
    from .architectures import architecture
    exempt = architecture(settings.arch).no_decay
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:   # a wrapper's prefix ("module.", "_orig_mod.") before the registry's names
            free = p.ndim <= 1 or any(name == n or name.endswith("." + n) for n in exempt)
            (no_decay if free else decay).append(p)
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kind, options = ((torch.optim.AdamW, {}) if settings.optimizer == "adamw" else
                     (torch.optim.SGD, {"momentum": settings.momentum}))
    if zero and settings.build_ddp == "f":   # yours: the same contract as torch's ZeRO-1
        from .own_ddp import sharded_optimizer
        return sharded_optimizer(groups, kind, lr=settings.effective_lr, **options)
    if zero:   # each rank steps the parameters it owns (about 1/N, by size) and broadcasts them (speed/sharding.py)
        return ZeroRedundancyOptimizer(groups, optimizer_class=kind, lr=settings.effective_lr, **options)
    return kind(groups, lr=settings.effective_lr, **options)


def lr_factor(step: int, total_steps: int, warmup_steps: int) -> float:
    """Linear warm-up from ~0 to 1, then cosine decay to 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def optimizer_steps(batches: int, accumulate: int) -> int:
    """Optimizer steps in an epoch of ``batches``: one per ``accumulate`` batches, the last group maybe shorter."""
    return math.ceil(batches / accumulate)


def build_scheduler(optimizer, settings, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-optimizer-step schedule: ``settings.warmup_epochs`` of warm-up, cosine over the rest."""
    total = settings.epochs * steps_per_epoch
    warmup = int(settings.warmup_epochs * steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, warmup))


BF16_FROM = (8, 0)   # compute capability with native bf16 (A100, A10, L4, H100); the T4 is 7.5


def amp_dtype(settings, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for full fp32. auto: bf16 on GPUs of compute capability 8.0 and later,
    fp16 (with the gradient scaler) before; off on a CPU.

    Decided from the capability, not ``torch.cuda.is_bf16_supported()``: that answers True on a T4 too
    (bf16 is emulated there), and cuDNN has no fast bf16 convolutions before 8.0."""
    mode = settings.amp
    native_bf16 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= BF16_FROM
    if mode == "auto":
        if device.type != "cuda":
            return None
        mode = "bf16" if native_bf16 else "fp16"
    if mode == "bf16" and device.type == "cuda" and not native_bf16:
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"amp=bf16 on {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}): "
                         f"this GPU has no native bf16 (it needs {BF16_FROM[0]}.{BF16_FROM[1]}, an A100, A10 or newer), "
                         f"so PyTorch would emulate it, far slower. Use amp=fp16 (with the gradient scaler) or "
                         f"amp=auto, which picks fp16 here.")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[mode]


def precision_note(settings, device: torch.device) -> str:
    """A line when the precision asked for is a slow one on this device, else ""."""
    if device.type == "cpu" and settings.amp == "fp16":
        return ("note: amp=fp16 on a CPU: a CPU has no fast float16 arithmetic, so this run computes many times "
                "slower than in fp32 (amp=off) or bf16; fp16 is for GPUs without bf16 (a T4)")
    return ""


def precision_name(settings, device: torch.device) -> str:
    """"bf16", "fp16" or "fp32": what ``amp_dtype`` gives on this device (every rank must compute alike)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[amp_dtype(settings, device)]


def make_scaler(dtype, device: torch.device):
    """A gradient scaler, active only for fp16 (bf16 has fp32's range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


class ScaledStep:
    """``scaler.step(optimizer)`` then ``scaler.update()``, telling whether the optimizer really stepped.

    With fp16 the gradient scaler skips a step whose gradients overflowed (inf / NaN) and halves its
    scale: normal now and then, above all in the first steps. A run whose steps keep being skipped
    learns nothing while its loss and weights stay finite, so no other check notices it:
    ``in_a_row`` counts the skipped steps since the last real one, ``skipped`` all of them. The
    optimizer's own step hook says whether it ran, so this costs no extra GPU synchronisation.
    """

    def __init__(self, optimizer, scaler):
        self.optimizer, self.scaler = optimizer, scaler
        self.in_a_row = self.skipped = 0
        self._ran = False
        optimizer.register_step_post_hook(self._note)

    def _note(self, *_) -> None:
        self._ran = True

    def __call__(self) -> bool:
        self._ran = False
        self.scaler.step(self.optimizer)
        self.scaler.update()
        ran = self._ran or not self.scaler.is_enabled()
        self.in_a_row = 0 if ran else self.in_a_row + 1
        self.skipped += not ran
        return ran


def autocast(dtype, device):
    """torch.autocast for ``dtype``, or a context that does nothing for full fp32."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def use_fast_gpu_kernels(device: torch.device) -> None:
    """On a GPU: let cuDNN time its convolution algorithms once and keep the fastest (every batch has
    the same shape here: drop_last and fixed crops), and let fp32 matrix products use TF32 on Ampere and
    later (fp32 runs: a tenth of the mantissa lost, several times the speed; autocast runs are unaffected)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True


# Where --channels-last takes effect: cuDNN's NHWC convolutions are the fast ones; on a CPU the kit leaves the
# layout alone. Tests add "cpu" to run a GPU run's path on a CPU (tests/helpers/mode_matrix.py).
NHWC_DEVICES = {"cuda"}


def channels_last_on(settings, device: torch.device) -> bool:
    """Whether models and batches take the channels_last (NHWC) layout on ``device``."""
    return settings.channels_last and device.type in NHWC_DEVICES


def to_device(images, labels, settings, device):
    """Move a batch to ``device`` without blocking, in channels_last layout on a GPU when asked."""
    non_blocking = device.type == "cuda"
    images = images.to(device, non_blocking=non_blocking)
    if channels_last_on(settings, device):
        images = images.contiguous(memory_format=torch.channels_last)
    return images, labels.to(device, non_blocking=non_blocking)

"""Models: build one by name (its facts: architectures.py; the kit's own small nets: nets.py), then place it on
the device and (DDP:) wrap it for several ranks."""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import distributed, own_ddp, parallel
from .architectures import architecture
from .optim import amp_dtype, channels_last_on, use_fast_gpu_kernels
from .robust import peers


def build_model(arch: str, num_classes: int, seed: int | None = None, image_size: int = 0) -> nn.Module:
    """A freshly initialised classifier by name (the registry's, architectures.py, or any torchvision one) for
    images of ``image_size`` px (0: the size it is made for; a ViT is built for the size it will see).

    ``seed``: seeds PyTorch's global generator first (``torch.manual_seed``), so that the initial
    weights are reproducible; under DDP every rank then starts from rank 0's copy anyway."""
    entry = architecture(arch)   # ValueError for an unknown name, before the seed is touched
    if seed is not None:
        torch.manual_seed(seed)
    return entry.build(num_classes, image_size or entry.default_size)


class AutocastInReplicas(nn.Module):
    """DataParallel's wrapped model: enters autocast with the run's dtype inside every replica's forward.

    DataParallel runs each GPU's replica in a thread of its own, and re-enters autocast there without the
    dtype (PyTorch issue 125186): a new thread's default is fp16, so a bf16 run computed in fp16 with no
    scaler while its results said bf16. ``unwrap`` sees through this wrapper: checkpoints keep plain keys."""

    def __init__(self, module: nn.Module, dtype, device_type: str = "cuda"):
        super().__init__()
        self.module, self.dtype, self.device_type = module, dtype, device_type

    def forward(self, *args, **kwargs):
        if self.dtype is None or not _autocast_on(self.device_type):
            return self.module(*args, **kwargs)
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:   # torch < 2.4 asks without a device: CUDA's
        return torch.is_autocast_enabled()


def parallel_mode(settings, ctx) -> str:
    """What really runs: ``ddp`` with several ranks (a sharded mode when asked for: ``zero1`` or ``fsdp``, from
    speed/sharding.py), ``dp`` when DataParallel was asked for (one process), else ``none`` (one process, one
    device, no wrapper).
    DataParallel over one GPU or on a CPU splits nothing (torch then calls the model itself): a rehearsal of its
    code path where the node has fewer than 2 GPUs, as the homework's nodes do, and ``describe_parallel`` says so.
    zero1 and fsdp on one process have nothing to shard: ``none``, said too."""
    if ctx.distributed:
        if settings.build_ddp == "f":   # your ShardedOptimizer (lab/build_ddp, part f) as ZeRO-1's
            return "zero1"
        return settings.parallel if _sharded(settings.parallel) else "ddp"
    return "dp" if settings.parallel == "dp" else "none"


def devices_used(mode: str, ctx) -> list[torch.device]:
    """The devices this process computes on: every visible GPU under DataParallel on a GPU, else its own device."""
    if mode == "dp" and ctx.device.type == "cuda":
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [ctx.device]


def describe_parallel(settings, ctx, model: nn.Module | None = None) -> str:
    """What runs, in a line or two (rank 0 prints it); ``model``: the prepared one, whose FSDP blocks are counted."""
    mode = parallel_mode(settings, ctx)
    if mode == "dp":
        n = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
        if n >= 2:
            return (f"parallel: DataParallel over {n} GPUs in one process; each step splits the batch of "
                    f"{settings.batch_size} into {n} parts and gathers the outputs on cuda:0")
        # torch's DataParallel.forward: with one GPU, or none, it calls the wrapped model itself
        where = "over 1 GPU" if n else f"on the {ctx.device.type.upper()} (DataParallel splits over GPUs only)"
        return (f"parallel: DataParallel {where} in one process: nothing to split, so torch runs the model "
                f"directly (no replicas, no gather): a rehearsal of DP's code path, not of its cost; a node "
                f"with 2+ GPUs splits each batch between them")
    if mode == "ddp" and settings.build_ddp:
        return (f"parallel: {ctx.world_size} processes, {own_ddp.named(settings.build_ddp)} from lab/build_ddp/"
                f"{own_ddp.which()}, part {settings.build_ddp}: {own_ddp.PARTS[settings.build_ddp]}")
    if mode == "zero1" and settings.build_ddp == "f":   # your ShardedOptimizer as ZeRO-1's
        return (f"parallel: ZeRO-1, {ctx.world_size} processes: DDP all-reduces the gradients; "
                f"{own_ddp.named('f')} from lab/build_ddp/{own_ddp.which()},\n  part f: "
                f"{own_ddp.PARTS['f']}")
    if mode == "ddp":
        return f"parallel: DDP, {ctx.world_size} processes, gradients all-reduced in buckets during backward"
    if _sharded(mode):
        return parallel.MODES[mode].describe(settings, ctx, model)
    if _sharded(settings.parallel):
        return (f"parallel: {settings.parallel} with one process: nothing to shard, so plain one-process training "
                f"on {ctx.device}\n  (recorded as none)")
    return f"parallel: none, one process on {ctx.device}"


def prepare_model(model: nn.Module, settings, ctx, log=print) -> nn.Module:
    """Move to the device, apply the speed settings and, with several ranks, wrap in
    ``DistributedDataParallel`` (buckets of ``bucket_mb``; how its gradients travel is decided when
    training starts: ``train.fit``); DataParallel for parallel=dp (over every GPU of the node); for parallel=fsdp
    a sharded mode's own placing (fsdp: its blocks and root sharded in place, ``speed/sharding.py``; zero1 is DDP
    here).

    Returns the module to train with; ``unwrap(result)`` gives back the plain model. Rank 0 says
    what runs (``describe_parallel``). On an error every rank is told and the process group is left.
    """
    with distributed.leaving_on_error(ctx):
        # DDP: the wrap is a collective (rank 0's weights go to every rank); the other notebook may still be
        # at an earlier cell, so wait for it here, up to init_timeout, not in a collective that times out
        peers.wait_for_all("start the model cell (prepare_model)", ctx, settings.init_timeout, log)
        model = _place(model, settings, ctx)
        use_fast_gpu_kernels(ctx.device)   # cuDNN's autotuner and TF32 on a GPU
        if ctx.is_main:
            log(describe_parallel(settings, ctx, model))
    return model


def _place(model: nn.Module, settings, ctx) -> nn.Module:
    if settings.build_ddp and not ctx.distributed:   # settings.json would say a DDP that never ran
        raise ValueError(f"build_ddp={settings.build_ddp!r} trains with your own DDP (lab/build_ddp) between ranks, but "
                         f"this run is one process: there is nothing to synchronise, and it would train plainly while "
                         f"its settings say {settings.build_ddp!r}. Run it on 2 or more ranks (world_size; on one "
                         f"machine: launch --nproc-per-node 2), or leave build_ddp empty.")
    if settings.sync_bn and ctx.distributed:
        if ctx.device.type != "cuda":
            raise ValueError("sync_bn needs GPUs: PyTorch's SyncBatchNorm has no CPU implementation. "
                             "Turn sync_bn off for CPU runs.")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # DDP: BN statistics over the global batch
    model = model.to(ctx.device)
    mode = parallel.MODES[parallel_mode(settings, ctx)]
    placing = mode.places_model   # a mode that places the model itself (FSDP shards it)
    # FSDP2 shards only contiguous parameters: under fsdp the weights stay NCHW, and the batches alone go
    # channels_last (a convolution takes its layout from its input)
    if channels_last_on(settings, ctx.device) and not placing:
        model = model.to(memory_format=torch.channels_last)
    if placing:   # FSDP: no wrapper; the model's blocks are sharded in place
        model = mode.place(model, settings, ctx)
        return torch.compile(model) if settings.compile else model
    if ctx.distributed and settings.build_ddp in own_ddp.WRAPPERS:   # the DDP you wrote (lab/build_ddp)
        model = own_ddp.wrap(model, settings.build_ddp, settings.bucket_mb)
    elif ctx.distributed:
        # DDP: the wrap. It copies rank 0's weights to every rank now, then during each backward pass
        # all-reduces (averages) the gradients in buckets, overlapped with the rest of the backward.
        # gradient_as_bucket_view lets gradients live inside the communication buffers (no copy).
        # static_graph: the same layers run every step, so DDP can skip per-step bookkeeping.
        model = wrap_ddp(model, settings, ctx)
    elif parallel_mode(settings, ctx) == "dp":
        # every visible GPU; outputs gathered on cuda:0; each replica computes in the run's precision
        model = nn.DataParallel(AutocastInReplicas(model, amp_dtype(settings, ctx.device)))
    if settings.compile:
        model = torch.compile(model)
    return model


def wrap_ddp(model: nn.Module, settings, ctx) -> DDP:
    """``model`` in DistributedDataParallel as the kit trains it (the link probe times a copy wrapped alike)."""
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               gradient_as_bucket_view=True, bucket_cap_mb=settings.bucket_mb, static_graph=settings.static_graph,
               find_unused_parameters=settings.find_unused_parameters)


def local_gradients(model: nn.Module, local: bool):
    """DDP's ``no_sync()`` (a sharded mode's, FSDP's) while ``local``: this batch's gradients are added to the
    ones already there, not all-reduced (gradient accumulation). Nothing for one process or DataParallel."""
    if not local:
        return contextlib.nullcontext()
    net = unwrap(model)
    return model.no_sync() if hasattr(model, "no_sync") else parallel.of_state(net).no_sync(net)


def forwards_to_add(net: nn.Module, loader, ctx) -> int:
    """FSDP: the empty forwards this rank adds after its evaluation batches (every rank runs as many: each
    forward all-gathers); 0 for any other model (parallel.py's modes)."""
    return parallel.of_state(net).forwards_to_add(net, loader, ctx)


def ddp_of(model: nn.Module) -> DDP | None:
    """The DDP wrapper of ``model`` (also under torch.compile), or None."""
    while model is not None and not isinstance(model, DDP):
        model = getattr(model, "_orig_mod", None)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP / DataParallel (``.module``) and torch.compile (``._orig_mod``)."""
    while True:
        if isinstance(model, (DDP, nn.DataParallel, AutocastInReplicas)) or own_ddp.is_own(model):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def _sharded(name: str) -> bool:
    """Whether ``name`` is a registered mode that splits what a DDP rank holds (zero1, fsdp: speed/sharding.py)."""
    return name in parallel.MODES and parallel.MODES[name].sharded

"""``build_data``: this rank's train and validation loaders, checked once, built once.

    data = build_data(settings, ctx)                      # DDP: this rank's share of every epoch
    for epoch in range(settings.epochs):
        for images, labels in data.train.epoch(epoch):   # DDP: calls sampler.set_epoch(epoch) itself
            ...                                           # images (B, 3, H, W) float32, labels (B,) int64
        for images, labels in data.val:                   # this rank's share; all ranks together see
            ...                                           # every validation image exactly once

Every training loader draws its indices from a ``DistributedSampler(num_replicas=world_size,
rank=rank, seed=seed, drop_last=True)``: each epoch it shuffles the whole split with ``seed + epoch``
(the same order on every rank) and gives rank r every world_size-th index from r on, so the ranks'
shares are disjoint and of equal size. ``set_epoch(epoch)`` picks the epoch's shuffle; without it
every epoch would repeat the first one. ``datasets.TrainLoader`` does both, once for every loader.

It checks the folders (``datasets.check_data``), then picks one of four loader pairs with the same
shards and steps: ``workers`` (DataLoader worker processes decode each epoch, any preset; for ImageNet
they send uint8 crops that are normalised batched on the device, ``fastjpeg.py``), ``memory`` (decode
once into a uint8 tensor, ``memdata.py``; cinic10 and demo), ``dali`` (NVIDIA DALI decodes and
augments, fed the kit's own sampler indices, ``dali.py``; imagenet) or ``nvjpeg`` (workers read the files,
torchvision's nvJPEG decodes and crops on the GPU, ``nvjpeg.py``; imagenet). The pieces live in ``datasets.py``,
``fastjpeg.py``, ``memdata.py``, ``dali.py`` and ``nvjpeg.py``; this module only decides and assembles.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader

from . import distributed
from .datasets import (Data, EpochLoader, EvalShardSampler, ImageFolderDataset, check_batch_fits, check_data,
                       close_inherited_listeners, eval_transform, fake_dataset, load_preset, train_sampler,
                       train_transform, worker_context)
from .presets import auto_loader
from .speed import fastjpeg, regionjpeg
from .speed.dali import build_dali_data, check_dali_dataset
from .robust.threads import set_threads
from .speed.memdata import build_memory_data, check_memory_dataset
from .speed.nvjpeg import build_nvjpeg_data, check_nvjpeg_dataset, decoder_warning

__all__ = ["build_data", "build_loaders"]


def build_data(settings, ctx, log=print) -> Data:
    """This rank's loaders (``build_loaders``), and the ranks' agreement that they read the same data.

    Each node reads its own copy from its own disk, so after building the ranks compare what they
    found (classes, image counts, statistics: ``Data.fingerprint``) and stop with a paragraph if a
    node's copy differs. On an error every rank is told and the process group is left.
    """
    with distributed.leaving_on_error(ctx):
        # DDP: the other notebook may still be at an earlier cell: wait for it (up to init_timeout) before the
        # cell's first collective (which ranks share this machine), not in one that times out
        distributed.wait_for_all("start the data cell (build_data)", ctx, settings.init_timeout, log)
        set_threads(settings, ctx, log)       # ranks sharing a machine share its cores
        data = build_loaders(settings, ctx.rank, ctx.world_size, ctx.device)   # DDP: a DistributedSampler each
        warning = decoder_warning(ctx.device) if loader_for(settings) == "nvjpeg" else None
        if warning and ctx.is_main:
            log(warning)   # a GPU without nvJPEG's hardware decoder (a T4, an A10): the run goes on
        # DDP: reading the data can take minutes on one node (a cold disk): wait for it explicitly
        distributed.wait_for_all("finish reading the data", ctx, settings.init_timeout, log)
        distributed.agree(data.fingerprint(), ctx, what="data")   # DDP: the same data on every node
    return data


def loader_for(settings) -> str:
    """``settings.loader`` with ``auto`` resolved by the preset (``presets.auto_loader``)."""
    return settings.loader if settings.loader != "auto" else auto_loader(settings.dataset)


def build_loaders(settings, rank: int, world_size: int, device: torch.device | str | None = None) -> Data:
    """Check the data (``check_data``) and build this rank's train and validation loaders.

    Train: DistributedSampler (shuffle with ``settings.seed``, drop_last), so each rank gets a
    disjoint 1/world_size of the split each epoch, in full batches of ``settings.batch_size``.
    Val: EvalShardSampler, every image exactly once across ranks, last batch may be short.
    ``device`` decides ``pin_memory`` (on for CUDA), where ImageNet's batches are normalised (its
    workers send uint8), and for the memory loader where the images live; DALI decodes on it.
    Raises DataError.
    """
    loader = loader_for(settings)
    if loader == "memory":
        check_memory_dataset(settings.dataset)   # ImageNet: fail before scanning its folders
    if loader == "dali":
        check_dali_dataset(settings.dataset)     # and DALI installed: fail before scanning the folders
    if loader == "nvjpeg":
        check_nvjpeg_dataset(settings.dataset)
    found = check_data(settings)
    preset = load_preset(settings.dataset, settings.data_dir)
    size = settings.image_size or preset.image_size
    val_split = settings.val_split or preset.val_split
    root = Path(settings.data_dir).expanduser()
    if loader == "memory":
        return build_memory_data(root, preset, size, val_split, found["classes"], settings.batch_size,
                                 settings.seed, settings.max_steps_per_epoch, settings.workers, rank,
                                 world_size, device)
    if loader == "dali":
        return build_dali_data(root, preset, size, val_split, found["classes"], settings.batch_size, settings.seed,
                               settings.max_steps_per_epoch, settings.workers, rank, world_size, device,
                               settings.channels_last)
    if loader == "nvjpeg":
        return build_nvjpeg_data(root, preset, size, val_split, found["classes"], settings.batch_size, settings.seed,
                                 settings.max_steps_per_epoch, settings.workers, rank, world_size, device,
                                 settings.channels_last)
    # ImageNet: the workers decode with libjpeg-turbo and send uint8 crops, normalised here per batch.
    uint8 = preset.crop == "resized"
    if uint8:
        if regionjpeg.available():   # only each crop's box decoded: the same crops, a fifth less CPU an image
            train_set = ImageFolderDataset(root / preset.train_split, regionjpeg.RegionCropFlip(size, preset.hflip),
                                           loader=str)   # the crop reads the file itself
        else:
            train_set = ImageFolderDataset(root / preset.train_split, fastjpeg.train_transform(preset, size),
                                           loader=fastjpeg.decode_rgb)
        val_set = ImageFolderDataset(root / val_split, fastjpeg.eval_transform(preset, size),
                                     loader=fastjpeg.decode_rgb)
    elif preset.folders:
        train_set = ImageFolderDataset(root / preset.train_split, train_transform(preset, size))
        val_set = ImageFolderDataset(root / val_split, eval_transform(preset, size))
    else:
        train_set = fake_dataset("train", preset, size)
        val_set = fake_dataset("val", preset, size)
    check_batch_fits(len(train_set), settings.batch_size, world_size,
                     f"in {settings.data_dir}" if preset.folders else "of fake data")

    cuda = device is not None and torch.device(device).type == "cuda"
    loader_args = dict(batch_size=settings.batch_size, num_workers=settings.workers,
                       pin_memory=cuda,                             # faster host-to-GPU copies
                       worker_init_fn=close_inherited_listeners,    # workers must not keep master_port
                       multiprocessing_context=worker_context(settings.workers))   # nor free the parent's garbage
    sampler = train_sampler(len(train_set), rank, world_size, settings.seed)   # DDP: a DistributedSampler
    # The generator seeds the workers' augmentation; EpochLoader reseeds it every epoch with
    # datasets.augmentation_seed(seed, rank, epoch). Train workers are not persistent, so they
    # pick up the new seeds each epoch.
    train = DataLoader(train_set, sampler=sampler, drop_last=True, generator=torch.Generator(), **loader_args)
    val = DataLoader(val_set, sampler=EvalShardSampler(val_set, rank, world_size), drop_last=False,
                     persistent_workers=settings.workers > 0, **loader_args)   # no restart per epoch
    if uint8:
        to_device = fastjpeg.DeviceNormalize(preset, device, settings.channels_last)
        train = fastjpeg.NormalizedEpochLoader(train, to_device, settings.max_steps_per_epoch, settings.seed, rank)
        val = fastjpeg.NormalizedLoader(val, to_device)
    else:
        train = EpochLoader(train, settings.max_steps_per_epoch, seed=settings.seed, rank=rank)
    return Data(train=train, val=val,
                num_classes=len(found["classes"]), classes=found["classes"],
                train_size=len(train_set), val_size=len(val_set), image_size=size, preset=preset,
                val_split=val_split)

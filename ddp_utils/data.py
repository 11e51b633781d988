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
every epoch would repeat the first one. ``loaders.TrainLoader`` does both, once for every loader.

It checks the folders (``datasets.check_data``), then builds with the loader the settings name, a row of the table
``loaders.LOADERS``: ``workers`` is this module's (DataLoader worker processes decode each epoch, any preset; a
crop style may decode its own way: ``WORKERS_BY_CROP``, where speed/fastjpeg.py puts ImageNet's uint8 crops,
normalised batched on the device); speed/ registers ``memory``, ``dali`` and ``nvjpeg``. Each builder takes the
preset, the settings and the rank's ``Source``; this module only picks and checks.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import DataLoader

from . import collectives, distributed
from .datasets import DataError, ImageFolderDataset, check_data, eval_transform, fake_dataset, load_preset, \
    train_transform
from .loaders import (LOADERS, Data, EpochLoader, EvalShardSampler, Loader, Source, auto_loader, check_batch_fits,
                      check_presets, close_inherited_listeners, register_loader, train_sampler, worker_context)
from .presets import loader_refusal
from .robust import peers
from .robust.threads import set_threads

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
        peers.wait_for_all("start the data cell (build_data)", ctx, settings.init_timeout, log)
        set_threads(settings, ctx, log)       # ranks sharing a machine share its cores
        data = build_loaders(settings, ctx.rank, ctx.world_size, ctx.device)   # DDP: a DistributedSampler each
        warning = LOADERS[loader_for(settings)].warning(ctx.device)
        if warning and ctx.is_main:
            log(warning)   # e.g. a GPU without nvJPEG's hardware decoder (a T4, an A10): the run goes on
        # DDP: reading the data can take minutes on one node (a cold disk): wait for it explicitly
        peers.wait_for_all("finish reading the data", ctx, settings.init_timeout, log)
        collectives.agree(data.fingerprint(), ctx, what="data")   # DDP: the same data on every node
    return data


def loader_for(settings) -> str:
    """``settings.loader`` with ``auto`` resolved by the preset (``loaders.auto_loader``)."""
    return settings.loader if settings.loader != "auto" else auto_loader(settings.dataset)


def build_loaders(settings, rank: int, world_size: int, device: torch.device | str | None = None) -> Data:
    """Check the data (``check_data``) and build this rank's train and validation loaders with the loader
    ``settings.loader`` names (``loaders.LOADERS``).

    Train: DistributedSampler (shuffle with ``settings.seed``, drop_last), so each rank gets a
    disjoint 1/world_size of the split each epoch, in full batches of ``settings.batch_size``.
    Val: EvalShardSampler, every image exactly once across ranks, last batch may be short.
    ``device`` decides ``pin_memory`` (on for CUDA), where ImageNet's batches are normalised (its
    workers send uint8), and for the memory loader where the images live; DALI decodes on it.
    Raises DataError.
    """
    loader = LOADERS[loader_for(settings)]
    check_presets()   # a preset added since the kit loaded (a test's, a TA's) names loaders that exist
    why_not = loader_refusal(settings.dataset, loader.name) or loader.missing()
    if why_not:   # before scanning the folders (ImageNet's take minutes)
        raise DataError(why_not)
    found = check_data(settings)
    preset = load_preset(settings.dataset, settings.data_dir)
    source = Source(Path(settings.data_dir).expanduser(), found["classes"], settings.image_size or preset.image_size,
                    settings.val_split or preset.val_split, rank, world_size,
                    torch.device(device) if device is not None else None)
    return loader.build(preset, settings, source)


# -- the workers path ------------------------------------------------------------------------------------------------
# A crop style that decodes its own way in the worker processes: preset.crop -> builder(preset, settings, source).
# speed/fastjpeg.py registers ImageNet's ("resized"): uint8 crops from libjpeg-turbo, normalised on the device.
WORKERS_BY_CROP: dict[str, Callable] = {}


def build_workers(preset, settings, source: Source) -> Data:
    """``--loader workers``: DataLoader worker processes decode and augment each image, every epoch (Pillow and
    torchvision's transforms; a crop style of ``WORKERS_BY_CROP`` its own way). Any preset."""
    if preset.crop in WORKERS_BY_CROP:
        return WORKERS_BY_CROP[preset.crop](preset, settings, source)
    if preset.folders:
        train_set = ImageFolderDataset(source.root / preset.train_split, train_transform(preset, source.image_size))
        val_set = ImageFolderDataset(source.root / source.val_split, eval_transform(preset, source.image_size))
    else:
        train_set = fake_dataset("train", preset, source.image_size)
        val_set = fake_dataset("val", preset, source.image_size)
    train, val = worker_loaders(train_set, val_set, settings, source, f"in {settings.data_dir}" if preset.folders
                                else "of fake data")
    train = EpochLoader(train, settings.max_steps_per_epoch, seed=settings.seed, rank=source.rank)
    return source.data(train, val, (len(train_set), len(val_set)), preset)


def worker_loaders(train_set, val_set, settings, source: Source, where: str) -> tuple[DataLoader, DataLoader]:
    """The two DataLoaders of the workers path: the train split through this rank's DistributedSampler (full
    batches), the validation split through ``EvalShardSampler`` (every image once over the ranks); ``where`` names
    the images in the message when a rank's share is smaller than a batch."""
    check_batch_fits(len(train_set), settings.batch_size, source.world_size, where)
    cuda = source.device is not None and source.device.type == "cuda"
    loader_args = dict(batch_size=settings.batch_size, num_workers=settings.workers,
                       pin_memory=cuda,                             # faster host-to-GPU copies
                       worker_init_fn=close_inherited_listeners,    # workers must not keep master_port
                       multiprocessing_context=worker_context(settings.workers))   # nor free the parent's garbage
    sampler = train_sampler(len(train_set), source.rank, source.world_size, settings.seed)   # DDP: DistributedSampler
    # The generator seeds the workers' augmentation; EpochLoader reseeds it every epoch with
    # loaders.augmentation_seed(seed, rank, epoch). Train workers are not persistent, so they
    # pick up the new seeds each epoch.
    train = DataLoader(train_set, sampler=sampler, drop_last=True, generator=torch.Generator(), **loader_args)
    val = DataLoader(val_set, sampler=EvalShardSampler(val_set, source.rank, source.world_size), drop_last=False,
                     persistent_workers=settings.workers > 0, **loader_args)   # no restart per epoch
    return train, val


register_loader(Loader("workers", "DataLoader worker processes decode and augment each image (Pillow, libjpeg-turbo)",
                       build_workers))

"""loader='dali': NVIDIA DALI decodes and augments ImageNet, fed the kit's own sampler indices.

    settings = Settings(dataset="imagenet", data_dir="/data/imagenet", loader="dali")
    data = build_loaders(settings, rank, world_size, device)    # the same Data as the workers path

Why: on a GPU node with few CPU cores the JPEG decode is the wall. With a GPU, DALI's "mixed" decoder runs
nvJPEG (the hardware JPEG decoder on A100/H100) and the crop, resize, flip and normalisation run as GPU
kernels: the CPU only reads the files. Without a GPU the same pipeline runs on the CPU (``device_id=None``),
which is how the CPU test suite checks this path. ``workers`` CPU threads help DALI either way.

What stays the kit's, by construction:
- shards and ``set_epoch``: DALI's file reader gets this rank's list of files for the pass, in the order of
  a DistributedSampler over the split (same seed, epoch, rank, world size, drop_last), not DALI's own
  shuffling and shard_id/num_shards, so every rank trains on exactly the workers path's indices. The reader
  reads them on DALI's threads, ahead of the training loop (no Python callback on the training thread);
- exact evaluation: EvalShardSampler's indices (rank r gets images r, r + W, ...), the last batch short;
- seeding: epoch e's pipeline is built with seed ``augmentation_seed(seed, rank, e)``: the same crops on a
  re-run and after a resume, other crops for every rank and epoch (DALI's own random stream, so not the
  workers path's crops);
- the recipe: random area 8-100 % and aspect 3/4-4/3 (``image_random_crop`` decodes only the crop's
  region), antialiased resize to S x S, flip, the preset's mean and std; val: short side to S * 256/224,
  centre S x S. DALI's resize rounds sizes its own way, so its validation tensors are close to the
  workers path's, not equal to them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from ..datasets import DataError, ImageFolderDataset, Preset, load_rgb
from ..loaders import (Data, EvalShardSampler, Loader, Source, TrainLoader, augmentation_seed, check_batch_fits,
                       register_loader, train_sampler)
from ..presets import loader_refusal

__all__ = ["require_dali", "check_dali_dataset", "DaliTrainLoader", "DaliEvalLoader",
           "build_dali_data"]


def require_dali() -> str:
    """DALI's version; DataError with what to install unless NVIDIA DALI imports."""
    try:
        import nvidia.dali
    except ImportError as e:
        raise DataError(
            f"loader='dali' needs NVIDIA DALI, which this Python cannot import ({e}). Inside the NVIDIA PyTorch "
            f"container (nvcr.io/nvidia/pytorch, what docker/run.sh starts) it is already installed. Elsewhere "
            f"install the build for your CUDA driver: pip install nvidia-dali-cuda120 (CUDA 12; "
            f"nvidia-dali-cuda130 for CUDA 13), about 420 MB; it does not install or replace torch. Or train "
            f"with loader='workers' (--loader workers), which needs nothing more.") from None
    return nvidia.dali.__version__


def check_dali_dataset(dataset: str) -> str:
    """DALI's version; DataError unless ``dataset``'s preset takes this loader (presets.py) and DALI is installed."""
    refusal = loader_refusal(dataset, "dali")
    if refusal:
        raise DataError(refusal)
    return require_dali()


class _FileBatches:
    """The files of one pass, in the kit's order: batch ``step`` is ``batch_size`` files of ``indices``."""

    def __init__(self, samples: list[tuple[str, int]], indices: list[int], batch_size: int, steps: int):
        self.samples, self.indices, self.batch_size, self.steps = samples, indices, batch_size, steps

    def files(self) -> tuple[list[str], list[int]]:
        """Paths and labels of the pass (``steps`` batches; the last one may be short), for DALI's file reader."""
        chosen = [self.samples[i] for i in self.indices[:self.steps * self.batch_size]]
        return [path for path, _ in chosen], [label for _, label in chosen]

    def batch(self, step: int) -> list[tuple[str, int]]:
        return [self.samples[i] for i in self.indices[step * self.batch_size:(step + 1) * self.batch_size]]

    def recent_paths(self, delivered: int, ahead: int = 3) -> list[str]:
        """The files of the batches DALI may have been decoding after ``delivered`` batches: a decode error is
        in one of them (it reads and decodes a few batches ahead)."""
        return [path for step in range(delivered, min(self.steps, delivered + ahead)) for path, _ in self.batch(step)]


@dataclass(frozen=True)
class Decoding:
    """How this rank's DALI pipelines make batches: ``preset``'s crops and statistics at ``image_size`` px, with
    ``threads`` CPU threads, on GPU ``device_id`` (None: DALI's CPU pipeline), channels_last there when asked."""
    preset: Preset
    image_size: int
    threads: int = 1
    device_id: int | None = None
    channels_last: bool = False


def _pipeline(source: _FileBatches, train: bool, how: Decoding, seed: int):
    """The DALI pipeline of one pass: file bytes -> normalised float32 crops (on the GPU with a device_id)."""
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline

    preset, size, channels_last = how.preset, how.image_size, how.channels_last
    pipe = Pipeline(batch_size=source.batch_size, num_threads=how.threads, device_id=how.device_id, seed=seed,
                    prefetch_queue_depth=2)
    decoder = "cpu" if how.device_id is None else "mixed"   # mixed: nvJPEG on the GPU, bytes in from the CPU
    paths, targets = source.files()
    with pipe:
        # DALI's own reader: files are read on its threads, ahead of the training loop, in the kit's order
        jpegs, labels = fn.readers.file(files=paths, labels=targets, random_shuffle=False, name=READER,
                                        pad_last_batch=True)   # each pass starts at the first file again
        labels = fn.cast(labels, dtype=types.INT64)
        if train:   # RandomResizedCrop + flip, decoding only the crop's region
            images = fn.decoders.image_random_crop(jpegs, device=decoder, output_type=types.RGB,
                                                   random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3],
                                                   num_attempts=10)
            images = fn.resize(images, resize_x=size, resize_y=size, antialias=True)
            crop, mirror = None, fn.random.coin_flip(probability=0.5) if preset.hflip else 0
        else:       # Resize(S * 256/224) + CenterCrop(S)
            images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB)
            images = fn.resize(images, resize_shorter=round(size * 256 / 224), antialias=True)
            crop, mirror = (size, size), 0
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, crop=crop, mirror=mirror,
                                          output_layout="HWC" if channels_last else "CHW",
                                          mean=[255 * m for m in preset.mean], std=[255 * s for s in preset.std])
        pipe.set_outputs(images, labels)
    return pipe


READER = "files"


def _iterate(pipe):
    """DALI's iterator over one pass of ``pipe``, the last batch short where the pass is (validation)."""
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator
    return DALIGenericIterator(pipe, ["images", "labels"], reader_name=READER,   # starts the pipeline:
                               last_batch_policy=LastBatchPolicy.PARTIAL)      # decoding errors show from here


def _run(batches, source: _FileBatches, channels_last: bool, where: str) -> Iterator[tuple[Tensor, Tensor]]:
    """The pipeline's batches (``batches()`` gives DALI's iterator) as torch tensors: images float32
    (B, 3, S, S) on the pipeline's device, labels (B,)."""
    delivered = 0
    try:
        for out in batches():
            images, labels = out[0]["images"], out[0]["labels"].squeeze(1)
            if channels_last:   # (B, S, S, 3) memory seen as (B, 3, S, S): channels_last, no copy
                images = images.permute(0, 3, 1, 2)
            delivered += 1
            yield images, labels
    except RuntimeError as e:
        for path in source.recent_paths(delivered):   # name the file as the workers path does, if Pillow fails too
            load_rgb(path)
        lines = [line.strip() for line in str(e).split("encountered:")[-1].splitlines() if line.strip()]
        raise DataError(f"DALI could not decode a batch of {where} ({lines[0] if lines else type(e).__name__}). "
                        f"Find the file with python -m ddp_utils check --dataset imagenet --data-dir ... "
                        f"--verify-images, delete it or replace it with a good copy.") from None


def _device_id(device) -> int | None:
    """The GPU index for DALI's mixed pipeline, or None for its CPU pipeline."""
    if device is None or torch.device(device).type != "cuda":
        return None
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


class DaliTrainLoader(TrainLoader):
    """One rank's training batches from DALI; a ``loaders.TrainLoader``.

    ``for images, labels in loader.epoch(epoch)``: images float32 (B, 3, S, S), normalised, on the GPU
    (channels_last when asked) or the CPU; labels int64 (B,). Every batch is full (drop_last). The order
    is DistributedSampler's for (seed, epoch, rank, world_size, drop_last=True).

    The pipeline is built anew for each epoch, on purpose: DALI takes its random seed when a pipeline is
    built, and the kit's seeding recipe gives every (seed, rank, epoch) its own crops and flips, which is
    what makes a resumed run draw exactly the crops of one that never stopped. A build plus the first
    batch took about 10 ms on the CPU pipeline here (benchmarked with 4 epochs of real photos), once an
    epoch. Validation has no randomness, so DaliEvalLoader builds its pipeline once.
    """

    def __init__(self, dataset: ImageFolderDataset, how: Decoding, sampler, batch_size: int, seed: int = 0,
                 max_steps: int = 0):
        super().__init__(sampler, batch_size, seed, sampler.rank, max_steps)   # DDP: this rank's DistributedSampler
        self.dataset, self.how = dataset, how

    def _batches(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        source = _FileBatches(self.dataset.samples, list(self.sampler), self.batch_size, len(self))
        pipe = _pipeline(source, True, self.how, augmentation_seed(self.seed, self.rank, epoch))
        return _run(lambda: _iterate(pipe), source, self.how.channels_last, self.dataset.root)


class DaliEvalLoader:
    """This rank's validation batches from DALI: rank r gets images r, r + W, r + 2W, ... (EvalShardSampler).

    ``for images, labels in loader``: float32 (B, 3, S, S) normalised, int64 (B,); the last batch may be short.
    """

    def __init__(self, dataset: ImageFolderDataset, how: Decoding, sampler: EvalShardSampler, batch_size: int):
        self.dataset, self.how, self.sampler, self.batch_size = dataset, how, sampler, batch_size
        self._source = self._pipe = self._iterator = None   # built at the first pass, reused by the later ones
        self._finished = True   # the last pass ran to its end (else its reader stands midway: build anew)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        if len(self) == 0:
            return iter(())   # more ranks than images: nothing for this one
        if self._pipe is None or not self._finished:   # validation has no randomness: one pipeline serves
            self._source = _FileBatches(self.dataset.samples, list(self.sampler), self.batch_size, len(self))
            self._pipe = _pipeline(self._source, False, self.how, 0)   # every evaluation
            self._iterator = None
        return self._pass()

    def _pass(self) -> Iterator[tuple[Tensor, Tensor]]:
        self._finished = False
        yield from _run(self._batches, self._source, self.how.channels_last, self.dataset.root)
        self._finished = True

    def _batches(self):
        if self._iterator is None:
            self._iterator = _iterate(self._pipe)
        else:
            self._iterator.reset()   # back to the first batch: the reader starts its file list again
        return self._iterator


def build_dali_data(preset: Preset, settings, source: Source) -> Data:
    """``--loader dali``: list the splits' files, DALI pipelines built per pass, with ``settings.workers`` CPU
    threads (at least 1). A CUDA ``source.device`` runs the mixed (GPU) pipeline, anything else the CPU pipeline.
    Returns the same Data as the workers path."""
    require_dali()
    train_set = ImageFolderDataset(source.root / preset.train_split)   # only its file list and labels are used
    val_set = ImageFolderDataset(source.root / source.val_split)
    for split in (train_set, val_set):
        if split.classes != list(source.classes):
            raise DataError(f"{split.root} has the class folders {split.classes}, expected {list(source.classes)}.")
    check_batch_fits(len(train_set), settings.batch_size, source.world_size, f"in {source.root}")
    device_id = _device_id(source.device)
    how = Decoding(preset, source.image_size, max(1, settings.workers), device_id,
                   settings.channels_last and device_id is not None)
    sampler = train_sampler(len(train_set), source.rank, source.world_size, settings.seed)   # DDP: this rank's share
    return source.data(DaliTrainLoader(train_set, how, sampler, settings.batch_size, settings.seed,
                                       settings.max_steps_per_epoch),
                       DaliEvalLoader(val_set, how, EvalShardSampler(len(val_set), source.rank, source.world_size),
                                      settings.batch_size),
                       (len(train_set), len(val_set)), preset)


def _why_missing() -> str | None:
    try:
        require_dali()
    except DataError as e:
        return str(e)
    return None


register_loader(Loader("dali", "NVIDIA DALI decodes JPEGs on the GPU (nvJPEG) and augments there", build_dali_data,
                       missing=_why_missing))

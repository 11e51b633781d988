"""ImageNet through DataLoader workers, fast: libjpeg-turbo decode, crop on uint8, normalise batched on the device.

    data = build_loaders(Settings(dataset="imagenet", data_dir="/data/imagenet"), rank, world_size, device)

Why: the course's ImageNet path (Pillow decodes the JPEG, RandomResizedCrop, ToTensor and Normalize in
every worker, float32 through the worker queues) fed a T4 about 300 img/s against the ~900 it sustains.
ImageNet's ``loader="workers"`` takes this path (``regionjpeg.build_imagenet_workers``, in data.py's
``WORKERS_BY_CROP``). In each worker, per image:

- train: decode only the crop's box where nvImageCodec imports (``regionjpeg``: 1.06-1.13x the images per core of
  the whole decode, the same pixels; ``regionjpeg.RegionCropFlip``), else the whole image; val: the whole image. Whole images with
  ``torchvision.io.decode_jpeg`` (libjpeg-turbo, the very same pixels as Pillow's decoder, faster); Pillow for
  what it cannot read (ImageNet has a PNG and some CMYK files named .JPEG), so an
  unreadable file is still the kit's DataError paragraph;
- RandomResizedCrop + flip (train) or Resize + CenterCrop (val) on the uint8 tensor, with the
  ``torchvision.transforms.v2`` kernels (an antialiased uint8 resize; within 2 of 255 levels of Pillow's);
- send the uint8 (3, S, S) crop: a quarter of float32's bytes through the worker queue and pinned memory.

Then, per batch in the training process (``DeviceNormalize``): copy to the device (non-blocking from pinned
memory), channels_last there when asked, and x / 255, - mean, / std: the arithmetic of ToTensor + Normalize,
as ``memdata.normalize`` does it, on the GPU when there is one.

What stays the course's: the data set (``ImageFolderDataset``'s samples), the DistributedSampler shards and
``set_epoch`` (``EpochLoader``), exact evaluation (``EvalShardSampler``), and the random draws: the v2
transforms draw the same torch random numbers as the classic ones, seeded per (seed, rank, epoch) by
``loaders.augmentation_seed``, so for the same seed this path cuts the same crops as the classic one.
"""
from __future__ import annotations

import math
import warnings
from typing import Iterable, Iterator

import torch
from torch import Tensor
from torchvision import transforms as T
from torchvision.transforms import v2
from torchvision.transforms.functional import pil_to_tensor

from ..datasets import Preset, load_rgb
from ..loaders import EpochLoader
from .memdata import normalize

try:
    from torchvision.io import ImageReadMode, decode_jpeg, read_file
except ImportError:       # a torchvision without its own image decoders: Pillow decodes (slower, same pixels)
    decode_jpeg = None

__all__ = ["decode_rgb", "train_transform", "eval_transform", "DeviceNormalize", "ReusedBatches",
           "NormalizedEpochLoader", "NormalizedLoader"]


def decode_rgb(path: str) -> Tensor:
    """The image at ``path`` as uint8 (3, H, W) RGB. Raises the kit's DataError for an unreadable file."""
    if decode_jpeg is not None:
        try:
            with warnings.catch_warnings():
                # torchvision 0.29 deprecates its decoders for TorchCodec's; until they go they are the
                # quickest libjpeg-turbo on every install (the import fallback covers the day they are gone)
                warnings.simplefilter("ignore", DeprecationWarning)
                return decode_jpeg(read_file(path), mode=ImageReadMode.RGB)
        except RuntimeError:
            pass          # not a JPEG after all, or a broken one: Pillow decides, and names the file if it fails
    return pil_to_tensor(load_rgb(path))


def train_transform(preset: Preset, image_size: int = 0) -> "RandomCropFlip":
    """``datasets.train_transform`` without ToTensor and Normalize: uint8 (3, H, W) -> uint8 (3, S, S)."""
    _require_resized(preset)
    return RandomCropFlip(image_size or preset.image_size, preset.hflip)


class RandomCropFlip:
    """RandomResizedCrop (area 8-100 %, aspect 3/4-4/3) then a random horizontal flip, on a uint8 tensor.

    The classic transforms' own random draws (``RandomResizedCrop.get_params``, then ``torch.rand(1) < 0.5``), so
    the same crops and flips as they cut for the same seed; the work done by the v2 kernels directly, without the
    per-sample dispatch of ``v2.Compose`` (its hooks and input checks cost ~0.05 ms an image, a tenth of a decode).
    """

    def __init__(self, size: int, hflip: bool = True):
        self.crop, self.hflip = T.RandomResizedCrop(size), hflip   # the classic one: its scale, ratio and draws

    def __call__(self, image: Tensor) -> Tensor:
        top, left, height, width = self.crop.get_params(image, self.crop.scale, self.crop.ratio)
        out = v2.functional.resized_crop(image, top, left, height, width, list(self.crop.size), antialias=True)
        if self.hflip and torch.rand(1) < 0.5:
            out = v2.functional.horizontal_flip(out)
        return out

    def __repr__(self) -> str:
        return f"RandomCropFlip(size={self.crop.size[0]}, hflip={self.hflip})"


def eval_transform(preset: Preset, image_size: int = 0) -> v2.Compose:
    """``datasets.eval_transform`` without ToTensor and Normalize: short side to S * 256/224, centre S x S, uint8."""
    _require_resized(preset)
    size = image_size or preset.image_size
    return v2.Compose([v2.Resize(round(size * 256 / 224), antialias=True), v2.CenterCrop(size)])


def _require_resized(preset: Preset) -> None:
    if preset.crop != "resized":
        raise ValueError(f"fastjpeg's transforms are ImageNet's (crop='resized'); {preset.name} has "
                         f"crop={preset.crop!r}")


class DeviceNormalize:
    """uint8 batches in, normalised float32 batches on ``device`` out, one batch at a time.

    images uint8 (B, 3, S, S) -> float32 (B, 3, S, S) on ``device`` (channels_last there when asked and
    the device is a GPU), labels int64 (B,) -> the same on ``device``. The copy does not block when the
    batch is in pinned memory; the normalisation then runs on the device, queued behind the copy.
    """

    def __init__(self, preset: Preset, device=None, channels_last: bool = False):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.channels_last = channels_last and self.device.type == "cuda"
        self.mean, self.std = (torch.tensor(v, dtype=torch.float32, device=self.device).view(-1, 1, 1)
                               for v in (preset.mean, preset.std))
        self.reuse = ReusedBatches() if self.device.type == "cpu" else None   # (a GPU's allocator caches)

    def __call__(self, batches: Iterable[tuple[Tensor, Tensor]]) -> Iterator[tuple[Tensor, Tensor]]:
        for images, labels in batches:
            images = images.to(self.device, non_blocking=True)
            if self.channels_last:       # on uint8, before the float copy: a quarter of the bytes to reorder
                images = images.contiguous(memory_format=torch.channels_last)
            out = self.reuse.take(images.shape) if self.reuse is not None else None
            yield normalize(images, self.mean, self.std, out), labels.to(self.device, non_blocking=True)


class ReusedBatches:
    """float32 CPU batches whose memory is reused once nothing else holds it.

    Why: a 64-image batch at 224 px is 38 MB of float32, above the 32 MB up to which glibc reuses freed memory, so
    a fresh one per batch maps new pages, and the kernel's zeroing them on first touch cost 2.5x the
    normalisation's arithmetic (0.37 against 0.15 ms per image; benchmarks/imagenet_input.py). ``take(shape)``
    hands out a new tensor on one of ``keep`` kept storages that no tensor uses any more: a loop that keeps its
    batches, a view, or a graph still to run backward holds the storage, and then a fresh one is allocated.
    """

    def __init__(self, keep: int = 2):
        self.keep, self.storages = keep, []

    def take(self, shape) -> Tensor:
        nbytes = 4 * math.prod(shape)
        for storage in self.storages:
            if storage.nbytes() == nbytes and self._unused(storage):
                return torch.empty(0, dtype=torch.float32).set_(storage, 0, tuple(shape))
        out = torch.empty(tuple(shape), dtype=torch.float32)   # float32 whatever the default dtype
        if len(self.storages) < self.keep:
            self.storages.append(out.untyped_storage())
        return out

    @staticmethod
    def _unused(storage) -> bool:
        """Only this pool holds ``storage``: every tensor on it is gone (their TensorImpls each count one)."""
        try:
            return torch._C._storage_Use_Count(storage._cdata) == 1
        except (AttributeError, RuntimeError):   # a torch without the count: never reuse
            return False


class NormalizedEpochLoader(EpochLoader):
    """``EpochLoader`` whose workers send uint8 crops: ``epoch(e)`` yields them normalised on the device.

    Shards, ``set_epoch``, ``len`` and the per-(seed, rank, epoch) seeding are EpochLoader's (TrainLoader's) own.
    ``self.loader`` is the DataLoader of uint8 batches.
    """

    def __init__(self, loader, to_device: DeviceNormalize, max_steps: int = 0, seed: int = 0, rank: int = 0):
        super().__init__(loader, max_steps, seed=seed, rank=rank)
        self.to_device = to_device

    def _batches(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        return self.to_device(super()._batches(epoch))


class NormalizedLoader:
    """A validation DataLoader of uint8 batches, iterated as normalised float32 batches on the device.

    ``sampler`` (EvalShardSampler), ``dataset``, ``batch_size``, ``pin_memory`` and ``len`` are the DataLoader's.
    """

    def __init__(self, loader, to_device: DeviceNormalize):
        self.loader, self.to_device = loader, to_device
        self.dataset, self.sampler, self.batch_size = loader.dataset, loader.sampler, loader.batch_size
        self.pin_memory = loader.pin_memory

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self.to_device(self.loader)

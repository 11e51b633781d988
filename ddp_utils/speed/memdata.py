"""In-memory data for the small-image presets (cinic10, demo): decode once, augment whole batches.

    settings = Settings(dataset="cinic10", data_dir="data/cinic10", loader="memory")
    data = build_loaders(settings, rank, world_size, device)    # the same Data as the workers path

Why: the workers path opens and decodes every PNG again each epoch, in DataLoader worker processes.
CINIC-10's 90,000 training images are only 276 MB as uint8 (3 x 32 x 32 bytes each), so this path
decodes each split once, keeps it as one uint8 tensor (on the GPU when there is one) and does the
crop, flip and normalisation on whole batches of tensors, with no worker processes (the approach of
KellerJordan/cifar10-airbench and hlb-CIFAR10). ImageNet does not fit: it keeps the workers path.

What stays the same as the workers path, by construction:
- the shuffle: a DistributedSampler over range(N) with the same seed, epoch, rank, world size and
  drop_last, so every rank trains on exactly the indices the workers path would give it;
- evaluation: EvalShardSampler (rank r gets images r, r + W, ...), and the same Pillow decode and
  the same arithmetic as ToTensor + Normalize, so the validation tensors are bit-identical;
- the augmentation recipe: random crop with S/8 pixels of zero padding (4 at 32 px), a horizontal
  flip when the preset flips (never the demo's digits), then normalisation. Only the random draws
  differ: both paths seed from ``loaders.augmentation_seed(seed, rank, epoch)``, but here one
  generator draws for a whole batch, there each worker process draws per image.

No disk cache: decoding CINIC-10 takes seconds per split, data folders may be read-only, and a
cache would need invalidating when the files change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader
from torchvision import transforms as T

from ..datasets import DataError, ImageFolderDataset, Preset
from ..loaders import (Data, EvalShardSampler, Loader, Source, TrainLoader, augmentation_seed, check_batch_fits,
                       register_loader, train_sampler, worker_context)
from ..presets import loader_refusal

__all__ = ["MemorySplit", "MemoryLoader", "MemoryEvalLoader", "decode_split",
           "crop_flip", "normalize", "augmentation_generator", "check_memory_dataset",
           "build_memory_data"]

PARALLEL_DECODE_FROM = 10_000           # splits this big are decoded by `workers` processes (once)


@dataclass
class MemorySplit:
    """A decoded split: ``images`` uint8 (N, 3, S, S), ``labels`` int64 (N,), both on one device."""
    images: Tensor
    labels: Tensor
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.images[i], int(self.labels[i])

    def to(self, device) -> "MemorySplit":
        return MemorySplit(self.images.to(device), self.labels.to(device), self.classes)


def _as_list(batch):
    return batch   # collate_fn: keep (image, label) pairs as they are; module level so workers can pickle it


def decode_split(root: str | Path, split: str, classes: list[str] | None = None, image_size: int = 0,
                 workers: int = 0) -> tuple[Tensor, Tensor]:
    """Decode every image of ``root/split`` once, in ImageFolder order (the workers path's indices).

    Returns images uint8 (N, 3, H, W) and labels int64 (N,). ``image_size`` > 0 resizes to S x S
    first, as ``eval_transform`` does when the crop differs from the preset's size. ``classes``: the
    class folders expected (DataError if the split has others). ``workers`` processes share the
    decoding of big splits (PARALLEL_DECODE_FROM images or more). Raises DataError.
    """
    folder = Path(root).expanduser() / split
    steps = [T.Resize((image_size, image_size))] if image_size else []
    dataset = ImageFolderDataset(folder, T.Compose(steps + [T.PILToTensor()]))   # (3, H, W) uint8
    if classes is not None and list(classes) != dataset.classes:
        raise DataError(f"{folder} has the class folders {dataset.classes}, expected {list(classes)}.")
    n = len(dataset)
    workers = workers if n >= PARALLEL_DECODE_FROM else 0
    loader = DataLoader(dataset, batch_size=256, collate_fn=_as_list, num_workers=workers,
                        multiprocessing_context=worker_context(workers))
    images, i = None, 0
    for batch in loader:
        for image, _ in batch:
            if images is None:
                images = torch.empty((n, *image.shape), dtype=torch.uint8)   # one allocation, no torch.cat copy
            if image.shape != images.shape[1:]:
                raise DataError(f"{dataset.samples[i][0]} is {image.shape[2]}x{image.shape[1]} pixels but "
                                f"{dataset.samples[0][0]} is {images.shape[3]}x{images.shape[2]}: every image "
                                f"of a split held in memory must have the same size.")
            images[i] = image
            i += 1
    return images, torch.tensor(dataset.targets, dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# Batched augmentation and normalisation, on whatever device the images are on
# --------------------------------------------------------------------------------------------
def augmentation_generator(seed: int, rank: int, epoch: int, device=None) -> torch.Generator:
    """A generator that depends on (seed, rank, epoch) only: a resumed epoch draws the same crops."""
    return torch.Generator(device=device or "cpu").manual_seed(augmentation_seed(seed, rank, epoch))


def crop_flip(images: Tensor, pad: int, flip: bool, generator: torch.Generator) -> Tensor:
    """Random crop after ``pad`` pixels of zero padding, then a random horizontal flip if ``flip``.

    images uint8 (B, C, H, W) -> uint8 (B, C, H, W), same device. Each sample draws its own offset
    (0..2*pad in y and x) and its own coin for the flip. No host-device synchronisation.
    """
    b, c, h, w = images.shape
    dev = images.device
    padded = F.pad(images, (pad, pad, pad, pad))            # zeros, as RandomCrop(padding=pad)
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=dev)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=dev)
    windows = padded.unfold(2, h, 1).unfold(3, w, 1)        # (B, C, 2p+1, 2p+1, H, W): every crop, a view
    out = windows[torch.arange(b, device=dev), :, dy, dx]   # one crop per sample -> (B, C, H, W)
    if flip:
        mirrored = torch.rand(b, generator=generator, device=dev) < 0.5
        out = torch.where(mirrored[:, None, None, None], out.flip(-1), out)
    return out


def normalize(images: Tensor, mean: Tensor, std: Tensor, out: Tensor | None = None) -> Tensor:
    """uint8 (B, 3, H, W) -> float32 (B, 3, H, W): x / 255, then (x - mean) / std per channel.

    The same operations in the same order as ToTensor + Normalize, so bit-identical results.
    ``mean`` and ``std`` are float32 (3, 1, 1) on the images' device. ``out``: a float32 tensor of the images'
    shape to write into (the uint8 -> float32 copy is exact, so the result is the same bits).
    """
    if out is None:
        return images.float().div_(255).sub_(mean).div_(std)
    return out.copy_(images).div_(255).sub_(mean).div_(std)


def _stats(preset: Preset, device) -> tuple[Tensor, Tensor]:
    """The preset's mean and std as float32 (3, 1, 1) tensors on ``device``."""
    return tuple(torch.tensor(v, dtype=torch.float32, device=device).view(-1, 1, 1)
                 for v in (preset.mean, preset.std))


# --------------------------------------------------------------------------------------------
# Loaders with the interfaces train.py consumes
# --------------------------------------------------------------------------------------------
class MemoryLoader(TrainLoader):
    """One rank's training batches from a split held in memory (a ``loaders.TrainLoader``).

    ``for images, labels in loader.epoch(epoch)``: images float32 (B, 3, S, S), normalised, and
    labels int64 (B,), on the split's device. B = batch_size; every batch is full (drop_last).
    The crops and flips are drawn batched, from ``augmentation_generator(seed, rank, epoch)``.
    """

    def __init__(self, split: MemorySplit, preset: Preset, sampler, batch_size: int, seed: int = 0,
                 max_steps: int = 0):
        super().__init__(sampler, batch_size, seed, sampler.rank, max_steps)   # DDP: this rank's DistributedSampler
        self.dataset = split
        self.pad = split.images.shape[-1] // 8              # 4 px at 32, as train_transform
        self.flip = preset.hflip
        self.mean, self.std = _stats(preset, split.images.device)

    def indices(self, epoch: int) -> Tensor:
        """This rank's image indices for ``epoch``, in training order (int64, on the split's device)."""
        self._shuffle(epoch)
        return self._order()

    def _order(self) -> Tensor:
        return torch.tensor(list(self.sampler), dtype=torch.int64, device=self.dataset.images.device)

    def _batches(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        order = self._order()   # the sampler is already set to this epoch (TrainLoader.epoch)
        generator = augmentation_generator(self.seed, self.rank, epoch, self.dataset.images.device)
        for step in range(len(self)):
            idx = order[step * self.batch_size:(step + 1) * self.batch_size]
            images = crop_flip(self.dataset.images[idx], self.pad, self.flip, generator)
            yield normalize(images, self.mean, self.std), self.dataset.labels[idx]


class MemoryEvalLoader:
    """This rank's validation batches, like a DataLoader with EvalShardSampler: rank r gets images
    r, r + W, r + 2W, ... (every image on exactly one rank, no padding), no augmentation.

    ``for images, labels in loader``: float32 (B, 3, S, S) normalised, int64 (B,); the last batch may be short.
    """

    def __init__(self, split: MemorySplit, preset: Preset, batch_size: int, rank: int, world_size: int):
        self.dataset = split
        self.batch_size = batch_size
        self.sampler = EvalShardSampler(len(split), rank, world_size)
        self.mean, self.std = _stats(preset, split.images.device)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        mine = torch.tensor(list(self.sampler), dtype=torch.int64, device=self.dataset.images.device)
        for idx in mine.split(self.batch_size):
            yield normalize(self.dataset.images[idx], self.mean, self.std), self.dataset.labels[idx]


def check_memory_dataset(dataset: str) -> None:
    """DataError unless ``dataset``'s preset says its splits fit in memory (presets.py)."""
    refusal = loader_refusal(dataset, "memory")
    if refusal:
        raise DataError(refusal)


def build_memory_data(preset: Preset, settings, source: Source) -> Data:
    """``--loader memory``: decode both splits once, keep them on the rank's device. ``preset`` is the loaded preset
    (demo statistics read); ``settings.workers`` processes share decoding a big split. Returns the same Data as the
    workers path. Raises DataError."""
    resize = source.image_size if source.image_size != preset.image_size else 0   # as eval_transform
    device = source.device if source.device is not None else torch.device("cpu")

    def load(split: str) -> MemorySplit:   # decoded on the CPU, copied to the device once
        return MemorySplit(*decode_split(source.root, split, source.classes, resize, settings.workers),
                           source.classes).to(device)

    train = load(preset.train_split)
    check_batch_fits(len(train), settings.batch_size, source.world_size, f"in {source.root}")
    val = load(source.val_split)
    sampler = train_sampler(len(train), source.rank, source.world_size, settings.seed)   # DDP: this rank's share
    return source.data(MemoryLoader(train, preset, sampler, settings.batch_size, settings.seed,
                                    settings.max_steps_per_epoch),
                       MemoryEvalLoader(val, preset, settings.batch_size, source.rank, source.world_size),
                       (len(train), len(val)), preset)


register_loader(Loader("memory", "the splits decoded once into a uint8 tensor, augmented a whole batch at a time",
                       build_memory_data, auto=True))

"""loader='nvjpeg': the GPU decodes ImageNet's JPEGs (torchvision's nvJPEG) and crops, resizes, flips and normalises
them there; the DataLoader workers only read the files.

    data = build_loaders(Settings(dataset="imagenet", data_dir="/data/imagenet", loader="nvjpeg"), rank, world, device)

Why: on the workers path every image is decoded on a CPU core (~1 ms for an ImageNet photo here), so a GPU node
with few cores (a g4dn.xlarge has 4 vCPUs) waits for its data. DALI moves the decode to the GPU but is a separate
420 MB install; torchvision's CUDA builds carry nvJPEG already. Per batch, in the training process:

- the workers send the batch's file bytes (a ~110 KB JPEG is less than the 150 KB uint8 crop the workers path
  sends). A file nvJPEG is not given is decoded in the worker instead (``fastjpeg.decode_rgb``: libjpeg-turbo,
  Pillow for the rest): not a JPEG (ImageNet has a PNG named .JPEG), CMYK (22 ImageNet files), arithmetic-coded;
- ``decode_jpeg(list of byte tensors, device=...)`` decodes the batch at once; if nvJPEG refuses the batch, each
  image alone, and the one it refuses on the CPU, where a broken file gets the kit's DataError naming it;
- train: the classic RandomResizedCrop draws (area 8-100 %, aspect 3/4-4/3) then the flip draw, image by image,
  from a stream of its own seeded per (seed, rank, epoch) (``datasets.augmentation_seed``): the very draws the
  workers path makes without worker processes. The crop is a view, resized antialiased in float32 (kept in float:
  no rounding back to 255 levels), flipped, stacked and normalised. Validation: short side to S * 256/224,
  centre S x S, as the workers path (within one of 255 levels of it: that path rounds to uint8 after resizing);
- on a GPU, batch k + 1 is decoded and cropped on a side CUDA stream while step k trains on the default one.

Without a GPU the same code runs on the CPU (how the tests check it), slower than the workers path: for rehearsals.
Shards, ``set_epoch``, ``max_steps_per_epoch`` and exact evaluation are the workers path's own (EpochLoader,
EvalShardSampler).
"""
from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T
from torchvision.transforms import v2

from ..datasets import (Data, DataError, EpochLoader, EvalShardSampler, ImageFolderDataset, Preset, augmentation_seed,
                        check_batch_fits, close_inherited_listeners, train_sampler, worker_context)
from . import fastjpeg
from .memdata import normalize

try:
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:       # a torchvision built without its image decoders
    decode_jpeg = None

__all__ = ["NVJPEG_DATASETS", "check_nvjpeg_dataset", "jpeg_components", "JpegBytes", "DeviceCrops",
           "NvjpegTrainLoader", "NvjpegEvalLoader", "build_nvjpeg_data"]

NVJPEG_DATASETS = ("imagenet",)   # JPEG photos; the 32 px PNG presets are decoded once by the memory loader
BYTES, DECODED = 0, 1             # what a JpegBytes item holds: the file's bytes, or the image decoded on the CPU
NVJPEG_FRAMES = (0xC0, 0xC1, 0xC2)   # baseline, extended and progressive Huffman-coded frames


def check_nvjpeg_dataset(dataset: str) -> None:
    """DataError unless ``dataset`` is a preset this loader serves and torchvision can decode JPEGs."""
    if dataset not in NVJPEG_DATASETS:
        raise DataError(f"loader='nvjpeg' is for {', '.join(NVJPEG_DATASETS)} (JPEG photos) only: the 32 px PNG "
                        f"presets are best decoded once (--loader memory), fake data with --loader workers.")
    if decode_jpeg is None:
        raise DataError("loader='nvjpeg' needs torchvision.io.decode_jpeg, which this torchvision lacks: train "
                        "with --loader workers, or install the torchvision built for your torch.")


def jpeg_components(data: bytes) -> int:
    """The colour components of a JPEG nvJPEG decodes (1 grey, 3 YCbCr) from its frame header, else 0: not a
    JPEG, CMYK or YCCK (4), or a frame type it is not given (arithmetic-coded, lossless, hierarchical)."""
    if data[:2] != b"\xff\xd8":
        return 0
    i = 2
    while i + 9 < len(data):
        if data[i] != 0xFF:
            return 0                        # lost in the markers: let the CPU decide
        marker = data[i + 1]
        if marker == 0xFF:                  # a fill byte before a marker
            i += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD7:   # markers without a length
            i += 2
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):   # a frame header (SOFn)
            components = data[i + 9]         # FF Cn, length (2), precision (1), height (2), width (2), components
            return components if marker in NVJPEG_FRAMES and components in (1, 3) else 0
        elif marker == 0xDA:                 # the scan began without a frame header
            return 0
        else:
            i += 2 + (data[i + 2] << 8 | data[i + 3])
    return 0


class JpegBytes(Dataset):
    """``dataset[i]`` -> (tensor, label, kind, i): a JPEG nvJPEG decodes as its bytes (uint8, 1-D, kind BYTES),
    any other image decoded here to uint8 (3, H, W) (kind DECODED). ``samples`` are ImageFolder's (path, label)."""

    def __init__(self, samples: list[tuple[str, int]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot read this file ({e}).") from None
        if jpeg_components(data):
            return torch.frombuffer(bytearray(data), dtype=torch.uint8), label, BYTES, index
        return fastjpeg.decode_rgb(path), label, DECODED, index


def collate(items):
    """A batch of JpegBytes items: (list of tensors, labels int64, kinds, indices); the tensors differ in size."""
    tensors, labels, kinds, indices = zip(*items)
    return list(tensors), torch.tensor(labels, dtype=torch.int64), list(kinds), list(indices)


class DeviceCrops:
    """Batches of file bytes in, normalised float32 (B, 3, S, S) batches on ``device`` out.

    ``train``: RandomResizedCrop + flip with the classic draws from the stream seeded ``seed``; else Resize(S *
    256/224) + CenterCrop(S). ``samples`` name the files in errors. On a GPU each batch is made on a side stream,
    one batch ahead of the one the training uses.
    """

    def __init__(self, samples, preset: Preset, size: int, device=None, channels_last: bool = False):
        self.samples, self.size, self.hflip = samples, size, preset.hflip
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.channels_last = channels_last and self.cuda
        self.mean, self.std = (torch.tensor(v, dtype=torch.float32, device=self.device).view(-1, 1, 1)
                               for v in (preset.mean, preset.std))
        self.crop = T.RandomResizedCrop(size)   # the classic one: its scale, ratio and draws
        self.side = torch.cuda.Stream(self.device) if self.cuda else None

    def __call__(self, batches, seed: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        state = None if seed is None else torch.Generator().manual_seed(seed).get_state()
        if not self.cuda:
            for batch in batches:
                images, labels, state = self._make(batch, state)
                yield images, labels
            return
        pending = None
        for batch in batches:
            with torch.cuda.stream(self.side):    # queued behind nothing of the training's: runs beside its step
                images, labels, state = self._make(batch, state)
                done = torch.cuda.Event()
                done.record(self.side)
            if pending is not None:
                yield self._hand_over(*pending)
            pending = images, labels, done
        if pending is not None:
            yield self._hand_over(*pending)

    def _hand_over(self, images: Tensor, labels: Tensor, done) -> tuple[Tensor, Tensor]:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(done)              # this batch only: the next one may still be in the making
        images.record_stream(stream)         # made on the side stream, used on this one: keep it till then
        labels.record_stream(stream)
        return images, labels

    def _make(self, batch, state):
        tensors, labels, kinds, indices = batch
        images = self._decode(tensors, kinds, indices)
        if state is None:
            crops = [self._centre(image) for image in images]
        else:
            with torch.random.fork_rng(devices=[]):   # the draws from this loader's stream, the training's kept
                torch.set_rng_state(state)
                crops = [self._random(image) for image in images]
                state = torch.get_rng_state()
        out = normalize(torch.stack(crops), self.mean, self.std)
        if self.channels_last:
            out = out.contiguous(memory_format=torch.channels_last)
        return out, labels.to(self.device, non_blocking=True), state

    def _decode(self, tensors, kinds, indices) -> list[Tensor]:
        """uint8 (3, H, W) images on the device, in the batch's order."""
        images = [t.to(self.device, non_blocking=True) if kind == DECODED else None
                  for t, kind in zip(tensors, kinds)]
        todo = [i for i, kind in enumerate(kinds) if kind == BYTES]
        if todo:
            for i, image in zip(todo, self._nvjpeg([tensors[i] for i in todo], [indices[i] for i in todo])):
                images[i] = image
        return images

    def _nvjpeg(self, data: list[Tensor], indices: list[int]) -> list[Tensor]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)   # torchvision 0.29: see fastjpeg.decode_rgb
            try:
                return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
            except RuntimeError:
                pass   # one file it refuses: each alone, the refused ones by libjpeg-turbo or Pillow (names the file)
            out = []
            for one, index in zip(data, indices):
                try:
                    out.append(decode_jpeg(one, mode=ImageReadMode.RGB, device=self.device))
                except RuntimeError:
                    out.append(fastjpeg.decode_rgb(self.samples[index][0]).to(self.device))
            return out

    def _random(self, image: Tensor) -> Tensor:
        top, left, height, width = self.crop.get_params(image, self.crop.scale, self.crop.ratio)
        crop = image[:, top:top + height, left:left + width].float()
        out = F.interpolate(crop[None], size=(self.size, self.size), mode="bilinear", align_corners=False,
                            antialias=True)[0]
        if self.hflip and torch.rand(1) < 0.5:   # RandomCropFlip's order: the crop's draws, then the flip's
            out = out.flip(-1)
        return out

    def _centre(self, image: Tensor) -> Tensor:
        resized = v2.functional.resize(image.float(), round(self.size * 256 / 224), antialias=True)
        return v2.functional.center_crop(resized, self.size)


class NvjpegTrainLoader(EpochLoader):
    """One rank's training batches decoded and cropped on the device; an ``EpochLoader`` (shards, steps, set_epoch)
    whose DataLoader sends file bytes. ``epoch(e)`` yields float32 (B, 3, S, S) normalised, int64 (B,)."""

    def __init__(self, loader: DataLoader, crops: DeviceCrops, max_steps: int = 0, seed: int = 0, rank: int = 0):
        super().__init__(loader, max_steps, seed=seed, rank=rank)
        self.crops = crops

    def _batches(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        raw = itertools.islice(self.loader, len(self))   # the workers draw nothing: no seeding of theirs needed
        return self.crops(raw, augmentation_seed(self.seed, self.rank, epoch))


class NvjpegEvalLoader:
    """This rank's validation batches (EvalShardSampler: rank r gets images r, r + W, ...), decoded on the device;
    the last batch may be short. ``sampler``, ``dataset``, ``batch_size`` and ``len`` are the DataLoader's."""

    def __init__(self, loader: DataLoader, crops: DeviceCrops):
        self.loader, self.crops = loader, crops
        self.dataset, self.sampler, self.batch_size = loader.dataset, loader.sampler, loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self.crops(self.loader)


def build_nvjpeg_data(root: Path, preset: Preset, image_size: int, val_split: str, classes: list[str],
                      batch_size: int, seed: int, max_steps: int, workers: int, rank: int, world_size: int,
                      device=None, channels_last: bool = False) -> Data:
    """build_loaders's ``loader="nvjpeg"`` branch: ``workers`` processes read the files, ``device`` decodes."""
    check_nvjpeg_dataset(preset.name)
    folders = {split: ImageFolderDataset(root / split) for split in (preset.train_split, val_split)}
    for split in folders.values():
        if split.classes != list(classes):
            raise DataError(f"{split.root} has the class folders {split.classes}, expected {list(classes)}.")
    train_set, val_set = JpegBytes(folders[preset.train_split].samples), JpegBytes(folders[val_split].samples)
    check_batch_fits(len(train_set), batch_size, world_size, f"in {root}")
    cuda = device is not None and torch.device(device).type == "cuda"
    args = dict(batch_size=batch_size, num_workers=workers, collate_fn=collate, pin_memory=cuda,
                worker_init_fn=close_inherited_listeners, multiprocessing_context=worker_context(workers))
    train = DataLoader(train_set, sampler=train_sampler(len(train_set), rank, world_size, seed), drop_last=True,
                       generator=torch.Generator(), **args)
    val = DataLoader(val_set, sampler=EvalShardSampler(val_set, rank, world_size), drop_last=False,
                     persistent_workers=workers > 0, **args)
    return Data(train=NvjpegTrainLoader(train, DeviceCrops(train_set.samples, preset, image_size, device,
                                                           channels_last), max_steps, seed, rank),
                val=NvjpegEvalLoader(val, DeviceCrops(val_set.samples, preset, image_size, device, channels_last)),
                num_classes=len(classes), classes=classes, train_size=len(train_set), val_size=len(val_set),
                image_size=image_size, preset=preset, val_split=val_split)

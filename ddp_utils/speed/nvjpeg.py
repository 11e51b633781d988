"""loader='nvjpeg': the GPU decodes ImageNet's JPEGs (torchvision's nvJPEG) and crops, resizes, flips and normalises
them there; the DataLoader workers only read the files.

    data = build_loaders(Settings(dataset="imagenet", data_dir="/data/imagenet", loader="nvjpeg"), rank, world, device)

Why: on the workers path every image is decoded on a CPU core (~1 ms for an ImageNet photo here), so a GPU node
with few cores (a g4dn.xlarge has 4 vCPUs) waits for its data. DALI moves the decode to the GPU but is a separate
420 MB install; torchvision's CUDA builds carry nvJPEG already (on an A100, H100 or H200 its hardware decoder).

- in the workers, per image: read the file, its size from the JPEG header, and the train crop's draws (the classic
  RandomResizedCrop's: area 8-100 %, aspect 3/4-4/3, then the flip's, RandomCropFlip's order), seeded per
  (seed, rank, epoch) exactly as the workers path seeds its own: the same crops as that path. A file nvJPEG is not
  given is decoded there instead (``fastjpeg.decode_rgb``): not a JPEG (ImageNet has a PNG named .JPEG), CMYK
  (22 ImageNet files), arithmetic-coded. A batch goes as one byte tensor (a ~110 KB JPEG is less than the
  150 KB uint8 crop the workers path sends), not one tensor per image: one shared-memory block and one pinned
  copy per batch (per image, those cost more than the GPU's decode on the first H200 run);
- in the training process, ``decode_jpeg(list of byte tensors, device=...)`` decodes the batch at once; if nvJPEG
  refuses it, each image alone, and the one it refuses on the CPU, where a broken file gets the kit's DataError;
- each crop is a view, resized antialiased in float32 (kept in float: no rounding back to 255 levels), the batch
  flipped where drawn and normalised. Validation: short side to S * 256/224, centre S x S. Both within one of 255
  levels of the workers path (it rounds to uint8 after resizing);
- batch k + 1 is decoded and cropped on one decode thread (on a GPU, on its own CUDA stream) while step k trains:
  ``decode_jpeg`` blocks its thread on a stream sync, so the training thread keeps launching the step. Up to
  AHEAD batches ahead; the thread's errors reach the training thread unchanged; it is joined when the epoch
  ends or is left (break, error, ``max_steps_per_epoch``).

A GPU without nvJPEG's hardware decoder (T4, V100, A10, RTX 4090: ``has_hardware_jpeg_decoder``) decodes one
image at a time, its Huffman step on the CPU: rank 0 says so at start (``decoder_warning``) and the run goes on.

Without a GPU the same code runs on the CPU (how the tests check it), slower than the workers path: for rehearsals.
Shards, ``set_epoch``, ``max_steps_per_epoch`` and exact evaluation are the workers path's own (EpochLoader,
EvalShardSampler).
"""
from __future__ import annotations

import collections
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T
from torchvision.transforms import v2

from ..datasets import DataError, ImageFolderDataset, Preset
from ..loaders import (Data, EpochLoader, EvalShardSampler, Loader, Source, check_batch_fits, close_inherited_listeners,
                       register_loader, train_sampler, worker_context)
from ..presets import loader_refusal
from . import fastjpeg
from .memdata import _stats, normalize

try:
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:       # a torchvision built without its image decoders
    decode_jpeg = None

__all__ = ["check_nvjpeg_dataset", "has_hardware_jpeg_decoder", "decoder_warning", "jpeg_header", "JpegBytes",
           "RawBatch", "DeviceCrops", "NvjpegTrainLoader", "NvjpegEvalLoader", "build_nvjpeg_data"]

BYTES, DECODED = 0, 1             # what a JpegBytes item holds: the file's bytes, or the image decoded on the CPU
NVJPEG_FRAMES = (0xC0, 0xC1, 0xC2)   # baseline, extended and progressive Huffman-coded frames
DECODE_THREAD = "nvjpeg-decode"     # the decode thread's name (tests and robust/workers.py look for it)
AHEAD = 2                         # batches the decode thread may make ahead of the training (GPU memory: ~150 MB
                                  # each at 256 x 224 px float32)


def check_nvjpeg_dataset(dataset: str) -> None:
    """DataError unless ``dataset``'s preset takes this loader (presets.py) and torchvision can decode JPEGs."""
    why_not = loader_refusal(dataset, "nvjpeg") or _why_missing()
    if why_not:
        raise DataError(why_not)


# GPUs with nvJPEG's hardware decoder (the NVJPG engine), by compute capability; 8.9 is both the L4 (which has one)
# and the RTX 4090 / L40 (which have none), so there the name decides
HARDWARE_JPEG = {(8, 0): True, (9, 0): True, (10, 0): True}    # A100 / A30, H100 / H200, B200
HARDWARE_JPEG_BY_NAME = {(8, 9): ("L4",)}


def has_hardware_jpeg_decoder(capability: tuple[int, int], name: str) -> bool:
    """Whether the GPU of ``capability`` (major, minor) and ``name`` (torch.cuda.get_device_name) has nvJPEG's
    hardware decoder: A100/A30 (8.0), H100/H200 (9.0), B200 (10.0), L4 (8.9 by name); not T4 (7.5), V100 (7.0),
    A10/A10G/RTX 30xx (8.6), RTX 4090/L40 (8.9)."""
    capability = tuple(capability)
    if capability in HARDWARE_JPEG_BY_NAME:
        words = name.replace("-", " ").split()
        return any(model in words for model in HARDWARE_JPEG_BY_NAME[capability])
    return HARDWARE_JPEG.get(capability, False)


def decoder_warning(device) -> str | None:
    """The paragraph rank 0 prints at start when ``loader='nvjpeg'`` runs on a GPU without nvJPEG's hardware
    decoder, else None. A warning, not a refusal: the run goes on, because a student may want to measure this
    loader against the others on that GPU (it is the lesson of the comparison)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return None
    name, (major, minor) = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    if has_hardware_jpeg_decoder((major, minor), name):
        return None
    return (f"loader nvjpeg: the {name} (compute capability {major}.{minor}) has no hardware JPEG decoder, so "
            f"torchvision decodes one image at a time, its Huffman step on the CPU of the thread that decodes: "
            f"this loader is likely slower here than --loader workers (the default) or --loader dali. Use one of "
            f"those to train; keep --loader nvjpeg to compare them.")


def jpeg_header(data: bytes) -> tuple[int, int, int] | None:
    """(components, height, width) of a JPEG nvJPEG decodes (1 grey or 3 YCbCr components) from its frame header,
    else None: not a JPEG, CMYK or YCCK (4), a frame type it is not given (arithmetic-coded, lossless,
    hierarchical) or a height only a later marker gives."""
    if data[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 9 < len(data):
        if data[i] != 0xFF:
            return None                      # lost in the markers: let the CPU decide
        marker = data[i + 1]
        if marker == 0xFF:                   # a fill byte before a marker
            i += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD7:   # markers without a length
            i += 2
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):   # a frame header (SOFn):
            height, width = data[i + 5] << 8 | data[i + 6], data[i + 7] << 8 | data[i + 8]   # FF Cn, length (2),
            components = data[i + 9]                                    # precision, height, width, components
            ok = marker in NVJPEG_FRAMES and components in (1, 3) and height > 0 and width > 0
            return (components, height, width) if ok else None
        elif marker == 0xDA:                 # the scan began without a frame header
            return None
        else:
            i += 2 + (data[i + 2] << 8 | data[i + 3])
    return None


class JpegBytes(Dataset):
    """``dataset[i]`` -> (tensor, label, kind, i, box): a JPEG nvJPEG decodes as its bytes (uint8, 1-D, kind
    BYTES), any other image decoded here to uint8 (3, H, W) (kind DECODED). ``samples`` are ImageFolder's
    (path, label). ``box`` (top, left, height, width, flip): with ``crop`` (train) the classic RandomResizedCrop
    draws on the image's size from its header, then the flip draw when ``hflip``, in RandomCropFlip's order, so
    the DataLoader seeds them as it seeds the workers path's; without ``crop`` the whole image, no flip.
    """

    def __init__(self, samples: list[tuple[str, int]], crop: T.RandomResizedCrop | None = None, hflip: bool = False):
        self.samples, self.crop, self.hflip = samples, crop, hflip

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot read this file ({e}).") from None
        header = jpeg_header(data)
        if header:
            tensor, kind, (height, width) = torch.frombuffer(bytearray(data), dtype=torch.uint8), BYTES, header[1:]
        else:
            tensor, kind = fastjpeg.decode_rgb(path), DECODED
            height, width = tensor.shape[-2:]
        return tensor, label, kind, index, self._box(height, width)

    def _box(self, height: int, width: int) -> tuple[int, int, int, int, int]:
        if self.crop is None:
            return 0, 0, height, width, 0
        shape_only = torch.empty(1, dtype=torch.uint8).expand(3, height, width)   # get_params reads the size
        top, left, h, w = self.crop.get_params(shape_only, self.crop.scale, self.crop.ratio)
        return top, left, h, w, int(bool(self.hflip and torch.rand(1) < 0.5))


class RawBatch(NamedTuple):
    """What the workers send: the batch's JPEG files as one byte tensor (``sizes`` cut it into files: one shared
    memory block and one pinned copy per batch, not one per image), the images decoded on the CPU, labels, each
    image's kind (BYTES or DECODED), index into the split and box (B, 5)."""
    jpegs: Tensor
    sizes: list[int]
    decoded: list[Tensor]
    labels: Tensor
    kinds: list[int]
    indices: list[int]
    boxes: Tensor


def collate(items) -> RawBatch:
    """A batch of JpegBytes items as one RawBatch."""
    tensors, labels, kinds, indices, boxes = zip(*items)
    jpegs = [t for t, kind in zip(tensors, kinds) if kind == BYTES]
    return RawBatch(torch.cat(jpegs) if jpegs else torch.empty(0, dtype=torch.uint8), [len(t) for t in jpegs],
                    [t for t, kind in zip(tensors, kinds) if kind == DECODED], torch.tensor(labels, dtype=torch.int64),
                    list(kinds), list(indices), torch.tensor(boxes, dtype=torch.int64))


class DeviceCrops:
    """RawBatches in, normalised float32 (B, 3, S, S) batches on ``device`` out.

    ``train``: each image's box cut as a view, resized to S x S antialiased in float32, flipped where its box says
    so; else Resize(S * 256/224) + CenterCrop(S). ``samples`` name the files in errors. Each batch is made on one
    decode thread (on a GPU, on its own CUDA stream), up to AHEAD batches ahead of the one the training uses; the
    thread's errors are raised in the training thread, and the thread is joined when the epoch ends or is left.
    """

    def __init__(self, samples, preset: Preset, size: int, device=None, channels_last: bool = False,
                 train: bool = False):
        self.samples, self.size, self.train = samples, size, train
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.channels_last = channels_last and self.cuda
        self.mean, self.std = _stats(preset, self.device)
        self.side = torch.cuda.Stream(self.device) if self.cuda else None

    def __call__(self, batches: Iterable[RawBatch]) -> Iterator[tuple[Tensor, Tensor]]:
        # One decode thread: decode_jpeg blocks its thread on a stream sync (14 ms a batch of 256 on an H200), so it
        # runs there while this thread launches the training step. The RawBatches are read here, not there: with
        # workers=0 the crops' draws use this thread's random state (datasets._with_own_rng).
        decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix=DECODE_THREAD)
        pending = collections.deque()    # batches handed to the thread, oldest first: at most AHEAD + 1
        try:
            for batch in batches:
                pending.append(decoder.submit(self._make_aside, batch))
                if len(pending) > AHEAD:
                    yield self._hand_over(pending.popleft())
            while pending:
                yield self._hand_over(pending.popleft())
        finally:   # the epoch ended, or was left (break, an error, a closed generator): the thread is joined
            decoder.shutdown(wait=True, cancel_futures=True)

    def _make_aside(self, batch: RawBatch):
        """On the decode thread: the batch made on its own CUDA stream (queued behind nothing of the training's)."""
        if not self.cuda:
            return self._make(batch), None
        with torch.cuda.device(self.device), torch.cuda.stream(self.side):
            made = self._make(batch)
            done = torch.cuda.Event()
            done.record(self.side)
        return made, done

    def _hand_over(self, future) -> tuple[Tensor, Tensor]:
        (images, labels), done = future.result()   # the decode thread's error is raised here, as it was raised
        if done is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)              # this batch only: the next one may still be in the making
            images.record_stream(stream)         # made on the side stream, used on this one: keep it till then
            labels.record_stream(stream)
        return images, labels

    def _make(self, batch: RawBatch) -> tuple[Tensor, Tensor]:
        images = self._decode(batch)
        if self.train:
            crops = [self._resized(image[:, top:top + h, left:left + w])
                     for image, (top, left, h, w, _) in zip(images, batch.boxes.tolist())]
            out = torch.cat(crops)
            flips = batch.boxes[:, 4].to(self.device, non_blocking=True).bool().view(-1, 1, 1, 1)
            out = torch.where(flips, out.flip(-1), out)   # one pass for the batch, not one per flipped image
        else:
            out = torch.stack([self._centre(image) for image in images])
        out = normalize(out, self.mean, self.std)
        if self.channels_last:
            out = out.contiguous(memory_format=torch.channels_last)
        return out, batch.labels.to(self.device, non_blocking=True)

    def _decode(self, batch: RawBatch) -> list[Tensor]:
        """uint8 (3, H, W) images on the device, in the batch's order."""
        jpegs = iter(self._nvjpeg(list(batch.jpegs.split(batch.sizes)),
                                  [i for i, kind in zip(batch.indices, batch.kinds) if kind == BYTES]))
        decoded = iter(batch.decoded)
        return [next(jpegs) if kind == BYTES else next(decoded).to(self.device, non_blocking=True)
                for kind in batch.kinds]

    def _nvjpeg(self, data: list[Tensor], indices: list[int]) -> list[Tensor]:
        if not data:
            return []
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

    def _resized(self, crop: Tensor) -> Tensor:
        return F.interpolate(crop[None].float(), size=(self.size, self.size), mode="bilinear", align_corners=False,
                             antialias=True)

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
        return self.crops(super()._batches(epoch))   # the draws seeded per (seed, rank, epoch) as the workers path's


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


def build_nvjpeg_data(preset: Preset, settings, source: Source) -> Data:
    """``--loader nvjpeg``: ``settings.workers`` processes read the files, ``source.device`` decodes them."""
    check_nvjpeg_dataset(preset.name)
    root, classes, device, workers = source.root, source.classes, source.device, settings.workers
    folders = {split: ImageFolderDataset(root / split) for split in (preset.train_split, source.val_split)}
    for split in folders.values():
        if split.classes != list(classes):
            raise DataError(f"{split.root} has the class folders {split.classes}, expected {list(classes)}.")
    train_set = JpegBytes(folders[preset.train_split].samples, T.RandomResizedCrop(source.image_size), preset.hflip)
    val_set = JpegBytes(folders[source.val_split].samples)
    check_batch_fits(len(train_set), settings.batch_size, source.world_size, f"in {root}")
    cuda = device is not None and device.type == "cuda"
    args = dict(batch_size=settings.batch_size, num_workers=workers, collate_fn=collate, pin_memory=cuda,
                worker_init_fn=close_inherited_listeners, multiprocessing_context=worker_context(workers))
    train = DataLoader(train_set, sampler=train_sampler(len(train_set), source.rank, source.world_size, settings.seed),
                       drop_last=True, generator=torch.Generator(), **args)
    val = DataLoader(val_set, sampler=EvalShardSampler(val_set, source.rank, source.world_size), drop_last=False,
                     persistent_workers=workers > 0, **args)
    crops = (DeviceCrops(train_set.samples, preset, source.image_size, device, settings.channels_last, train=True),
             DeviceCrops(val_set.samples, preset, source.image_size, device, settings.channels_last))
    return source.data(NvjpegTrainLoader(train, crops[0], settings.max_steps_per_epoch, settings.seed, source.rank),
                       NvjpegEvalLoader(val, crops[1]), (len(train_set), len(val_set)), preset)


def _why_missing() -> str | None:
    if decode_jpeg is None:
        return ("loader='nvjpeg' needs torchvision.io.decode_jpeg, which this torchvision lacks: train with --loader "
                "workers, or install the torchvision built for your torch.")
    return None


register_loader(Loader("nvjpeg", "torchvision's decode_jpeg on the GPU, fed the files' bytes by the workers",
                       build_nvjpeg_data, missing=_why_missing, warning=decoder_warning))

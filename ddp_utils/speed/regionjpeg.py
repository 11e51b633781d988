"""Decode only a JPEG's crop box (nvImageCodec's CPU decoder), instead of the whole image then a crop.

    image = decode_region(path, top, left, height, width)    # uint8 (3, height, width), RGB
    image = decode_drawn(path, lambda h, w: crop.get_params(torch.empty(3, h, w, device="meta"), scale, ratio))

Why: the training crop (RandomResizedCrop: 8-100 % of the area) needs only its box. libjpeg-turbo can decode a
box: the rows above it are still entropy-decoded but not inverse-transformed, upsampled or colour-converted, the
columns beside it are skipped after entropy decoding, and it stops after the box's last row. nvImageCodec's CPU
backend (its libjpeg-turbo, in the ``nvidia-nvimgcodec-cu12`` / ``-cu13`` wheel) does this for a Region; the
output is pixel-identical to the whole decode's crop (0 of 255 levels apart on every test photo: it decodes a
box by the very same libjpeg-turbo arithmetic).

Measured (benchmarks/photos.py's ImageNet-like JPEGs, 460-500 px, ~0.52 bytes a pixel; 300 images, the same
RandomResizedCrop boxes and flips for every path, drawn once with seed 0; 5 interleaved rounds; CPU time of the
process per image (``time.process_time``), one torch thread; torch 2.14.1, torchvision 0.29.1, nvImageCodec
0.9.0; a 2-core machine shared with other jobs, load average 5-6, so the ratios are the figures to read):

    =====================================================  ======  =======
    path, per image                                        CPU ms  vs (a)
    =====================================================  ======  =======
    (a) the kit: decode_jpeg whole + resized_crop + flip    2.38    1.00
    (b) decode_region (nvImageCodec) + resize + flip        1.78    0.76
    (b') TurboJPEG 3 tj3SetCroppingRegion (ctypes) + same   2.02    0.79
    (b'') pyvips crop on a sequential load + same           3.97    1.70
    (c) decode only: decode_jpeg, the whole image           1.69    0.71
    (c') decode only: decode_region, the box                1.33    0.57
    =====================================================  ======  =======

(an earlier run, load 3.5, 4 rounds: (b) 0.79, (b') 0.81.) The boxes: 41 % of the image's area on average, and
86 % of its rows down to their bottom, which are entropy-decoded all the same. About 1.06-1.13x the images per core of
the whole decode (benchmarks/results/imagenet_input.json): the decode work skipped, and a quicker resize (a box is a contiguous image, a crop of the whole one a strided view).
Stopping after the box's last row is most of the decode's saving: the top quarter's rows cost 0.3 of the whole
decode, the left quarter's columns over all rows 0.9.

Why nvImageCodec and not the others (their install cost is the reason, not their speed):

- TurboJPEG 3's own region API (``tj3SetCroppingRegion``) is as quick, but needs a libturbojpeg 3.x: Debian 12's
  and Ubuntu 24.04's apt ``libturbojpeg0`` are 2.1.5 (no tj3 API; PyTurboJPEG 2.x refuses them too), and the only
  wheel that bundles one (``turbojpeg`` 0.0.2: a 3.0 beta, CPython 3.10-3.13 only) shadows PyTurboJPEG's module;
- torchvision's own bundled libjpeg-turbo 3.1 exports ``jpeg_crop_scanline`` and ``jpeg_skip_scanlines``, but its
  libjpeg API reports errors by ``longjmp`` from ``error_exit`` (by default it calls ``exit()``): ctypes cannot
  catch that, so a broken file would end the worker; a C extension can, but needs a compiler and libjpeg-turbo
  3.x headers built for the v8 ABI (Debian's libjpeg62-turbo-dev is the v6.2 ABI) on every student's machine;
- pyvips (``pyvips-binary``, 8 MB) decodes row strips of the whole width, and costs more than the whole decode;
- simplejpeg (and Pillow's ``draft``) decode the whole image at 1/2, 1/4 or 1/8 scale only: other pixels, and a
  224 px crop of a 500 px photo rarely allows a smaller scale (whole decode at the smallest scale the box allows,
  then crop, resize and flip: 0.92 and 1.14 of (a) in the two runs).

nvImageCodec installs from PyPI as one wheel (cu12: 32 MB, cu13: 25 MB, no dependencies; Linux x86-64 and
aarch64, Windows; no macOS), with no compiler, no system library and without touching torch; DALI depends on it,
so the NGC PyTorch container, which ships DALI, usually has it already. The decoder asks for the CPU only
(``device_id=NVIMGCODEC_DEVICE_CPU_ONLY``, the CPU backend): it runs where there is no GPU or CUDA driver (measured
so; not yet run on a GPU node's forked workers). One decoder per process, made on first use, with one decoding
thread (the DataLoader workers are the parallelism); a forked worker makes its own, since fork copies no thread
(nvImageCodec 0.9 coped with its parent's in a test, a later release need not).

What it takes, and what it leaves to the kit's whole decode (``fastjpeg.decode_rgb``, then the crop, so the
result is the same in kind: uint8 (3, height, width) RGB, or the kit's DataError naming the file):
``fallback_reason`` says why for a file. Taken: 8-bit JPEGs in YCbCr or greyscale, baseline or progressive, any
chroma subsampling. Left: no nvImageCodec; not a JPEG (ImageNet has a PNG named .JPEG); CMYK or YCCK (22 ImageNet
files: one colour conversion, the kit's, for them); 12-bit; a file that does not end with the end-of-image marker
(a truncated file: a box above the missing part would decode, where the whole decode fails and the kit names the
file); anything nvImageCodec will not parse or decode.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np
import torch
from torch import Tensor
from torchvision import transforms as T
from torchvision.transforms import v2

from .. import data
from ..datasets import ImageFolderDataset
from ..loaders import Source
from . import fastjpeg

try:
    from nvidia import nvimgcodec
except Exception:   # not installed (ImportError), or a broken install (OSError from its shared libraries)
    nvimgcodec = None

__all__ = ["available", "decode_region", "decode_drawn", "fallback_reason"]

JPEG_SOI, JPEG_EOI = b"\xff\xd8\xff", b"\xff\xd9"
EOI_WINDOW = 64                 # bytes at the end searched for the end-of-image marker (some files pad after it)

_decoder = None                 # (pid, Decoder, DecodeParams): one per process, a forked worker makes its own
_unavailable = "" if nvimgcodec is not None else "nvImageCodec is not installed (pip install nvidia-nvimgcodec-cu12)"


def available() -> bool:
    """True where nvImageCodec imports and its CPU decoder can be made: ``decode_region`` then decodes boxes."""
    return _state() is not None


def version() -> str:
    """nvImageCodec's version where it imports, else '' (the benchmarks record it beside their figures)."""
    try:
        from importlib.metadata import PackageNotFoundError, version as installed
    except ImportError:
        return ""
    for name in ("nvidia-nvimgcodec-cu13", "nvidia-nvimgcodec-cu12", "nvidia-nvimgcodec-cu11"):
        try:
            return installed(name)
        except PackageNotFoundError:
            continue
    return ""


def _state():
    global _decoder, _unavailable
    if _unavailable:
        return None
    if _decoder is None or _decoder[0] != os.getpid():
        try:
            decoder = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                                         backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)])
            params = nvimgcodec.DecodeParams(color_spec=nvimgcodec.ColorSpec.SRGB, apply_exif_orientation=False)
        except Exception as error:       # an nvImageCodec without a CPU decoder, or one that cannot start
            _unavailable = f"nvImageCodec's CPU decoder cannot start: {error}"
            return None
        _decoder = (os.getpid(), decoder, params)
    return _decoder


def _why_not(data: bytes):
    """(reason, None) to leave ``data`` to the whole decode, or (None, code stream) to decode a box of it."""
    if _state() is None:
        return _unavailable, None
    if not data.startswith(JPEG_SOI):
        return "not a JPEG", None
    if data.rfind(JPEG_EOI, max(len(data) - EOI_WINDOW, 0)) < 0:
        return "no end-of-image marker at its end (truncated?)", None
    try:
        stream = nvimgcodec.CodeStream(data)
        codec, precision, spec = stream.codec_name, stream.precision, stream.color_spec
    except Exception as error:
        return f"nvImageCodec cannot parse it: {error}", None
    if codec != "jpeg":
        return f"nvImageCodec reads it as {codec}", None
    if precision not in (0, 8):          # 0: the format's default, 8 bits for a JPEG
        return f"{precision}-bit samples", None
    if spec not in (nvimgcodec.ColorSpec.SYCC, nvimgcodec.ColorSpec.GRAY):
        return f"colour space {spec.name}", None
    return None, stream


def fallback_reason(path: str) -> str | None:
    """Why ``decode_region`` decodes ``path`` whole and then crops it, or None when it decodes only the box."""
    with open(path, "rb") as f:
        return _why_not(f.read())[0]


def decode_region(path: str, top: int, left: int, height: int, width: int) -> Tensor:
    """Pixels [top, top + height) x [left, left + width) of the image at ``path``: uint8 (3, height, width) RGB.

    The same pixels as ``fastjpeg.decode_rgb(path)[:, top:top + height, left:left + width]``; ValueError for a box
    that is empty or leaves the image; the kit's DataError for an unreadable file.
    """
    return decode_drawn(path, lambda image_height, image_width: (top, left, height, width))


def decode_drawn(path: str, draw: Callable[[int, int], tuple[int, int, int, int]]) -> Tensor:
    """``decode_region`` for a box that depends on the image's size: ``draw(height, width)`` -> (top, left,
    height, width), called once, with the size from the JPEG's header (or, for a file left to the whole decode,
    from the decoded image), so a random crop's draws are made once per image either way: the same crops, in the
    same order, as RandomResizedCrop draws on the whole image for the same seed."""
    with open(path, "rb") as f:
        data = f.read()
    reason, stream = _why_not(data)
    if reason is None:
        top, left, height, width = box = draw(stream.height, stream.width)
        _check_box(path, box, stream.height, stream.width)
        _, decoder, params = _state()
        try:
            region = nvimgcodec.Region(top, left, top + height, left + width)
            image = decoder.decode(stream.get_sub_code_stream(region=region), params=params)
        except Exception:
            image = None
        if image is not None:
            pixels = np.asarray(image.cpu())
            if pixels.shape == (height, width, 3) and pixels.dtype == np.uint8:
                return torch.from_numpy(pixels).permute(2, 0, 1)
        image = fastjpeg.decode_rgb(path)        # nvImageCodec refused it after all: the box already drawn
        _check_box(path, box, image.shape[1], image.shape[2])
    else:
        image = fastjpeg.decode_rgb(path)
        top, left, height, width = box = draw(image.shape[1], image.shape[2])
        _check_box(path, box, image.shape[1], image.shape[2])
    return image[:, top:top + height, left:left + width]


def _check_box(path, box, image_height, image_width) -> None:
    top, left, height, width = box
    if height <= 0 or width <= 0 or top < 0 or left < 0 or top + height > image_height or left + width > image_width:
        raise ValueError(f"box (top={top}, left={left}, height={height}, width={width}) is empty or leaves the "
                         f"{image_height} x {image_width} image {path}")


class RegionCropFlip:
    """RandomCropFlip from a file's path, decoding only the drawn box (``regionjpeg``: nvImageCodec's CPU decoder,
    1.06-1.13x the images per core): the same draws in the same order, so the same crops and flips for the same
    seed, and the same pixels (0 of 255 levels apart, tests/test_regionjpeg.py). A file it does not take is decoded
    whole, as ``decode_rgb`` does, and cropped. ``build_imagenet_workers`` uses it when nvImageCodec imports."""

    def __init__(self, size: int, hflip: bool = True):
        self.crop, self.hflip = T.RandomResizedCrop(size), hflip

    def _draw(self, height: int, width: int) -> tuple[int, int, int, int]:
        # RandomResizedCrop's own draws need only the size: a meta tensor stands for the image
        return self.crop.get_params(torch.empty(3, height, width, device="meta"), self.crop.scale, self.crop.ratio)

    def __call__(self, path: str) -> Tensor:
        out = v2.functional.resize(decode_drawn(path, self._draw), list(self.crop.size), antialias=True)
        if self.hflip and torch.rand(1) < 0.5:
            out = v2.functional.horizontal_flip(out)
        return out

    def __repr__(self) -> str:
        return f"RegionCropFlip(size={self.crop.size[0]}, hflip={self.hflip})"


def build_imagenet_workers(preset, settings, source: Source):
    """The workers path for ImageNet-style crops (``crop="resized"``, speed/fastjpeg.py): the workers decode with
    libjpeg-turbo (only each crop's box where nvImageCodec imports: the same crops, 1.06-1.13x the images per core) and
    send uint8 crops, which ``fastjpeg.DeviceNormalize`` normalises a batch at a time on the device."""
    if available():
        train_set = ImageFolderDataset(source.root / preset.train_split, RegionCropFlip(source.image_size,
                                                                                        preset.hflip),
                                       loader=str)   # the crop reads the file itself
    else:
        train_set = ImageFolderDataset(source.root / preset.train_split,
                                       fastjpeg.train_transform(preset, source.image_size), loader=fastjpeg.decode_rgb)
    val_set = ImageFolderDataset(source.root / source.val_split, fastjpeg.eval_transform(preset, source.image_size),
                                 loader=fastjpeg.decode_rgb)
    train, val = data.worker_loaders(train_set, val_set, settings, source, f"in {settings.data_dir}")
    to_device = fastjpeg.DeviceNormalize(preset, source.device, settings.channels_last)
    train = fastjpeg.NormalizedEpochLoader(train, to_device, settings.max_steps_per_epoch, settings.seed, source.rank)
    return source.data(train, fastjpeg.NormalizedLoader(val, to_device), (len(train_set), len(val_set)), preset)


data.WORKERS_BY_CROP["resized"] = build_imagenet_workers

"""Benchmark: ImageNet training input per CPU core, the course's path against the kit's faster ones.

    python benchmarks/imagenet_input.py                 # 5 rounds of 200 steady batches of 16 a path
    python benchmarks/imagenet_input.py --rounds 1 --steps 20 --images 400 --allow-dirty --out /tmp/t.json  # trial

Images: ImageNet-like JPEGs without a download (benchmarks/photos.py: windows of scikit-learn's two real photos at
1:1 scale with a camera's grain, quality 94-96, ~0.54 bytes a pixel like ImageNet's; their mean size and bytes a
pixel go into the JSON), in ImageNet's folder layout (train/<wnid>/, val/<wnid>/) under --data-dir, made once.
A copy resized to a short side of 288 px is made with lab/scripts/resize_imagenet.py.

Each path's figure is a steady window (benchmarks/steady.py): --steps batches timed after the batches its loader
made ahead, going on into the next epoch where one ends.

Paths, each making training batches of --batch-size (RandomResizedCrop(224) and a flip) in this
process on one thread (DataLoader workers=0, DALI num_threads=1), each up to what it sends to the GPU:

  course             Pillow decodes the whole JPEG; RandomResizedCrop, flip, ToTensor, Normalize per image:
                     normalised float32 batches
  kit workers        only the crop's box decoded (nvImageCodec's libjpeg-turbo, ddp_utils/speed/regionjpeg.py);
                     resize and flip on uint8 with v2's kernels: uint8 batches, normalised afterwards on the GPU
                     (what --loader workers does for ImageNet, ddp_utils/speed/fastjpeg.py)
  ... whole decode   the same without nvImageCodec: torchvision.io.decode_jpeg of the whole image, then the crop
  ... + normalise    the same with the batch normalisation on this CPU too, as in a CPU-only run (into memory
                     reused from batch to batch: fastjpeg.ReusedBatches)
  Pillow draft       Pillow decodes at 1/2, 1/4 or 1/8 scale when the crop is still at least 224 px there (draft()),
                     crops and resizes with Pillow: uint8 batches
  DALI CPU           --loader dali's pipeline on the CPU (device_id=None; decodes only the crop's region):
                     normalised float32 batches (on a GPU node DALI does all of it on the GPU)
  kit, 288-px copy   kit workers (uint8) on the resized copy
  ... + normalise    the same on the copy, normalised on this CPU

plus two decode-only rows (decode_jpeg of the originals and of the 288-px copy), the crop-resize-only row (the kit's
crop, resize, flip and batching on images decoded beforehand), the same with each other resize (OpenCV's bilinear
and area resizes on decode_jpeg's own HWC pixels, Pillow's antialiased bilinear, with and without reduce() first:
`reducing_gap=2`; OpenCV's rows need `pip install opencv-python-headless` and are left out without it) and the
entropy decoding alone (Pillow decoding the
originals at 1/8 scale: every byte entropy-decoded, almost no pixels made). The kit's uint8 path is held to
OF_FLOOR_MARK of 1 / (decode + crop-resize) on its whole-decode path, the three measured in the same rounds. Each
resize is also compared with the kit's, pixel by pixel, on the same crops (RESIZE_TOLERANCE): the fastest one within
it is what the kit should use. Every
round runs every path once, in rotating order, so that drifts in machine speed hit all alike. Per core = images per
CPU-second of this process (all its threads: DALI runs a few of its own), the fair figure for "how many cores feed
one GPU"; the ratio is the median over rounds of each round's ratio to the course's path. Run it on an idle
machine.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import PIL
import torch
import torchvision

try:
    import cv2
except ImportError:   # the OpenCV rows are left out
    cv2 = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_utils.speed import fastjpeg, regionjpeg  # noqa: E402
from ddp_utils.data import build_loaders  # noqa: E402
from ddp_utils.datasets import ImageFolderDataset, load_preset, train_transform  # noqa: E402
from ddp_utils.loaders import EpochLoader
from ddp_utils.runlog import cpu_name  # noqa: E402
from ddp_utils.settings import Settings  # noqa: E402
from photos import describe, make_photos  # noqa: E402  (benchmarks/photos.py: ImageNet-like JPEGs)
from results import Recorder, add_out, busy_cpu_seconds  # noqa: E402  (benchmarks/results.py)
from steady import MIN_STEPS, stream, time_steady, warm_batches  # noqa: E402  (benchmarks/steady.py)

LABELS = {   # what each path is, as the table says it
    "course": "course: Pillow decodes, RandomResizedCrop, ToTensor, Normalize per image (float32 batches)",
    "kit workers": "**kit `--loader workers`**: only the crop's box decoded (nvImageCodec, `regionjpeg`), resize/flip "
                   "with v2's kernels on uint8 (uint8 batches; the GPU normalises)",
    "kit workers, whole decode": "kit `--loader workers` without nvImageCodec: `decode_jpeg` of the whole image, "
                                 "crop/resize/flip on uint8",
    "kit workers, normalised on the CPU": "kit `--loader workers` (the crop's box decoded) with the normalisation on "
                                          "this CPU too (a CPU-only run; into reused memory)",
    "Pillow draft": "Pillow `draft()` where the crop allows, Pillow crop and resize (uint8 batches)",
    "DALI CPU": "DALI's CPU pipeline, `--loader dali` without a GPU (float32 batches)",
    "kit workers, 288-px copy": "kit `--loader workers` on the 288-px copy from `resize_imagenet.py` (uint8 batches)",
    "kit workers, 288-px copy, normalised on the CPU": "the same normalised on this CPU too",
    "decode only, originals": "decode only, `decode_jpeg`: the originals",
    "crop-resize only": "crop, resize, flip and batching only, the kit's (images decoded beforehand)",
    "crop-resize only, OpenCV bilinear": "the same, resized by OpenCV's `INTER_LINEAR` (no antialiasing)",
    "crop-resize only, OpenCV area": "the same, resized by OpenCV's `INTER_AREA` (bilinear when enlarging)",
    "crop-resize only, Pillow": "the same, resized by Pillow's antialiased bilinear (the course's resize)",
    "crop-resize only, Pillow reduce": "the same, Pillow with `reducing_gap=2` (`reduce()` by a whole factor first)",
    "decode only, 288-px copy": "decode only, `decode_jpeg`: the 288-px copy",
    "entropy decoding only": "decode floor: Pillow decodes the originals at 1/8 scale (every byte still "
                             "entropy-decoded, 1/64 of the pixels made)",
}
REPO = Path(__file__).resolve().parents[1]
OF_FLOOR_MARK = 0.85   # the kit's uint8 path at least this share of 1 / (decode + crop-resize) (issue 46)
# A resize gives "the same pixels" as the kit's when, on the same crops, at most 0.5 % of its values differ from
# the kit's by more than 2 of 255 levels (Pillow's resize, the course's: 0.28 % in the recorded run) and by 0.5 of a
# level on average.
RESIZE_TOLERANCE = {"levels": 2, "share_over": 0.005, "mean_abs": 0.5}


def resized_copy(src: Path, dst: Path, short_side: int = 288) -> Path:
    # importable by name: the script's forkserver pool workers import it to find resize_one
    sys.path.insert(0, str(REPO / "lab" / "scripts"))
    import resize_imagenet as script
    if script.main([str(src), str(dst), "--short-side", str(short_side), "--no-progress"]) != 0:
        raise SystemExit(f"resize_imagenet.py failed on {src}")
    return dst


class PillowDraftCrop:
    """RandomResizedCrop + flip with Pillow from a path, decoding at a reduced scale where the crop allows it.

    The crop is drawn on the full-size image as the course's transform draws it; when the crop is at least
    2x (4x, 8x) the output size in both directions, the JPEG is decoded at 1/2 (1/4, 1/8) scale. Returns
    uint8 (3, S, S). ``reduced`` counts the images that were.
    """

    def __init__(self, size: int):
        from torchvision import transforms as T
        self.size, self.rrc, self.reduced = size, T.RandomResizedCrop(size), 0

    def __call__(self, path: str) -> torch.Tensor:
        from PIL import Image
        with Image.open(path) as image:
            full_w, full_h = image.size
            top, left, h, w = self.rrc.get_params(image, self.rrc.scale, self.rrc.ratio)
            r = 1
            while r < 8 and min(h, w) // (2 * r) >= self.size:
                r *= 2
            if r > 1:
                image.draft("RGB", (math.ceil(full_w / r), math.ceil(full_h / r)))
                self.reduced += image.size != (full_w, full_h)
            sx, sy = image.width / full_w, image.height / full_h
            out = image.convert("RGB").resize((self.size, self.size), Image.Resampling.BILINEAR,
                                              box=(left * sx, top * sy, (left + w) * sx, (top + h) * sy))
        if torch.rand(1) < 0.5:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(out)).permute(2, 0, 1)


def course_loader(root: Path, batch_size: int) -> EpochLoader:
    """The course's path: Pillow + RandomResizedCrop + flip + ToTensor + Normalize per image, float32 batches."""
    from torch.utils.data import DataLoader, DistributedSampler
    dataset = ImageFolderDataset(root / "train", train_transform(load_preset("imagenet")))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    return EpochLoader(DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                                  generator=torch.Generator()))


def draft_loader(root: Path, batch_size: int) -> tuple[fastjpeg.NormalizedEpochLoader, PillowDraftCrop]:
    """Pillow with draft() where the crop allows, uint8 out; normalised per batch like the kit's workers path."""
    from torch.utils.data import DataLoader, DistributedSampler
    preset = load_preset("imagenet")
    crop = PillowDraftCrop(preset.image_size)
    dataset = ImageFolderDataset(root / "train", crop, loader=str)   # the transform opens the file itself
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, generator=torch.Generator())
    return fastjpeg.NormalizedEpochLoader(loader, fastjpeg.DeviceNormalize(preset, "cpu")), crop


class DecodeOnly:
    """A pass that only decodes the training images with decode_jpeg, in batches (a list of images, their paths):
    the decode's share of a path."""

    def __init__(self, root: Path, batch_size: int):
        self.paths, self.batch_size = sorted(str(p) for p in (root / "train").glob("*/*.JPEG")), batch_size

    def chunks(self):
        for i in range(0, len(self.paths) - self.batch_size + 1, self.batch_size):
            yield self.paths[i:i + self.batch_size]

    def epoch(self, epoch: int):
        for paths in self.chunks():
            yield [fastjpeg.decode_rgb(path) for path in paths], paths


class EntropyOnly(DecodeOnly):
    """Pillow decodes the training images at 1/8 scale (draft()): each byte of the file is still entropy-decoded,
    but the inverse DCT, upsampling and colour conversion make 1/64 of the pixels. What no decode of the whole file
    can go below: a decoder of only the crop's region skips the rest, never the entropy decoding of the rows above
    the crop's bottom (a JPEG's Huffman stream has no index to seek in)."""

    def epoch(self, epoch: int):
        from PIL import Image
        for paths in self.chunks():
            for path in paths:
                with Image.open(path) as image:
                    image.draft("RGB", (image.width // 8, image.height // 8))
                    image.load()
            yield None, paths


class OpenCVCropFlip(fastjpeg.RandomCropFlip):
    """The kit's crop and flip (the same draws), the resize by OpenCV's ``cv2.resize`` on the crop's HWC pixels:
    decode_jpeg's (3, H, W) is a view of HWC memory, so OpenCV reads it without a copy."""

    def __init__(self, size: int, interpolation: str):
        super().__init__(size)
        self.interpolation = interpolation

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        top, left, height, width = self.crop.get_params(image, self.crop.scale, self.crop.ratio)
        size = self.crop.size[0]
        crop = image.permute(1, 2, 0).numpy()[top:top + height, left:left + width]
        # INTER_AREA averages only when shrinking; enlarging it is bilinear
        how = cv2.INTER_AREA if self.interpolation == "area" else cv2.INTER_LINEAR
        out = torch.from_numpy(cv2.resize(crop, (size, size), interpolation=how)).permute(2, 0, 1)
        if self.hflip and torch.rand(1) < 0.5:
            out = out.flip(-1)
        return out


class PillowCropFlip(fastjpeg.RandomCropFlip):
    """The kit's crop and flip draws, the resize by Pillow's antialiased bilinear on a PIL image (what Pillow's own
    decode gives: the conversion from the tensor is made beforehand, untimed); ``reducing_gap`` as Pillow's."""

    def __init__(self, size: int, reducing_gap: float | None = None):
        super().__init__(size)
        self.reducing_gap = reducing_gap

    def __call__(self, image) -> torch.Tensor:
        from PIL import Image
        top, left, height, width = self.crop.get_params(image, self.crop.scale, self.crop.ratio)
        size = self.crop.size[0]
        out = image.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + width, top + height),
                           reducing_gap=self.reducing_gap)
        if self.hflip and torch.rand(1) < 0.5:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(out)).permute(2, 0, 1)


def resize_options(size: int) -> dict:
    """name -> (crop-flip-resize object, whether it takes PIL images): the kit's and the others measured beside it."""
    options = {"crop-resize only": (fastjpeg.RandomCropFlip(size), False)}
    if cv2 is not None:
        cv2.setNumThreads(1)   # one core, as every other path here
        options["crop-resize only, OpenCV bilinear"] = (OpenCVCropFlip(size, "bilinear"), False)
        options["crop-resize only, OpenCV area"] = (OpenCVCropFlip(size, "area"), False)
    options["crop-resize only, Pillow"] = (PillowCropFlip(size), True)
    options["crop-resize only, Pillow reduce"] = (PillowCropFlip(size, reducing_gap=2.0), True)
    return options


def pixel_differences(images: list, options: dict, seed: int = 0) -> dict:
    """Each resize against the kit's on the same crops and flips (the same seed before each image): the mean
    absolute difference in levels, the share of values more than RESIZE_TOLERANCE's levels apart, the largest, and
    whether it is within the tolerance."""
    from PIL import Image
    pil = [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in images]
    outs = {}
    for name, (crop, takes_pil) in options.items():
        outs[name] = []
        for i, image in enumerate(images):
            torch.manual_seed(seed + i)
            outs[name].append(crop(pil[i] if takes_pil else image).int())
    kit = outs["crop-resize only"]
    found = {}
    for name, out in outs.items():
        d = torch.cat([(a - b).abs().flatten() for a, b in zip(out, kit)]).float()
        over = float((d > RESIZE_TOLERANCE["levels"]).float().mean())
        found[name] = {"mean_abs": float(d.mean()), "share_over": over, "max": int(d.max()),
                       "within": over <= RESIZE_TOLERANCE["share_over"]
                       and float(d.mean()) <= RESIZE_TOLERANCE["mean_abs"]}
    return found


class CropResizeOnly:
    """The kit's crop, resize and flip (RandomCropFlip on uint8) and its batching, on images decoded beforehand:
    the workers path without its decode. ``keep`` images are decoded once and cycled (all of them would not fit).
    ``crop``: another resize's crop-flip object (``resize_options``); ``pil``: it takes PIL images."""

    def __init__(self, root: Path, batch_size: int, keep: int = 256, crop=None, pil: bool = False):
        paths = sorted(str(p) for p in (root / "train").glob("*/*.JPEG"))[:keep]
        self.images = [fastjpeg.decode_rgb(path) for path in paths]
        if pil:
            from PIL import Image
            self.images = [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in self.images]
        self.crop = crop or fastjpeg.train_transform(load_preset("imagenet"))
        self.batch_size = batch_size
        self.length = len(list((root / "train").glob("*/*.JPEG")))   # an epoch as long as the others'

    def epoch(self, epoch: int):
        for i in range(0, self.length - self.batch_size + 1, self.batch_size):
            chosen = [self.images[(i + k) % len(self.images)] for k in range(self.batch_size)]
            yield torch.stack([self.crop(image) for image in chosen]), list(range(self.batch_size))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data/imagenet-input", help="where the photos and their copy go")
    p.add_argument("--images", type=int, default=3264, help="training images (one epoch holds every path's window)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=MIN_STEPS, help="timed batches of each path in each round, taken "
                   "after the batches made ahead (steady.py)")
    add_out(p, "imagenet_input")
    args = p.parse_args()
    recorder = Recorder("imagenet_input", args)
    torch.set_num_threads(1)
    root = Path(args.data_dir)
    original = make_photos(root / "original", args.images, 16)   # val: only the resized copy reads it
    copy = resized_copy(original, root / "resized-288")
    files = describe(original)

    def kit(data_dir, loader="workers"):
        return build_loaders(Settings(dataset="imagenet", data_dir=str(data_dir), workers=1 if loader == "dali" else 0,
                                   batch_size=args.batch_size, loader=loader), 0, 1, "cpu").train

    def uint8(data_dir):   # the kit's workers path up to its uint8 batches: on a GPU node the GPU normalises
        train = kit(data_dir)
        return EpochLoader(train.loader, seed=train.seed, rank=train.rank)

    def whole_decode(data_dir):   # the same without nvImageCodec (the kit decides when it builds the loader)
        real, regionjpeg.available = regionjpeg.available, lambda: False
        try:
            return uint8(data_dir)
        finally:
            regionjpeg.available = real

    if not regionjpeg.available():
        raise SystemExit("imagenet_input.py compares the kit's region decode with the whole decode: it needs "
                         "nvImageCodec (pip install nvidia-nvimgcodec-cu12; requirements-dev.txt's DALI brings it)")

    draft, draft_crop = draft_loader(original, args.batch_size)
    paths = {"course": course_loader(original, args.batch_size),
             "kit workers": uint8(original),
             "kit workers, whole decode": whole_decode(original),
             "kit workers, normalised on the CPU": kit(original),
             "Pillow draft": EpochLoader(draft.loader),
             "DALI CPU": kit(original, "dali"),
             "kit workers, 288-px copy": uint8(copy),
             "kit workers, 288-px copy, normalised on the CPU": kit(copy),
             "decode only, originals": DecodeOnly(original, args.batch_size),
             **{name: CropResizeOnly(original, args.batch_size, crop=crop, pil=pil)
                for name, (crop, pil) in resize_options(224).items()},
             "decode only, 288-px copy": DecodeOnly(copy, args.batch_size),
             "entropy decoding only": EntropyOnly(original, args.batch_size)}
    # batches made ahead of the clock: none in this process (workers 0), DALI's queue of 2 with its one thread
    warm = {name: warm_batches(1) if name == "DALI CPU" else warm_batches(0) for name in paths}
    names = list(paths)
    for name in names:            # warm-up: first-call costs (DALI's pipeline build, page cache) out of the figures
        time_steady(stream(paths[name], 100), warm[name], 2)
    per_core = {name: [] for name in names}
    wall = {name: [] for name in names}
    start = (time.perf_counter(), busy_cpu_seconds(), time.process_time())
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:   # rotate who goes first
            w = time_steady(stream(paths[name], r * 1000), warm[name], args.steps)
            per_core[name].append(w["images"] / w["cpu_seconds"])
            wall[name].append(w["images"] / w["seconds"])
    # What the other processes of the machine used meanwhile, in cores: others' tests would slow every path.
    others = ((busy_cpu_seconds() - start[1]) - (time.process_time() - start[2])) / (time.perf_counter() - start[0])

    course = names[0]
    ratio = {name: statistics.median(a / b for a, b in zip(per_core[name], per_core[course])) for name in names}
    print(f"{args.images} training images, {files['mean_kb']:.0f} KB and {files['bytes_per_pixel']:.2f} bytes a "
          f"pixel on average ({original}); {args.steps} batches of {args.batch_size} a path and round, timed after "
          f"the batches made ahead; {cpu_name()}, {os.cpu_count()} cores, 1 thread, torch {torch.__version__}; "
          f"median of {args.rounds} rounds; other processes used {others:.2f} cores on average meanwhile")
    table = ["| path | img/s per core | img/s wall | per core vs the course's path |", "| --- | ---: | ---: | ---: |"]
    table += [f"| {LABELS[name]} | {statistics.median(per_core[name]):,.0f} | {statistics.median(wall[name]):,.0f} | "
              f"{ratio[name]:.2f}x |" for name in names]
    print("\n".join(table))
    if others > 0.1:
        print("note: the machine was not idle (other processes used the CPU meanwhile): run again when it is")
    # The kit's whole-decode path against its floor, decode + crop-resize measured alike in this run: per round,
    # so that the three figures of one round are compared (the median of those ratios); then the region decode's gain
    of_floor = statistics.median(k * (1 / d + 1 / c) for k, d, c in zip(
        per_core["kit workers, whole decode"], per_core["decode only, originals"], per_core["crop-resize only"]))
    region_gain = statistics.median(a / b for a, b in zip(per_core["kit workers"],
                                                          per_core["kit workers, whole decode"]))
    ms = {name: 1000 / statistics.median(per_core[name]) for name in names}
    print(f"the kit's uint8 path with the whole decode runs at {of_floor:.2f} of 1 / (decode "
          f"{ms['decode only, originals']:.2f} ms + crop-resize {ms['crop-resize only']:.2f} ms an image): the mark is "
          f"{OF_FLOOR_MARK}; decoding only the crop's box makes it {region_gain:.2f}x as fast")
    differences = pixel_differences(paths["crop-resize only"].images[:200], resize_options(224))   # decoded once
    kept = max((name for name in differences if differences[name]["within"]), key=lambda n: ratio[n])
    print("resizes against the kit's on the same 200 crops: " + "; ".join(
        f"{name.split(', ', 1)[-1] if ', ' in name else 'the kit (v2)'} {ms[name]:.2f} ms an image, mean "
        f"{d['mean_abs']:.2f} levels, {100 * d['share_over']:.2f} % over {RESIZE_TOLERANCE['levels']}, max {d['max']}"
        f"{'' if d['within'] else ' (not the same pixels)'}" for name, d in differences.items()))
    print(f"the fastest resize with the same pixels: {kept}" + ("" if cv2 is not None else
                                                                 " (OpenCV not installed: its rows left out)"))
    print(f"Pillow draft decoded {draft_crop.reduced} crops at a reduced scale; the 288-px copy decodes "
          f"{ratio['decode only, 288-px copy'] / ratio['decode only, originals']:.2f}x faster than the originals and "
          f"the kit's workers path runs {ratio['kit workers, 288-px copy'] / ratio['kit workers']:.2f}x faster on it")
    recorder.save({"per_core": {name: statistics.median(v) for name, v in per_core.items()},
                   "wall": {name: statistics.median(v) for name, v in wall.items()}, "vs_course": ratio,
                   "rounds": per_core, "draft_reduced": draft_crop.reduced, "ms": ms,
                   "kit_of_floor": of_floor, "of_floor_mark": OF_FLOOR_MARK, "region_gain": region_gain,
                   "resize_differences": differences, "resize_tolerance": RESIZE_TOLERANCE, "resize_kept": kept,
                   "files": files}, table, others=others,
                  steady_after_batches=max(warm.values()), steady_steps=args.steps,
                  # the ratios are against Pillow's path and with torchvision's decoder: their releases move them
                  libraries={"Pillow": PIL.__version__, "torchvision": torchvision.__version__,
                             "nvImageCodec": regionjpeg.version(), "OpenCV": cv2.__version__ if cv2 else None})


if __name__ == "__main__":
    main()

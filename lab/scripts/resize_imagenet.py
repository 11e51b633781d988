#!/usr/bin/env python3
"""Write a copy of ImageNet with every image's short side resized to 288 pixels, once, so that every epoch
decodes fewer pixels.

Training decodes each JPEG in full every epoch, then throws most pixels away: RandomResizedCrop ends at
224 x 224, validation at Resize(256) + CenterCrop(224). A copy at a short side of 288 keeps enough for both
(and for crops at 224 a little bigger) and decodes faster (measured: see --help). The copy keeps the layout and the
file names, so classes, labels and image order are the same as the original's::

    SRC/train/<wnid>/<name>.JPEG  ->  DST/train/<wnid>/<name>.JPEG      (and val/ likewise)

Images whose short side is already at most --short-side are copied byte for byte. The others are decoded
by Pillow at a reduced scale where JPEG allows it (``draft``: 1/2, 1/4 or 1/8 while staying above the
target, much faster for big originals), resized with an antialiased bicubic filter and saved as JPEG
(--quality, default 90). Then train with ``--data-dir DST``.

Safe to interrupt and run again: finished images are skipped, each image is written to
``<name>.partial`` and renamed when complete (an interrupted run leaves no half-written image), and
``.partial`` leftovers are redone. At the end DST is verified against SRC: the same class folders,
every image there, every output readable with the expected size. Exit status 1 on problems, listed.

Examples::

    python lab/scripts/resize_imagenet.py /data/imagenet /data/imagenet-288
    python lab/scripts/resize_imagenet.py /data/imagenet /data/imagenet-288 --verify-only
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
from pathlib import Path

SPLITS = ("train", "val")
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")   # torchvision's
PARTIAL = ".partial"    # suffix of an image still being written
SHOW = 10               # list at most this many examples per problem

# Measured with benchmarks/imagenet_input.py (one core of a 2-core Intel Xeon VM, torch 2.14.1): see --help.
SPEED_UP = ("Measured on one core of an idle 2-core Intel Xeon VM (benchmarks/imagenet_input.py: 400-500 px JPEGs "
            "made from real photos, about the size of ImageNet's originals, which average some 470 x 390 px): "
            "the 288-px copy decodes {decode} faster, and the kit's ImageNet training input (decode, random crop, "
            "resize, flip) runs {train} faster on it. Images already at or below the short side are copied as "
            "they are.")
MEASURED = {"decode": "1.28x", "train": "1.17x"}


def target_size(size: tuple[int, int], short_side: int) -> tuple[int, int]:
    """(width, height) with the short side at ``short_side``, or ``size`` itself if it is already smaller."""
    w, h = size
    if min(w, h) <= short_side:
        return w, h
    if w <= h:
        return short_side, max(1, round(h * short_side / w))
    return max(1, round(w * short_side / h)), short_side


def resize_one(task: tuple[str, str, int, int]) -> tuple[str, str, str]:
    """Make DST from SRC: (src, dst, short side, quality) -> (src, outcome, why) with outcome one of
    'skipped' (already there), 'copied', 'resized' or 'failed' (why says what went wrong)."""
    from PIL import Image

    src, dst, short_side, quality = task
    out = Path(dst)
    if out.is_file() and out.stat().st_size > 0:
        return src, "skipped", ""
    tmp = out.with_name(out.name + PARTIAL)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(src) as image:
            size = target_size(image.size, short_side)
            if size == image.size:
                outcome = "copied"
                shutil.copyfile(src, tmp)    # no second JPEG generation for images that are small already
            else:
                outcome = "resized"
                image.draft("RGB", size)     # JPEG: decode at 1/2, 1/4 or 1/8 scale, never below ``size``
                image.convert("RGB").resize(size, Image.Resampling.BICUBIC).save(tmp, format="JPEG",
                                                                                  quality=quality)
        os.replace(tmp, out)                 # atomic: DST holds the whole image or none of it
    except (OSError, ValueError, SyntaxError) as e:   # Pillow raises all three for bad files
        tmp.unlink(missing_ok=True)
        return src, "failed", f"{type(e).__name__}: {e}"
    return src, outcome, ""


def list_images(root: Path, splits: tuple[str, ...]) -> list[Path]:
    """Every image below root/<split>/<class>/, relative to root, in sorted order."""
    found = []
    for split in splits:
        for class_dir in sorted(p for p in (root / split).iterdir() if p.is_dir() and not p.name.startswith(".")):
            found += sorted(p.relative_to(root) for p in class_dir.iterdir()
                            if p.is_file() and p.suffix.lower() in EXTENSIONS)
    return found


def _examples(items: list, show: int = SHOW) -> str:
    text = ", ".join(str(x) for x in items[:show])
    return text + (f" ... and {len(items) - show} more" if len(items) > show else "")


def check_pair(task: tuple[str, str, int]) -> str:
    """'' if DST is a readable image of the size SRC resized to the short side should have, else why not."""
    from PIL import Image

    src, dst, short_side = task
    if not Path(dst).is_file():
        return "missing"
    try:
        with Image.open(src) as image:
            expected = target_size(image.size, short_side)
    except (OSError, ValueError, SyntaxError):
        return ""                      # the source itself is unreadable: reported when it failed to resize
    try:
        with Image.open(dst) as image:
            got = image.size
            image.draft("RGB", (1, 1))     # decode at 1/8 scale: quick, and still reads every byte
            image.load()
    except (OSError, ValueError, SyntaxError) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    if abs(got[0] - expected[0]) > 1 or abs(got[1] - expected[1]) > 1:
        return f"{got[0]}x{got[1]} px, expected {expected[0]}x{expected[1]}"
    return ""


def workers(processes: int):
    """A pool whose processes a fresh server process forks (``forkserver``, Python 3.14's default): forking this
    process itself, when it has threads (a notebook kernel, a test runner with torch loaded), can leave a child
    holding a lock nobody will release, and the pool hangs."""
    return multiprocessing.get_context("forkserver").Pool(processes)


def verify(src_root: Path, dst_root: Path, splits: tuple[str, ...], short_side: int, processes: int,
           progress: bool = True) -> list[str]:
    """Problems of DST against SRC (empty = all good): class folders, missing, extra, unreadable or
    wrongly sized images, half-written files."""
    from tqdm import tqdm

    problems = []
    for split in splits:
        if not (dst_root / split).is_dir():
            return [f"{dst_root / split} does not exist"]
        src_classes = {p.name for p in (src_root / split).iterdir() if p.is_dir() and not p.name.startswith(".")}
        dst_classes = {p.name for p in (dst_root / split).iterdir() if p.is_dir() and not p.name.startswith(".")}
        if src_classes != dst_classes:
            problems.append(f"{split}/: class folders differ from the source's (missing: "
                            f"{_examples(sorted(src_classes - dst_classes)) or 'none'}; extra: "
                            f"{_examples(sorted(dst_classes - src_classes)) or 'none'})")
    src_images = list_images(src_root, splits)
    dst_images = set(list_images(dst_root, splits))
    extra = sorted(dst_images - set(src_images))
    if extra:
        problems.append(f"{len(extra)} images in the copy are not in the source: {_examples(extra)}")
    partial = sorted(p.relative_to(dst_root) for split in splits for p in (dst_root / split).glob(f"*/*{PARTIAL}"))
    if partial:
        problems.append(f"{len(partial)} half-written files (run the script again): {_examples(partial)}")
    tasks = [(str(src_root / rel), str(dst_root / rel), short_side) for rel in src_images]
    bad = {}
    with workers(processes) as pool:
        results = pool.imap(check_pair, tasks, chunksize=64)
        for rel, why in zip(src_images, tqdm(results, total=len(tasks), desc="verifying", unit="img",
                                             disable=not progress)):
            if why == "missing":
                bad.setdefault("missing from the copy (run the script again)", []).append(rel)
            elif why:
                kind = "unreadable" if why.startswith("unreadable") else "of the wrong size"
                bad.setdefault(f"{kind} in the copy (delete them and run the script again)", []).append(f"{rel}: {why}")
    for kind, items in bad.items():
        problems.append(f"{len(items)} images {kind}: {_examples(items)}")
    return problems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Write a copy of ImageNet (train/ and val/ class folders) with every image's short side "
                    "resized to --short-side pixels, in parallel, resumable, then verify it.",
        epilog=SPEED_UP.format(**MEASURED) + " Exit status: 0 all good, 1 problems found (listed), 2 bad arguments.")
    p.add_argument("src", type=Path, help="ImageNet folder holding train/ and val/ (sorted into class folders)")
    p.add_argument("dst", type=Path, help="where the resized copy goes (created; may already hold a partial copy)")
    p.add_argument("--short-side", type=int, default=288,
                   help="short side in pixels after resizing (default 288; 256-320 suits 224-px training)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of the resized images (default 90)")
    p.add_argument("--processes", type=int, default=os.cpu_count(),
                   help=f"worker processes (default: every core, {os.cpu_count()} here)")
    p.add_argument("--splits", nargs="+", default=list(SPLITS), help="split folders to copy (default: train val)")
    p.add_argument("--verify-only", action="store_true", help="resize nothing, only check an existing copy")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (for logs)")
    args = p.parse_args(argv)
    if not 64 <= args.short_side <= 4096:
        p.error(f"--short-side {args.short_side}: choose 64..4096 pixels (256-320 for 224-px training)")
    if not 1 <= args.quality <= 100:
        p.error(f"--quality {args.quality}: choose 1..100")
    if args.processes < 1:
        p.error("--processes must be at least 1")
    if args.src.resolve() == args.dst.resolve():
        p.error("dst must differ from src: the script never writes into the original")
    return args


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = parse_args(argv)
    splits = tuple(args.splits)
    missing = [str(args.src / s) for s in splits if not (args.src / s).is_dir()]
    if missing:
        print(f"error: {', '.join(missing)} not found: src must hold the split folders {' '.join(splits)}",
              file=sys.stderr)
        return 2
    problems = []
    if not args.verify_only:
        images = list_images(args.src, splits)
        print(f"{len(images):,} images in {args.src} ({', '.join(splits)}) -> {args.dst}, short side "
              f"{args.short_side} px, {args.processes} processes")
        tasks = [(str(args.src / rel), str(args.dst / rel), args.short_side, args.quality) for rel in images]
        counts = dict.fromkeys(("skipped", "copied", "resized", "failed"), 0)
        failed = []
        with workers(args.processes) as pool:
            for src, outcome, why in tqdm(pool.imap_unordered(resize_one, tasks, chunksize=64), total=len(tasks),
                                          desc="resizing", unit="img", disable=args.no_progress):
                counts[outcome] += 1
                if why:
                    failed.append(f"{src} ({why})")
        print("  " + ", ".join(f"{k}: {v:,}" for k, v in counts.items()))
        if failed:
            problems.append(f"{len(failed)} source images cannot be read (not copied; replace them and run "
                            f"again): {_examples(sorted(failed))}")
        for leftover in (p for s in splits for p in (args.dst / s).glob(f"*/*{PARTIAL}")):
            leftover.unlink()   # from an interrupted earlier run; their images were just written again
    print(f"verifying {args.dst} against {args.src} ...")
    problems += verify(args.src, args.dst, splits, args.short_side, args.processes, not args.no_progress)
    if problems:
        print(f"\nFOUND {len(problems)} PROBLEM(S):", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"OK: {args.dst} holds every image of {args.src} ({', '.join(splits)}) at a short side of at most "
          f"{args.short_side} px. Train with --data-dir {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

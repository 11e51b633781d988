#!/usr/bin/env python3
"""Unpack CINIC-10 and check that it is complete before anybody trains on it.

CINIC-10 (https://github.com/BayesWatch/cinic-10) is 270,000 PNG images of 32x32 pixels in three
equal splits, each with the ten CIFAR-10 classes::

    train/airplane/*.png  ...  train/truck/*.png      9,000 images per class
    valid/...                                          9,000 images per class
    test/...                                           9,000 images per class

The script unpacks ``CINIC-10.tar.gz`` into a target folder (skipped when the splits are already
there), then verifies: the three splits, exactly the ten class folders in each, 9,000 images per
class, and that images open as 32x32 pictures (a sample per class; ``--full`` opens all 270,000).
Any deviation is named (split, class, count) and the exit status is 1.

Examples::

    python lab/scripts/prepare_cinic10.py --archive ~/CINIC-10.tar.gz --target /data/cinic10
    python lab/scripts/prepare_cinic10.py --target /data/cinic10 --verify-only --full
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tarfile
from pathlib import Path

SPLITS = ("train", "valid", "test")
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGES_PER_CLASS = 9000
IMAGE_SIZE = (32, 32)
UNPACKING = ".unpacking"   # temporary folder inside the target while the archive is extracted
SHOW = 10                  # list at most this many examples per problem


def find_root(folder: Path) -> Path | None:
    """The folder that holds train/ valid/ test/: ``folder`` itself or a single sub-folder of it
    (some copies of the archive wrap everything in ``CINIC-10/``). None if there is none."""
    if all((folder / s).is_dir() for s in SPLITS):
        return folder
    subdirs = [p for p in folder.iterdir() if p.is_dir() and p.name != UNPACKING] if folder.is_dir() else []
    if len(subdirs) == 1 and all((subdirs[0] / s).is_dir() for s in SPLITS):
        return subdirs[0]
    return None


def _safe_members(tar: tarfile.TarFile, dest: Path):
    """Yield the archive's members, refusing any that would land outside ``dest`` (for Pythons
    without tarfile's 'data' filter)."""
    for m in tar:
        target = (dest / m.name).resolve()
        if not (m.isfile() or m.isdir()) or not target.is_relative_to(dest.resolve()):
            raise RuntimeError(f"refusing suspicious archive member {m.name!r}")
        yield m


def unpack(archive: Path, target: Path, force: bool = False) -> Path:
    """Extract ``archive`` so that ``target`` holds train/ valid/ test/. Returns the data root.

    Skips the work when the splits are already there (unless ``force``). Extracts into a temporary
    folder first and moves the splits in at the end, so an interrupted run never looks finished.
    """
    root = find_root(target) if target.is_dir() else None
    if root is not None and not force:
        print(f"already unpacked: {root} has {', '.join(SPLITS)} (use --force to unpack again)")
        return root
    if not archive.is_file():
        raise FileNotFoundError(f"archive {archive} does not exist")

    tmp = target / UNPACKING
    if tmp.exists():
        print(f"removing {tmp} left over from an interrupted run")
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    print(f"unpacking {archive} into {target} (270,000 small files: a few minutes) ...", flush=True)
    count = 0
    try:
        with tarfile.open(archive, "r:*") as tar:
            has_filter = hasattr(tarfile, "data_filter")   # Python 3.12, and 3.8-3.11 security updates
            for member in tar if has_filter else _safe_members(tar, tmp):
                if has_filter:
                    # The 'data' filter refuses absolute paths, '..', links out of the folder and devices.
                    tar.extract(member, tmp, filter="data")
                else:
                    tar.extract(member, tmp)
                count += 1
                if count % 30_000 == 0:
                    print(f"  {count:,} entries", flush=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)   # a half-unpacked folder must not linger
        raise
    extracted = find_root(tmp)
    if extracted is None:
        shutil.rmtree(tmp)
        raise RuntimeError(f"{archive} does not contain the folders {', '.join(SPLITS)}; is it CINIC-10?")
    for split in SPLITS:
        dest = target / split
        if dest.exists():
            shutil.rmtree(dest)   # only reached with --force, or when a split was half there
        os.replace(extracted / split, dest)
    shutil.rmtree(tmp)
    print(f"unpacked {count:,} entries")
    return target


def check_image(path: Path) -> tuple[str | None, str]:
    """Open one image. Returns (problem or None, its PIL mode)."""
    from PIL import Image  # Pillow comes with torchvision
    try:
        with Image.open(path) as im:
            im.load()            # decode the pixels, not just the header
            size, mode = im.size, im.mode
            im.convert("RGB")    # what the training loader does
    except Exception as e:       # any decoder error means a broken file
        return f"{path}: cannot be read as an image ({e.__class__.__name__}: {e})", "?"
    if size != IMAGE_SIZE:
        return f"{path}: {size[0]}x{size[1]} pixels, expected {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}", mode
    return None, mode


def verify(root: Path, expect_per_class: int = IMAGES_PER_CLASS, sample: int = 10, full: bool = False,
           strict_rgb: bool = False, seed: int = 0) -> tuple[list[str], list[str]]:
    """Check a CINIC-10 folder. Returns (problems, notes); no problems = ready to train on.

    Opens ``sample`` random images per class and split (all of them with ``full``). Images stored
    as grayscale or palette PNGs are reported as notes (the loader converts them to RGB), or as
    problems with ``strict_rgb``.
    """
    problems: list[str] = []
    notes: list[str] = []
    rng = random.Random(seed)   # the same sample every run, so a report can be reproduced
    non_rgb: dict[str, int] = {}
    for split in SPLITS:
        split_dir = root / split
        if not split_dir.is_dir():
            problems.append(f"{split}/: missing")
            continue
        present = {p.name for p in split_dir.iterdir() if p.is_dir()}
        for name in sorted(set(CLASSES) - present):
            problems.append(f"{split}/{name}: class folder missing")
        for name in sorted(present - set(CLASSES)):
            problems.append(f"{split}/{name}: unexpected folder (ImageFolder would make it an 11th class)")
        total = 0
        for name in CLASSES:
            if name not in present:
                continue
            files = sorted(p for p in (split_dir / name).iterdir() if p.is_file())
            images = [p for p in files if p.suffix.lower() == ".png"]
            total += len(images)
            if len(images) != expect_per_class:
                problems.append(f"{split}/{name}: {len(images):,} images, expected {expect_per_class:,}")
            others = [p.name for p in files if p.suffix.lower() != ".png"]
            if others:
                notes.append(f"{split}/{name}: {len(others)} non-PNG files ignored by the loader, "
                             f"e.g. {others[0]}")
            to_open = images if full else rng.sample(images, min(sample, len(images)))
            bad = []
            for path in to_open:
                problem, mode = check_image(path)
                if problem:
                    bad.append(problem)
                elif mode != "RGB":
                    non_rgb[mode] = non_rgb.get(mode, 0) + 1
                    if strict_rgb:
                        bad.append(f"{path}: mode {mode}, not RGB")
            if bad:
                problems.append(f"{split}/{name}: {len(bad)} of {len(to_open)} opened images are bad: "
                                + "; ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""))
        print(f"  {split}: {len(present & set(CLASSES))} classes, {total:,} images")
    if non_rgb and not strict_rgb:
        modes = ", ".join(f"{n} {m}" for m, n in sorted(non_rgb.items()))
        notes.append(f"opened images not stored as RGB ({modes}); the loader converts them with "
                     ".convert('RGB'), so this is harmless")
    return problems, notes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Unpack CINIC-10.tar.gz and verify splits, classes, counts and images.",
        epilog="Exit status: 0 all good, 1 problems found (listed), 2 bad arguments or unpacking failed.")
    p.add_argument("--archive", type=Path, help="path to CINIC-10.tar.gz")
    p.add_argument("--target", type=Path, required=True,
                   help="folder that will hold (or holds) train/ valid/ test/, e.g. /data/cinic10")
    p.add_argument("--verify-only", action="store_true", help="do not unpack; only check --target")
    p.add_argument("--force", action="store_true", help="unpack again even if the splits are present")
    p.add_argument("--full", action="store_true", help="open every image, not only a sample per class")
    p.add_argument("--sample", type=int, default=10, help="images opened per class and split (default 10)")
    p.add_argument("--strict-rgb", action="store_true",
                   help="count images not stored as RGB (e.g. grayscale) as problems")
    p.add_argument("--expect-per-class", type=int, default=IMAGES_PER_CLASS,
                   help=f"images per class in every split (default {IMAGES_PER_CLASS:,})")
    args = p.parse_args(argv)
    if args.verify_only and args.archive:
        p.error("--verify-only checks an unpacked folder; leave out --archive")
    if not args.verify_only and not args.archive:
        p.error("--archive is required (or use --verify-only on an unpacked folder)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verify_only:
        root = find_root(args.target) if args.target.is_dir() else None
        if root is None:
            print(f"error: {args.target} does not hold the folders {', '.join(SPLITS)}", file=sys.stderr)
            return 1
    else:
        try:
            root = unpack(args.archive, args.target, force=args.force)
        except (OSError, RuntimeError, tarfile.TarError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    print(f"verifying {root} ({'every image' if args.full else f'{args.sample} images per class'} opened) ...")
    problems, notes = verify(root, args.expect_per_class, args.sample, args.full, args.strict_rgb)
    for note in notes:
        print(f"  note: {note}")
    if problems:
        print(f"\nFOUND {len(problems)} PROBLEM(S) in {root}:", file=sys.stderr)
        for p in problems[:50]:
            print(f"  - {p}", file=sys.stderr)
        if len(problems) > 50:
            print(f"  ... and {len(problems) - 50} more", file=sys.stderr)
        if not args.verify_only:
            print("If the archive was cut short, download it again and rerun with --force.", file=sys.stderr)
        return 1
    print(f"OK: CINIC-10 at {root} is complete. Point the kit at it: data_dir='{root}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())

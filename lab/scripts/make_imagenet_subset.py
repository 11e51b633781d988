#!/usr/bin/env python3
"""Make a smaller ImageNet from a full one: N of its classes (default 100), optionally M training images each.

For a homework that must go through every step without ImageNet's hours: 100 classes are a tenth of the images,
so a tenth of the time per epoch. The source is ImageNet in the kit's layout, with val already sorted into class
folders (lab/scripts/sort_imagenet_val.py); the subset has the same layout::

    SRC/train/<wnid>/*.JPEG  ->  DST/train/<wnid>/*.JPEG   the chosen classes; with --per-class M only the
                                                           first M images of each, by file name
    SRC/val/<wnid>/*.JPEG    ->  DST/val/<wnid>/*.JPEG     every validation image of the chosen classes

The kit's ``imagenet`` preset reads it as it is (it counts the class folders): train with ``--data-dir DST``.
The classes are every (total / N)-th in sorted wnid order, so that they spread over all of ImageNet's kinds of
things and the same command picks the same classes on every node; ``--class-list FILE`` names them instead
(one wnid per line, the first word of each line; the source's val/ may then hold more classes than its train/).

Files are hard links when DST is on the file system of SRC: no extra disk, done in seconds (training never
writes to the images, so sharing them is safe). Elsewhere, or with ``--copy``, they are copied, each to
``<name>.partial`` first and renamed when complete. Safe to interrupt and run again: finished files are skipped.
At the end DST is verified against SRC: exactly the chosen class folders in train/ and val/, every image there
with its source's size, no other image and no half-written file. Exit status 1 on problems (listed), 2 on
bad arguments or a source that is not ImageNet in the kit's layout. Needs nothing but Python 3.9+.

Examples::

    python3 lab/scripts/make_imagenet_subset.py /data/imagenet /data/imagenet-100
    python3 lab/scripts/make_imagenet_subset.py /data/imagenet /data/imagenet-100-300 --per-class 300
    python3 lab/scripts/make_imagenet_subset.py /data/imagenet /data/imagenet-100 --verify-only
"""
from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
from pathlib import Path

SPLITS = ("train", "val")
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")   # torchvision's
PARTIAL = ".partial"    # suffix of a copy still being written
SHOW = 10               # list at most this many examples per problem
NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP)   # "cannot hard-link here"


class SourceError(Exception):
    """SRC is not ImageNet in the kit's layout, or the classes asked for are not in it."""


def _examples(items: list, show: int = SHOW) -> str:
    text = ", ".join(str(x) for x in items[:show])
    return text + (f" ... and {len(items) - show} more" if len(items) > show else "")


def class_names(split_dir: Path) -> list[str]:
    """The class folders of one split, sorted (as ImageFolder numbers them)."""
    return sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def image_names(class_dir: Path) -> list[str]:
    """The images of one class folder, sorted by name."""
    return sorted(p.name for p in class_dir.iterdir() if p.is_file() and p.suffix.lower() in EXTENSIONS)


def spread(classes: list[str], n: int) -> list[str]:
    """``n`` classes evenly spaced over the sorted list: every 10th of 1000 for 100, starting with the first."""
    return [classes[i * len(classes) // n] for i in range(n)]


def read_class_list(path: Path) -> list[str]:
    """The first word of each line that is not empty or a # comment, in order, without repeats."""
    names = [line.split()[0] for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return list(dict.fromkeys(names))


def choose(src: Path, n: int, class_list: Path | None) -> list[str]:
    """The chosen classes, sorted; SourceError when SRC or the list does not fit."""
    for split in SPLITS:
        if not (src / split).is_dir():
            raise SourceError(f"{src / split} does not exist: SRC must hold train/ and val/ (ImageNet in the kit's "
                              "layout, SRC/train/<wnid>/*.JPEG and SRC/val/<wnid>/*.JPEG)")
    train, val = class_names(src / "train"), class_names(src / "val")
    flat = [p.name for p in (src / "val").iterdir() if p.is_file() and p.suffix.lower() in EXTENSIONS]
    if flat and not val:
        raise SourceError(f"{src / 'val'} holds {len(flat):,} images directly, not in class folders: sort them "
                          "first with lab/scripts/sort_imagenet_val.py")
    if class_list is not None:
        wanted = read_class_list(class_list)
        missing = [f"{c} ({', '.join(s for s, names in (('train', train), ('val', val)) if c not in names)})"
                   for c in wanted if c not in train or c not in val]
        if not wanted or missing:
            raise SourceError(f"{class_list}: " + (f"{len(missing)} classes are not in SRC: {_examples(missing)}"
                                                   if wanted else "lists no class"))
        return sorted(wanted)
    if train != val:
        raise SourceError(f"{src}/train and {src}/val have different class folders (train only: "
                          f"{_examples(sorted(set(train) - set(val))) or 'none'}; val only: "
                          f"{_examples(sorted(set(val) - set(train))) or 'none'}); sort val with "
                          "lab/scripts/sort_imagenet_val.py --train-dir, or name the classes with --class-list")
    if not 1 <= n <= len(train):
        raise SourceError(f"--classes {n}: SRC has {len(train)} classes; choose 1 to {len(train)}")
    return spread(train, n)


def plan(src: Path, dst: Path, classes: list[str], per_class: int) -> list[tuple[Path, Path]]:
    """(source file, subset file) of every image the subset holds, train then val."""
    pairs = []
    for split in SPLITS:
        for wnid in classes:
            names = image_names(src / split / wnid)
            if split == "train" and per_class:
                names = names[:per_class]
            pairs += [(src / split / wnid / name, dst / split / wnid / name) for name in names]
    return pairs


def can_link(src_file: Path, dst: Path) -> bool:
    """Whether a hard link from SRC's file system into DST works (tried once, then removed)."""
    probe = dst / f".link-test{PARTIAL}"
    probe.unlink(missing_ok=True)
    try:
        os.link(src_file, probe)
    except OSError as e:
        if e.errno in NO_LINK:
            return False
        raise
    probe.unlink()
    return True


def done(src_file: Path, dst_file: Path) -> bool:
    """The subset's file is already there: the same file (a hard link) or a copy of the same size."""
    try:
        return dst_file.samefile(src_file) or dst_file.stat().st_size == src_file.stat().st_size
    except FileNotFoundError:
        return False


def place(src_file: Path, dst_file: Path, link: bool) -> str:
    """Put one image into the subset: 'skipped' (already there), 'linked' or 'copied'. The file appears under its
    name complete or not at all: written as ``<name>.partial``, then renamed."""
    if done(src_file, dst_file):
        return "skipped"
    dst_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst_file.with_name(dst_file.name + PARTIAL)
    tmp.unlink(missing_ok=True)
    if link:
        os.link(src_file, tmp)
    else:
        shutil.copyfile(src_file, tmp)
    os.replace(tmp, dst_file)
    return "linked" if link else "copied"


def verify(pairs: list[tuple[Path, Path]], dst: Path, classes: list[str]) -> list[str]:
    """Problems of DST against the plan (empty = all good): class folders, missing, extra, wrongly sized images,
    half-written files."""
    problems = []
    for split in SPLITS:
        if not (dst / split).is_dir():
            return [f"{dst / split} does not exist (run the script without --verify-only)"]
        have = set(class_names(dst / split))
        if have != set(classes):
            problems.append(f"{split}/: class folders differ from the chosen ones (missing: "
                            f"{_examples(sorted(set(classes) - have)) or 'none'}; extra: "
                            f"{_examples(sorted(have - set(classes))) or 'none'})")
    expected = {d.relative_to(dst): s for s, d in pairs}
    present = {p.relative_to(dst) for split in SPLITS for p in (dst / split).glob("*/*")
               if p.is_file() and p.suffix.lower() in EXTENSIONS}
    missing = sorted(set(expected) - present)
    if missing:
        problems.append(f"{len(missing)} images are missing (run the script again): {_examples(missing)}")
    extra = sorted(present - set(expected))
    if extra:
        problems.append(f"{len(extra)} images are not part of this subset (left from a run with other settings? "
                        f"delete DST and run again): {_examples(extra)}")
    wrong = sorted(rel for rel in present & set(expected) if not done(expected[rel], dst / rel))
    if wrong:
        problems.append(f"{len(wrong)} images differ in size from their source (delete them and run again): "
                        f"{_examples(wrong)}")
    partial = sorted(p.relative_to(dst) for split in SPLITS for p in (dst / split).glob(f"*/*{PARTIAL}"))
    if partial:
        problems.append(f"{len(partial)} half-written files (run the script again): {_examples(partial)}")
    return problems


def gigabytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Make an ImageNet subset (train/ and val/ class folders) of N classes, optionally M training "
                    "images per class, from ImageNet in the kit's layout; hard links where possible; verified.",
        epilog="Exit status: 0 all good, 1 problems found (listed), 2 bad arguments or source.")
    p.add_argument("src", type=Path, help="ImageNet folder holding train/<wnid>/ and val/<wnid>/ (val sorted)")
    p.add_argument("dst", type=Path, help="where the subset goes (created; may hold a partial subset of an "
                                          "interrupted run with the same settings)")
    p.add_argument("--classes", type=int, default=100,
                   help="how many classes, evenly spread over the sorted class list (default 100)")
    p.add_argument("--per-class", type=int, default=0,
                   help="training images per class, the first by file name (default 0: all of them); "
                        "validation keeps all of the class's images")
    p.add_argument("--class-list", type=Path,
                   help="a file naming the classes instead (first word of each line: a wnid); overrides --classes")
    p.add_argument("--copy", action="store_true", help="copy the images instead of hard-linking them")
    p.add_argument("--verify-only", action="store_true", help="write nothing, only check an existing subset")
    args = p.parse_args(argv)
    if args.per_class < 0:
        p.error("--per-class must be 0 (all) or more")
    if args.class_list is not None and not args.class_list.is_file():
        p.error(f"--class-list {args.class_list} is not a file")
    src, dst = args.src.resolve(), args.dst.resolve()
    if dst == src or dst.is_relative_to(src):
        p.error("dst must be outside src: the script never writes into the original")
    return args


def make(pairs: list[tuple[Path, Path]], dst: Path, copy: bool) -> int:
    """Link or copy every planned image into DST. Returns 2 when copies would not fit, else 0."""
    dst.mkdir(parents=True, exist_ok=True)
    link = not copy and can_link(pairs[0][0], dst)
    if link:
        print(f"hard links into {dst} (the same file system: no extra disk)")
    else:
        todo = sum(s.stat().st_size for s, d in pairs if not done(s, d))
        free = shutil.disk_usage(dst).free
        print(f"copies into {dst}: {gigabytes(todo)} to write, {gigabytes(free)} free"
              + ("" if copy else " (another file system than the source's: no hard links)"))
        if todo > free:
            print(f"error: not enough free space in {dst}", file=sys.stderr)
            return 2
    counts = dict.fromkeys(("skipped", "linked", "copied"), 0)
    for i, (src_file, dst_file) in enumerate(pairs, start=1):
        counts[place(src_file, dst_file, link)] += 1
        if i % 10_000 == 0:
            print(f"  {i:,} / {len(pairs):,} images handled", flush=True)
    print("  " + ", ".join(f"{k}: {v:,}" for k, v in counts.items()))
    for leftover in (p for split in SPLITS for p in (dst / split).glob(f"*/*{PARTIAL}")):
        leftover.unlink()   # from an interrupted earlier run; its image was just placed again
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        classes = choose(args.src, args.classes, args.class_list)
    except SourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    how = (f"listed in {args.class_list}" if args.class_list else
           f"spread evenly over the {len(class_names(args.src / 'train'))} of {args.src}, in sorted order")
    print(f"{len(classes)} classes ({how}): {_examples(classes, 5)}")
    pairs = plan(args.src, args.dst, classes, args.per_class)
    have = {(d.parent.parent.name, d.parent.name) for _, d in pairs}
    empty = [f"{split}/{c}" for split in SPLITS for c in classes if (split, c) not in have]
    if empty:
        print(f"error: class folders without images in {args.src}: {_examples(empty)}", file=sys.stderr)
        return 2
    n_train = sum(1 for _, d in pairs if d.parent.parent.name == "train")
    n_val = len(pairs) - n_train
    each = f"at most {args.per_class} per class" if args.per_class else "all of each class"
    print(f"train: {n_train:,} images ({each}), val: {n_val:,} images; "
          f"{gigabytes(sum(s.stat().st_size for s, _ in pairs))}")
    if not args.verify_only and make(pairs, args.dst, args.copy):
        return 2
    print(f"verifying {args.dst} ...")
    problems = verify(pairs, args.dst, classes)
    if problems:
        print(f"\nFOUND {len(problems)} PROBLEM(S):", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"OK: {args.dst} holds {len(classes)} classes, {n_train:,} train and {n_val:,} val images. "
          f"Train with --dataset imagenet --data-dir {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

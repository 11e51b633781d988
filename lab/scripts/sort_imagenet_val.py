#!/usr/bin/env python3
"""Sort ImageNet-2012's flat validation folder into one folder per class, and check the result.

The official validation archive unpacks to 50,000 JPEGs in one folder::

    val/ILSVRC2012_val_00000001.JPEG ... val/ILSVRC2012_val_00050000.JPEG

``torchvision.datasets.ImageFolder`` needs ``val/<wnid>/<image>`` instead, with exactly the same class
folders as ``train/`` (it numbers classes by sorted folder name, so one missing or extra folder shifts
every label after it). This script moves (or ``--copy``) each image into its class folder using the
official ground truth, in one of these forms (``--format auto`` recognises them):

  csv      Kaggle's ``LOC_val_solution.csv``: ``ImageId,PredictionString``; the first word of
           PredictionString is the wnid (``n01751748 52 32 ...``).
  wnids    a text file of 50,000 wnids, one per line, line i for ILSVRC2012_val_<i>.JPEG
           (for example TensorFlow's ``imagenet_2012_validation_synset_labels.txt``).
  indices  the devkit's ``ILSVRC2012_validation_ground_truth.txt`` (class ids 1..1000, one per line)
           together with ``--synsets``: the devkit's ``meta.mat`` or a text file whose line k is the
           wnid of ILSVRC2012_ID k. The ids are NOT in sorted-wnid order, so never use a sorted list.

It is safe to run again: images already in place are left alone, an interrupted run is finished,
and no image is ever deleted unless an identical copy is already in its class folder.
At the end it verifies the folder: 1000 class folders, 50 images each, no image left unsorted or in
the wrong class, and (with ``--train-dir``) the same class folders as train/. Exit status 1 on problems.

Examples::

    python lab/scripts/sort_imagenet_val.py /data/imagenet/val --labels LOC_val_solution.csv \\
        --train-dir /data/imagenet/train
    python lab/scripts/sort_imagenet_val.py /data/imagenet/val --labels LOC_val_solution.csv --dry-run
    python lab/scripts/sort_imagenet_val.py /data/imagenet/val --verify-only --train-dir /data/imagenet/train
"""
from __future__ import annotations

import argparse
import csv
import errno
import filecmp
import os
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

WNID = re.compile(r"^n\d{8}$")                       # WordNet id, e.g. n01440764
VAL_NAME = re.compile(r"^ILSVRC2012_val_\d{8}\.JPEG$")
PARTIAL = ".partial"                                  # suffix of a copy still being written
SHOW = 10                                             # list at most this many examples per problem


class LabelError(Exception):
    """The ground-truth file cannot be read or does not make sense."""


def val_name(index: int) -> str:
    """File name of validation image number ``index`` (1-based): ILSVRC2012_val_00000001.JPEG."""
    return f"ILSVRC2012_val_{index:08d}.JPEG"


# -- reading the ground truth ------------------------------------------------------------------------

def read_csv_labels(path: Path) -> dict[str, str]:
    """Kaggle ``LOC_val_solution.csv`` -> {file name: wnid}."""
    mapping: dict[str, str] = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"ImageId", "PredictionString"} <= set(reader.fieldnames):
            raise LabelError(f"{path}: expected the header 'ImageId,PredictionString', got {reader.fieldnames}")
        for line_no, row in enumerate(reader, start=2):
            image_id = (row["ImageId"] or "").strip()
            words = (row["PredictionString"] or "").split()
            if not image_id or not words or not WNID.match(words[0]):
                raise LabelError(f"{path}:{line_no}: cannot read a wnid for image '{image_id}'")
            name = image_id if image_id.endswith(".JPEG") else image_id + ".JPEG"
            if name in mapping and mapping[name] != words[0]:
                raise LabelError(f"{path}:{line_no}: {name} is listed twice with different classes")
            mapping[name] = words[0]
    return mapping


def read_wnid_lines(path: Path) -> dict[str, str]:
    """Text file with one wnid per line, in image order -> {file name: wnid}."""
    wnids = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    bad = [(i, w) for i, w in enumerate(wnids, start=1) if not WNID.match(w)]
    if bad:
        raise LabelError(f"{path}: line {bad[0][0]} is '{bad[0][1]}', not a wnid like n01440764")
    return {val_name(i): w for i, w in enumerate(wnids, start=1)}


def read_synsets(path: Path) -> list[str]:
    """Wnids in ILSVRC2012_ID order (index 0 = id 1), from the devkit ``meta.mat`` or a text file."""
    if path.suffix == ".mat":
        try:
            from scipy.io import loadmat  # only needed for this input form
        except ImportError as e:
            raise LabelError("reading meta.mat needs scipy (pip install scipy), "
                             "or pass a text file of wnids in ILSVRC2012_ID order") from e
        synsets = loadmat(str(path), squeeze_me=True)["synsets"]
        # meta.mat lists 1860 synsets; the 1000 classes are the leaves (no children), ids 1..1000.
        leaves = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets if int(s["num_children"]) == 0}
        wnids = [leaves[k] for k in sorted(leaves)]
        if sorted(leaves) != list(range(1, len(leaves) + 1)):
            raise LabelError(f"{path}: leaf synset ids are not 1..{len(leaves)}")
    else:
        wnids = [line.split()[0] for line in path.read_text().splitlines() if line.strip()]
    bad = [w for w in wnids if not WNID.match(w)]
    if bad:
        raise LabelError(f"{path}: '{bad[0]}' is not a wnid like n01440764")
    return wnids


def read_index_lines(path: Path, synsets: list[str]) -> dict[str, str]:
    """Devkit ground truth (class ids 1..N, one per line, image order) -> {file name: wnid}."""
    mapping = {}
    for i, line in enumerate((ln.strip() for ln in path.read_text().splitlines() if ln.strip()), start=1):
        if not line.isdigit() or not 1 <= int(line) <= len(synsets):
            raise LabelError(f"{path}: line {i} is '{line}', expected a class id from 1 to {len(synsets)}")
        mapping[val_name(i)] = synsets[int(line) - 1]
    return mapping


def detect_format(path: Path) -> str:
    """Guess 'csv', 'wnids' or 'indices' from the first line of the ground-truth file."""
    with open(path) as f:
        first = next((line.strip() for line in f if line.strip()), "")
    if first.startswith("ImageId"):
        return "csv"
    if WNID.match(first):
        return "wnids"
    if first.isdigit():
        return "indices"
    raise LabelError(f"{path}: cannot tell its format from the first line '{first[:60]}'; use --format")


def load_labels(path: Path, fmt: str = "auto", synsets: Path | None = None) -> dict[str, str]:
    """Read any supported ground-truth form into {file name: wnid}."""
    if not path.is_file():
        raise LabelError(f"ground-truth file {path} does not exist")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "csv":
        mapping = read_csv_labels(path)
    elif fmt == "wnids":
        mapping = read_wnid_lines(path)
    else:
        if synsets is None:
            raise LabelError(f"{path} holds class ids; pass --synsets meta.mat (or a wnid list in "
                             "ILSVRC2012_ID order) to turn them into wnids")
        mapping = read_index_lines(path, read_synsets(synsets))
    if not mapping:
        raise LabelError(f"{path} lists no images")
    return mapping


# -- moving files --------------------------------------------------------------------------------------

def copy_atomically(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` so that ``dst`` is either absent or complete, never half-written."""
    tmp = dst.with_name(dst.name + PARTIAL)
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)   # atomic rename: an interrupted run leaves only a *.partial to redo


def place(src: Path, dst: Path, copy: bool, dry_run: bool) -> str:
    """Put one image where it belongs. Returns what happened (a key of the summary).

    'done'      already in its class folder (an identical leftover source is removed when moving)
    'moved'     / 'copied' (or would be, with dry_run)
    'missing'   neither the flat file nor the sorted one exists
    'conflict'  both exist and differ: left alone for a person to decide
    """
    outcome = _place(src, dst, copy, dry_run)
    if outcome in ("done", "moved", "copied") and not dry_run:
        # A half-written copy left by an interrupted run is garbage once the image is in place.
        dst.with_name(dst.name + PARTIAL).unlink(missing_ok=True)
    return outcome


def _place(src: Path, dst: Path, copy: bool, dry_run: bool) -> str:
    if dst.is_file():
        if src.is_file() and not copy:
            # An earlier --copy run, or a move across file systems cut short after the copy.
            if not filecmp.cmp(src, dst, shallow=False):
                return "conflict"
            if not dry_run:
                src.unlink()   # safe: an identical copy is in the class folder
        return "done"
    if not src.is_file():
        return "missing"
    if dry_run:
        return "copied" if copy else "moved"
    dst.parent.mkdir(exist_ok=True)
    if copy:
        copy_atomically(src, dst)
        return "copied"
    try:
        os.rename(src, dst)    # same file system: instant and atomic
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        copy_atomically(src, dst)   # another file system: copy, then remove the original
        src.unlink()
    return "moved"


def sort_images(mapping: dict[str, str], src_dir: Path, out_dir: Path, copy: bool = False,
                dry_run: bool = False) -> Counter:
    """Move or copy every image of ``mapping`` from ``src_dir`` into ``out_dir/<wnid>/``.

    Returns a Counter of the outcomes of :func:`place`; its ``missing`` and ``conflict`` entries
    are problems. Prints progress every 10,000 images.
    """
    outcome: Counter = Counter()
    for i, (name, wnid) in enumerate(sorted(mapping.items()), start=1):
        outcome[place(src_dir / name, out_dir / wnid / name, copy, dry_run)] += 1
        if i % 10_000 == 0:
            print(f"  {i:,} / {len(mapping):,} images handled", flush=True)
    return outcome


# -- verification --------------------------------------------------------------------------------------

def _examples(items: list, show: int = SHOW) -> str:
    text = ", ".join(str(x) for x in items[:show])
    return text + (f" ... and {len(items) - show} more" if len(items) > show else "")


def check_counts(per_class: dict[str, int], expect_classes: int, expect_per_class: int) -> list[str]:
    """Problems with the number of classes and of images per class."""
    problems = []
    if len(per_class) != expect_classes:
        problems.append(f"{len(per_class)} class folders, expected {expect_classes}")
    off = sorted((wnid, n) for wnid, n in per_class.items() if n != expect_per_class)
    if off:
        problems.append(f"{len(off)} classes do not have {expect_per_class} images: "
                        + _examples([f"{w}={n}" for w, n in off]))
    return problems


def verify_val_dir(val_dir: Path, expect_classes: int = 1000, expect_per_class: int = 50,
                   train_dir: Path | None = None, mapping: dict[str, str] | None = None,
                   allow_flat: bool = False) -> list[str]:
    """Check a sorted validation folder. Returns a list of problems (empty = all good).

    Checks: only wnid class folders; ``expect_classes`` of them with ``expect_per_class`` JPEGs each;
    no image left in the flat folder (unless ``allow_flat``: the originals kept by --copy);
    no half-copied file; with ``mapping``, every image is in the class the ground truth gives it;
    with ``train_dir``, the same class folders as train/.
    """
    problems = []
    if not val_dir.is_dir():
        return [f"{val_dir} is not a folder"]
    class_dirs = sorted(p for p in val_dir.iterdir() if p.is_dir())
    odd_dirs = [p.name for p in class_dirs if not WNID.match(p.name)]
    if odd_dirs:
        problems.append(f"folders that are not classes (ImageFolder would treat them as classes): "
                        f"{_examples(odd_dirs)}")
    flat = sorted(p.name for p in val_dir.iterdir() if p.is_file() and VAL_NAME.match(p.name))
    if flat and not allow_flat:
        problems.append(f"{len(flat)} images are still unsorted in {val_dir}: {_examples(flat)}")

    per_class: dict[str, int] = {}
    partial, misplaced = [], []
    for d in class_dirs:
        if not WNID.match(d.name):
            continue
        images = [p.name for p in d.iterdir() if p.is_file() and p.suffix.lower() in (".jpeg", ".jpg")]
        per_class[d.name] = len(images)
        partial += [f"{d.name}/{p.name}" for p in d.iterdir() if p.name.endswith(PARTIAL)]
        if mapping is not None:
            misplaced += [f"{d.name}/{n} (belongs in {mapping[n]})"
                          for n in images if n in mapping and mapping[n] != d.name]
    problems += check_counts(per_class, expect_classes, expect_per_class)
    if partial:
        problems.append(f"{len(partial)} half-copied files (run the script again): {_examples(partial)}")
    if misplaced:
        problems.append(f"{len(misplaced)} images are in the wrong class folder: {_examples(misplaced)}")

    if train_dir is not None:
        if not train_dir.is_dir():
            problems.append(f"--train-dir {train_dir} is not a folder")
        else:
            train_classes = {p.name for p in train_dir.iterdir() if p.is_dir()}
            val_classes = set(per_class)
            if train_classes - val_classes:
                problems.append(f"{len(train_classes - val_classes)} train classes have no val folder: "
                                f"{_examples(sorted(train_classes - val_classes))}")
            if val_classes - train_classes:
                problems.append(f"{len(val_classes - train_classes)} val classes are not in train: "
                                f"{_examples(sorted(val_classes - train_classes))}")
    return problems


# -- command line --------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Sort ImageNet-2012 validation JPEGs into val/<wnid>/ class folders and verify them.",
        epilog="Exit status: 0 all good, 1 problems found (listed), 2 bad arguments or unreadable labels.")
    p.add_argument("val_dir", type=Path, help="folder with the flat ILSVRC2012_val_*.JPEG files")
    p.add_argument("--labels", type=Path,
                   help="ground truth: LOC_val_solution.csv, a wnid-per-line file, or the devkit's "
                        "ILSVRC2012_validation_ground_truth.txt (with --synsets)")
    p.add_argument("--format", choices=("auto", "csv", "wnids", "indices"), default="auto",
                   help="form of --labels (default: recognise it from the first line)")
    p.add_argument("--synsets", type=Path,
                   help="devkit meta.mat, or a text file of wnids in ILSVRC2012_ID order (for --format indices)")
    p.add_argument("--out-dir", type=Path,
                   help="where the class folders go (default: inside val_dir itself)")
    p.add_argument("--copy", action="store_true", help="copy instead of move (keeps the flat files)")
    p.add_argument("--dry-run", action="store_true", help="only report what would be done; change nothing")
    p.add_argument("--verify-only", action="store_true",
                   help="do not sort, only check an already sorted folder (--labels optional)")
    p.add_argument("--train-dir", type=Path,
                   help="ImageNet train/ folder: check that val has exactly the same class folders")
    p.add_argument("--expect-classes", type=int, default=1000, help="number of classes (default 1000)")
    p.add_argument("--expect-per-class", type=int, default=50, help="images per class (default 50)")
    args = p.parse_args(argv)
    if not args.verify_only and args.labels is None:
        p.error("--labels is required (unless --verify-only)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = args.out_dir or args.val_dir
    if not args.val_dir.is_dir():
        print(f"error: {args.val_dir} is not a folder", file=sys.stderr)
        return 2
    try:
        mapping = load_labels(args.labels, args.format, args.synsets) if args.labels else None
    except LabelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    problems: list[str] = []
    if mapping is not None:
        expected = args.expect_classes * args.expect_per_class
        print(f"ground truth: {len(mapping):,} images in {len(set(mapping.values())):,} classes "
              f"(expected {expected:,} in {args.expect_classes:,})")
        # Check the labels themselves first: a wrong file would sort wrongly and look fine otherwise.
        label_problems = check_counts(Counter(mapping.values()), args.expect_classes, args.expect_per_class)
        problems += [f"ground truth: {p}" for p in label_problems]

    if not args.verify_only:
        verb = "copy" if args.copy else "move"
        print(f"{'dry run: would ' if args.dry_run else ''}{verb} images from {args.val_dir} into "
              f"{out_dir}/<wnid>/")
        if not args.dry_run:
            out_dir.mkdir(parents=True, exist_ok=True)
        outcome = sort_images(mapping, args.val_dir, out_dir, copy=args.copy, dry_run=args.dry_run)
        print("  " + ", ".join(f"{k}: {v:,}" for k, v in sorted(outcome.items())))
        if outcome["missing"]:
            missing = sorted(n for n in mapping
                             if not (args.val_dir / n).is_file() and not (out_dir / mapping[n] / n).is_file())
            problems.append(f"{outcome['missing']} images of the ground truth exist neither flat nor "
                            f"sorted: {_examples(missing)}")
        if outcome["conflict"]:
            problems.append(f"{outcome['conflict']} images exist both flat and sorted with different "
                            "contents; left untouched, compare them by hand")
        unknown = sorted(p.name for p in args.val_dir.iterdir()
                         if p.is_file() and VAL_NAME.match(p.name) and p.name not in mapping)
        if unknown:
            problems.append(f"{len(unknown)} flat images are not in the ground truth: {_examples(unknown)}")

    if args.dry_run:
        print("dry run: nothing was changed; the folder itself was not verified")
    else:
        print(f"verifying {out_dir} ...")
        problems += verify_val_dir(out_dir, args.expect_classes, args.expect_per_class,
                                   args.train_dir, mapping, allow_flat=args.copy)

    if problems:
        print(f"\nFOUND {len(problems)} PROBLEM(S):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print("OK: every class folder has the expected images"
          + (" and matches train/" if args.train_dir and not args.dry_run else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the walkthrough's data steps (lab/README.md step 2) on a small copy of Kaggle's ImageNet zip, each
step's rate, and that rate scaled to ImageNet's file count: the "measured here" column of lab/data.md's time plan.

    python benchmarks/data_prep.py                 # 20,000 files of ImageNet's mean JPEG size: a few minutes

It writes a zip in Kaggle's layout (``ILSVRC/Data/CLS-LOC/train/<wnid>/``, a flat ``val/``, ``LOC_val_solution.csv``)
of ``--classes`` x ``--per-class`` training and ``--val`` validation files, each a real JPEG of about 110 KB (the
mean of ImageNet's 147 GB over 1,331,167 files), then times what step 2 runs, as it runs it: ``unzip`` of train
and val, ``sort_imagenet_val.py`` (val into class folders), ``make_imagenet_subset.py`` (hard links), the copy to
node 2 (``tar | tar``, here into another folder of the same disk) and the kit's check of the data (it lists every
file and decodes one image per class, as for ImageNet's splits). Only the rates are this machine's: a cloud volume is also bounded by its own throughput (gp3: 125
MB/s), which lab/data.md applies on top. Needs ``unzip`` and ``tar``; the files go to a temporary folder (``--dir``).
"""
from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)

REPO = Path(__file__).resolve().parents[1]
IMAGENET_FILES = 1_281_167 + 50_000     # train + val
IMAGENET_GB = 147.0                     # unpacked (the walkthrough's figure)
MEAN_BYTES = int(IMAGENET_GB * 1e9 / IMAGENET_FILES)


def a_jpeg(size: int) -> bytes:
    """A real JPEG of about ``size`` bytes: scikit-learn's sample photo, re-encoded until it is that big."""
    from PIL import Image
    from sklearn.datasets import load_sample_image
    photo = Image.fromarray(load_sample_image("china.jpg"))
    for quality in range(60, 100, 2):
        out = io.BytesIO()
        photo.save(out, "JPEG", quality=quality)
        if out.tell() >= size:
            break
    return out.getvalue()


def kaggle_zip(path: Path, classes: int, per_class: int, val: int) -> int:
    """Kaggle's zip of ImageNet in small; its file count."""
    body = a_jpeg(MEAN_BYTES)
    wnids = [f"n{1440764 + 10 * k:08d}" for k in range(classes)]
    rows = []
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        z.writestr("LOC_synset_mapping.txt", "".join(f"{w} class {w}\n" for w in wnids))
        for w in wnids:
            for i in range(per_class):
                z.writestr(f"ILSVRC/Data/CLS-LOC/train/{w}/{w}_{i}.JPEG", body)
        for i in range(val):
            name = f"ILSVRC2012_val_{i + 1:08d}"
            z.writestr(f"ILSVRC/Data/CLS-LOC/val/{name}.JPEG", body)
            rows.append((name, f"{wnids[i % classes]} 1 2 3 4"))
        text = io.StringIO()
        csv.writer(text).writerows([("ImageId", "PredictionString"), *rows])
        z.writestr("LOC_val_solution.csv", text.getvalue())
    return classes * per_class + val


def timed(what: str, argv: list[str], cwd: Path, shell: bool = False) -> float:
    start = time.perf_counter()
    out = subprocess.run(" ".join(argv) if shell else argv, cwd=cwd, shell=shell, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{what} failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    print(f"{what}: {seconds:.1f} s", flush=True)
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", type=int, default=100, help="training class folders (default 100)")
    p.add_argument("--per-class", type=int, default=180, help="training images per class (default 180)")
    p.add_argument("--val", type=int, default=2000, help="validation images, flat as in the zip (default 2000)")
    p.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temporary folder)")
    add_out(p, "data_prep")
    args = p.parse_args()
    if not (shutil.which("unzip") and shutil.which("tar")):
        raise SystemExit("data_prep.py needs unzip and tar (apt-get install unzip)")
    record = Recorder("data_prep", args)
    py, scripts = sys.executable, REPO / "lab" / "scripts"
    with tempfile.TemporaryDirectory(prefix="data-prep-", dir=args.dir) as tmp:
        root = Path(tmp)
        files = kaggle_zip(root / "imagenet.zip", args.classes, args.per_class, args.val)
        (root / "copy").mkdir()
        subset = (args.classes * args.per_class + args.val) // 10   # every 10th class, all its images
        steps = {
            "unzip": (files, timed("unzip", ["unzip", "-q", "imagenet.zip", "ILSVRC/Data/CLS-LOC/train/*",
                                             "ILSVRC/Data/CLS-LOC/val/*", "LOC_val_solution.csv", "-d", "kaggle"], root)),
            "sort val": (args.val, timed("sort val", [py, str(scripts / "sort_imagenet_val.py"),
                                                      "kaggle/ILSVRC/Data/CLS-LOC/val", "--labels",
                                                      "kaggle/LOC_val_solution.csv", "--expect-classes",
                                                      str(args.classes), "--expect-per-class",
                                                      str(args.val // args.classes)], root)),
            "subset (hard links)": (subset, timed("subset", [py, str(scripts / "make_imagenet_subset.py"),
                                                             "kaggle/ILSVRC/Data/CLS-LOC", "subset", "--classes",
                                                             str(args.classes // 10)], root)),
            "copy (tar to tar)": (files, timed("copy", ["tar -C kaggle/ILSVRC/Data/CLS-LOC -cf - train val | "
                                                       "tar -C copy -xf -"], root, shell=True)),
        }
        # the kit's check of the data (datasets.check_data, which `check` runs), in this process: it lists every file
        # and decodes some; a split of at most VERIFY_ALL_UP_TO images is decoded whole, ImageNet's are above it and
        # get one image per class decoded, so this folder is checked as ImageNet is
        from ddp_utils import datasets
        from ddp_utils.settings import Settings
        datasets.VERIFY_ALL_UP_TO = 0
        start = time.perf_counter()
        datasets.check_data(Settings(dataset="imagenet", data_dir=str(root / "copy")))
        listed = time.perf_counter() - start
        print(f"check: {listed:.1f} s", flush=True)
        steps["check (list every file)"] = (files, listed)
    # ImageNet's count for each step: every file, its 50,000 val images, or the subset's tenth
    imagenet = {"sort val": 50_000, "subset (hard links)": IMAGENET_FILES // 10}
    figures, table = {"files": files, "file_bytes": MEAN_BYTES}, [
        "| step | files | seconds here | files/s | MB/s | ImageNet's at this rate |",
        "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, (count, seconds) in steps.items():
        rate = count / seconds
        scaled = imagenet.get(name, IMAGENET_FILES) / rate
        figures[name] = {"files": count, "seconds": round(seconds, 2), "files_per_s": round(rate),
                         "mb_per_s": round(rate * MEAN_BYTES / 1e6), "imagenet_minutes": round(scaled / 60, 1)}
        mb = f"{rate * MEAN_BYTES / 1e6:.0f}" if name != "subset (hard links)" else "-"   # a link moves no bytes
        table.append(f"| {name} | {count:,} | {seconds:.1f} | {rate:,.0f} | {mb} | {scaled / 60:.1f} min |")
    record.save(figures=figures, table=table)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``demo`` data set: real images that ship with the kit, in CINIC-10's folder layout.

scikit-learn bundles 1,797 real 8x8 grey-scale handwritten digits (``load_digits``, 10 classes).
``prepare_demo(root)`` upsamples them to 32x32 RGB PNGs and writes them once::

    root/train/0_zero/0000.png ... root/train/9_nine/1796.png   (about 60 % of each class)
    root/valid/<class>/*.png                                      (about 20 %)
    root/test/<class>/*.png                                       (about 20 %)
    root/demo.json          mean/std of the train split, classes, image counts

So the whole training pipeline (ImageFolder, DistributedSampler, workers, transforms) runs on a
laptop with no download, and a small convnet reaches over 90 % validation accuracy in seconds.
The split is fixed (seed ``DEMO_SEED``), so every node that builds it gets identical files.

Command line: ``python -m ddp_utils.demo_data data/demo``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

DEMO_JSON = "demo.json"
DEMO_CLASSES = ["0_zero", "1_one", "2_two", "3_three", "4_four",
                "5_five", "6_six", "7_seven", "8_eight", "9_nine"]
DEMO_SPLITS = {"train": 0.6, "valid": 0.2, "test": 0.2}  # fractions of each class, CINIC-10's names
DEMO_SEED = 0        # fixed, not Settings.seed: every node and every run must see the same files
DEMO_SIZE = 32       # pixels, like CINIC-10
DEMO_VERSION = 1     # bump when the recipe changes


def prepare_demo(root: str | Path) -> Path:
    """Write the demo set into ``root`` unless it is already there; return ``root`` as a Path.

    Safe when several processes (two ranks on one machine) call it at once: each writes into its
    own temporary folder next to ``root`` and renames it into place. A rename is atomic, so
    ``root`` is either absent or complete; the loser of the race deletes its copy and uses the
    winner's. Takes about a second.
    """
    root = Path(root).expanduser()
    if (root / DEMO_JSON).is_file():
        return root
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(f"{root} exists but holds no {DEMO_JSON}, so it is not a demo set. "
                              f"Delete it, or choose another data_dir for the demo preset.")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the data set is not secret
        _write_demo(tmp)
        try:
            os.rename(tmp, root)  # atomic; also replaces an empty ``root`` folder on POSIX
        except OSError:
            if not (root / DEMO_JSON).is_file():
                raise
            # Another process finished first: its copy is complete, use it.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left when we lost the race or failed
    return root


def read_demo_info(root: str | Path) -> dict:
    """The contents of ``root/demo.json``: mean and std (per RGB channel, 0..1), classes, counts."""
    with open(Path(root) / DEMO_JSON) as f:
        return json.load(f)


def demo_images() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits as uint8 RGB images ``(N, 32, 32, 3)`` and int labels ``(N,)`` in 0..9."""
    from sklearn.datasets import load_digits  # imported here: only needed when writing the set

    digits = load_digits()
    grey = np.round(digits.images * (255 / 16)).astype(np.uint8)  # 8x8, values 0..16 -> 0..255
    images = np.stack([
        np.asarray(Image.fromarray(g, mode="L").resize((DEMO_SIZE, DEMO_SIZE), Image.BILINEAR)
                   .convert("RGB"))
        for g in grey])
    return images, digits.target.astype(np.int64)


def demo_split(labels: np.ndarray) -> dict[str, list[int]]:
    """Stratified, seeded split: for each class, shuffle its indices and cut 60/20/20."""
    rng = np.random.default_rng(DEMO_SEED)
    out: dict[str, list[int]] = {name: [] for name in DEMO_SPLITS}
    for label in range(len(DEMO_CLASSES)):
        idx = rng.permutation(np.flatnonzero(labels == label))
        n_train = round(len(idx) * DEMO_SPLITS["train"])
        n_valid = round(len(idx) * DEMO_SPLITS["valid"])
        out["train"] += idx[:n_train].tolist()
        out["valid"] += idx[n_train:n_train + n_valid].tolist()
        out["test"] += idx[n_train + n_valid:].tolist()
    return {name: sorted(ids) for name, ids in out.items()}


def _write_demo(folder: Path) -> None:
    images, labels = demo_images()
    splits = demo_split(labels)
    for split, ids in splits.items():
        for name in DEMO_CLASSES:
            (folder / split / name).mkdir(parents=True)
        for i in ids:
            # File name = index in load_digits, so any PNG can be traced back to its source.
            Image.fromarray(images[i]).save(folder / split / DEMO_CLASSES[labels[i]] / f"{i:04d}.png")
    # Normalisation statistics from the train split only (never peek at valid/test).
    train = images[splits["train"]].astype(np.float64) / 255  # (N, 32, 32, 3) in 0..1
    info = {
        "version": DEMO_VERSION,
        "source": "sklearn.datasets.load_digits, 8x8 upsampled bilinearly to 32x32 RGB",
        "mean": train.mean(axis=(0, 1, 2)).round(8).tolist(),
        "std": train.std(axis=(0, 1, 2)).round(8).tolist(),
        "image_size": DEMO_SIZE,
        "classes": DEMO_CLASSES,
        "images": {split: len(ids) for split, ids in splits.items()},
        "seed": DEMO_SEED,
    }
    # Written last: inside the temporary folder, so readers never see a half-written set anyway.
    (folder / DEMO_JSON).write_text(json.dumps(info, indent=2) + "\n")


if __name__ == "__main__":
    target = prepare_demo(sys.argv[1] if len(sys.argv) > 1 else "data/demo")
    print(f"demo set ready in {target}: {read_demo_info(target)['images']}")

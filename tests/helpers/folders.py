"""Data folders in the presets' exact layouts, made in a test's own folder: ImageNet's (solid-colour JPEGs, or
windows of scikit-learn's two photos), CINIC-10's, and two nodes' copies that differ."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ddp_utils.datasets import load_preset


WNIDS = ["n01440764", "n01443537", "n01484850"]  # tench, goldfish, great white shark


CINIC = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def solid(path: Path, size: tuple[int, int], rgb: tuple[int, int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, rgb).save(path)


def make_imagenet(root: Path, train_per_class: int = 3, val_per_class: int = 2) -> Path:
    """root/train/<wnid>/<wnid>_<n>.JPEG and root/val/<wnid>/ILSVRC2012_val_<n>.JPEG, odd sizes."""
    rng = random.Random(0)
    n_val = 0
    for wnid in WNIDS:
        for i in range(train_per_class):
            solid(root / "train" / wnid / f"{wnid}_{1000 + i}.JPEG", (rng.randint(40, 80), rng.randint(30, 60)),
                  (rng.randrange(256), rng.randrange(256), rng.randrange(256)))
        for _ in range(val_per_class):
            n_val += 1
            solid(root / "val" / wnid / f"ILSVRC2012_val_{n_val:08d}.JPEG", (64, 48), (120, 60, 200))
    return root


def make_cinic(root: Path, per_class: int = 2) -> Path:
    """root/{train,valid,test}/<class>/*.png, 32x32 RGB, ten CINIC-10 classes."""
    for split in ("train", "valid", "test"):
        for c, name in enumerate(CINIC):
            for i in range(per_class):
                solid(root / split / name / f"cifar10-{split}-{c * 100 + i}.png", (32, 32), (10 * c, 100, 250))
    return root


def make_photo_imagenet(root: Path, train_per_class: int = 4, val_per_class: int = 3, seed: int = 0) -> Path:
    """ImageNet's layout (train/<wnid>/, val/<wnid>/) of small JPEG photos cut from scikit-learn's two."""
    from sklearn.datasets import load_sample_images
    photos = [Image.fromarray(a) for a in load_sample_images().images]   # china.jpg, flower.jpg: 640 x 427
    rng = random.Random(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for wnid in WNIDS:
            (root / split / wnid).mkdir(parents=True)
            for i in range(count):
                x, y = rng.randrange(300), rng.randrange(150)
                image = photos[rng.randrange(2)].crop((x, y, x + 320, y + 260))
                image = image.resize((rng.randint(70, 150), rng.randint(60, 130)), Image.BICUBIC)
                image.save(root / split / wnid / f"{wnid}_{i}.JPEG", quality=90)
    return root


def levels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| of two normalised ImageNet batches, in levels of 255 per pixel."""
    std = torch.tensor(load_preset("imagenet").std).view(1, 3, 1, 1)
    return (a - b).abs() * std * 255


# ---------------------------------------------------------------------------------------------
# Decoding: libjpeg-turbo, Pillow for the rest, the kit's paragraph for a broken file
# ---------------------------------------------------------------------------------------------
def pillow(path) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)


def data_copies(tmp_path, rank1: str) -> tuple[Path, Path]:
    """Rank 0's imagenet folder (3 classes: train 9 images, val 6) and rank 1's, which ``rank1`` says how it
    differs: "a class short" (the subset on one node), "an image short" (a partial copy), "missing"."""
    import shutil
    full, other = make_imagenet(tmp_path / "node-a"), tmp_path / "node-b"
    if rank1 != "missing":
        make_imagenet(other)
    if rank1 == "a class short":
        for split in ("train", "val"):
            shutil.rmtree(other / split / WNIDS[-1])
    if rank1 == "an image short":
        sorted((other / "train" / WNIDS[0]).iterdir())[0].unlink()
    return full, other


# what each rank says of rank 1's copy, and the counts rank 1 reads of rank 0's
RANK1_SEES = {"a class short": "train 6 images / 2 classes, val 4 images / 2 classes",
              "an image short": "train 8 images / 3 classes, val 6 images / 3 classes",
              "missing": "does not exist"}

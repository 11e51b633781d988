"""ImageNet-like JPEG files without a download: what every benchmark that measures a JPEG rate decodes.

    from photos import make_photos, describe      # benchmarks/photos.py
    root = make_photos(Path("data/imagenet-input/original"), train=1600, val=64)
    describe(root)   # {"files": 1664, "mean_kb": 91.2, "bytes_per_pixel": 0.54, "recipe": "..."}

ImageNet's training photos are mostly 500 x 375 or 500 x 333, saved at quality ~90-96: about 110 KB a file,
0.5-0.6 bytes a pixel. A decode's largest part, the entropy decoding, grows with the bytes, so test files with
fewer bytes a pixel flatter every per-core rate (the earlier files, upsampled windows at quality 75-95, had 0.28).
Here: windows of scikit-learn's two real photos (640 x 427) at 1:1 scale (upsampling would smooth the picture
and shrink the file), with a camera's sensor grain (sigma 3 levels of luminance, which these two downscaled
photos lack), saved at quality 94-96: about 0.54 bytes a pixel, ~100 KB for 500 x 375.

The folder gets ImageNet's layout (train/<wnid>/, val/<wnid>/) and a ``photos.json`` naming the recipe; a folder
made by another recipe or with other counts is made again.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np

WNIDS = ["n01440764", "n01443537", "n01484850", "n01491361"]
RECIPE = "1:1 windows 460-500 px wide of scikit-learn's photos, luminance grain sigma 3, JPEG quality 94-96"
MARKER = "photos.json"


def marked(root: Path) -> dict | None:
    """What ``mark`` wrote when ``root``'s photos were made (recipe, counts, ``describe``), or None."""
    try:
        return json.loads((root / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def current(root: Path, train: int, val: int) -> bool:
    """True when ``root`` holds ``train`` + ``val`` photos of this recipe."""
    made = marked(root) or {}
    return made.get("recipe") == RECIPE and (made.get("train"), made.get("val")) == (train, val)


def make_photos(root: Path, train: int, val: int, seed: int = 0) -> Path:
    """``train`` and ``val`` ImageNet-like JPEGs under ``root`` (see the module's docstring); kept if current."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    if current(root, train, val):
        return root
    shutil.rmtree(root, ignore_errors=True)
    photos = [Image.fromarray(a) for a in load_sample_images().images]
    rng = random.Random(seed)
    grain = np.random.default_rng(seed)
    for split, count in (("train", train), ("val", val)):
        for k in range(count):
            photo = photos[k % 2]
            w = rng.randint(460, 500)
            h = min(photo.height, round(w * rng.uniform(0.66, 0.8)))   # 500 x 330-400: ImageNet's usual shapes
            x, y = rng.randint(0, photo.width - w), rng.randint(0, photo.height - h)
            pixels = np.asarray(photo.crop((x, y, x + w, y + h)), dtype=np.float32)
            if rng.random() < 0.5:
                pixels = pixels[:, ::-1]
            pixels = pixels + grain.normal(0, 3, (h, w, 1))   # the same grain on R, G and B: luminance only
            image = Image.fromarray(pixels.clip(0, 255).round().astype(np.uint8))
            wnid = WNIDS[k % len(WNIDS)]
            folder = root / split / wnid
            folder.mkdir(parents=True, exist_ok=True)
            image.save(folder / f"{wnid}_{k}.JPEG", quality=rng.choice([94, 95, 96]))
    mark(root, train, val)
    return root


def mark(root: Path, train: int, val: int) -> dict:
    """Writes ``root``/photos.json: the recipe, the counts and what the files are like (``describe``)."""
    made = {"recipe": RECIPE, "train": train, "val": val, **describe(root)}
    (root / MARKER).write_text(json.dumps(made, indent=1) + "\n", encoding="utf-8")
    return made


def describe(root: Path) -> dict:
    """The files' count, mean size in KB and mean bytes a pixel: what a JPEG rate measured on them depends on."""
    from PIL import Image
    files = sorted(root.glob("*/*/*.JPEG"))
    sizes, per_pixel = [], []
    for f in files:
        with Image.open(f) as image:   # reads the header only
            pixels = image.width * image.height
        sizes.append(f.stat().st_size)
        per_pixel.append(sizes[-1] / pixels)
    n = max(1, len(files))
    return {"files": len(files), "mean_kb": round(sum(sizes) / n / 1000, 1),
            "bytes_per_pixel": round(sum(per_pixel) / n, 3)}

"""Data sets on disk: each preset with its statistics, its transforms, its folders checked before anything loads.

- ``load_preset`` gives a data set's preset (``presets.py``) with its statistics, so ImageNet is
  never normalised with CINIC-10 statistics and its validation images are always centre-cropped;
- ``train_transform`` / ``eval_transform``: PIL image in, normalised tensor out (the workers path's);
- ``check_data`` checks the folders before anything is loaded (each node reads its own copy: there
  is no shared file system), naming every preset whose layout the folders have when it is another;
- ``ImageFolderDataset`` reads a split, naming an unreadable file in a ``DataError``.

How the images become batches (the samplers, the loaders and their table) is loaders.py's.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from PIL import Image
from torchvision import transforms as T
from torchvision.datasets import FakeData, ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

from .demo_data import DEMO_JSON, prepare_demo, read_demo_info
from .presets import PRESETS, Preset

__all__ = ["DataError", "Preset", "PRESETS", "load_preset", "train_transform", "eval_transform", "check_data",
           "ImageFolderDataset"]

# A split with at most this many images has every image decoded by check_data (a few seconds);
# a bigger one (ImageNet, full CINIC-10) has one image per class checked, and a broken file
# met later during training raises a DataError that names it.
VERIFY_ALL_UP_TO = 20_000
FAKE_SIZES = {"train": 2560, "val": 512}  # images in the fake preset's splits


class DataError(ValueError):
    """The data on disk is not what the preset expects. The message names the path, what is
    wrong and what to do about it."""

    def plain(self) -> "DataError":
        """The kit's paragraph alone. Raised in a DataLoader worker, the error arrives wrapped in
        "Caught DataError in DataLoader worker process 0. Original Traceback ...": unwrap it."""
        text = str(self)
        marker = f"{type(self).__module__}.{type(self).__name__}: "
        if marker in text:
            text = text.rsplit(marker, 1)[1].strip()
        return DataError(text)


def load_preset(dataset: str, data_dir: str | Path = "") -> Preset:
    """The preset for ``dataset``, complete: the demo preset gets its mean/std from demo.json."""
    if dataset not in PRESETS:
        raise DataError(f"Unknown dataset {dataset!r}: choose one of {', '.join(PRESETS)}")
    preset = PRESETS[dataset]
    if preset.mean is None:
        path = Path(data_dir).expanduser() / DEMO_JSON
        try:
            info = read_demo_info(path.parent)
            mean, std = tuple(info["mean"]), tuple(info["std"])
        except (OSError, ValueError, KeyError) as e:
            raise DataError(f"{path}: cannot read the demo statistics ({e}). The demo preset expects "
                            f"{preset.layout}. Delete {path.parent} and it will be rebuilt.") from None
        preset = dataclasses.replace(preset, mean=mean, std=std)
    return preset


# --------------------------------------------------------------------------------------------
# Transforms: PIL image in, normalised float32 tensor (3, size, size) out
# --------------------------------------------------------------------------------------------
def train_transform(preset: Preset, image_size: int = 0) -> T.Compose:
    """Training augmentation for ``preset``: PIL image -> float32 tensor (3, S, S), normalised.

    ``image_size`` S in pixels; 0 = the preset's (224 ImageNet, 32 CINIC-10/demo).
    """
    size = image_size or preset.image_size
    _require_stats(preset)
    steps = []
    if preset.crop == "resized":      # ImageNet: random area 8-100 %, random aspect, resized to S
        steps.append(T.RandomResizedCrop(size))
    elif preset.crop == "padded":     # CIFAR/CINIC: pad by S/8 (4 px at 32) and crop back to S
        if size != preset.image_size:
            steps.append(T.Resize((size, size)))
        steps.append(T.RandomCrop(size, padding=size // 8))
    if preset.hflip:
        steps.append(T.RandomHorizontalFlip())
    steps += [T.ToTensor(), T.Normalize(preset.mean, preset.std)]  # uint8 0..255 -> 0..1 -> z-score
    return T.Compose(steps)


def eval_transform(preset: Preset, image_size: int = 0) -> T.Compose:
    """Deterministic evaluation transform: PIL image -> float32 tensor (3, S, S), normalised.

    ImageNet style resizes the short side to S * 256/224 (256 at 224) and centre-crops S.
    """
    size = image_size or preset.image_size
    _require_stats(preset)
    steps = []
    if preset.crop == "resized":
        steps += [T.Resize(round(size * 256 / 224)), T.CenterCrop(size)]
    elif preset.crop == "padded" and size != preset.image_size:
        steps.append(T.Resize((size, size)))
    steps += [T.ToTensor(), T.Normalize(preset.mean, preset.std)]
    return T.Compose(steps)


def _require_stats(preset: Preset) -> None:
    if preset.mean is None or preset.std is None:
        raise ValueError(f"The {preset.name} preset has no statistics yet: get it with "
                         f"load_preset({preset.name!r}, data_dir), which reads them from the data folder")


# --------------------------------------------------------------------------------------------
# Data sets (module level, so DataLoader workers started with spawn/forkserver can unpickle them)
# --------------------------------------------------------------------------------------------
def find_classes(directory: str | Path) -> tuple[list[str], dict[str, int]]:
    """Class folders in ``directory``, sorted; hidden ones (``.ipynb_checkpoints``) skipped."""
    classes = sorted(e.name for e in Path(directory).iterdir() if e.is_dir() and not e.name.startswith("."))
    return classes, {name: i for i, name in enumerate(classes)}


def load_rgb(path: str) -> Image.Image:
    """Open an image file as RGB; a file Pillow cannot read raises a DataError naming it."""
    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:  # Pillow raises all three for bad files
        raise DataError(f"{path}: Pillow cannot read this image ({type(e).__name__}: {e}). "
                        f"Delete it or replace it with a good copy.") from None


class ImageFolderDataset(ImageFolder):
    """torchvision's ImageFolder (``root/<class>/<image>``, labels = sorted class folder index)
    that skips hidden folders and names the file when an image cannot be read.

    ``dataset[i]`` -> (transform(image), label): with the preset transforms a float32 tensor
    (3, S, S) and an int in 0..num_classes-1. ``loader`` opens a file: ``load_rgb`` (a PIL image) or
    ``fastjpeg.decode_rgb`` (a uint8 tensor); either raises a DataError naming an unreadable file.
    """

    def __init__(self, root: str | Path, transform=None, loader=load_rgb):
        super().__init__(str(root), transform=transform, loader=loader)

    def find_classes(self, directory):
        return find_classes(directory)


def fake_dataset(split: str, preset: Preset, image_size: int) -> FakeData:
    """Random images (3, S, S), the same for a given index on every rank and every run."""
    # The offset gives val other images than train (FakeData seeds each image with index + offset).
    offset = 0 if split == "train" else FAKE_SIZES["train"]
    return FakeData(size=FAKE_SIZES["train" if split == "train" else "val"],
                    image_size=(3, image_size, image_size), num_classes=preset.num_classes,
                    transform=eval_transform(preset, image_size), random_offset=offset)


# --------------------------------------------------------------------------------------------
# Checks: run before anything is loaded, every error says what is wrong, where, and what to do
# --------------------------------------------------------------------------------------------
def check_data(settings) -> dict:
    """Check the folders of ``settings.dataset`` in ``settings.data_dir`` without building loaders.

    Checks: DATA_DIR and the train and validation split folders exist; each split has class
    folders, none of them empty; all splits have the same classes (and as many as the preset
    expects); Pillow can decode the images (all of them in splits up to VERIFY_ALL_UP_TO images,
    else the first of each class). The demo set is written first if DATA_DIR does not exist.

    Returns ``{"dataset", "data_dir", "splits": {name: {"images": n, "classes": k}}, "classes": [...]}``.
    Raises DataError.
    """
    preset = PRESETS[settings.dataset]
    val_split = settings.val_split or preset.val_split
    if not preset.folders:
        classes = [str(i) for i in range(preset.num_classes)]
        return {"dataset": preset.name, "data_dir": "", "classes": classes,
                "splits": {name: {"images": FAKE_SIZES[name], "classes": preset.num_classes}
                           for name in (preset.train_split, preset.val_split)}}
    root = Path(settings.data_dir).expanduser()
    if preset.made_here:
        try:
            prepare_demo(root)  # writes the set the first time (race-safe across ranks), then a no-op
        except FileExistsError as e:
            raise DataError(f"{e} The demo preset expects {preset.layout}.") from None
    _check_root(root, preset)
    preset = load_preset(preset.name, root)

    scans = {split: _scan_split(root, split, preset) for split in dict.fromkeys([preset.train_split, val_split])}
    classes = next(iter(scans.values()))[0]
    _check_same_classes(root, {split: scan[0] for split, scan in scans.items()})
    if preset.num_classes is not None and len(classes) != preset.num_classes:
        raise DataError(f"{root / preset.train_split} has {len(classes)} class folders "
                        f"({_few(classes)}) but the {preset.name} preset expects {preset.num_classes}: "
                        f"{preset.layout}. {_layout_hint(root, preset)}")
    for split, (_, samples) in scans.items():
        _check_images(root / split, samples, preset)
    return {"dataset": preset.name, "data_dir": str(root), "classes": classes,
            "splits": {split: {"images": len(samples), "classes": len(cls)}
                       for split, (cls, samples) in scans.items()}}


def _check_root(root: Path, preset: Preset) -> None:
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise DataError(f"data_dir {root} {what}. The {preset.name} preset expects {preset.layout}. "
                        f"Put the data on this node (every node needs its own copy) or fix data_dir.")


def _scan_split(root: Path, split: str, preset: Preset) -> tuple[list[str], list[tuple[str, int]]]:
    """(classes, [(image path, label), ...]) of one split folder, or a DataError."""
    folder = root / split
    if not folder.is_dir():
        found = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
        raise DataError(f"Split folder {folder} is missing (data_dir {root} holds: {_few(found) or 'nothing'}). "
                        f"The {preset.name} preset expects {preset.layout}. {_layout_hint(root, preset)}")
    classes, class_to_idx = find_classes(folder)
    if not classes:
        loose = [p for p in folder.iterdir() if p.suffix.lower() in IMG_EXTENSIONS]
        detail = (f"it holds {len(loose)} images directly instead: sort them into class folders"
                  if loose else "it is empty")
        raise DataError(f"Split folder {folder} has no class folders ({detail}). "
                        f"The {preset.name} preset expects {preset.layout}.")
    samples = make_dataset(str(folder), class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
    counts = dict.fromkeys(classes, 0)
    for _, label in samples:
        counts[classes[label]] += 1
    empty = [name for name, n in counts.items() if n == 0]
    if empty:
        raise DataError(f"{len(empty)} class folder(s) in {folder} hold no images "
                        f"({', '.join(IMG_EXTENSIONS)}): {_few([str(folder / e) for e in empty])}. "
                        f"Copy the missing images again or delete the empty folders in every split.")
    return classes, samples


def _check_same_classes(root: Path, classes_by_split: dict[str, list[str]]) -> None:
    """Every split must have the same class folders, or label i would mean different things."""
    (first, reference), *others = classes_by_split.items()
    problems = []
    for split, classes in others:
        missing = sorted(set(reference) - set(classes))
        extra = sorted(set(classes) - set(reference))
        if missing:
            problems.append(f"{root / split} lacks {len(missing)} class(es) that {first}/ has: {_few(missing)}")
        if extra:
            problems.append(f"{root / split} has {len(extra)} class(es) that {first}/ lacks: {_few(extra)}")
    if problems:
        raise DataError("The splits have different class folders, so the same label would mean "
                        "different classes:\n  - " + "\n  - ".join(problems) +
                        "\nGive every split the same class folders.")


def _unreadable(path: str) -> str | None:
    """Why Pillow cannot decode ``path`` (every byte), or None. Module level: pool workers run it."""
    try:
        with Image.open(path) as img:
            img.draft("RGB", (1, 1))  # JPEG: decode at 1/8 scale, much faster, still reads every byte
            img.load()
    except (OSError, ValueError, SyntaxError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def verify_images(settings, processes: int = 0, progress: bool = False) -> tuple[int, list[tuple[str, str]]]:
    """Decode every image of the train and validation splits, in ``processes`` worker processes (0 = one
    per core). Returns (images checked, [(path, why), ...] for the unreadable ones). For big data sets,
    where ``check_data`` decodes one image per class only. Raises DataError for a wrong layout."""
    import multiprocessing

    from tqdm.auto import tqdm
    preset = load_preset(settings.dataset, settings.data_dir) if PRESETS[settings.dataset].folders else None
    if preset is None:
        return 0, []
    root = Path(settings.data_dir).expanduser()
    splits = dict.fromkeys([preset.train_split, settings.val_split or preset.val_split])
    paths = [path for split in splits for path, _ in _scan_split(root, split, preset)[1]]
    bad = []
    # forkserver: forking this process itself, when it has threads (a notebook kernel, torch's), can leave a
    # child holding a lock nobody releases, and the pool hangs (lab/scripts/resize_imagenet.py did)
    with multiprocessing.get_context("forkserver").Pool(processes or os.cpu_count()) as pool:
        results = pool.imap(_unreadable, paths, chunksize=64)
        for path, why in zip(paths, tqdm(results, total=len(paths), desc="verifying images", disable=not progress)):
            if why:
                bad.append((path, why))
    return len(paths), bad


def _check_images(folder: Path, samples: list[tuple[str, int]], preset: Preset) -> None:
    """Decode every image of a small split, or the first image of each class of a big one."""
    if len(samples) > VERIFY_ALL_UP_TO:
        first_of_class = {}
        for path, label in samples:
            first_of_class.setdefault(label, path)
        paths = list(first_of_class.values())
    else:
        paths = [path for path, _ in samples]
    for path in paths:
        why = _unreadable(path)
        if why:
            raise DataError(f"{path}: Pillow cannot read this image ({why}). "
                            f"Delete it or replace it with a good copy.") from None
        with Image.open(path) as img:
            size = img.size
        if preset.crop == "padded" and size != (preset.image_size, preset.image_size):
            raise DataError(f"{path} is {size[0]}x{size[1]} pixels, but {preset.name} images are "
                            f"{preset.image_size}x{preset.image_size}. {_layout_hint(folder.parent, preset)}")


def _layout_hint(root: Path, preset: Preset) -> str:
    """Every preset whose folders are there, when they are not ``preset``'s (two presets may share a layout:
    CIFAR-100's train/ and test/ are Food-101's too, so naming one would be a coin toss)."""
    names = {p.name for p in root.iterdir()} if root.is_dir() else set()
    if preset.val_split in names:
        return ""
    fits = [p for p in PRESETS.values() if p.folders and {p.train_split, p.val_split} <= names
            and (p.test_split is None or p.test_split in names)]
    fits.sort(key=lambda p: p.made_here != (DEMO_JSON in names))   # demo.json: the kit's own set first
    if not fits:
        return ""
    layouts = [f"dataset='{p.name}' (" + "/, ".join(dict.fromkeys(s for s in (p.train_split, p.val_split,
                                                                                  p.test_split) if s)) + "/)"
               for p in fits]
    if len(fits) == 1:
        return f"These folders look like the {fits[0].name} layout: use {layouts[0]}."
    return (f"These folders fit the layout of {len(fits)} presets: use {' or '.join(layouts)}, whichever data set "
            f"these images are.")


def _few(names: list[str], k: int = 5) -> str:
    shown = ", ".join(names[:k])
    return shown + (f" (and {len(names) - k} more)" if len(names) > k else "")



"""Data sets for DDP training: presets with statistics, transforms, folder checks, samplers, loaders.

Everything ``data.build_loaders`` assembles, and nothing that decides between the loaders:

- ``load_preset`` gives a data set's preset (``presets.py``) with its statistics, so ImageNet is
  never normalised with CINIC-10 statistics and its validation images are always centre-cropped;
- ``check_data`` checks the folders before anything is loaded (each node reads its own copy: there
  is no shared file system), and ``Data.fingerprint()`` lets the ranks compare what they found;
- ``TrainLoader`` is the training-loader protocol, written once: this rank's DistributedSampler, its
  ``set_epoch``, the steps per epoch. Every training loader is one (``EpochLoader`` for the workers path,
  ``fastjpeg.NormalizedEpochLoader``, ``memdata.MemoryLoader``, ``dali.DaliTrainLoader``): each only
  says how it makes the batches of an epoch;
- ``EvalShardSampler`` gives exact evaluation;
- ``augmentation_seed`` is the one seeding recipe of all of them.

Rank and world size are plain arguments: nothing here touches ``torch.distributed``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import itertools
import multiprocessing.context
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sized

import numpy as np
import psutil   # here, not in the forked workers: a C extension loaded after fork in a threaded parent can hang
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, Sampler
from torchvision import transforms as T
from torchvision.datasets import FakeData, ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

from .robust.workers import end_workers_in

from .demo_data import DEMO_JSON, prepare_demo, read_demo_info
from .presets import PRESETS, Preset

__all__ = ["DataError", "Preset", "PRESETS", "load_preset", "train_transform", "eval_transform",
           "check_data", "Data", "TrainLoader", "EpochLoader", "train_sampler", "EvalShardSampler", "ImageFolderDataset",
           "augmentation_seed", "check_batch_fits"]

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


# --------------------------------------------------------------------------------------------
# Presets (defined in presets.py) and the one seeding recipe of every training loader
# --------------------------------------------------------------------------------------------
def augmentation_seed(seed: int, rank: int, epoch: int) -> int:
    """The seed of rank ``rank``'s random crops and flips in epoch ``epoch``: one independent stream
    per (seed, rank, epoch), the same for every loader.

    Why not ``seed + rank + epoch``: then rank r at epoch e+1 would repeat the crops of rank r+1 at
    epoch e. ``numpy.random.SeedSequence`` hashes the three numbers into unrelated streams. Depending on
    (seed, rank, epoch) alone, a run resumed at epoch k draws the same crops as one that never stopped.
    """
    return int(np.random.SeedSequence([seed % 2**64, rank, epoch]).generate_state(1, np.uint64)[0] % 2**63)


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
    """A guess at the right preset from the folders that are there."""
    names = {p.name for p in root.iterdir()} if root.is_dir() else set()
    if preset.val_split in names:
        return ""
    fits = [p for p in PRESETS.values() if p.folders and {p.train_split, p.val_split} <= names
            and (p.test_split is None or p.test_split in names)]
    fits.sort(key=lambda p: p.made_here != (DEMO_JSON in names))   # demo.json: the kit's own set first
    if not fits:
        return ""
    splits = "/, ".join(dict.fromkeys(s for s in (fits[0].train_split, fits[0].val_split, fits[0].test_split) if s))
    return f"These folders look like the {fits[0].name} layout ({splits}/): use dataset='{fits[0].name}'."


def _few(names: list[str], k: int = 5) -> str:
    shown = ", ".join(names[:k])
    return shown + (f" (and {len(names) - k} more)" if len(names) > k else "")


# --------------------------------------------------------------------------------------------
# Samplers and loaders
# --------------------------------------------------------------------------------------------
class EvalShardSampler(Sampler[int]):
    """Exact evaluation: rank r gets indices r, r + W, r + 2W, ... of the data set.

    Every index goes to exactly one rank, with no padding (DistributedSampler pads with repeats,
    which counts some images twice). Ranks may get one batch more or fewer than each other, so
    an evaluation loop must not run a collective per batch: sum loss and correct counts locally,
    then all-reduce the sums and counts once at the end.
    """

    def __init__(self, data: Sized | int, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in 0..{world_size - 1}")
        self.size = data if isinstance(data, int) else len(data)
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.size, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world_size))


def close_inherited_listeners(worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn``: close the listening sockets a forked worker inherited.

    Rank 0 hosts the rendezvous store on master_port; a worker forked from it holds a copy of that
    listening socket for as long as it lives (persistent validation workers: until the loader is gone),
    so re-running the notebook found its own port "in use by pid <worker>". A worker never listens.
    It imports nothing: psutil was imported by the parent before the fork.
    """
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.fd >= 0:
            try:
                os.close(conn.fd)
            except OSError:
                pass


class _ForkWithParentsObjectsFrozen(multiprocessing.context.ForkProcess):
    def start(self):
        gc.freeze()   # what exists now (also the parent's garbage) sits in a generation the child never collects
        try:
            super().start()
        finally:
            gc.unfreeze()   # the parent collects its garbage as before


class WorkerForkContext(multiprocessing.context.ForkContext):
    """DataLoader ``multiprocessing_context``: fork, without letting the worker collect the parent's garbage.

    A forked worker inherits every object of the process, also garbage the parent has not collected yet, such as
    an old process group in a reference cycle (a notebook cell re-run, a torn-down run). When the worker's
    collector frees that group, its destructor waits for gloo threads that exist only in the parent: the worker
    hangs for ever, and so does the rank reading from it (seen). ``gc.freeze()`` around the fork is the recipe of
    Python's ``gc`` documentation for processes that fork.
    """
    Process = _ForkWithParentsObjectsFrozen


def worker_context(workers: int):
    """The DataLoader ``multiprocessing_context`` for ``workers`` processes (None without workers, which
    DataLoader requires, or where this system cannot fork)."""
    if workers <= 0 or "fork" not in multiprocessing.get_all_start_methods():
        return None
    return WorkerForkContext()


def train_sampler(size: int, rank: int, world_size: int, seed: int) -> DistributedSampler:
    """DDP: this rank's share of a training split of ``size`` images.

    Every epoch the whole split is shuffled with ``seed + epoch`` (the same order on every rank) and
    rank r gets every world_size-th index of it from r on: the ranks' shares are disjoint, of equal
    size (``drop_last`` leaves out the few that do not divide evenly) and together cover the epoch.
    """
    return DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                              drop_last=True)


class TrainLoader:
    """One rank's training batches, reshuffled every epoch: the protocol every training loader keeps.

    ``for images, labels in loader.epoch(e)`` yields this rank's batches of epoch ``e`` (0, 1, ...):
    images float32 (B, 3, S, S), normalised, and labels int64 (B,), every batch full. The order is
    the DistributedSampler's for (seed, e, rank, world size), and the random crops come from
    ``augmentation_seed(seed, rank, e)``: a re-run of epoch e gives the same batches.
    ``len(loader)`` is the steps per epoch, the same on every rank, which keeps the ranks' collectives
    in step. ``epoch()`` calls ``sampler.set_epoch(e)`` itself: without it a DistributedSampler repeats
    the first epoch's order every epoch. There is deliberately no plain ``iter(loader)``.

    A loader subclasses this and says how it makes the batches (``_batches``), reading
    ``self.sampler`` for this rank's indices of the epoch.
    """

    def __init__(self, sampler: DistributedSampler, batch_size: int, seed: int = 0, rank: int = 0,
                 max_steps: int = 0):
        self.sampler = sampler          # DDP: this rank's share of every epoch (train_sampler)
        self.batch_size = batch_size    # per rank
        self.seed, self.rank = seed, rank
        self.max_steps = max_steps      # 0 = whole epochs

    def __len__(self) -> int:
        """Steps (batches) per epoch on this rank, the same on every rank."""
        steps = len(self.sampler) // self.batch_size
        return min(steps, self.max_steps) if self.max_steps > 0 else steps

    def epoch(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        """The batches of epoch ``epoch`` (0, 1, ...): same order and crops on a re-run, new ones each epoch."""
        self._shuffle(epoch)
        return self._batches(epoch)

    def indices(self, epoch: int) -> list[int]:
        """This rank's image indices for ``epoch``, in training order."""
        self._shuffle(epoch)
        return list(self.sampler)

    def _shuffle(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)   # DDP: seed + epoch -> one shuffle shared by all ranks

    def _batches(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        raise NotImplementedError

    def __iter__(self):
        raise TypeError("Iterate over loader.epoch(epoch), not the loader itself: the epoch number "
                        "sets the shuffle (DistributedSampler.set_epoch).")


class EpochLoader(TrainLoader):
    """The workers path: a DataLoader (whose sampler is this rank's DistributedSampler) as a TrainLoader.

    Its worker processes decode and augment; each epoch they seed their random crops from the
    DataLoader's generator, which ``epoch()`` seeds with ``augmentation_seed(seed, rank, epoch)``.
    """

    def __init__(self, loader: DataLoader, max_steps: int = 0, seed: int = 0, rank: int = 0):
        if not hasattr(loader.sampler, "set_epoch"):
            raise TypeError("EpochLoader needs a DataLoader whose sampler has set_epoch (a DistributedSampler)")
        if loader.generator is None:
            raise TypeError("EpochLoader needs a DataLoader with a generator: it seeds the workers' augmentation")
        if not loader.drop_last:
            raise TypeError("EpochLoader needs a DataLoader with drop_last=True: every rank the same full batches")
        super().__init__(loader.sampler, loader.batch_size, seed, rank, max_steps)
        self.loader = loader

    @property
    def dataset(self):
        return self.loader.dataset

    def _batches(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        seed = augmentation_seed(self.seed, self.rank, epoch)
        if self.loader.num_workers > 0:
            # Each worker process seeds its random crops from this generator (train workers start
            # afresh each epoch: they are not persistent). Seeded before iter(): that draws the seeds.
            self.loader.generator.manual_seed(seed)
            return itertools.islice(self.loader, len(self))
        return _with_own_rng(itertools.islice(self.loader, len(self)), seed)


# where the loaders' frames come from: torch's DataLoader and its iterators, the kit's loaders
_SPEED = os.path.join(os.path.dirname(__file__), "speed")
_LOADER_FRAMES = (os.path.join("torch", "utils", "data", ""), os.path.join(os.path.dirname(__file__), "datasets.py"),
                  *(os.path.join(_SPEED, f"{name}.py") for name in ("memdata", "fastjpeg", "nvjpeg", "dali")))


def release_workers(exc: BaseException) -> None:
    """Let the loader that ``exc`` came through free its worker processes now.

    An exception raised while the training loop waited for a batch (Stop, Ctrl-C, a worker's error) carries a
    traceback whose frames hold the DataLoader's iterator, and a notebook keeps the last traceback: the iterator
    never dies, so its workers are never joined (after a Ctrl-C, which ends them too, they stay as zombies under
    the kernel). Clearing the locals of the loaders' own frames (torch's DataLoader, the kit's loaders) frees it;
    the frames of your model and of the kit's loop keep theirs for a debugger.
    """
    end_workers_in(exc.__traceback__)   # wherever the iterator sits: the loop's own frame, a generator (robust/)
    tb = exc.__traceback__
    while tb is not None:
        if any(part in tb.tb_frame.f_code.co_filename for part in _LOADER_FRAMES):
            with contextlib.suppress(RuntimeError):   # a frame still running (the caller's) is left alone
                tb.tb_frame.clear()
        tb = tb.tb_next


def _with_own_rng(batches: Iterator, seed: int) -> Iterator:
    """``batches`` made in this process (no workers) with a random stream of their own.

    Without workers the transforms draw from torch's global generator, which prepare() seeds the same
    on every rank: every rank would crop alike, and the training step's own draws would shift the
    crops. So each batch is made with the global generator set to this loader's stream, and the
    training's state put back afterwards.
    """
    state = torch.Generator().manual_seed(seed).get_state()
    batches = iter(batches)
    while True:
        with torch.random.fork_rng(devices=[]):   # CPU generator only: the transforms run on the CPU
            torch.set_rng_state(state)
            batch = next(batches, None)
            state = torch.get_rng_state()
        if batch is None:
            return
        yield batch


@dataclass
class Data:
    """What build_data returns: this rank's loaders and facts about the data set.

    ``train_size`` and ``val_size`` are the whole splits (all ranks together), in images.
    """
    train: TrainLoader
    val: DataLoader
    num_classes: int
    classes: list[str]
    train_size: int
    val_size: int
    image_size: int
    preset: Preset
    val_split: str = ""

    def fingerprint(self) -> dict:
        """What every rank must share (compare across ranks before training; JSON-friendly)."""
        return {"dataset": self.preset.name, "train_size": self.train_size, "val_size": self.val_size,
                "val_split": self.val_split, "num_classes": self.num_classes,
                "classes_sha1": hashlib.sha1("\n".join(self.classes).encode()).hexdigest()[:12],
                "image_size": self.image_size,
                "mean": [round(m, 6) for m in self.preset.mean], "std": [round(s, 6) for s in self.preset.std]}


def check_batch_fits(train_images: int, batch_size: int, world_size: int, where: str) -> None:
    """DataError if a rank's share of the train split is smaller than one batch (no step could run)."""
    per_rank = train_images // world_size
    if per_rank < batch_size:
        raise DataError(f"The train split ({train_images} images {where}) gives each of {world_size} ranks "
                        f"{per_rank} images, less than one batch of {batch_size}: lower batch_size.")

"""Every loader: the protocol they keep, and the table they register in (``LOADERS``).

- ``TrainLoader`` is the training-loader protocol, written once: this rank's DistributedSampler, its
  ``set_epoch``, the steps per epoch. Every training loader is one (``EpochLoader`` for the workers path,
  ``fastjpeg.NormalizedEpochLoader``, ``memdata.MemoryLoader``, ``dali.DaliTrainLoader``): each only says how it
  makes the batches of an epoch; ``EvalShardSampler`` gives exact evaluation; ``augmentation_seed`` is the one seeding
  recipe of all of them; ``Data`` is what a loader builds.
- ``LOADERS`` is the table of ``--loader`` choices, one ``Loader`` row each: its name, what it does, whether this
  machine can run it, and one builder taking the preset, the settings and the rank's ``Source`` (where its data is
  and what ``check_data`` found there). data.py registers ``workers`` and picks from the table; speed/ registers
  ``memory``, ``dali`` and ``nvjpeg``. A preset's ``not_for`` names rows of it (``check_presets``).

Rank and world size are plain arguments: nothing here touches ``torch.distributed``.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import multiprocessing.context
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sized

import numpy as np
import psutil   # here, not in the forked workers: a C extension loaded after fork in a threaded parent can hang
import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from .datasets import DataError
from .presets import PRESETS, Preset, loader_refusal
from .robust.workers import end_workers_in


# --------------------------------------------------------------------------------------------
# The table of loaders
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """Where this rank reads its data and what ``check_data`` found there: what every loader's builder needs besides
    the preset and the settings."""
    root: Path                       # DATA_DIR
    classes: list[str]               # the class folders, the same in every split
    image_size: int                  # the training crop (the settings' or the preset's)
    val_split: str                   # the split evaluated on
    rank: int
    world_size: int
    device: torch.device | None      # where the batches go (pinned memory and GPU decoders when a GPU)

    def data(self, train, val, sizes: tuple[int, int], preset) -> "Data":
        """The ``Data`` of ``train`` and ``val`` loaders over splits of ``sizes`` (train, val) images."""
        return Data(train=train, val=val, num_classes=len(self.classes), classes=self.classes, train_size=sizes[0],
                    val_size=sizes[1], image_size=self.image_size, preset=preset, val_split=self.val_split)


@dataclass(frozen=True)
class Loader:
    """One way to feed the GPUs (``--loader NAME``): a row of ``LOADERS``."""
    name: str
    about: str                                   # what it does, for --help and the docs
    build: Callable                              # (preset, settings, source) -> Data: this rank's loaders
    missing: Callable[[], str | None] = lambda: None   # why this machine cannot run it (DALI not installed)
    warning: Callable[[object], str | None] = lambda device: None   # a word for rank 0 before a run on ``device``
    auto: bool = False   # --loader auto takes it for every preset that allows it (else workers)


LOADERS: dict[str, Loader] = {}


def register_loader(loader: Loader) -> Loader:
    """Add a row to the table of loaders: ``--loader NAME`` then builds with it."""
    if loader.name in LOADERS or loader.name == "auto":
        raise ValueError(f"loader {loader.name!r} is registered twice (or is 'auto', which picks one)")
    LOADERS[loader.name] = loader
    return loader


def check_presets(presets: dict[str, Preset] = PRESETS) -> None:
    """Every preset's ``not_for`` names registered loaders; else ValueError naming the preset, the unknown name and
    the loaders (a typo there would let ``--loader auto`` load a split into memory that does not fit). ddp_utils
    calls it once its loaders have registered (the package's ``__init__``), so a typo fails at import."""
    for preset in presets.values():
        unknown = sorted(set(preset.not_for) - set(LOADERS))
        if unknown:
            raise ValueError(f"preset {preset.name!r}: not_for names {', '.join(map(repr, unknown))}, which is no "
                             f"loader; the loaders are {', '.join(LOADERS)}")


def auto_loader(dataset: str) -> str:
    """What ``--loader auto`` feeds ``dataset`` with: the first loader registered with ``auto`` that the preset
    allows (memory, where the splits fit: no worker processes competing with the ranks for the cores, on a CPU
    rehearsal most of the difference), else the workers."""
    return next((name for name, row in LOADERS.items() if row.auto and loader_refusal(dataset, name) is None),
                "workers")


def describe_loaders() -> str:
    """``--loader``'s help: each row of the table, and the presets it suits."""
    rows = [f"{name}: {row.about} ({', '.join(p for p, preset in PRESETS.items() if name not in preset.not_for)})"
            for name, row in LOADERS.items()]
    return "auto: " + ", else ".join([*(n for n, r in LOADERS.items() if r.auto), "workers"]) + \
        " (the first the preset allows); " + "; ".join(rows)


def recipe_table() -> str:
    """docs/commands.md's table of the recipes (a generated region: python docs/quotes.py pages)."""
    rows = ["| `--dataset` | model | batch per rank | epochs | lr (at 256) | warm-up (epochs) | optimizer | weight "
            "decay | loaders (auto first) |", "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for name, preset in PRESETS.items():
        r, first = preset.recipe, auto_loader(name)
        loaders = [first, *(x for x in LOADERS if x != first and x not in preset.not_for)]
        rows.append(f"| `{name}` | `{r.arch}` | {r.batch_size} | {r.epochs} | {r.lr:g} | {r.warmup_epochs:g} | "
                    f"{r.optimizer} | {r.weight_decay:g} | {', '.join(loaders)} |")
    return "\n".join(rows)


# --------------------------------------------------------------------------------------------
# The one seeding recipe of every training loader
# --------------------------------------------------------------------------------------------
def augmentation_seed(seed: int, rank: int, epoch: int) -> int:
    """The seed of rank ``rank``'s random crops and flips in epoch ``epoch``: one independent stream
    per (seed, rank, epoch), the same for every loader.

    Why not ``seed + rank + epoch``: then rank r at epoch e+1 would repeat the crops of rank r+1 at
    epoch e. ``numpy.random.SeedSequence`` hashes the three numbers into unrelated streams. Depending on
    (seed, rank, epoch) alone, a run resumed at epoch k draws the same crops as one that never stopped.
    """
    return int(np.random.SeedSequence([seed % 2**64, rank, epoch]).generate_state(1, np.uint64)[0] % 2**63)


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
    frames = _loader_frames()
    tb = exc.__traceback__
    while tb is not None:
        if any(part in tb.tb_frame.f_code.co_filename for part in frames):
            with contextlib.suppress(RuntimeError):   # a frame still running (the caller's) is left alone
                tb.tb_frame.clear()
        tb = tb.tb_next


def _loader_frames() -> tuple[str, ...]:
    """Where the loaders' frames come from: torch's DataLoader and its iterators, this module, and every
    registered loader's module (its builder's)."""
    modules = {sys.modules[entry.build.__module__] for entry in LOADERS.values()} | {sys.modules[__name__]}
    return (os.path.join("torch", "utils", "data", ""), *(m.__file__ for m in modules if getattr(m, "__file__", None)))


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

"""Checkpoints that are never half-written, and that load without running anyone's code.

``save_checkpoint`` writes to a temporary file beside the target, forces it to disk, checks that it
loads back, and only then renames it over the old file (``os.replace`` is atomic). A crash, a full
disk or a killed worker while saving leaves the previous checkpoint exactly as it was.

``load_checkpoint`` uses ``torch.load(weights_only=True)``: only tensors and plain Python values
(dict, list, tuple, str, int, float, bool, None) are accepted, so a tampered file cannot execute
code. Everything we store must therefore be plain: ``settings.to_dict()``, ``str(torch.__version__)``
(a ``TorchVersion`` object is refused), ``rng_state()`` (no numpy arrays).

``save_state``, ``load_state`` and ``restore`` are the training side: every rank calls them (they
are collectives), rank 0 alone touches files, and rank 0 sends what it read to the others, so the
nodes need no shared folder.

Layout of a run folder's checkpoints (rank 0 writes them, on the rank-0 node only)::

    <run_dir>/last.pt   end of the latest epoch: resume from here
    <run_dir>/best.pt   the epoch with the best validation acc1
"""
from __future__ import annotations

import contextlib
import pickle
import random
import re
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from . import collectives
from .robust import peers
from .robust.files import atomic_write
from .model import unwrap
from .parallel import full_state, load_model_state, load_optimizer_state

READ_EPOCH_S = 2.0   # how long a failing rank 0 reads its last.pt for the epoch before it tells the others


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used (truncated, not a checkpoint, unsafe content)."""


def checkpoint_paths(run_dir) -> tuple[Path, Path]:
    """``(run_dir/last.pt, run_dir/best.pt)``."""
    run_dir = Path(run_dir)
    return run_dir / "last.pt", run_dir / "best.pt"


# -- saving --------------------------------------------------------------------------------------
def save_checkpoint(path, state: dict, verify: bool = True) -> None:
    """Write ``state`` to ``path`` atomically: either the complete new file or the old one, never half.

    ``verify`` loads the temporary file back with ``weights_only=True`` before it replaces the old
    checkpoint, so a state that could not be resumed from is refused now (CheckpointError) instead
    of being discovered after the crash it was meant to survive.
    """
    path = Path(path)
    atomic_write(path, lambda f: torch.save(state, f), check=(lambda tmp: _check_loads_back(tmp, path)) if verify else None)


def _check_loads_back(tmp: Path, path: Path) -> None:
    try:
        _torch_load(tmp, "cpu")
    except Exception as e:
        raise CheckpointError(
            f"Not saving {path}: torch.load(weights_only=True) could not read the state back "
            f"({_why(e)}). Store only tensors and plain values: state_dict()s, settings.to_dict(), "
            f"str(torch.__version__), rng_state(). Any earlier {path.name} is unchanged.") from e


# -- loading -------------------------------------------------------------------------------------
def _torch_load(path, map_location):
    return torch.load(path, map_location=map_location, weights_only=True)


def load_checkpoint(path, map_location="cpu") -> dict:
    """The dict saved by ``save_checkpoint``, with tensors moved to ``map_location``.

    Raises FileNotFoundError for a missing file and CheckpointError for a truncated file, a file
    that is not a checkpoint, or one holding Python objects that ``weights_only`` refuses.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"No checkpoint at {path}. Checkpoints are <run_dir>/last.pt and <run_dir>/best.pt, "
            f"written by rank 0 on the rank-0 node only: check the path, copy the file to this node, "
            f"or start without --resume.")
    try:
        state = _torch_load(path, map_location)
    except pickle.UnpicklingError as e:
        # Python objects: a zip from torch.save ("Unsupported global") or a plain pickle (it starts
        # with the PROTO opcode). Anything else (random bytes, a truncated file) is not a checkpoint.
        if "unsupported global" not in str(e).lower() and not _is_plain_pickle(path):
            raise _damaged(path, e) from e
        raise CheckpointError(
            f"{path} holds Python objects that torch.load(weights_only=True) refuses ({_why(e)}). "
            f"Loading them could run arbitrary code. If you made this file yourself and trust it, "
            f"load it with torch.load({str(path)!r}, weights_only=False) and re-save its plain "
            f"parts with save_checkpoint.") from e
    except Exception as e:  # RuntimeError (bad zip), EOFError (empty), KeyError (not a pickle) ...
        raise _damaged(path, e) from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a checkpoint dict "
                              f"(expected keys such as 'model', 'optimizer', 'epoch').")
    return state


def _is_plain_pickle(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(2)
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5   # PROTO opcode and version


def _damaged(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a complete checkpoint ({path.stat().st_size:,} bytes; {_why(error)}). "
        f"It is probably truncated (the disk filled up, or a copy was interrupted) or not a "
        f"torch.save file. Resume from the other checkpoint (last.pt / best.pt) or start afresh.")


def _why(error: Exception) -> str:
    """The useful line of a torch.load error (its messages run to many lines)."""
    text = str(error)
    found = re.search(r"Unsupported (global: GLOBAL [\w.]+|operand \d+)", text)
    if found:
        return found.group(0)
    first = text.strip().splitlines()[0].split(". ")[0] if text.strip() else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


# -- random number generators ----------------------------------------------------------------------
def rng_state() -> dict:
    """Every RNG a training step may draw from, as plain values that load with ``weights_only``.

    Keys: ``python`` (random module), ``torch`` (CPU generator), ``cuda`` (one state per visible
    GPU; empty without CUDA) and ``numpy`` (the legacy global generator, if numpy is installed).
    """
    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    # numpy arrays are refused by weights_only loading: store plain Python numbers instead.
    state["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(cached))
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state()`` captured; the next random numbers repeat the saved run's."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].cpu())
    if torch.cuda.is_available():
        # Resuming on a node with fewer GPUs: restore the ones that exist.
        for device, cuda_state in enumerate(state.get("cuda", [])[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu(), device)
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# -- the training state, across ranks ---------------------------------------------------------------
def gather_per_rank(value, ctx) -> list:
    """Every rank's ``value`` (plain values), gathered so rank 0 can store them all in one file (a collective)."""
    if not ctx.distributed:
        return [value]
    values = [None] * ctx.world_size
    dist.all_gather_object(values, value)   # DDP: collective
    return values


def save_state(paths, loop) -> None:
    """Write ``loop``'s full training state to each of ``paths`` (rank 0 only; every rank must call this).

    ``loop`` (train.py's Loop): its model, optimizer, scheduler and scaler, where it is (``epoch`` done, ``step``,
    ``best_acc1``, ``history``), its ``settings`` and ``ctx``, and what its observers asked the checkpoint to keep
    (``kept``: how the gradients travel, ``{"comm": {"choice": "powersgd", "powersgd": ...}}``, so that a resume
    continues with comm=auto's choice and PowerSGD's memory, already gathered)."""
    ctx, scaler = loop.ctx, loop.scaler
    # collective, so that resuming restores each rank's own RNG, and its own fp16 scaler: with local SGD each
    # rank's scaler sees only its own gradients, so their scales can differ
    ranks = gather_per_rank({"rng": rng_state(), "scaler": scaler.state_dict()}, ctx)
    rngs, scalers = [r["rng"] for r in ranks], [r["scaler"] for r in ranks]
    # zero1 / fsdp: the shards gathered to rank 0 (collectives), saved as one process's state_dict()s would be
    weights, optimizer_state = full_state(unwrap(loop.model), loop.optimizer, ctx)
    if ctx.is_main:
        state = {"model": weights, "optimizer": optimizer_state,
                 "scheduler": loop.scheduler.state_dict(), "scaler": scaler.state_dict(),
                 "epoch": loop.epoch, "step": loop.step, "best_acc1": loop.best_acc1, "history": loop.history,
                 "settings": loop.settings.to_dict(),
                 "rng": rngs, "torch_version": str(torch.__version__), **loop.kept}
        if ctx.distributed and any(scalers):
            state["scalers"] = scalers
        for path in paths:
            save_checkpoint(path, state)


def load_state(path, ctx, timeout: float = 300.0) -> dict | None:
    """Rank 0 reads the checkpoint and sends it to the others: the nodes need no shared folder.

    The others wait for the reading explicitly (``timeout`` s), not in the broadcast: a big file on a
    slow disk must not trip the collective timeout."""
    state = load_checkpoint(path) if ctx.is_main and path else None
    peers.wait_for_all("finish reading the checkpoint", ctx, timeout)
    if ctx.distributed:
        own = _per_rank_parts(state)   # each rank gets its own later (PowerSGD's error feedback), not everyone's
        state = collectives.broadcast_object(state, ctx)   # DDP: worker nodes get rank 0's file
        if ctx.is_main and own is not None:
            state["comm"]["powersgd"]["errors"] = own
    return state


def _per_rank_parts(state: dict | None):
    """Rank 0: take every rank's PowerSGD error feedback out of ``state`` (leaving their number), and return them."""
    saved = ((state or {}).get("comm") or {}).get("powersgd") or {}
    if not isinstance(saved.get("errors"), list):
        return None
    own, saved["errors"] = saved["errors"], len(saved["errors"])
    return own


def mend_best(state: dict, run_dir, ctx, timeout: float = 300.0) -> bool:
    """Every rank: rank 0 writes best.pt again where a stop came between an epoch's two writes (``_mend_best``),
    and the others wait for it (``timeout`` s) here, not in the next collective, whose short timeout a slow disk
    would trip. True on rank 0 when it wrote best.pt."""
    wrote = _mend_best(state, run_dir, ctx)
    peers.wait_for_all("let rank 0 write best.pt again", ctx, timeout)
    return wrote


def _mend_best(state: dict, run_dir, ctx) -> bool:
    """Write best.pt again from a resumed state when a stop came between the two writes of a best epoch.

    A best epoch writes last.pt, then best.pt. Killed in between, last.pt records that epoch as the
    best while best.pt is missing or an older epoch's, and if no later epoch beats it the run would end
    without the best weights it names. Then the state (last.pt's, which is that best epoch) is also
    written to best.pt. Rank 0 only; True when it wrote best.pt."""
    history = state.get("history") or []
    if not ctx.is_main or not run_dir or not history or history[-1]["val"]["acc1"] < state["best_acc1"]:
        return False   # the last epoch saved was not the best: best.pt was written before it
    if any(h["val"]["acc1"] >= state["best_acc1"] for h in history[:-1]):
        return False   # it only tied an earlier best epoch, whose best.pt stays (a best epoch must beat the best)
    last, best = checkpoint_paths(run_dir)
    if best.exists() and (not last.exists() or best.stat().st_mtime_ns >= last.stat().st_mtime_ns):
        return False   # written after last.pt, as a best epoch does
    save_checkpoint(best, state)
    return True


def check_matches(state: dict, settings, path) -> None:
    """CheckpointError (on every rank: all hold the state) if the checkpoint is of another model or data."""
    saved = state.get("settings") or {}
    wrong = [f"{name}={saved[name]!r}" for name in ("arch", "dataset")
             if name in saved and saved[name] != getattr(settings, name)]
    if wrong:
        now = ", ".join(f"{name}={getattr(settings, name)!r}" for name in ("arch", "dataset"))
        flags = " ".join(f"--{w.split('=')[0]} {saved[w.split('=')[0]]}" for w in wrong)
        raise CheckpointError(
            f"{path} is a checkpoint of {', '.join(wrong)}, but these settings say {now}. Resume it with the "
            f"same settings ({flags}; in the notebooks the same values in the parameter cell), or start a new "
            f"run without resume.")


def restore(state, model, optimizer, scheduler, scaler, ctx) -> None:
    """Put a loaded state back: weights, optimiser, schedule, this rank's own scaler and RNG (zero1 and fsdp keep
    their own shares of the full state that every rank was sent)."""
    load_model_state(unwrap(model), state["model"])
    if optimizer is not None:
        load_optimizer_state(unwrap(model), optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        # A checkpoint from a run without fp16 (bf16 on A100s, a CPU) holds a disabled scaler's empty state,
        # which an fp16 scaler refuses to load: it starts afresh (its scale settles in a few steps).
        scalers = state.get("scalers") or []
        own = scalers[ctx.rank] if len(scalers) == ctx.world_size else state["scaler"]   # else: rank 0's
        if own or not scaler.is_enabled():
            scaler.load_state_dict(own)
    rngs = state["rng"]
    set_rng_state(rngs[ctx.rank] if ctx.rank < len(rngs) else rngs[0])


def kept_checkpoint(run_dir, ctx) -> str:
    """What rank 0's run folder holds now, said only if it exists; "" on other ranks (they cannot see it)."""
    if not ctx.is_main:
        return ""
    last = checkpoint_paths(run_dir)[0] if run_dir else None
    if last is None or not last.exists():
        return "no checkpoint was written yet"
    epoch = _epoch_of(last)
    if epoch is None:
        return f"the checkpoint {last} is kept as it was"
    return f"the checkpoint {last} holds epoch {epoch + 1}"   # a sentence may start with it: never capitalise a path


def _epoch_of(path: Path) -> int | None:
    """The epoch a checkpoint holds, from its pickle alone (mmap: no tensor's bytes are read) and within
    READ_EPOCH_S: a failing rank 0 says this before it tells the others why, and a slow disk must not make them
    think it stopped answering. None when it cannot say in time."""
    got: dict = {}

    def read() -> None:
        with contextlib.suppress(Exception):   # only for the message
            got["epoch"] = int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["epoch"])
    thread = threading.Thread(target=read, daemon=True, name="checkpoint-epoch")
    thread.start()
    thread.join(READ_EPOCH_S)
    return got.get("epoch")

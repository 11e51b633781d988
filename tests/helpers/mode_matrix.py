"""Per-rank code for tests/test_mode_matrix.py: every parallel mode on the settings a GPU run takes.

    python -m tests.helpers.mode_matrix save   RANK WORLD PORT FOLDER
    python -m tests.helpers.mode_matrix resume RANK WORLD PORT FOLDER

``save``: for each mode (ddp, zero1, fsdp where this torch runs it), momentum (0, 0.9) and layout (channels_last
on, off), build the matrix's net (conv blocks, a classifier and a parameter no forward uses), place it as a run
does (``prepare_model``), train two steps in bf16 autocast with fp16's gradient scaler in the loop (the GPU's
defaults; channels_last forced on this CPU) and save ``FOLDER/<WORLD>-<mode>-m<momentum>-<layout>/{last,best}.pt``
as ``fit`` does (``checkpoint.save_state``).

``resume``: for every checkpoint in FOLDER (saved on any number of ranks) and every mode: restore it as a resume
does (``checkpoint.load_state`` and ``restore``), then print one line per round trip::

    CHECK <from> -> <mode>@<WORLD> input=<the state given to restore unchanged, also after a step> mended=<mend_best
    wrote best.pt> stepped=<one more step saved> equal=<gathered back: the file's model and optimizer state, bit
    for bit; else where they first differ>

and leave ``<from>/to-<mode>-<WORLD>/{last,best}.pt`` for the test to load in a fresh process. An exception in a
round trip prints ``FAIL <from> -> <mode>@<WORLD>: <error>`` and goes on (every rank meets it alike).
"""
from __future__ import annotations

import copy
import os
import shutil
import sys
import traceback
import types
from pathlib import Path

import torch
from torch import nn

from ddp_utils import checkpoint, distributed, optim, parallel
from ddp_utils.robust import peers
from ddp_utils.model import prepare_model, unwrap
from ddp_utils.optim import ScaledStep, autocast, build_optimizer, build_scheduler, make_scaler, to_device
from ddp_utils.robust import compat
from ddp_utils.settings import Settings
from tests.helpers.procs import describe, free_port, python, run_all
from tests.helpers.sharding_ranks import same

CLASSES, IMAGE = 10, 16


class MatrixNet(nn.Module):
    """Two conv blocks (each an FSDP unit), a classifier, and ``spare``: a parameter that no forward uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, CLASSES)
        self.spare = nn.Linear(4, 4)   # unused: its gradient stays None on every rank

    def forward(self, x):
        return self.head(self.block2(self.block1(x)).mean((2, 3)))


def difference(a, b, path: str = "") -> str | None:
    """Where nested states ``a`` and ``b`` first differ (tensors bit for bit), or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))} in one only"
        return next((d for k in a if (d := difference(a[k], b[k], f"{path}/{k}"))), None)
    return None if same(a, b) else f"{path}: {str(a)[:60]!r} != {str(b)[:60]!r}"


BACKEND = os.environ.get("MATRIX_BACKEND", "gloo")   # nccl: the GPU suite's run (tests/test_gpu.py), one GPU a rank


def modes() -> list[str]:
    runnable = not compat.fsdp_refusal("cuda" if BACKEND == "nccl" else "cpu", BACKEND)   # on a CPU: torch 2.7+
    return ["ddp", "zero1", *(["fsdp"] if runnable else [])]


def settings_for(mode: str, momentum: float, layout: str, rank: int, world: int, port: int) -> Settings:
    # static_graph: DDP's way to train a model with a parameter that no forward uses
    return Settings(dataset="demo", arch="convnet", parallel=mode, world_size=world, rank=rank, master_port=port,
                    backend=BACKEND, init_timeout=60, momentum=momentum, channels_last=layout == "nhwc",
                    amp="bf16", static_graph=mode != "fsdp", epochs=2, warmup_epochs=0)


def build(settings, ctx):
    model = prepare_model(MatrixNet(), settings, ctx, log=lambda *_: None)
    optimizer = build_optimizer(model, settings, zero=settings.parallel == "zero1" and ctx.distributed)
    scheduler = build_scheduler(optimizer, settings, steps_per_epoch=4)
    scaler = make_scaler(torch.float16, ctx.device)   # the T4's scaler in the loop (enabled on CPU since torch 2.3)
    return model, optimizer, scheduler, scaler


def train(model, optimizer, scheduler, scaler, settings, ctx, steps: int, seed: int) -> None:
    stepper = ScaledStep(optimizer, scaler)
    generator = torch.Generator().manual_seed(seed * 100 + ctx.rank)   # each rank its own batch
    for _ in range(steps):
        images = torch.randn(4, 3, IMAGE, IMAGE, generator=generator)
        labels = torch.randint(0, CLASSES, (4,), generator=generator)
        images, labels = to_device(images, labels, settings, ctx.device)
        with autocast(torch.bfloat16, ctx.device):
            loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        stepper()
        scheduler.step()


def save(settings, ctx, folder: Path, layout: str) -> None:
    model, optimizer, scheduler, scaler = build(settings, ctx)
    train(model, optimizer, scheduler, scaler, settings, ctx, steps=2, seed=1)
    run = folder / f"{ctx.world_size}-{settings.parallel}-m{settings.momentum}-{layout}"
    if ctx.is_main:
        run.mkdir(parents=True, exist_ok=True)
    history = [{"epoch": 0, "val": {"acc1": 50.0}}]
    checkpoint.save_state(checkpoint.checkpoint_paths(run), types.SimpleNamespace(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, epoch=0, step=2, best_acc1=50.0,
        history=history, settings=settings, ctx=ctx, kept={}))
    peers.wait_for_all("save the matrix's checkpoint", ctx, 60)


def resume(settings, ctx, source: Path) -> str:
    """One round trip: ``source``'s last.pt into ``settings.parallel`` on this many ranks."""
    model, optimizer, scheduler, scaler = build(settings, ctx)
    state = checkpoint.load_state(source / "last.pt", ctx)
    sent = copy.deepcopy(state)
    checkpoint.restore(state, model, optimizer, scheduler, scaler, ctx)
    unchanged = same(state, sent)
    weights, optimizer_state = parallel.full_state(unwrap(model), optimizer, ctx)
    equal = (difference({"model": weights, "optimizer": optimizer_state},
                        {"model": sent["model"], "optimizer": sent["optimizer"]}) or True) if ctx.is_main else True
    # mend_best's case: last.pt records its epoch as the best, best.pt was never written
    target = source / f"to-{settings.parallel}-{ctx.world_size}"
    if ctx.is_main:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        shutil.copy(source / "last.pt", target / "last.pt")
    mended = checkpoint.mend_best(state, target if ctx.is_main else None, ctx, 60) or not ctx.is_main
    train(model, optimizer, scheduler, scaler, settings, ctx, steps=1, seed=2)
    unchanged = unchanged and same(state, sent)   # training shares no tensor with it either
    checkpoint.save_state([target / "last.pt"], types.SimpleNamespace(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, epoch=1, step=3, best_acc1=50.0,
        history=state["history"], settings=settings, ctx=ctx, kept={}))
    peers.wait_for_all("save after the resume", ctx, 60)
    return f"input={unchanged} mended={mended} stepped=True equal={equal}"


def main() -> None:
    optim.NHWC_DEVICES.add("cpu")   # the GPU's default layout, forced on this CPU (torch's CPU convolutions take it)
    phase, rank, world, port, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    first = settings_for("ddp", 0.9, "nchw", rank, world, port)
    ctx = distributed.setup(first, log=lambda *_: None)
    for mode in modes():
        for momentum in (0.0, 0.9):
            for layout in ("nhwc", "nchw"):
                settings = settings_for(mode, momentum, layout, rank, world, port)
                if phase == "save":
                    save(settings, ctx, folder, layout)
                    continue
                for source in sorted(folder.glob(f"*-m{momentum}-{layout}")):
                    name = f"{source.name} -> {mode}@{world}"
                    try:
                        print(f"CHECK {name} {resume(settings, ctx, source)}", flush=True)
                    except Exception as exc:   # noqa: BLE001 - the matrix goes on; the test names each failure
                        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
                        print(f"FAIL {name}: {last[:300]}", flush=True)
                        peers.wait_for_all(f"go on after {name}", ctx, 60)
    distributed.teardown()


# -- the matrix's phases, started by a test on WORLD ranks ----------------------------------------
LIMIT_S = 300   # a phase on 3 ranks: about 60 s alone on two cores


def phase(name: str, world: int, folder, env=None) -> list[str]:
    """Phase ``name`` of the matrix on ``world`` ranks (this module, run once per rank); rank 0's lines."""
    port = free_port()
    results = run_all([python("-m", "tests.helpers.mode_matrix", name, str(rank), str(world), str(port), str(folder))
                       for rank in range(world)], timeout=LIMIT_S, env=env)
    for res in results:
        assert res.returncode == 0, describe(results)
    return results[0].output.splitlines()


if __name__ == "__main__":
    main()

"""Per-rank code for tests/test_mode_matrix.py: every parallel mode on the settings a GPU run takes.

    python -m tests.helpers.mode_matrix save   RANK WORLD PORT FOLDER
    python -m tests.helpers.mode_matrix resume RANK WORLD PORT FOLDER

``save``: for each mode (ddp, zero1, fsdp where this torch runs it) and variant (SGD without momentum, SGD with
momentum and AdamW with channels_last on; SGD with momentum also off: VARIANTS), build the matrix's net (conv blocks, a classifier and a
parameter no forward uses, at the kit's default: ddp and zero1 with find_unused_parameters, the setting the kit
names for it), place it as a run does (``prepare_model``), train two steps in bf16 autocast with fp16's gradient
scaler in the loop (the GPU's defaults; channels_last forced on this CPU), save
``FOLDER/<WORLD>-<mode>-<variant>-<layout>/{last,best}.pt`` as ``fit`` does (``checkpoint.save_state``), then take
the next step (``next_step``) and keep its result as ``after.pt``: the reference for every resume of that
checkpoint.

``resume``: for every checkpoint in FOLDER (saved on any number of ranks) and every mode: restore it as a resume
does (``checkpoint.load_state`` and ``restore``), take the same next step, and print one line per round trip on
EVERY rank::

    CHECK <from> -> <mode>@<WORLD> rank=<r> built=<what ran, @ its device> input=<the state given to restore unchanged, also after the step>
    mended=<rank 0: mend_best wrote best.pt; '-' on the others, which write nothing> equal=<what this rank holds,
    as a whole (a sharded mode's pieces gathered), is the file's model and optimizer state bit for bit; else where
    it first differs> stepped=<after the next step, this rank's state is the source mode's after.pt within
    STEP_RTOL; else where it is not>

and leave ``<from>/to-<mode>-<WORLD>/{last,best}.pt`` for the test to load in a fresh process. An exception in a
round trip prints ``FAIL <from> -> <mode>@<WORLD>: <error>`` and goes on (every rank meets it alike).

The next step is the same on any number of ranks: every rank takes the same batch (its BatchNorm statistics, hence
its gradient, are then those of one process, and DDP's average of equal gradients is that gradient), in fp32 (a
comparison of modes, not of bf16's roundings). ``MATRIX_DATA=<demo folder>``: the two steps before the checkpoint
take their batches from the kit's loader (the GPU suite's). ``MATRIX_BREAK=1``: rank 1 adds 1e-3 to its first weight after the
restore (the test that shows the matrix reads every rank). ``MATRIX_MODES`` / ``MATRIX_VARIANTS``: a part of the
matrix (comma-separated).
"""
from __future__ import annotations

import copy
import functools
import os
import shutil
import sys
import traceback
import types
from pathlib import Path

import torch
from torch import nn

from ddp_utils import checkpoint, distributed, optim
from ddp_utils.robust import peers
from ddp_utils.model import ddp_of, prepare_model, unwrap
from ddp_utils.optim import ScaledStep, autocast, build_optimizer, build_scheduler, make_scaler, to_device
from ddp_utils.robust import compat
from ddp_utils.settings import Settings
from ddp_utils.speed import sharding
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


BACKEND = os.environ.get("MATRIX_BACKEND", "gloo")   # the GPU suite's run (tests/test_gpu.py): gloo on CUDA tensors
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def modes() -> list[str]:
    runnable = not compat.fsdp_refusal(DEVICE, BACKEND)   # on a CPU: torch 2.7+; on a GPU: nccl only
    only = os.environ.get("MATRIX_MODES")
    return [m for m in ("ddp", "zero1", *(["fsdp"] if runnable else [])) if not only or m in only.split(",")]


# (optimizer, momentum, layout): SGD without momentum keeps no state; AdamW keeps two tensors and a step count. Each
# optimizer in the GPU's layout (channels_last); the plain layout with the state that takes the weights' strides (SGD's
# momentum): a layout changes how the weights and that state are laid out, not which state an optimizer keeps.
VARIANTS = (("sgd", 0.0, "nhwc"), ("sgd", 0.9, "nhwc"), ("sgd", 0.9, "nchw"), ("adamw", 0.0, "nhwc"))
STEP_RTOL = 1e-4   # the next step in another mode or on other ranks: each tensor within this share of its norm


def variants() -> list[tuple]:
    only = os.environ.get("MATRIX_VARIANTS")
    return [v for v in VARIANTS if not only or variant_name(*v) in only.split(",")]


def variant_name(optimizer: str, momentum: float, layout: str) -> str:
    return f"{optimizer}{'-m' + str(momentum) if optimizer == 'sgd' else ''}-{layout}"


def settings_for(mode: str, variant: tuple, rank: int, world: int, port: int) -> Settings:
    optimizer, momentum, layout = variant
    # the parameter no forward uses: DDP (ddp, zero1) is told, as the kit's first-step check says; FSDP needs nothing
    return Settings(dataset="demo", arch="convnet", parallel=mode, world_size=world, rank=rank, master_port=port,
                    backend=BACKEND, init_timeout=60, optimizer=optimizer, momentum=momentum,
                    lr=0.2 if optimizer == "sgd" else 1e-3, channels_last=layout == "nhwc", amp="bf16",
                    find_unused_parameters=mode != "fsdp", epochs=2, warmup_epochs=0)


def build(settings, ctx):
    model = prepare_model(MatrixNet(), settings, ctx, log=lambda *_: None)
    optimizer = build_optimizer(model, settings, zero=settings.parallel == "zero1" and ctx.distributed)
    scheduler = build_scheduler(optimizer, settings, steps_per_epoch=4)
    scaler = make_scaler(torch.float16, ctx.device)   # the T4's scaler in the loop (enabled on CPU since torch 2.3)
    return model, optimizer, scheduler, scaler


def batches(seed: int, rank: int | None, steps: int):
    """``steps`` batches of 4; each rank its own (``rank``), or the same on every rank (None)."""
    generator = torch.Generator().manual_seed(seed * 100 + (rank if rank is not None else 99))
    for _ in range(steps):
        yield torch.randn(4, 3, IMAGE, IMAGE, generator=generator), torch.randint(0, CLASSES, (4,), generator=generator)


def train(model, optimizer, scheduler, scaler, settings, ctx, data, dtype=torch.bfloat16) -> None:
    stepper = ScaledStep(optimizer, scaler)
    for images, labels in data:
        images, labels = to_device(images, labels, settings, ctx.device)
        with autocast(dtype, ctx.device):
            loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        stepper()
        scheduler.step()


def next_step(model, optimizer, scheduler, scaler, settings, ctx) -> None:
    """The step after the checkpoint: one batch, the same on every rank, in fp32 (see the module's docstring)."""
    train(model, optimizer, scheduler, scaler, settings, ctx, batches(2, None, 1), dtype=None)


def whole(model, optimizer, ctx) -> dict:
    """What this rank holds, as a whole: its own copy (ddp, one process), or a sharded mode's pieces gathered onto
    every rank (collectives): the model and the optimizer state, on the CPU, in the checkpoint's format."""
    net = unwrap(model)
    if sharding.is_fsdp(net):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        every = StateDictOptions(full_state_dict=True, cpu_offload=False)   # whole tensors on every rank
        weights = get_model_state_dict(net, options=every)
        state = sharding._by_index(get_optimizer_state_dict(net, optimizer, options=every))
    elif hasattr(optimizer, "consolidate_state_dict"):   # ZeRO: each rank's share to each rank in turn
        weights, state = net.state_dict(), None
        for rank in range(ctx.world_size):
            optimizer.consolidate_state_dict(to=rank)
            if rank == ctx.rank:
                state = optimizer.state_dict()
        getattr(optimizer, "_all_state_dicts", []).clear()
    else:
        weights, state = net.state_dict(), optimizer.state_dict()
    return {"model": _cpu(weights), "optimizer": _cpu(state)}


def _cpu(value):
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def near(a, b, path: str = "") -> str | None:
    """Where nested states ``a`` and ``b`` first differ by more than STEP_RTOL of a tensor's norm (other values
    exactly), or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))} in one only"
        return next((d for k in a if (d := near(a[k], b[k], f"{path}/{k}"))), None)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point():
        gap, size = (a.float() - b.float()).norm().item(), b.float().norm().item()
        return None if a.shape == b.shape and gap <= STEP_RTOL * size + 1e-12 else f"{path}: {gap:.3g} off ({size:.3g})"
    return None if same(a, b) else f"{path}: {str(a)[:60]!r} != {str(b)[:60]!r}"


def kit_batches(settings, ctx, steps: int) -> list:
    """``steps`` batches of this rank's shard from the kit's own loader over the demo set in ``MATRIX_DATA`` (on a
    GPU: pinned memory, copied without blocking), for the GPU suite; None without MATRIX_DATA."""
    folder = os.environ.get("MATRIX_DATA")
    if not folder:
        return None
    from ddp_utils.data import build_loaders
    data = build_loaders(settings.replace(data_dir=folder, batch_size=4, workers=1), ctx.rank, ctx.world_size,
                         ctx.device)
    assert data.train.loader.pin_memory == (ctx.device.type == "cuda"), "a GPU run's loader pins its batches"
    return [batch for _, batch in zip(range(steps), data.train.epoch(0))]


def save(settings, ctx, folder: Path, variant: tuple) -> None:
    model, optimizer, scheduler, scaler = build(settings, ctx)
    data = kit_batches(settings, ctx, 2) or batches(1, ctx.rank, 2)   # each rank its own batches
    train(model, optimizer, scheduler, scaler, settings, ctx, data)
    run = folder / f"{ctx.world_size}-{settings.parallel}-{variant_name(*variant)}"
    if ctx.is_main:
        run.mkdir(parents=True, exist_ok=True)
    history = [{"epoch": 0, "val": {"acc1": 50.0}}]
    checkpoint.save_state(checkpoint.checkpoint_paths(run), types.SimpleNamespace(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, epoch=0, step=2, best_acc1=50.0,
        history=history, settings=settings, ctx=ctx, kept={}))
    next_step(model, optimizer, scheduler, scaler, settings, ctx)
    after = whole(model, optimizer, ctx)
    if ctx.is_main:
        torch.save(after, run / "after.pt")
    peers.wait_for_all("save the matrix's checkpoint", ctx, 60)


def resume(settings, ctx, source: Path) -> str:
    """One round trip: ``source``'s last.pt into ``settings.parallel`` on this many ranks; this rank's verdicts."""
    model, optimizer, scheduler, scaler = build(settings, ctx)
    state = checkpoint.load_state(source / "last.pt", ctx)
    sent = copy.deepcopy(state)
    checkpoint.restore(state, model, optimizer, scheduler, scaler, ctx)
    if os.environ.get("MATRIX_BREAK") and ctx.rank == 1:   # a restore gone wrong on rank 1 alone
        with torch.no_grad():
            next(unwrap(model).parameters()).add_(1e-3)
    unchanged = same(state, sent)
    held = whole(model, optimizer, ctx)
    equal = difference(held, {"model": sent["model"], "optimizer": sent["optimizer"]}) or True
    # mend_best's case: last.pt records its epoch as the best, best.pt was never written
    target = source / f"to-{settings.parallel}-{ctx.world_size}"
    if ctx.is_main:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        shutil.copy(source / "last.pt", target / "last.pt")
    mended = checkpoint.mend_best(state, target if ctx.is_main else None, ctx, 60)   # every rank waits for rank 0
    mended = mended if ctx.is_main else "-"
    next_step(model, optimizer, scheduler, scaler, settings, ctx)
    unchanged = unchanged and same(state, sent)   # training shares no tensor with it either
    stepped = near(whole(model, optimizer, ctx), reference(source)) or True
    checkpoint.save_state([target / "last.pt"], types.SimpleNamespace(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, epoch=1, step=3, best_acc1=50.0,
        history=state["history"], settings=settings, ctx=ctx, kept={}))
    peers.wait_for_all("save after the resume", ctx, 60)
    return f"rank={ctx.rank} built={built(model, optimizer, ctx)} input={unchanged} mended={mended} equal={equal} " \
           f"stepped={stepped}"


@functools.lru_cache(maxsize=None)
def reference(source: Path) -> dict:
    """``source``'s after.pt, read once per phase (every mode and rank count compares with it; nothing changes it)."""
    return torch.load(source / "after.pt", weights_only=True)


def built(model, optimizer, ctx) -> str:
    """What the round trip really ran: ``DDP``, ``DDP+ZeRO``, ``FSDP`` or ``none`` (one process), ``@`` its device."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    parts = (["FSDP"] if sharding.is_fsdp(unwrap(model)) else []) + (["DDP"] if ddp_of(model) is not None else []) \
        + (["ZeRO"] if isinstance(optimizer, ZeroRedundancyOptimizer) else [])
    return f"{'+'.join(parts) or 'none'}@{ctx.device}"


def main() -> None:
    optim.NHWC_DEVICES.add("cpu")   # the GPU's default layout, forced on this CPU (torch's CPU convolutions take it)
    phase, rank, world, port, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    ctx = distributed.setup(settings_for("ddp", VARIANTS[0], rank, world, port), log=lambda *_: None)
    for mode in modes():
        for variant in variants():
            settings = settings_for(mode, variant, rank, world, port)
            if phase == "save":
                save(settings, ctx, folder, variant)
                continue
            for source in sorted(folder.glob(f"*-{variant_name(*variant)}")):
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
    """Phase ``name`` of the matrix on ``world`` ranks (this module, run once per rank); every rank's lines."""
    port = free_port()
    results = run_all([python("-m", "tests.helpers.mode_matrix", name, str(rank), str(world), str(port), str(folder))
                       for rank in range(world)], timeout=LIMIT_S, env=env)
    for res in results:
        assert res.returncode == 0, describe(results)
    return [line for res in results for line in res.output.splitlines()]


def wrong(lines: list[str]) -> list[str]:
    """The round trips that failed, or whose verdict on some rank is not all good: rank 0 mended best.pt, the
    others wrote nothing, and every rank kept the input, held the file's state and stepped as the source mode."""
    bad = [line for line in lines if line.startswith("FAIL")]
    for line in lines:
        if line.startswith("CHECK "):
            rank = int(line.split(" rank=")[1].split()[0])
            if not line.endswith(f"input=True mended={'True' if rank == 0 else '-'} equal=True stepped=True"):
                bad.append(line)
    return bad


def built_wrong(lines: list[str]) -> list[str]:
    """The round trips that did not build what their mode is: DDP, DDP and ZeRO, FSDP on several ranks; nothing
    on one (the kit trains one process plainly)."""
    expected = {"ddp": "DDP", "zero1": "DDP+ZeRO", "fsdp": "FSDP"}
    bad = []
    for line in lines:
        if line.startswith("CHECK "):
            mode, world = line.split(" -> ")[1].split()[0].split("@")
            what = line.split(" built=")[1].split("@")[0]
            if what != (expected[mode] if int(world) > 1 else "none"):
                bad.append(line)
    return bad


def round_trips(lines: list[str]) -> dict[str, list[int]]:
    """``"<from> -> <mode>@<world>"``: the ranks that printed its verdict."""
    seen: dict[str, list[int]] = {}
    for line in lines:
        if line.startswith("CHECK "):
            name, verdicts = line[len("CHECK "):].split(" rank=")
            seen.setdefault(name, []).append(int(verdicts.split()[0]))
    return seen


if __name__ == "__main__":
    main()

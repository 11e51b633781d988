"""Per-rank code for tests/test_sharding.py: a checkpoint of a 2-rank run resumed on WORLD ranks, then gathered back.

    python -m tests.helpers.sharding_ranks MODE RANK WORLD PORT CHECKPOINT

Each rank makes what a resume makes with ``--parallel MODE`` (``prepare_model``: DDP for zero1, fully_shard for
fsdp; ``build_optimizer``, the schedule, the scaler), loads the checkpoint as ``fit`` does (``checkpoint.load_state``:
rank 0 reads it and sends it; ``checkpoint.restore``), and gathers the state back as the next save would
(``parallel.full_state``). Rank 0 prints ``CHECK weights=<equal to the file's, bit for bit>`` and ``CHECK
optimizer=<the optimizer state likewise>``; every rank prints ``CHECK held=<its optimizer state, bytes>`` and
``CHECK total=<the whole optimizer state, bytes>``.
"""
from __future__ import annotations

import sys

import torch

from ddp_utils import checkpoint, distributed, parallel
from ddp_utils.model import build_model, prepare_model, unwrap
from ddp_utils.optim import build_optimizer, build_scheduler, make_scaler
from ddp_utils.settings import Settings
from ddp_utils.speed import sharding


def same(a, b) -> bool:
    """Equal nested state: tensors bit for bit, everything else by ==."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    return a == b


def main() -> None:
    mode, rank, world, port, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    settings = Settings(dataset="demo", arch="convnet", parallel=mode, world_size=world, rank=rank, master_port=port,
                        backend="gloo", init_timeout=60)
    ctx = distributed.setup(settings, log=lambda *_: None)
    model = prepare_model(build_model(settings.arch, 10, settings.seed), settings, ctx, log=lambda *_: None)
    optimizer = build_optimizer(model, settings, zero=mode == "zero1")
    scheduler, scaler = build_scheduler(optimizer, settings, 10), make_scaler(None, ctx.device)
    state = checkpoint.load_state(path, ctx)
    checkpoint.restore(state, model, optimizer, scheduler, scaler, ctx)
    weights, optimizer_state = parallel.full_state(unwrap(model), optimizer, ctx)
    if ctx.is_main:
        saved = checkpoint.load_checkpoint(path)
        print(f"CHECK weights={same(weights, saved['model'])}", flush=True)
        print(f"CHECK optimizer={same(optimizer_state, saved['optimizer'])}", flush=True)
    held = sharding.held_bytes(unwrap(model), optimizer)["optimizer"]
    total = sum(t.numel() * t.element_size() for s in state["optimizer"]["state"].values() for t in s.values())
    print(f"CHECK held={held}", flush=True)
    print(f"CHECK total={total}", flush=True)
    distributed.teardown()


if __name__ == "__main__":
    main()

"""Per-rank code for tests/test_comm.py: train with one gradient communication hook, then print
what each rank ended with.

    python -m tests.helpers.comm_scenarios COMM RANK PORT RUN_DIR [EXTRA_SETTINGS_JSON [OVERFLOW_JSON]]

Prints ``CHECK weights=<sha256 of this rank's parameters>`` and ``CHECK comm=<choice>``.
``OVERFLOW_JSON`` ``{"at": [6]}`` or ``{"from": 6}``: the gradients of those training steps (counted from 0)
overflow, as fp16 gradients now and then do, while the loss stays finite (a layer whose backward
multiplies by inf, in front of the classifier); ``"in_a_row": 5``: the run stops after 5 skipped steps in a
row instead of concerns.SKIPPED_IN_A_ROW (fp16 on a CPU is slow: fewer steps).
"""
from __future__ import annotations

import hashlib
import json
import sys

import torch

from ddp_utils.distributed import teardown
from ddp_utils.job import prepare
from ddp_utils.model import unwrap
from ddp_utils.settings import Settings
from ddp_utils.train import fit


class Overflow(torch.autograd.Function):
    steps = 0              # backward passes so far (the run has no link probe: each is a training step)
    at, start = (), None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        step, Overflow.steps = Overflow.steps, Overflow.steps + 1
        bad = step in Overflow.at or (Overflow.start is not None and step >= Overflow.start)
        return grad * float("inf") if bad else grad


class OverflowLayer(torch.nn.Module):
    def forward(self, x):
        return Overflow.apply(x)


def with_overflow(spec: dict) -> None:
    from ddp_utils import job
    Overflow.at, Overflow.start = tuple(spec.get("at", ())), spec.get("from")
    if "in_a_row" in spec:
        from ddp_utils import concerns
        concerns.SKIPPED_IN_A_ROW = spec["in_a_row"]
    real = job.build_model

    def build_model(arch, classes, seed=None, image_size=0):
        model = real(arch, classes, seed, image_size)
        return torch.nn.Sequential(*model[:-1], OverflowLayer(), model[-1])
    job.build_model = build_model


def main() -> None:
    choice, rank, port, run_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    if len(sys.argv) > 6:
        with_overflow(json.loads(sys.argv[6]))
    settings = Settings(**{**dict(dataset="fake", image_size=32, arch="convnet_gn", workers=0, wandb="disabled",
                                  backend="gloo", init_timeout=60, progress="off", epochs=2, max_steps_per_epoch=8,
                                  batch_size=8, comm=choice, powersgd_warmup_steps=3, world_size=2, rank=rank,
                                  master_port=port, run_dir=run_dir), **extra})
    job = prepare(settings)
    try:
        with job:
            results = fit(job)
    except Exception as e:   # noqa: BLE001 - the test reads the message
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        sys.exit(2)
    digest = hashlib.sha256()
    for p in unwrap(job.model).parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    print(f"CHECK weights={digest.hexdigest()}", flush=True)
    print(f"CHECK comm={results['comm']}", flush=True)
    print(f"CHECK comm_s={results['comm_total_s']}", flush=True)
    print(f"CHECK loss={results['loss']}", flush=True)
    print(f"CHECK skipped_steps={results['skipped_steps']}", flush=True)
    teardown()


if __name__ == "__main__":
    main()

"""Per-rank code for tests/test_distributed.py's release test: after a failure, does tearing the group down free it?

    python -m tests.helpers.release_ranks MODE RANK WORLD PORT RELEASE

Joins a gloo group of WORLD ranks, places a small net in MODE (ddp, zero1, fsdp) with its optimizer, takes a step,
then keeps the model and the optimizer alive (as a notebook's traceback does after a failed cell), calls
``job.release_group`` when RELEASE is 1, tears the group down as ``Job.fail`` does, and prints ``FREED True`` when
the default process group object is gone, ``FREED False`` when something still holds it. The kit is imported
first, as in a notebook (ZeRO's module must be imported before the group exists: ddp_utils/optim.py).
"""
from __future__ import annotations

import gc
import sys
import weakref

import torch
import torch.distributed as dist

from ddp_utils import distributed
from ddp_utils.job import release_group
from ddp_utils.model import build_model, prepare_model
from ddp_utils.optim import build_optimizer
from ddp_utils.settings import Settings


def main() -> None:
    mode, rank, world, port, release = sys.argv[1], *map(int, sys.argv[2:6])
    settings = Settings(dataset="fake", arch="convnet", parallel=mode, world_size=world, rank=rank, master_port=port,
                        backend="gloo", init_timeout=60, optimizer="sgd", momentum=0.9, image_size=16)
    ctx = distributed.setup(settings, log=lambda *_: None)
    model = prepare_model(build_model("convnet", 10, 0, 16), settings, ctx, log=lambda *_: None)
    optimizer = build_optimizer(model, settings, zero=mode == "zero1")
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    group = weakref.ref(dist.group.WORLD)
    if release:
        release_group(model, optimizer)
    distributed.teardown(abort=True)
    gc.collect()
    print(f"FREED {group() is None}", flush=True)
    del model, optimizer   # (held until here, as a traceback would)


if __name__ == "__main__":
    main()

"""Per-rank code for tests/test_comm.py: train with one gradient communication hook, then print
what each rank ended with.

    python -m tests.comm_scenarios COMM RANK PORT RUN_DIR [EXTRA_SETTINGS_JSON]

Prints ``CHECK weights=<sha256 of this rank's parameters>`` and ``CHECK comm=<choice>``.
"""
from __future__ import annotations

import hashlib
import json
import sys

from ddp_utils.distributed import teardown
from ddp_utils.job import prepare
from ddp_utils.model import unwrap
from ddp_utils.settings import Settings
from ddp_utils.train import fit


def main() -> None:
    choice, rank, port, run_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    settings = Settings(dataset="fake", image_size=32, arch="convnet_gn", workers=0, wandb="disabled",
                        backend="gloo", init_timeout=60, progress="off", epochs=2, max_steps_per_epoch=8,
                        batch_size=8, comm=choice, powersgd_warmup_steps=3, world_size=2, rank=rank,
                        master_port=port, run_dir=run_dir, **extra)
    job = prepare(settings)
    with job:
        results = fit(job)
    digest = hashlib.sha256()
    for p in unwrap(job.model).parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    print(f"CHECK weights={digest.hexdigest()}", flush=True)
    print(f"CHECK comm={results['comm']}", flush=True)
    print(f"CHECK comm_s={results['comm_total_s']}", flush=True)
    print(f"CHECK loss={results['loss']}", flush=True)
    teardown()


if __name__ == "__main__":
    main()

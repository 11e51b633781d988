"""Per-rank code for tests/test_feed.py: two ranks train the demo data, one rank's loader made slow.

    python -m tests.helpers.feed_ranks RANK PORT RUN_DIR SLOW_RANK DATA_DIR [emulate]

``SLOW_RANK``'s loader sleeps 10 ms an image (in-process loading: a node whose CPUs cannot decode fast enough);
the other rank's is the kit's own. ``emulate``: ``feed.says`` answers as a GPU run's rank 0 does (the paragraph is
said on a CPU); without it the run is a real GPU's (two ranks sharing cuda:0 over gloo). Every line the run's
logger says is printed, prefixed ``SAID``.
"""
from __future__ import annotations

import sys
import time

from ddp_utils import datasets
from ddp_utils.job import prepare
from ddp_utils.settings import Settings
from ddp_utils.speed import feed
from ddp_utils.train import fit


def main(rank: int, port: int, run_dir: str, slow_rank: int, data_dir: str, emulate: bool) -> None:
    if rank == slow_rank:
        original = datasets.ImageFolderDataset.__getitem__

        def slow(self, index):
            time.sleep(0.01)
            return original(self, index)
        datasets.ImageFolderDataset.__getitem__ = slow
    if emulate:
        feed.says = lambda ctx: ctx.is_main
    settings = Settings(dataset="demo", data_dir=data_dir, loader="workers", workers=0, epochs=2, batch_size=16,
                        max_steps_per_epoch=30, wandb="disabled", progress="off", run_dir=run_dir, link_probe=False,
                        threads=1, world_size=2, rank=rank, master_port=port, backend="gloo", local_rank=0)
    with prepare(settings, log=lambda text: print(f"SAID {text}", flush=True)) as job:
        job.logger.info = lambda text, *a, **k: print(f"SAID {text}", flush=True)
        fit(job)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6:] == ["emulate"])

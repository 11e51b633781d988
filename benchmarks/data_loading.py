"""Benchmark: images/s of one epoch of training batches, workers loader vs the in-memory loader.

    python benchmarks/data_loading.py                      # demo train split, 7 alternating rounds
    python benchmarks/data_loading.py --dataset cinic10 --data-dir data/cinic10 --rounds 3

Each round iterates one full epoch (every batch made, augmented and normalised, nothing trained) with
the workers loader at --workers 0 and 2 and with ``--loader memory``, in rotating order so that drifts
in machine speed hit all alike; the median images/s of each is compared. The workers loaders start
their processes every epoch, as in training. The memory loader's one-time decode is timed apart.
Everything runs on the CPU, in this process, with --threads intra-op threads.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_utils.data import build_loaders  # noqa: E402
from ddp_utils.demo_data import prepare_demo  # noqa: E402
from ddp_utils.runlog import cpu_name  # noqa: E402
from ddp_utils.settings import Settings  # noqa: E402
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)


def epoch_images_per_s(loader, epoch: int) -> float:
    t = time.perf_counter()
    n = sum(len(labels) for _, labels in loader.epoch(epoch))
    return n / (time.perf_counter() - t)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="demo", choices=("demo", "cinic10"))
    p.add_argument("--data-dir", default="data/demo")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    add_out(p, "data_loading")
    args = p.parse_args()
    recorder = Recorder("data_loading", args)
    torch.set_num_threads(args.threads)
    if args.dataset == "demo":
        prepare_demo(args.data_dir)
    base = Settings(dataset=args.dataset, data_dir=args.data_dir, batch_size=args.batch_size, wandb="disabled")

    loaders = {}
    for name, changes in (("workers 0", dict(workers=0)), ("workers 2", dict(workers=2)),
                          ("memory", dict(loader="memory", workers=2))):
        t = time.perf_counter()
        loaders[name] = build_loaders(base.replace(**changes), 0, 1, "cpu").train
        if name == "memory":
            decode_s = time.perf_counter() - t   # includes check_data, as the workers loaders' builds do
    images = len(loaders["memory"]) * args.batch_size

    rates = {name: [] for name in loaders}
    names = list(loaders)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:   # rotate who goes first
            rates[name].append(epoch_images_per_s(loaders[name], r))
    median = {name: statistics.median(v) for name, v in rates.items()}

    print(f"{args.dataset} train split, {images} images per epoch in batches of {args.batch_size}; "
          f"{cpu_name()}, {os.cpu_count()} cores, {args.threads} thread(s), torch {torch.__version__}; "
          f"median of {args.rounds} rounds")
    for name, value in median.items():
        print(f"  {name:9s} {value:10.0f} img/s   (rounds: {', '.join(f'{v:.0f}' for v in rates[name])})")
    print(f"  memory / workers 0 = {median['memory'] / median['workers 0']:.1f}x, "
          f"memory / workers 2 = {median['memory'] / median['workers 2']:.1f}x; "
          f"memory loader's one-time build (check + decode of train and valid): {decode_s:.2f} s")
    label = {"workers 0": "`--loader workers --workers 0`",
             "workers 2": "`--loader workers --workers 2` (processes restarted each epoch, as in training)",
             "memory": f"`--loader memory` (decoded once: {decode_s:.2f} s for train and valid)"}
    table = ["| loader | images/s | `memory` / this |", "| --- | ---: | ---: |"]
    table += [f"| {label[name]} | {value:,.0f} | "
              f"{'-' if name == 'memory' else format(median['memory'] / value, '.1f') + 'x'} |"
              for name, value in median.items()]
    recorder.save({"images": images, "images_per_s": median, "rounds": rates, "decode_s": decode_s,
                   "memory_over": {name: median["memory"] / value for name, value in median.items()}}, table)


if __name__ == "__main__":
    main()

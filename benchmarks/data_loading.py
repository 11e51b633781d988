"""Benchmark: images/s of one epoch of training batches, workers loader vs the in-memory loader.

    python benchmarks/data_loading.py                      # demo train split, 5 alternating rounds
    python benchmarks/data_loading.py --dataset cinic10 --data-dir data/cinic10 --rounds 3

Each round takes a steady window of batches (benchmarks/steady.py: --steps batches, every one made, augmented
and normalised, nothing trained, timed after the batches the loader made ahead) with the workers loader at
--workers 0 and 2 and with ``--loader memory``, in rotating order so that drifts in machine speed hit all alike;
the median images/s of each is compared. A window longer than an epoch goes on into the next one, where the
workers loaders start their processes again, as in training. The memory loader's one-time decode is timed apart.
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
from steady import MIN_STEPS, stream, time_steady, warm_batches  # noqa: E402  (benchmarks/steady.py)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="demo", choices=("demo", "cinic10"))
    p.add_argument("--data-dir", default="data/demo")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=MIN_STEPS, help="timed batches of each loader in each round")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    add_out(p, "data_loading")
    args = p.parse_args()
    recorder = Recorder("data_loading", args)
    torch.set_num_threads(args.threads)
    if args.dataset == "demo":
        prepare_demo(args.data_dir)
    base = Settings(dataset=args.dataset, data_dir=args.data_dir, batch_size=args.batch_size, wandb="disabled")

    loaders, warm = {}, {}
    for name, changes in (("workers 0", dict(workers=0)), ("workers 2", dict(workers=2)),
                          ("memory", dict(loader="memory", workers=2))):
        t = time.perf_counter()
        loaders[name] = build_loaders(base.replace(**changes), 0, 1, "cpu").train
        # the memory loader batches in this process: no batches made ahead, whatever --workers says
        warm[name] = warm_batches(0 if name == "memory" else changes["workers"])
        if name == "memory":
            decode_s = time.perf_counter() - t   # includes check_data, as the workers loaders' builds do
    images = len(loaders["memory"]) * args.batch_size

    rates = {name: [] for name in loaders}
    names = list(loaders)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:   # rotate who goes first
            window = time_steady(stream(loaders[name], r * 1000), warm[name], args.steps)
            rates[name].append(window["images"] / window["seconds"])
    median = {name: statistics.median(v) for name, v in rates.items()}

    print(f"{args.dataset} train split, {images} images per epoch in batches of {args.batch_size}, {args.steps} "
          f"batches timed after those made ahead ({warm}); "
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
                   "memory_over": {name: median["memory"] / value for name, value in median.items()}, "warm": warm}, table,
                  steady_after_batches=max(warm.values()), steady_steps=args.steps)


if __name__ == "__main__":
    main()

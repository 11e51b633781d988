"""Benchmark: a kit loader alone, no training: how many images/s it hands over, and how long the training process
spends inside the loader per batch (its own time, which a training step cannot overlap).

    python benchmarks/loader_alone.py --data-dir data/student-job/imagenet --loader nvjpeg --workers 3
    taskset -c 0-3 python benchmarks/loader_alone.py ...   # on 4 cores, as student_job.py pins the kit's runs

One epoch of ``--batches`` batches of ``--batch-size`` from ``build_loaders`` (the kit's own loaders, on the GPU when
there is one), the first batch apart (workers starting, nvJPEG's set-up). Prints one JSON line; writes nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_utils.data import build_loaders  # noqa: E402
from ddp_utils.settings import Settings  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="a folder in ImageNet's layout (train/<wnid>/, val/<wnid>/)")
    p.add_argument("--loader", default="nvjpeg", help="the kit's --loader")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=24)
    args = p.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    settings = Settings(dataset="imagenet", data_dir=args.data_dir, loader=args.loader, workers=args.workers,
                        batch_size=args.batch_size, max_steps_per_epoch=args.batches + 1)
    data = build_loaders(settings, 0, 1, device)
    inside, count = 0.0, 0
    batches = iter(data.train.epoch(0))
    start = time.perf_counter()
    next(batches)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.batches):
        t = time.perf_counter()
        images, _ = next(batches)
        inside += time.perf_counter() - t
        count += len(images)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(json.dumps({"loader": args.loader, "workers": args.workers, "device": str(device), "batch": args.batch_size,
                      "first_batch_s": round(first, 2), "images": count, "img_s": round(count / seconds),
                      "inside_ms_per_batch": round(1000 * inside / args.batches, 1)}), flush=True)


if __name__ == "__main__":
    main()

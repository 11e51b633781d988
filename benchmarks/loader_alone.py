"""Benchmark: a kit loader alone, no training: how many images/s it hands over, and how long the training process
spends inside the loader per batch (its own time, which a training step cannot overlap).

    python benchmarks/loader_alone.py --data-dir data/student-job/imagenet   # after student_job.py made the folder

For each of ``--loaders`` and ``--cores``: one process pinned to the first N CPUs (``taskset -c``, as student_job.py
pins the kit's runs) with N - 1 workers takes ``--batches`` batches of ``--batch-size`` from ``build_loaders`` (the
kit's own loaders, on the GPU when there is one) in a steady window (benchmarks/steady.py: timed after the
batches its workers made ahead, N - 1 x 2 + 1; the first batch, workers starting and nvJPEG's set-up, timed
apart), and prints one JSON line; the figures go to benchmarks/results/loader_alone.json (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)
from steady import MIN_STEPS, stream, time_steady, warm_batches  # noqa: E402  (benchmarks/steady.py)
from ddp_utils.data import build_loaders  # noqa: E402
from ddp_utils.settings import Settings  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="a folder in ImageNet's layout (train/<wnid>/, val/<wnid>/)")
    p.add_argument("--loaders", default="nvjpeg,workers", help="the kit's --loader values")
    p.add_argument("--cores", default="4,16", help="CPU counts each loader's process is pinned to")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=MIN_STEPS, help="batches timed, after those made ahead")
    p.add_argument("--one", nargs=2, metavar=("LOADER", "WORKERS"), help=argparse.SUPPRESS)   # a child's part
    add_out(p, "loader_alone")
    args = p.parse_args()
    if args.one:
        one(args, args.one[0], int(args.one[1]))
        return 0
    record, figures, rows = Recorder("loader_alone", args), {}, []
    cpus = sorted(os.sched_getaffinity(0))
    for loader in args.loaders.split(","):
        for cores in map(int, args.cores.split(",")):
            if cores > len(cpus):
                print(f"{loader} on {cores} cores: skipped, {len(cpus)} CPUs here", flush=True)
                continue
            taskset = shutil.which("taskset")
            pin = [taskset, "-c", ",".join(map(str, cpus[:cores]))] if taskset else []
            argv = [*pin, sys.executable, __file__, *sys.argv[1:], "--one", loader, str(max(1, cores - 1))]   # as asked
            out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                print(out.stdout + out.stderr, flush=True)
                return 1
            r = {**json.loads(out.stdout.strip().splitlines()[-1]), "cores": cores}
            print(json.dumps(r), flush=True)
            figures[f"{loader}-{cores}"] = r
            rows.append(f"| `--loader {loader}` | {cores} | {r['workers']} | {r['img_s']:,} | "
                        f"{r['inside_ms_per_batch']} | {r['first_batch_s']} |")
    record.save(figures, ["| loader | cores | workers | images/s handed over | training process's ms per batch "
                          "inside the loader | first batch (s) |", "| --- | ---: | ---: | ---: | ---: | ---: |", *rows],
                steady_after_batches=max((r["steady_after_batches"] for r in figures.values()), default=0),
                steady_steps=args.batches)
    return 0


def one(args, loader: str, workers: int) -> None:
    """One loader in this process: its JSON line on stdout."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    settings = Settings(dataset="imagenet", data_dir=args.data_dir, loader=loader, workers=workers,
                        batch_size=args.batch_size)
    data = build_loaders(settings, 0, 1, device)
    batches = stream(data.train)   # into the next epoch if the folder holds fewer batches than the window
    start = time.perf_counter()
    next(batches)
    first = time.perf_counter() - start
    warm = warm_batches(workers)
    window = time_steady(batches, warm - 1, args.batches)   # the first batch was one of the warm ones
    if device.type == "cuda":   # the GPU's decode of the last batches, still queued, belongs to the window
        start = time.perf_counter()
        torch.cuda.synchronize()
        window["seconds"] += time.perf_counter() - start
    print(json.dumps({"loader": loader, "workers": workers, "device": str(device), "batch": args.batch_size,
                      "first_batch_s": round(first, 2), "images": window["images"],
                      "img_s": round(window["images"] / window["seconds"]),
                      "inside_ms_per_batch": round(1000 * window["inside_s"] / args.batches, 1),
                      "steady_after_batches": warm, "steady_steps": args.batches}), flush=True)


if __name__ == "__main__":
    sys.exit(main())

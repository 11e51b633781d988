"""Benchmark: what batching uint8 crops costs when every batch goes to fresh memory, against memory reused.

    python benchmarks/batch_memory.py                  # 5 rounds of 200 batches a way and size
    python benchmarks/batch_memory.py --rounds 1 --steps 20 --allow-dirty --out /tmp/t.json   # a trial

The kit's `--loader workers` path hands the training process uint8 batches of 224-px crops (3 x 224 x 224 bytes an
image). A DataLoader worker's default collate stacks them into a **fresh shared-memory segment** per batch (one
the training process then maps), and `torch.stack` outside a worker into fresh private memory; a fresh mapping's
pages are zeroed by the kernel on first touch. This times, per image, one thread stacking a batch of crops made
beforehand three ways:

  fresh shared     what a DataLoader worker does (torch's collate_tensor_fn: a new shared storage, then stack)
  fresh private    torch.stack into a new tensor (the in-process loader; above glibc's mmap threshold, at most
                   32 MB, a new mapping each time)
  reused           torch.stack into one tensor kept from batch to batch (out=): the floor, no new memory

at each of --batch-sizes (16: imagenet_input.py's batch; 256: the ImageNet recipe's; 500: the course's), each way
and size once a round, in rotating order, over --steps batches (200: a steady window). The figures are the medians
over rounds with their lowest-highest round, and the extra cost of each fresh way over reused as a share of the
kit's whole per-image time in benchmarks/results/imagenet_input.json (decode, crop-resize and batching on one core),
so the lever is sized against the path it would speed up. Only the worker's side is timed: the training process
mapping the segment and reading it (pinning, the copy to the GPU) costs again, and is not measured here. Run it on
an idle machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results import RESULTS, Recorder, add_out  # noqa: E402  (benchmarks/results.py)
from steady import MIN_STEPS  # noqa: E402  (benchmarks/steady.py)

CROP = (3, 224, 224)   # one uint8 crop as the kit's workers send it
WAYS = ("fresh shared", "fresh private", "reused")


def stack_fresh_shared(crops: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """As a DataLoader worker's collate: a new shared-memory storage a batch, the crops stacked into it."""
    storage = crops[0]._typed_storage()._new_shared(sum(c.numel() for c in crops), device=crops[0].device)
    batch = crops[0].new(storage).resize_(len(crops), *crops[0].shape)
    return torch.stack(crops, 0, out=batch)


def stack_fresh_private(crops: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    return torch.stack(crops, 0)


def stack_reused(crops: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    return torch.stack(crops, 0, out=out)


STACK = {"fresh shared": stack_fresh_shared, "fresh private": stack_fresh_private, "reused": stack_reused}


def time_way(way: str, crops: list[torch.Tensor], steps: int) -> float:
    """Milliseconds an image over ``steps`` batches (each batch dropped before the next, as a loader's consumer
    does); the first batch, the warm-up, untimed."""
    out = torch.empty(len(crops), *CROP, dtype=torch.uint8)
    STACK[way](crops, out)
    start = time.perf_counter()
    for _ in range(steps):
        batch = STACK[way](crops, out)
        del batch
    return 1000 * (time.perf_counter() - start) / (steps * len(crops))


def kit_ms_per_image() -> float | None:
    """The kit's `--loader workers` path per image on one core, from imagenet_input.json (None without it)."""
    path = RESULTS / "imagenet_input.json"
    return json.loads(path.read_text(encoding="utf-8"))["figures"]["ms"]["kit workers"] if path.exists() else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="16,256,500", help="images a batch (default 16,256,500)")
    p.add_argument("--steps", type=int, default=MIN_STEPS, help=f"batches timed a way, size and round "
                                                               f"(default {MIN_STEPS})")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    add_out(p, "batch_memory")
    args = p.parse_args()
    torch.set_num_threads(1)   # one worker's thread, as in the kit's DataLoader workers
    record = Recorder("batch_memory", args)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    g = torch.Generator().manual_seed(0)
    crops = {b: [torch.randint(0, 256, CROP, dtype=torch.uint8, generator=g) for _ in range(b)] for b in sizes}
    ms = {b: {w: [] for w in WAYS} for b in sizes}
    for r in range(args.rounds):
        for way in WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]:   # a rotating order
            for b in sizes:
                ms[b][way].append(time_way(way, crops[b], args.steps))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    kit = kit_ms_per_image()
    figures, table = {"kit_ms_per_image": kit, "sizes": {}}, [
        "| batch | MB a batch | way | ms an image | over reused (ms an image) | over reused, of the kit's path |",
        "| ---: | ---: | --- | ---: | ---: | ---: |"]
    for b in sizes:
        floor = statistics.median(ms[b]["reused"])
        figures["sizes"][str(b)] = row = {"mb": b * torch.Size(CROP).numel() / 1e6}
        for way in WAYS:
            med = statistics.median(ms[b][way])
            extra = med - floor
            row[way] = {"ms": med, "low": min(ms[b][way]), "high": max(ms[b][way]), "rounds": ms[b][way],
                        "extra_ms": extra, "extra_of_kit": extra / kit if kit else None}
            share = f"{100 * extra / kit:.1f} %" if kit and way != "reused" else "-"
            table.append(f"| {b} | {row['mb']:.1f} | {way} | {med:.4f} ({min(ms[b][way]):.4f}-"
                         f"{max(ms[b][way]):.4f}) | {extra if way != 'reused' else 0:+.4f} | {share} |")
    print("\n".join(table))
    record.save(figures=figures, table=table, steady_steps=args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

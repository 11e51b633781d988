"""Benchmark: the kit's training loop against a bare hand-written PyTorch loop, and 2 ranks against 1.

    python benchmarks/loop_overhead.py              # both parts, figures as ratios measured in one run
    python benchmarks/loop_overhead.py --part loop  # only kit vs bare loop

Part 1 (loop): the same model, the same batches (pre-made tensors in memory, so data loading is
out of the picture), the same threads; kit and bare loops alternate for several rounds and the
median images/s of each is compared. Target: the kit at most 2 % slower than the bare loop (kit / bare >= 0.98).
Part 2 (scaling): ``python -m ddp_utils train`` on the demo set with 2 ranks on loopback and with
1 process, one thread per rank; global training images/s from each run's results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_utils import optim, train  # noqa: E402
from ddp_utils.job import prepare  # noqa: E402
from ddp_utils.model import build_model  # noqa: E402
from ddp_utils.observers import Loop  # noqa: E402
from ddp_utils.settings import Settings  # noqa: E402
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)


class InMemoryLoader:
    """The EpochLoader interface over a fixed list of batches."""

    def __init__(self, batches):
        self.batches = batches

    def epoch(self, epoch):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


class InMemoryData:
    def __init__(self, batches):
        self.train = InMemoryLoader(batches)


def bare_epoch(model, batches, optimizer, scheduler) -> float:
    """What a student writes by hand. Returns images/s."""
    model.train()
    t = time.perf_counter()
    for images, labels in batches:
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
    return sum(len(y) for _, y in batches) / (time.perf_counter() - t)


def kit_epoch(model, data, optimizer, scheduler, scaler, job) -> float:
    loop = Loop(model, data, optimizer, scheduler, scaler, job.settings, job.ctx, job.logger)
    stats = train.train_one_epoch(loop, 0)
    return stats["images_per_s"]


def part_loop(rounds: int, steps: int, batch: int, arch: str, threads: int) -> dict:
    settings = Settings(dataset="fake", image_size=32, arch=arch, batch_size=batch, epochs=1, log_every=20,
                        workers=0, wandb="disabled", progress="off", threads=threads,
                        run_dir=tempfile.mkdtemp(prefix="loop_overhead-"))
    job = prepare(settings, log=lambda *_: None)   # the kit's context, threads and logger, as in a real run
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
               for _ in range(steps)]
    data = InMemoryData(batches)

    def fresh():
        torch.manual_seed(0)
        model = build_model(arch, 10)
        opt = optim.build_optimizer(model, settings)
        return model, opt, optim.build_scheduler(opt, settings, steps)

    bare, kit = [], []
    for _ in range(rounds):            # alternate so drifts in machine speed hit both alike
        model, opt, sched = fresh()
        bare.append(bare_epoch(model, batches, opt, sched))
        model, opt, sched = fresh()
        kit.append(kit_epoch(model, data, opt, sched, optim.make_scaler(None, job.ctx.device), job))
    job.logger.close()
    b, k = statistics.median(bare), statistics.median(kit)
    return {"bare_images_per_s": b, "kit_images_per_s": k, "kit_over_bare": k / b,
            "rounds": rounds, "steps": steps, "batch": batch, "arch": arch, "threads": threads}


def part_scaling(epochs: int) -> dict:
    """The demo's two runs (same flags as ``python -m ddp_utils demo``), 2 ranks and then 1."""
    from ddp_utils.tools.demo import free_port, launch, train_cmd
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ws in (2, 1):
            port = free_port()
            launch([train_cmd(Path(tmp, f"ws{ws}"), epochs, r, ws, port) for r in range(ws)], timeout=900,
                   quiet=True)
            out[ws] = json.loads(Path(tmp, f"ws{ws}", "results.json").read_text())
    return {"images_per_s_2_ranks": out[2]["images_per_s"], "images_per_s_1_rank": out[1]["images_per_s"],
            "speedup": out[2]["images_per_s"] / out[1]["images_per_s"],
            "acc1_2_ranks": out[2]["acc1"], "acc1_1_rank": out[1]["acc1"], "epochs": epochs}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("loop", "scaling", "all"), default="all")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--arch", default="convnet")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, default=4, help="epochs of the scaling runs")
    add_out(p, "loop_overhead")
    args = p.parse_args()
    recorder, figures = Recorder("loop_overhead", args), {}
    cpu = f"{os.cpu_count()} CPU cores, torch {torch.__version__}"
    if args.part in ("loop", "all"):
        r = figures["loop"] = part_loop(args.rounds, args.steps, args.batch, args.arch, args.threads)
        print(f"loop ({cpu}; {r['arch']}, batch {r['batch']}, {r['steps']} steps x {r['rounds']} rounds, "
              f"{r['threads']} thread): bare {r['bare_images_per_s']:.0f} img/s, kit {r['kit_images_per_s']:.0f} "
              f"img/s, kit/bare = {r['kit_over_bare']:.3f}")
    if args.part in ("scaling", "all"):
        from ddp_utils.demo_data import prepare_demo
        prepare_demo("data/demo")
        r = figures["scaling"] = part_scaling(args.epochs)
        print(f"scaling ({cpu}; demo set, convnet, batch 32 per rank, {r['epochs']} epochs, gloo on loopback): "
              f"1 rank {r['images_per_s_1_rank']:.0f} img/s, 2 ranks {r['images_per_s_2_ranks']:.0f} img/s, "
              f"speed-up {r['speedup']:.2f}x; Acc@1 {r['acc1_1_rank']:.1f} vs {r['acc1_2_ranks']:.1f}")
    recorder.save(figures)


if __name__ == "__main__":
    main()

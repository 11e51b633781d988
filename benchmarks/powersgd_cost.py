"""What PowerSGD's own arithmetic costs per step, with no network: one process, world size 1.

    python benchmarks/powersgd_cost.py                  # ResNet-18, 32 px, batch 64, 1 thread, gloo
    python benchmarks/powersgd_cost.py --rounds 3

With one rank every all-reduce returns at once, so a step with a communication hook costs the step
without it plus the hook's own work: for PowerSGD, adding the error feedback into the gradients,
copying them, the low-rank products and orthogonalisation, writing the approximation back and
computing the new error (several passes over the 45 MB of ResNet-18's gradients). That work runs on
the device that trains: a few passes over memory on a GPU, a noticeable share of a step on one CPU
thread, and it is the share ``comm=powersgd`` cannot win back however fast the link. The hooks
alternate for ``--rounds`` rounds; medians of the steps after the warm-up. Take the figures on an
idle machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_utils.settings import Settings  # noqa: E402
from tests.helpers.procs import free_port  # noqa: E402
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)

WARMUP = 2     # exact steps before PowerSGD compresses (DDP rebuilds its buckets after the first)


def step_times(hook, state, steps: int, batch: int) -> list[float]:
    torch.manual_seed(0)
    model = DDP(torchvision.models.resnet18(num_classes=10), gradient_as_bucket_view=True)
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images, labels = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times[WARMUP + 2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--steps", type=int, default=16, help="steps per hook and round (default 16)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    add_out(parser, "powersgd_cost")
    args = parser.parse_args()
    recorder = Recorder("powersgd_cost", args)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)

    def psgd(rank: int):
        return powerSGD_hook.powerSGD_hook, powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=rank, start_powerSGD_iter=WARMUP, use_error_feedback=True,
            warm_start=True)

    kit = Settings().powersgd_rank
    hooks = {"fp32 all-reduce (DDP's default)": lambda: (default_hooks.allreduce_hook, None)}
    for rank in (1, 2, 4):
        hooks[f"PowerSGD rank {rank}{' (the kit default)' if rank == kit else ''}"] = lambda rank=rank: psgd(rank)
    times: dict[str, list[float]] = {name: [] for name in hooks}
    for _ in range(args.rounds):
        for name, make in hooks.items():
            times[name] += step_times(*make(), args.steps, args.batch)
    dist.destroy_process_group()
    base = statistics.median(times[next(iter(hooks))])
    print(f"torchvision ResNet-18 at 32 px, batch {args.batch}, 1 thread, world size 1 (no network); "
          f"median of {args.rounds} alternating rounds\n")
    table = ["| communication hook | ms per step | hook's own work (ms) | of the step without it |",
             "| --- | ---: | ---: | ---: |"]
    hooks_ms = {}
    for name, values in times.items():
        median = statistics.median(values)
        extra = median - base
        hooks_ms[name] = {"ms": 1000 * median, "extra_ms": 1000 * extra, "extra_pct": 100 * extra / base}
        table.append(f"| {name} | {1000 * median:.0f} | {1000 * extra:+.0f} | {100 * extra / base:+.0f} % |")
    print("\n".join(table))
    recorder.save({"base_ms": 1000 * base, "hooks": hooks_ms,
                   "kit": hooks_ms[next(name for name in hooks_ms if "kit default" in name)]}, table)


if __name__ == "__main__":
    main()

"""Per-rank code for tests/test_cli.py: check's all-reduce sweep when one rank's sums come out wrong.

    python -m tests.helpers.sweep_ranks RANK PORT

Two gloo ranks run ``sweep.run`` up to 1 MiB; rank 1's all-reduce of the 64 KiB payload hands back wrong numbers
(a faulty link or device, played by adding 1 after the real sum). Prints ``CHECK error=<what sweep.run raised on
this rank>`` (or null) and ``CHECK seconds=<how long it took>``.
"""
from __future__ import annotations

import json
import sys
import time
import types
from datetime import timedelta

import torch
import torch.distributed as dist

from ddp_utils.tools import sweep

WRONG_NUMEL = (64 << 10) // 4


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    if rank == 1:
        real = dist.all_reduce

        def wrong_sums(tensor, op=dist.ReduceOp.SUM, **kwargs):
            work = real(tensor, op=op, **kwargs)
            if op == dist.ReduceOp.SUM and tensor.numel() == WRONG_NUMEL:
                tensor.add_(1)
            return work
        dist.all_reduce = wrong_sums
    ctx = types.SimpleNamespace(rank=rank, world_size=2, device=torch.device("cpu"))
    start, error = time.monotonic(), None
    try:
        sweep.run(ctx, 1 << 20)
    except Exception as e:   # noqa: BLE001 - the test reads it
        error = f"{type(e).__name__}: {e}"
    print(f"CHECK error={json.dumps(error)}", flush=True)
    print(f"CHECK seconds={time.monotonic() - start:.1f}", flush=True)
    time.sleep(2)   # still here while the other rank finishes: an early exit would end its wait by a reset
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

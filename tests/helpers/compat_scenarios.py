"""Per-rank code for tests/test_compat.py's two-process tests of the collective timeout.

    python -m tests.helpers.compat_scenarios NAME RANK PORT

Each scenario prints ``CHECK name=value`` lines (JSON values): how long rank 0's all_reduce waited for a rank 1
that comes late, and whether it failed.
"""
from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def check(name: str, value) -> None:
    print(f"CHECK {name}={json.dumps(value)}", flush=True)


def late_all_reduce(rank: int, late_by: float) -> None:
    """Rank 1 joins rank 0's all_reduce ``late_by`` seconds late; rank 0 says how long it waited and how it ended."""
    if rank == 1:
        time.sleep(late_by)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        failed = False
    except RuntimeError:   # gloo's timeout, or rank 0's side closing
        failed = True
    if rank == 0:
        check("waited", round(time.monotonic() - start, 1))
        check("failed", failed)


def gloo_timeout(rank: int, port: int) -> None:
    """Plain torch: a group made with 30 s, then set to 2 s the way the kit does (compat.set_collective_timeout)."""
    from ddp_utils.robust import compat
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    dist.barrier()
    c10d = dist.distributed_c10d
    (c10d.set_timeout if hasattr(c10d, "set_timeout") else c10d._set_pg_timeout)(timedelta(seconds=2))
    check("compat_says", compat.timeout_changes_after_init("gloo"))
    late_all_reduce(rank, 6.0)


def kit_timeout(rank: int, port: int) -> None:
    """The kit's setup with collective_timeout=3 (init_timeout 30): whatever this torch allows, 3 s must hold."""
    from ddp_utils import collectives, distributed
    from ddp_utils.settings import Settings
    settings = Settings(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, backend="gloo",
                        init_timeout=30, collective_timeout=3, workers=0)
    distributed.setup(settings)
    collectives.barrier(distributed._active[1])
    late_all_reduce(rank, 8.0)


def setup_teardown_cycles(rank: int, port: int) -> None:
    """Join, agree (a collective), leave at once, 15 times: a notebook's setup cell run again and again. On torch
    2.6 destroying the gloo group right after a collective could deadlock on the GIL (robust/compat.py)."""
    from ddp_utils import collectives, distributed
    from ddp_utils.settings import Settings
    settings = Settings(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, backend="gloo",
                        init_timeout=30, workers=0)
    for cycle in range(15):
        ctx = distributed.setup(settings.replace(epochs=cycle + 1), log=lambda *_: None)
        collectives.agree({"cycle": cycle}, ctx)
        distributed.teardown()
    check("cycles", 15)


if __name__ == "__main__":
    name, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    {"gloo_timeout": gloo_timeout, "kit_timeout": kit_timeout, "cycles": setup_teardown_cycles}[name](rank, port)

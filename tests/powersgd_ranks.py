"""Per-rank code for tests/test_powersgd.py: PowerSGD's memory saved and resumed by three real ranks.

    python -m tests.powersgd_ranks RANK PORT FOLDER

Each rank trains tests.test_powersgd.Run on data of its own (so the ranks' error feedback differs) for 7 steps;
rank 0 writes its checkpoint, every rank resumes from it through ``checkpoint.load_state``. Prints
``CHECK own=<the resumed memory holds the error feedback this rank saved>`` and
``CHECK errors_received=<what load_state's broadcast gave this rank of every rank's error feedback>``.
(Not the weights after more steps: at 3 ranks the resumed run's first step groups DDP's buckets otherwise, and a
ring all-reduce adds 3 numbers in an order that depends on a bucket's size: the last bits differ.)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_utils import checkpoint, distributed
from ddp_utils.settings import Settings
from tests.test_powersgd import Run, batches

STOP = 7


def no_point_to_point(*args, **kwargs):
    raise AssertionError("PowerSGD's memory moved by send/recv: on NCCL that builds a communicator per pair of ranks "
                         "(issue 37, finding 10)")


def main() -> None:
    rank, port, folder = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    dist.send = dist.recv = no_point_to_point   # only collectives on the group every rank shares
    ctx = distributed.setup(Settings(dataset="fake", backend="gloo", world_size=3, rank=rank, master_port=port,
                                     init_timeout=60))
    data = batches("cpu")[rank:STOP + rank]   # each rank's own
    first = Run("cpu", "gloo")
    first.steps(data)
    pieces = first.memory.by_parameter()
    saved = first.memory.state_dict(ctx)
    mine = torch.cat([pieces[name]["error"].view(-1) for name in saved["names"]])   # a collective: rank 0 collects the others' error feedback
    path = folder / "last.pt"
    if ctx.is_main:
        checkpoint.save_checkpoint(path, {"model": first.weights(), "optimizer": first.optimizer.state_dict(),
                                          "comm": {"choice": "powersgd", "powersgd": saved}})
    state = checkpoint.load_state(path, ctx)
    received = state["comm"]["powersgd"]["errors"]
    print(f"CHECK errors_received={received if isinstance(received, int) else f'{len(received)} tensors'}",
          flush=True)
    again = Run("cpu", "gloo", weights=state["model"], optimizer=state["optimizer"])
    again.memory.load_state_dict(state["comm"]["powersgd"], ctx)
    loaded = torch.cat([again.memory.store[name]["error"].view(-1) for name in saved["names"]])
    print(f"CHECK own={torch.equal(loaded, mine)}", flush=True)
    distributed.teardown()


if __name__ == "__main__":
    main()

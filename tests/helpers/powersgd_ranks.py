"""Per-rank code for tests/test_powersgd.py: PowerSGD's memory saved and resumed by three real ranks.

    python -m tests.helpers.powersgd_ranks RANK PORT FOLDER

Each rank trains ``Run`` (below; tests/test_powersgd.py's too) on data of its own (so the ranks' error feedback differs) for 7 steps;
rank 0 writes its checkpoint, every rank resumes from it through ``checkpoint.load_state``. Prints
``CHECK own=<the resumed memory holds the error feedback this rank saved>`` and
``CHECK errors_received=<what load_state's broadcast gave this rank of every rank's error feedback>``.
(Not the weights after more steps: at 3 ranks the resumed run's first step groups DDP's buckets otherwise, and a
ring all-reduce adds 3 numbers in an order that depends on a bucket's size: the last bits differ.)
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_utils import checkpoint, distributed
from ddp_utils.settings import Settings
from ddp_utils.speed import comm

STOP = 7


class Net(nn.Module):
    """The head is registered first and used last: DDP's first grouping of buckets (by registration)
    differs from the one it regroups to after the first backward pass (by the order gradients are ready)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(32, 10)
        self.fc = nn.Linear(16 * 4 * 4, 32)
        self.convs = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.ReLU(), nn.Flatten())

    def forward(self, x):
        return self.head(torch.relu(self.fc(self.convs(x))))


SETTINGS = Settings(dataset="fake", comm="powersgd", powersgd_warmup_steps=3, powersgd_rank=2)


STEPS = 12


def batches(device):
    return [(torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(i)).to(device),
             torch.randint(10, (8,), generator=torch.Generator().manual_seed(i)).to(device)) for i in range(STEPS)]


class Run:
    """A DDP model with PowerSGD (small buckets: several of them) and SGD with momentum."""

    def __init__(self, device, backend, settings=SETTINGS, weights=None, optimizer=None):
        model = Net().to(device)
        if weights is not None:
            model.load_state_dict(weights)
        self.ddp = DDP(model, bucket_cap_mb=0.005)
        hook, self.memory = comm.hook_for("powersgd", settings, backend)
        self.memory.attach(self.ddp)
        self.ddp.register_comm_hook(self.memory, hook)
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=0.1, momentum=0.9)
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
        self.groupings = []   # after each PowerSGD step: the parameters of each bucket

    def steps(self, data):
        for x, y in data:
            self.optimizer.zero_grad()
            nn.functional.cross_entropy(self.ddp(x), y).backward()
            self.optimizer.step()
            plans = self.memory.plans
            self.groupings.append([[piece[0] for piece in plans[i]] for i in sorted(plans)])

    def weights(self):
        return copy.deepcopy(self.ddp.module.state_dict())


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

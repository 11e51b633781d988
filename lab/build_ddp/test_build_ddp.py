"""The specification of the build-DDP lab: what student.py must do, one test per part, each on 2 and on 3 ranks.

    python -m pytest lab/build_ddp                         # your student.py (from the repository's root)
    python -m pytest lab/build_ddp -k part_a               # part (a) only
    BUILD_DDP=reference python -m pytest lab/build_ddp     # the kit's reference.py

Each test starts its ranks as processes of this machine (gloo on 127.0.0.1; lab/build_ddp/README.md says how
to spread them over two nodes), runs the ``check_...`` function named in it on every rank, and fails with the
first rank's exception. A rank that hangs fails its test after harness.TIME_LIMIT_S seconds instead of
waiting for ever, and the test says where the rank was waiting.

"The same as one process": every rank builds the model from a seed of its own (so only broadcasting rank 0's
copy makes the ranks agree), trains on its shard of each global batch, and after every step its weights must
equal those of one process that trains rank 0's initial model on the whole global batch, with the same SGD
(momentum 0.9, weight decay). Equal means within ATOL + RTOL * |value|, not bit for bit: one process sums
the whole batch's gradient in one order, the ranks sum their shards and then add the shards' averages, and
float addition is not associative, so the last bits differ (by a few 1e-8 after 5 steps here: ATOL leaves
a margin of 30 times that).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from adapter import implementation
from harness import run_ranks

ddp = implementation()   # student.py, or reference.py with BUILD_DDP=reference (adapter.py)

WORLD_SIZES = [2, 3]
ATOL, RTOL = 1e-6, 1e-5   # fp32; see the module's docstring for why not exact
STEPS = 5
GLOBAL_BATCH = 24         # 12 samples per rank on 2 ranks, 8 on 3
FEATURES, HIDDEN, CLASSES = 20, 32, 4


# -- the model, the data and one process's training: the yardstick ---------------------------------------

class TinyNet(nn.Module):
    """A small MLP: 6 parameters of 16 to 4096 bytes, and an input-centring buffer (buffers are broadcast too)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("center", torch.randn(FEATURES))
        self.layers = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                    nn.Linear(HIDDEN, CLASSES))

    def forward(self, x):
        return self.layers(x - self.center)


def tiny_net(seed: int, device) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet().to(device)


def global_batch(step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step``, the same on every rank: inputs (GLOBAL_BATCH, FEATURES), labels (GLOBAL_BATCH,)."""
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(GLOBAL_BATCH, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=generator)
    return inputs.to(device), labels.to(device)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def assert_same_weights(model: nn.Module, reference: nn.Module, when: str) -> None:
    """Every parameter and buffer of ``model`` (wrapped or not) equals ``reference``'s, within ATOL and RTOL;
    ``when`` says which moment (and so which value) is checked."""
    names = [name for name, _ in [*reference.named_parameters(), *reference.named_buffers()]]
    mine = [*model.parameters(), *model.buffers()]
    theirs = [*reference.parameters(), *reference.buffers()]
    assert len(mine) == len(theirs), f"{when}: the model has {len(mine)} tensors, one process's {len(theirs)}"
    for name, got, want in zip(names, mine, theirs):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda text, name=name: (
            f"rank {dist.get_rank()}, {when}: {name} differs\n{text}"))


@dataclass(frozen=True)
class AllReduce:
    """One ``dist.all_reduce`` call: the size of its tensor, its async_op, and whether backward() was running."""
    bytes: int
    async_op: bool
    in_backward: bool

    def __repr__(self):
        return f"all_reduce({self.bytes} bytes, async_op={self.async_op}, {'during' if self.in_backward else 'after'} backward)"


class AllReduceLog:
    """Records every ``dist.all_reduce`` call made inside ``with log.recording():`` in ``log.calls``."""

    def __init__(self):
        self.calls: list[AllReduce] = []
        self.in_backward = False

    @contextlib.contextmanager
    def recording(self):
        real = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            async_op = kwargs.get("async_op", args[2] if len(args) > 2 else False)
            self.calls.append(AllReduce(tensor.numel() * tensor.element_size(), bool(async_op), self.in_backward))
            return real(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
        try:
            yield self
        finally:
            dist.all_reduce = real


def train_beside_one_process(rank, world_size, device, wrap, sync) -> list[list[AllReduce]]:
    """Train ``wrap(model)`` on this rank's shards with ``sync(model)`` between backward() and step(), next to
    one process training on the full batch; assert equal weights at the start and after every step.

    Returns each step's all-reduce calls (AllReduceLog), for the parts that say how gradients travel.
    """
    model = wrap(tiny_net(seed=rank, device=device))   # a different initial model on every rank ...
    single = tiny_net(seed=0, device=device)             # ... and rank 0's, which one process trains
    optimizer, single_optimizer = sgd(model), sgd(single)
    assert_same_weights(model, single, "before the first step: every rank must hold rank 0's initial weights and "
                                       "buffers (broadcast_parameters), but")

    shard = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    log, calls_per_step = AllReduceLog(), []
    for step in range(1, STEPS + 1):
        inputs, labels = global_batch(step, device)
        with log.recording():
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(inputs[shard]), labels[shard])
            log.in_backward = True
            loss.backward()
            log.in_backward = False
            sync(model)
            optimizer.step()
        calls_per_step.append(log.calls)
        log.calls = []

        single_optimizer.zero_grad()
        nn.functional.cross_entropy(single(inputs), labels).backward()
        single_optimizer.step()
        assert_same_weights(model, single, f"after step {step}: compared with one process trained on the full batch,")
    return calls_per_step


def parameter_bytes(model: nn.Module) -> list[int]:
    return [p.numel() * p.element_size() for p in model.parameters()]


# -- (a) all-reduce after backward --------------------------------------------------------------------------

def check_allreduce_gradients(rank, world_size, device):
    def broadcast(model):
        ddp.broadcast_parameters(model)
        return model

    train_beside_one_process(rank, world_size, device, wrap=broadcast, sync=ddp.allreduce_gradients)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_part_a_averaged_gradients_give_one_process_weights_after_every_step(world_size):
    run_ranks(check_allreduce_gradients, world_size)


# -- (b) one async all-reduce per parameter, started from its gradient hook ---------------------------------

def check_overlap_ddp(rank, world_size, device):
    steps = train_beside_one_process(rank, world_size, device, wrap=ddp.OverlapDDP,
                                     sync=lambda model: model.finish_gradient_sync())
    sizes = sorted(parameter_bytes(tiny_net(0, device)))
    for step, calls in enumerate(steps, start=1):
        assert sorted(c.bytes for c in calls) == sizes, (
            f"step {step}: expected one dist.all_reduce per parameter, of its gradient's size ({sizes} bytes); "
            f"saw {[c.bytes for c in calls]}")
        assert all(c.in_backward and c.async_op for c in calls), (
            f"step {step}: every all-reduce must start during backward() (from the parameter's "
            f"register_post_accumulate_grad_hook) with async_op=True; saw {calls}")


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_part_b_one_async_all_reduce_per_parameter_during_backward_gives_one_process_weights(world_size):
    run_ranks(check_overlap_ddp, world_size)


# -- (c) buckets -------------------------------------------------------------------------------------------

def check_bucket_ddp(rank, world_size, device):
    sizes = parameter_bytes(tiny_net(0, device))
    # one parameter per bucket; a few parameters per bucket (4096 bytes: the largest parameter's size); one bucket
    for bucket_bytes, buckets in [(1, [len(sizes)]), (4096, range(2, len(sizes))), (2**30, [1])]:
        steps = train_beside_one_process(rank, world_size, device,
                                         wrap=lambda model: ddp.BucketDDP(model, bucket_bytes=bucket_bytes),
                                         sync=lambda model: model.finish_gradient_sync())
        for step, calls in enumerate(steps, start=1):
            where = f"bucket_bytes={bucket_bytes}, step {step}: saw {calls}"
            assert sum(c.bytes for c in calls) == sum(sizes), (
                f"{where}\nevery gradient must travel exactly once: {sum(sizes)} bytes in all")
            assert len(calls) in buckets, f"{where}\nexpected {list(buckets)} bucket(s), one dist.all_reduce each"
            assert all(c.bytes <= max(bucket_bytes, max(sizes)) for c in calls), (
                f"{where}\na bucket holds at most bucket_bytes, or one parameter larger than that")
            assert all(c.in_backward and c.async_op for c in calls), (
                f"{where}\nevery bucket's all-reduce must start during backward(), as soon as its last gradient "
                f"is ready, with async_op=True")


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_part_c_one_async_all_reduce_per_full_bucket_during_backward_gives_one_process_weights(world_size):
    run_ranks(check_bucket_ddp, world_size)


# -- (d) ring all-reduce from point-to-point messages -------------------------------------------------------

def check_ring_all_reduce(rank, world_size, device):
    # sizes below, at and around multiples of 2 and 3 (a chunk may be empty), and a 2-D tensor
    shapes = [(1,), (2,), (3,), (7,), (12,), (1000,), (1001,), (3, 5)]
    for dtype in (torch.float32, torch.int64):
        for shape in shapes:
            generator = torch.Generator().manual_seed(rank * 100 + len(shape) * 10 + shape[0])
            mine = (torch.randn(shape, generator=generator) * 100).to(dtype).to(device)
            want = mine.clone()
            dist.all_reduce(want)
            log = AllReduceLog()
            with log.recording():
                got = ddp.ring_all_reduce(mine)
            case = f"ring_all_reduce of a {dtype} tensor of shape {shape} on {world_size} ranks"
            assert not log.calls, f"{case}: use point-to-point messages, not dist.all_reduce"
            assert got is mine, f"{case}: sum in place and return the tensor given"
            torch.testing.assert_close(mine, want, atol=ATOL, rtol=RTOL, msg=lambda text, case=case: (
                f"rank {rank}: {case} differs from dist.all_reduce's\n{text}"))
            everyone = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(everyone, mine)
            assert all(torch.equal(other, mine) for other in everyone), (
                f"{case}: every rank must end with the same bits (the all-gather copies the finished chunks)")


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_part_d_ring_all_reduce_equals_dist_all_reduce_for_every_size(world_size):
    run_ranks(check_ring_all_reduce, world_size)

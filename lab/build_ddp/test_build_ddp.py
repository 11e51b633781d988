"""The specification of the build-DDP lab: what student.py must do, one test per behaviour, each on 2, 3 and 4 ranks.

    python -m pytest lab/build_ddp                         # your student.py (from the repository's root)
    python -m pytest lab/build_ddp -k part_a               # part (a) only
    python -m pytest lab/build_ddp -rA > pytest-log.txt    # the log you hand in

Each test starts its ranks as processes of this machine (gloo on 127.0.0.1; lab/build_ddp/README.md says how
to spread them over two nodes), runs the ``check_...`` function named in it on every rank, and fails with the
first rank's exception. A rank that hangs fails its test after harness.TIME_LIMIT_S seconds instead of
waiting for ever, and the test says where the rank was waiting.

The model, ``LabNet``, is small but has what real models have: a frozen layer and a frozen bias (no gradient,
nothing to send), two layers that share one weight (its gradient comes from both, once), a head used only on
odd steps (a parameter without a gradient in a step), and parameters declared in another order than the one
in which backward() produces their gradients.

"The same as one process": every rank builds the model from a seed of its own (so only broadcasting rank 0's
copy makes the ranks agree), trains on its shard of each global batch, and after every step its weights must
equal those of one process that trains rank 0's initial model on the whole global batch, with the same SGD
(momentum 0.9, weight decay). Before each step, every gradient must already be the mean over the ranks; when
it is not, the failure says how it differs (checks.py). Equal means within ATOL + RTOL * |value|, not bit for
bit: one process sums the whole batch's gradient in one order, the ranks sum their shards and then add the
shards' averages, and float addition is not associative, so the last bits differ (by a few 1e-8 after 5
steps here: ATOL leaves a margin of 30 times that).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from build_ddp import checks
from build_ddp.adapter import implementation
from build_ddp.checks import ATOL, RTOL, AllReduce, AllReduceLog, Arrivals, RingLog
from build_ddp.harness import run_ranks

ddp = implementation()   # student.py, or the kit's solution with BUILD_DDP=reference (adapter.py)

WORLD_SIZES = [2, 3, 4]
STEPS = 5
GLOBAL_BATCH = 24         # 12 samples per rank on 2 ranks, 8 on 3, 6 on 4
FEATURES, HIDDEN, CLASSES = 20, 32, 4


# -- the model, the data and one process's training: the yardstick ---------------------------------------

class LabNet(nn.Module):
    """An MLP with what real models have: frozen, tied and sometimes-unused parameters, and a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("center", torch.randn(FEATURES))         # buffers are broadcast too
        self.head = nn.Linear(HIDDEN, CLASSES)      # declared first, used last: its gradient comes first
        self.aux = nn.Linear(HIDDEN, CLASSES)       # used on odd steps only (use_aux)
        self.embed = nn.Linear(FEATURES, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)  # a frozen layer: no gradient at all
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.mix.bias.requires_grad_(False)         # a frozen bias beside a weight that trains
        self.mix2 = nn.Linear(HIDDEN, HIDDEN)
        self.mix2.weight = self.mix.weight          # tied: one parameter, used twice
        self.use_aux = True

    def forward(self, x):
        h = torch.relu(self.embed(x - self.center))
        h = torch.relu(self.mix2(torch.relu(self.mix(torch.relu(self.frozen(h))))))
        return self.head(h) + self.aux(h) if self.use_aux else self.head(h)


def lab_net(seed: int, device) -> LabNet:
    torch.manual_seed(seed)
    return LabNet().to(device)


def uses_aux(step: int) -> bool:
    return step % 2 == 1   # the same on every rank: control flow that depends on the step, not on the data


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


def one_process_gradients(single: nn.Module, inputs, labels, shard: slice) -> tuple[dict, dict]:
    """``(whole batch, this rank's shard)``: the gradients one process computes; ``single`` keeps the first."""
    single.zero_grad()
    nn.functional.cross_entropy(single(inputs[shard]), labels[shard]).backward()
    mine = checks.gradients(single)
    single.zero_grad()
    nn.functional.cross_entropy(single(inputs), labels).backward()
    return checks.gradients(single), mine


@dataclass
class Step:
    """What one training step did: its all-reduces, and the trainable parameters' gradients in arrival order."""
    number: int
    calls: list[AllReduce]
    arrived: list[str]          # names, in the order backward() produced them
    grad_bytes: dict[str, int]  # every trainable parameter's gradient size

    @property
    def every_parameter_used(self) -> bool:
        return len(self.arrived) == len(self.grad_bytes)

    @property
    def used_bytes(self) -> list[int]:
        return [self.grad_bytes[name] for name in self.arrived]


def train_beside_one_process(rank, world_size, device, wrap, sync, case: str = "", accumulate: int = 1) -> list[Step]:
    """Train ``wrap(model)`` on this rank's shards with ``sync(model)`` between backward() and step(), next to
    one process training on the full batch; check the gradients before every step and the weights after it.
    ``accumulate``: each shard in that many micro-batches, all but the last inside ``model.no_sync()``.

    Returns what each step did (``Step``), for the parts that say how gradients travel.
    """
    net = lab_net(seed=rank, device=device)   # a different initial model on every rank ...
    arrivals = Arrivals(net)                  # (before your hooks: see checks.py)
    model = wrap(net)
    single = lab_net(seed=0, device=device)   # ... and rank 0's, which one process trains
    optimizer, single_optimizer = sgd(model), sgd(single)
    where = f"{case}, " if case else ""
    assert_same_weights(model, single, f"{where}before the first step: every rank must hold rank 0's initial "
                                       f"weights and buffers (broadcast_parameters), but")

    shard = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    micro = [slice(shard.start + (shard.stop - shard.start) * j // accumulate,
                   shard.start + (shard.stop - shard.start) * (j + 1) // accumulate) for j in range(accumulate)]
    log, steps = AllReduceLog(arrivals), []
    for number in range(1, STEPS + 1):
        net.use_aux = single.use_aux = uses_aux(number)
        inputs, labels = global_batch(number, device)
        want, mine = one_process_gradients(single, inputs, labels, shard)
        with log.recording(ddp):
            optimizer.zero_grad()
            for j, part in enumerate(micro):
                log.micro_batch = j
                last = j == accumulate - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = nn.functional.cross_entropy(model(inputs[part]), labels[part]) * (
                        (part.stop - part.start) / (shard.stop - shard.start))   # the shard's mean, in parts
                    log.in_backward = True
                    loss.backward()
                    log.in_backward = False
            sync(model)
        calls, works = log.take()
        step = Step(number, calls, arrivals.take(), dict(arrivals.bytes))
        when = f"{where}step {number}"
        checks.assert_all_waited(works, when)
        checks.explain_gradients(net, want, mine, when, calls=calls, sent=f"{sum(c.bytes for c in calls)} of "
                                 f"{sum(step.used_bytes)} gradient bytes in {len(calls)} call(s): {calls}")
        optimizer.step()
        single_optimizer.step()
        assert_same_weights(model, single, f"{when}: compared with one process trained on the full batch,")
        steps.append(step)
    return steps


def assert_overlaps(step: Step, where: str) -> None:
    """Every all-reduce started during backward(), asynchronously, and the first before backward() had computed
    the last gradient: communication overlapped computation (a wrapper that starts everything from the last
    gradient's hook sends the right numbers and overlaps nothing)."""
    calls = step.calls
    assert all(c.in_backward and c.async_op for c in calls), (
        f"{where}: every all-reduce must start during backward(), from a gradient hook, with async_op=True; "
        f"saw {calls}")
    assert calls[0].arrived < len(step.arrived), (
        f"{where}: the first all-reduce started only after backward() had computed all {len(step.arrived)} "
        f"gradients: nothing overlapped the backward pass. Start each one as soon as its gradient (or its "
        f"bucket's last gradient) is ready; saw {calls}")


def assert_nothing_waits(step: Step, where: str) -> None:
    """When each all-reduce starts, every gradient that arrived before it has been sent: no gradient waits in a
    bucket that fills later (the buckets follow the order in which backward() produces the gradients)."""
    sent = 0
    for call in step.calls:
        sent += call.bytes
        arrived = sum(step.used_bytes[:call.arrived])
        assert sent == arrived, (
            f"{where}: when {call} started, {arrived} gradient bytes had arrived but only {sent} were sent with "
            f"it and before it: a gradient that arrived earlier waits in a bucket that fills later. Build the "
            f"buckets in the order backward() produces the gradients (known after the first step); arrival "
            f"order: {step.arrived}")


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
    for step in steps:
        where = f"step {step.number}"
        assert sorted(c.bytes for c in step.calls) == sorted(step.used_bytes), (
            f"{where}: expected one dist.all_reduce per parameter that has a gradient this step, of its "
            f"gradient's size ({sorted(step.used_bytes)} bytes; frozen and unused parameters send nothing); "
            f"saw {[c.bytes for c in step.calls]}")
        if step.every_parameter_used:
            assert_overlaps(step, where)
            assert_nothing_waits(step, where)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_part_b_one_async_all_reduce_per_parameter_during_backward_gives_one_process_weights(world_size):
    run_ranks(check_overlap_ddp, world_size)


def check_no_sync(rank, world_size, device, wrap):
    steps = train_beside_one_process(rank, world_size, device, wrap=wrap, sync=lambda model: model.finish_gradient_sync(),
                                     case="2 micro-batches a step, the first inside no_sync()", accumulate=2)
    for step in steps:
        early = [c for c in step.calls if c.micro_batch == 0]
        assert not early, (f"step {step.number}: inside no_sync() backward() must only accumulate this rank's "
                           f"gradients; it started {early}")


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_part_b_no_sync_accumulates_locally_and_the_next_backward_sends_the_sum(world_size):
    run_ranks(check_no_sync_overlap, world_size)


def check_no_sync_overlap(rank, world_size, device):
    check_no_sync(rank, world_size, device, ddp.OverlapDDP)


# -- (c) buckets -------------------------------------------------------------------------------------------

def check_bucket_ddp(rank, world_size, device):
    sizes = [p.numel() * p.element_size() for p in lab_net(0, device).parameters() if p.requires_grad]
    # one parameter per bucket; a few parameters per bucket (4096 bytes: the largest parameter's size); one bucket
    for bucket_bytes in (1, 4096, 2**30):
        case = f"bucket_bytes={bucket_bytes}"
        steps = train_beside_one_process(rank, world_size, device, case=case,
                                         wrap=lambda model: ddp.BucketDDP(model, bucket_bytes=bucket_bytes),
                                         sync=lambda model: model.finish_gradient_sync())
        for step in steps:
            where = f"{case}, step {step.number}: saw {step.calls}"
            used = step.used_bytes
            assert sum(c.bytes for c in step.calls) == sum(used), (
                f"{where}\nevery gradient of this step must travel exactly once: {sum(used)} bytes in all "
                f"(frozen and unused parameters send nothing)")
            buckets = {1: [len(used)], 4096: range(2, len(used)), 2**30: [1]}[bucket_bytes]
            assert len(step.calls) in buckets, f"{where}\nexpected {list(buckets)} bucket(s), one dist.all_reduce each"
            assert all(c.bytes <= max(bucket_bytes, max(sizes)) for c in step.calls), (
                f"{where}\na bucket holds at most bucket_bytes, or one parameter larger than that")
            if step.every_parameter_used:
                if bucket_bytes < 2**30:   # one bucket can only start with the last gradient
                    assert_overlaps(step, f"{case}, step {step.number}")
                else:
                    assert all(c.in_backward and c.async_op for c in step.calls), (
                        f"{where}\nthe bucket's all-reduce must start during backward(), as soon as its last "
                        f"gradient is ready, with async_op=True")
                if step.number > 1:    # the first step may guess the order; from the second on it is known
                    assert_nothing_waits(step, f"{case}, step {step.number}")


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_part_c_one_async_all_reduce_per_full_bucket_during_backward_gives_one_process_weights(world_size):
    run_ranks(check_bucket_ddp, world_size)


def check_no_sync_buckets(rank, world_size, device):
    check_no_sync(rank, world_size, device, lambda model: ddp.BucketDDP(model, bucket_bytes=4096))


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_part_c_no_sync_accumulates_locally_and_the_next_backward_sends_the_sum(world_size):
    run_ranks(check_no_sync_buckets, world_size)


# -- (d) ring all-reduce from point-to-point messages -------------------------------------------------------

def check_ring_all_reduce(rank, world_size, device):
    # sizes below, at and around multiples of 2, 3 and 4 (a chunk may be empty), and a 2-D tensor
    shapes = [(1,), (2,), (3,), (7,), (12,), (1000,), (1001,), (3, 5)]
    for dtype in (torch.float32, torch.int64):
        for shape in shapes:
            generator = torch.Generator().manual_seed(rank * 100 + len(shape) * 10 + shape[0])
            mine = (torch.randn(shape, generator=generator) * 100).to(dtype).to(device)
            want = mine.clone()
            dist.all_reduce(want)
            log = RingLog(mine)   # every message, to whom and how large, and the tensor at each step (checks.py)
            with log.recording(ddp):
                got = ddp.ring_all_reduce(mine)
            log.returned(got)
            case = f"ring_all_reduce of a {dtype} tensor of shape {shape} on {world_size} ranks"
            # a ring: no collective; each rank sends 2 (N - 1) chunks to its right neighbour and receives as many
            # from its left; else, or when a chunk is wrong, the step and the chunk where it went wrong
            checks.explain_ring(log, case)
            # values of about +-100: another order of addition moves each partial sum's last bit (100 x 1.2e-7)
            torch.testing.assert_close(mine, want, atol=1e-4, rtol=RTOL, msg=lambda text, case=case: (
                f"rank {rank}: {case} differs from dist.all_reduce's\n{text}"))
            everyone = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(everyone, mine)
            assert all(torch.equal(other, mine) for other in everyone), (
                f"{case}: every rank must end with the same bits (the all-gather copies the finished chunks)")


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_part_d_ring_all_reduce_equals_dist_all_reduce_for_every_size(world_size):
    run_ranks(check_ring_all_reduce, world_size)


# -- (f) ZeRO-1: the optimizer's state sharded ---------------------------------------------------------------

def mean_gradients(net: nn.Module) -> None:
    """The tests' own all-reduce (not yours): part (f) is about the optimizer, given DDP's gradients."""
    for param in net.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()


def state_bytes_of(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def state_bytes(optimizer) -> int:
    return sum(state_bytes_of(state) for state in optimizer.state.values())


SHARDED_CASES = [   # (name, optimizer class, its arguments, whether the head's group comes from add_param_group)
    ("AdamW with weight decay", torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1), False),
    ("SGD with momentum", torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-4), False),
    ("AdamW, the head's group added by add_param_group", torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1), True),
]


def build_optimizer(make, net: nn.Module, cls, kwargs: dict, head_added: bool):
    """``make(params, cls, **kwargs)``; with ``head_added``, over all but the head, whose group of its own (its own
    lr, no weight decay) ``add_param_group`` adds next, as fine-tuning adds the layers it unfreezes."""
    if not head_added:
        return make(net.parameters(), cls, **kwargs)
    optimizer = make([p for name, p in net.named_parameters() if not name.startswith("head.")], cls, **kwargs)
    optimizer.add_param_group({"params": list(net.head.parameters()), "lr": 0.02, "weight_decay": 0.0})
    return optimizer


def check_sharded_optimizer(rank, world_size, device):
    shard = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    for name, cls, kwargs, head_added in SHARDED_CASES:
        net, single = lab_net(seed=0, device=device), lab_net(seed=0, device=device)   # the same start everywhere
        agreed = checks.AgreedCollectives(net, f"{name}, ShardedOptimizer")   # owners that differ: named, not hung
        with agreed.checking(ddp):
            optimizer = build_optimizer(ddp.ShardedOptimizer, net, cls, kwargs, head_added)
        single_optimizer = build_optimizer(lambda params, cls, **kw: cls(params, **kw), single, cls, kwargs, head_added)
        assert isinstance(optimizer, torch.optim.Optimizer), "ShardedOptimizer must be a torch.optim.Optimizer"
        schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + step))   # lr changes every step
                     for o in (optimizer, single_optimizer)]
        history = []   # the lr of each step, one per group: what the schedule set before it
        for number in range(1, STEPS + 1):
            net.use_aux = single.use_aux = uses_aux(number)
            inputs, labels = global_batch(number, device)
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(inputs[shard]), labels[shard]).backward()
            mean_gradients(net)
            single_optimizer.zero_grad()
            for mine, theirs in zip(net.parameters(), single.parameters()):   # the same gradients: exact equality
                theirs.grad = None if mine.grad is None else mine.grad.clone()
            history.append([group["lr"] for group in single_optimizer.param_groups])
            before = checks.OneOptimizerStep(single, single_optimizer)
            agreed.when = f"{name}, step {number}"
            with agreed.checking(ddp):
                optimizer.step()
            single_optimizer.step()
            when = f"{name}, after step {number} (lr {checks.lr_text(history[-1])})"
            checks.explain_sharded_step(net, single, before, history, when)   # never sent, stale lr: named
            assert_same_weights(net, single, f"{when}: compared with {cls.__name__} on one process, given the same "
                                             f"gradients,")
            for schedule in schedules:
                schedule.step()
        everyone = [None] * world_size
        dist.all_gather_object(everyone, state_bytes(optimizer))
        total = state_bytes(single_optimizer)
        largest = max(state_bytes_of(state) for state in single_optimizer.state.values())
        assert sum(everyone) == total, (
            f"{name}: the ranks keep {everyone} bytes of optimizer state, {sum(everyone)} in all; one process keeps "
            f"{total}: each parameter's state must be kept by exactly one rank (optimizer.state: this rank's only)")
        assert max(everyone) <= total / world_size + largest, (
            f"{name}: the ranks keep {everyone} bytes of optimizer state: each about 1/{world_size} of the {total}, "
            f"give or take one parameter's ({largest} bytes at most)")


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"{n}-ranks")
def test_part_f_sharded_optimizer_equals_one_optimizer_and_keeps_a_share_of_its_state(world_size):
    run_ranks(check_sharded_optimizer, world_size)

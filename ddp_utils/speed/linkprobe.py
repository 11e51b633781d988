"""Before training: how fast is the link, and what speed-up can DDP give on it?

Right after the model is built, every rank times (``measure``)

- a few all-reduces of a tensor as large as the model's gradients (what DDP sends every step),
- a few batches of the run's own train loader (its first batch and, with worker processes, the ones they had
  ready are left out): the loader's time a batch, and
- a few steps (forward, backward, SGD update) of a copy of the model on a random batch of the run's
  size: the compute of one step, without communication.

From the compute and the all-reduce ``--comm auto`` chooses how the gradients travel (comm.choose); then
(``predict``) every rank times as many steps of another copy wrapped in DDP as the run's model is, *with the
chosen communication hook*: the step with the communication the run will have (PowerSGD's or bf16's bytes and
their compression arithmetic, not the fp32 all-reduce), the all-reduces overlapping the backward pass as they
will in training. The real model, its statistics and the random number generators are left untouched.

The compute is timed both on every rank at once (the step under DDP) and on rank 0 alone while the others wait (the
step of a 1-rank baseline; slower together where ranks share a machine's cores or memory): four rounds of steps
after a warm-up, together and alone in turn, so that a machine slower for a while slows both alike, and the median
of each; the all-reduce, the median of a few rounds. From these: the link's bus bandwidth (nccl-tests' definition:
a ring all-reduce of S bytes over n ranks moves 2 (n-1)/n S bytes through every rank's link), and a **predicted
speed-up** over one rank with the same per-rank batch::

    step          = a DDP step of a copy of the model with the chosen hook, timed    (compute + the communication
                    the backward pass does not hide; where no torch DDP step can be timed (--build-ddp, local SGD):
                    compute + the time of the chosen communication's bytes on the measured link, no overlap)
    loader wait   = the loader's time a batch                   (no worker processes: the training process makes
                    the batches, so nothing overlaps it; with workers, they make the next batches while the step
                    runs: only what a batch takes longer than the step)
    predicted step     = step + loader wait
    predicted speed-up = n x (compute alone + its loader wait) / predicted step       (at most n)

The loader waits in the baseline too, so it enters both sides: left out, the speed-up was predicted ~11 % low on
1 Gbit (issue 46). The probe takes a few seconds at most (``--no-link-probe`` skips it): the all-reduces (3 s at
most), 13 steps of the copies (15 with PowerSGD: two more before it compresses) and 4 batches of the loader (with
W workers of prefetch P, W x P more, which they had ready). Its figures go into ``results.json``; after training
the measured step is printed next to the predicted one.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import collectives
from ..model import ddp_of, unwrap, wrap_ddp
from ..optim import amp_dtype, autocast, channels_last_on

BUDGET_S = 3.0      # time the all-reduce timing may take, after one warm-up round
PAIRS = 4           # compute timings: this many steps on every rank, each followed by one on rank 0 alone
LOADER_BATCHES = 3  # loader timing: this many batches after its first one (and the ones its workers had ready)
# steps of the DDP copy before it is timed, besides its first: PowerSGD compresses from its third step (the copy's
# warm-up of exact all-reduces is 2 steps) and lays out its memory then
EXTRA_WARMUP = {"powersgd": 2}


@dataclass
class Measured:
    """What ``measure`` timed before the choice of the communication, and what ``predict`` needs after it."""
    figures: dict       # allreduce_s, compute_s, compute_alone_s, grad_mb, link_gbit_s, loader_batch_s, ...
    model: torch.nn.Module
    settings: object
    ctx: object
    data: object        # the run's Data: its classes and image size (a step's batch)


def probe(model, settings, ctx, data, log=print) -> dict | None:
    """Time the link, the loader and one step's compute on every rank, and predict the step with DDP's default
    fp32 all-reduce; the same dict on every rank, or None with one rank (nothing to communicate) or when
    ``settings.link_probe`` is off. ``data``: the run's (``num_classes``, ``image_size`` and its ``train`` loader,
    of which a few batches are timed; None there: not timed). ``gradient_communication`` (comm.py) calls
    ``measure``, chooses, then ``predict`` for its choice."""
    measured = measure(model, settings, ctx, data)
    return predict(measured, "none", log=log) if measured is not None else None


def measure(model, settings, ctx, data) -> Measured | None:
    """The all-reduce of the gradients, the time a batch of ``data.train`` (the run's train loader; None: not
    timed) and one step's compute, together and alone; what comm.choose decides from (``figures``). None as
    ``probe``."""
    if not ctx.distributed or not settings.link_probe:
        return None
    params = [p for p in unwrap(model).parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    grads = torch.zeros(numel, dtype=torch.float32, device=ctx.device)
    allreduce_s = _time_allreduce(grads, ctx)
    loader = data.train
    loader_batch_s, workers = _time_loader(loader, ctx)
    stepper = Stepper(model, settings, ctx, data)   # its own copy, warmed up
    together, alone = [], []
    for _ in range(PAIRS):   # interleaved: a machine slower for a while (a neighbour, the clock) slows both alike
        together.append(_slowest(stepper.step(), ctx))
        # One rank alone, the others blocked in the collective below: what the 1-rank baseline computes per step.
        # Where ranks share a machine (a rehearsal, or several GPUs of a node sharing its CPU) it is slower together.
        collectives.barrier(ctx)
        alone.append(_slowest(stepper.step() if ctx.is_main else 0.0, ctx))
    n = ctx.world_size
    moved = 2 * (n - 1) / n * grads.numel() * grads.element_size()
    figures = {"allreduce_s": allreduce_s, "compute_s": statistics.median(together),
               "compute_alone_s": statistics.median(alone), "grad_mb": grads.numel() * 4 / 1e6,
               "link_gbit_s": moved * 8 / allreduce_s / 1e9, "loader_batch_s": loader_batch_s,
               "loader_workers": workers, "loader_timed": loader is not None,
               "powersgd_mb": powersgd_bytes(params, settings.powersgd_rank,
                                             settings.powersgd_min_compression) / 1e6}
    return Measured(figures, model, settings, ctx, data)


def predict(measured: Measured, comm: str = "none", register: Callable | None = None, log=print) -> dict:
    """The predicted step and speed-up with the gradient communication ``comm`` (comm.CHOICES): a DDP step of a
    copy with that hook, ``register(ddp_copy)`` putting it on the copy (None: DDP's default fp32 all-reduce),
    plus the loader's wait. Keys: ``measure``'s figures and ``predicted_comm``, ``comm_mb`` / ``comm_s`` (what the
    chosen communication sends per step and per rank, and its time on the measured link), ``ddp_step_s`` (None
    where none was timed), ``loader_s`` (the predicted wait a step), ``predicted_step_s``, ``predicted_speedup``."""
    f, ctx, n = measured.figures, measured.ctx, measured.ctx.world_size
    comm_mb = sent_mb(comm, f["grad_mb"], f["powersgd_mb"], measured.settings.average_every)
    comm_s = f["allreduce_s"] * comm_mb / f["grad_mb"]   # the link's time for these bytes
    with_ddp = []
    # DDP's own step on another copy, wrapped as the run's model is, with the run's hook: its all-reduces overlap the
    # backward pass (and on a CPU take cores from it), which the sum compute + communication cannot know. Not for a
    # DDP of your own, nor local SGD (its steps send nothing; an average every average_every steps)
    if ddp_of(measured.model) is not None and comm != "localsgd":
        ddp = Stepper(measured.model, measured.settings, ctx, measured.data, ddp=True, register=register)
        for _ in range(EXTRA_WARMUP.get(comm, 0)):
            ddp.step()
        with_ddp = [_slowest(ddp.step(), ctx) for _ in range(PAIRS)]
    step = statistics.median(with_ddp) if with_ddp else f["compute_s"] + comm_s
    loader_s = loader_wait(f["loader_batch_s"], step, f["loader_workers"])
    alone = f["compute_alone_s"] + loader_wait(f["loader_batch_s"], f["compute_alone_s"], f["loader_workers"])
    result = {**f, "predicted_comm": comm, "comm_mb": comm_mb, "comm_s": comm_s,
              "ddp_step_s": step if with_ddp else None, "loader_s": loader_s, "predicted_step_s": step + loader_s,
              # never above n: a step together that timed faster than one alone is the timer's noise, not a gain
              "predicted_speedup": min(float(n), n * alone / (step + loader_s))}
    if ctx.is_main:
        log(describe(result, n))
    return result


def loader_wait(batch_s: float, step_s: float, workers: int) -> float:
    """Seconds a step waits for its batch: all of the loader's ``batch_s`` where the training process makes the
    batches (no workers), else what a batch takes longer than the ``step_s`` its ``workers`` work beside."""
    return max(0.0, batch_s - step_s) if workers else batch_s


def sent_mb(comm: str, grad_mb: float, powersgd_mb: float, average_every: int = 1) -> float:
    """MB one rank sends per step (before the ring's 2 (n-1)/n) with the gradient communication ``comm``."""
    if comm in ("fp16", "bf16"):
        return grad_mb / 2
    if comm == "powersgd":
        return powersgd_mb
    if comm == "localsgd":   # the weights' difference in bf16, every average_every steps
        return grad_mb / 2 / max(1, average_every)
    return grad_mb


def powersgd_bytes(params, rank: int, min_compression: float) -> int:
    """Bytes PowerSGD sends per step for ``params``' gradients (torch's powerSGD_hook): each gradient viewed as a
    matrix (rows = its first dimension) goes as P (rows x r) and Q (columns x r), r = min(rank, rows, columns),
    where that is at least ``min_compression`` times smaller; the others exact. All fp32."""
    total = 0
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        cols = p.numel() // max(rows, 1)
        r = min(rank, rows, cols)
        compressed = (rows + cols) * r
        total += compressed if compressed * min_compression < rows * cols else rows * cols
    return 4 * total


def _time_loader(loader, ctx) -> tuple[float, int]:
    """``(seconds a batch, worker processes)`` of ``loader`` (a TrainLoader; None: ``(0, 0)``): the slowest rank's
    median over ``LOADER_BATCHES`` batches of epoch 0 after its first (start-up) and the ones its workers had
    ready, made as fast as it can; the run's random numbers untouched, its workers ended after."""
    inner = getattr(loader, "loader", None)   # EpochLoader: a DataLoader with worker processes, or none
    workers = getattr(inner, "num_workers", 0) or 0
    seconds = 0.0
    if loader is not None:
        ready = workers * (getattr(inner, "prefetch_factor", None) or 2)
        count = min(len(loader), ready + 1 + LOADER_BATCHES)
        times = []
        with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
            batches = loader.epoch(0)   # a loader makes epoch e alike each time: the run's epoch 0 is unchanged
            start = time.perf_counter()
            for _, _batch in zip(range(count), batches):
                _sync(ctx)
                now = time.perf_counter()
                times.append(now - start)
                start = now
            getattr(batches, "close", lambda: None)()
            del batches   # a DataLoader's iterator: its workers end
        timed = times[ready + 1:] or times[1:] or times
        seconds = statistics.median(timed) if timed else 0.0
    return _slowest(seconds, ctx), workers


def describe(result: dict, world_size: int) -> str:
    compute, allreduce = result["compute_s"], result["allreduce_s"]
    share = allreduce / (compute + allreduce)
    alone = result["compute_alone_s"]
    shared = (f" ({1e3 * alone:.0f} ms for one rank alone: these ranks share a machine)"
              if compute > 1.1 * alone else "")
    comm = result.get("predicted_comm", "none")
    loader = (f",\n  waiting for the loader {1e3 * result['loader_s']:.0f} ms a step "
              f"({1e3 * result['loader_batch_s']:.0f} ms a batch"
              + (f", {result['loader_workers']} workers beside the step)" if result["loader_workers"] else ")")
              if result.get("loader_timed") else "")
    sends = (f" with {comm} ({result['comm_mb']:.2f} MB a step, {1e3 * result['comm_s']:.0f} ms of this link)"
             if comm != "none" else "")
    step = result.get("ddp_step_s")
    if step is None:   # no DDP step timed (your own DDP, local SGD): the sum, which assumes no overlap
        ddp = f"\n  compute + communication{sends}: {1e3 * (compute + result['comm_s']):.0f} ms;" if sends else ""
        bound = f"\n  (ideal {world_size}x; DDP's overlap with the backward pass can do better)"
    elif comm == "none":
        hidden = min(1.0, max(0.0, (compute + allreduce - step) / allreduce))
        ddp = (f"\n  a DDP step of a copy {1e3 * step:.0f} ms, {100 * hidden:.0f} % of its all-reduce hidden behind "
               f"the backward pass;")
        bound = f" (ideal {world_size}x)"
    else:   # the hook's own arithmetic (PowerSGD's matrices, the casts) is in the step as well
        ddp = f"\n  a DDP step of a copy{sends}: {1e3 * step:.0f} ms;"
        bound = f" (ideal {world_size}x)"
    with_comm = f" with {comm}" if comm != "none" else ""
    return (f"link probe: all-reduce of the {result['grad_mb']:.1f} MB of gradients takes "
            f"{1e3 * allreduce:.0f} ms (link {result['link_gbit_s']:.2f} Gbit/s);\n  one step's compute "
            f"{1e3 * compute:.0f} ms{shared}{loader};{ddp}\n  so communication is up to {100 * share:.0f} % of a "
            f"step and {world_size} ranks should be about {result['predicted_speedup']:.2f}x one rank{with_comm}"
            f"{bound}")


def _time_allreduce(grads: torch.Tensor, ctx) -> float:
    """Seconds per all-reduce of ``grads``: the slowest rank's mean over a few rounds.

    Every rank must make the same number of rounds, so the count comes from the slowest rank's
    warm-up round.
    """
    _sync(ctx)
    start = time.perf_counter()
    dist.all_reduce(grads)
    _sync(ctx)
    rounds = max(1, min(5, int(BUDGET_S / max(_slowest(time.perf_counter() - start, ctx), 1e-6))))
    times = []
    for _ in range(rounds):   # each timed: their median, which one round slowed by something else does not move
        start = time.perf_counter()
        dist.all_reduce(grads)
        _sync(ctx)
        times.append(time.perf_counter() - start)
    return _slowest(statistics.median(times), ctx)


class Stepper:
    """Steps (forward, backward, SGD update) of a copy of the model on a random batch of the run's size: no DDP,
    nothing communicated (``ddp``: wrapped in DDP as the run's model is, ``register(ddp_copy)`` giving it a
    communication hook); the real model, its optimizer and the run's random numbers are not touched. Built with
    one warm-up step (allocations, cuDNN's choices); ``step()`` times one more. ``data``: the run's (its
    ``num_classes`` and ``image_size``)."""

    def __init__(self, model, settings, ctx, data, ddp: bool = False, register: Callable | None = None):
        self.ctx, self.dtype = ctx, amp_dtype(settings, ctx.device)
        self.net = local_batchnorm(copy.deepcopy(unwrap(model))).train()
        if ddp:   # a collective: every rank makes its copy together (rank 0's weights are copied to the others)
            self.net = wrap_ddp(self.net, settings, ctx)
            if register is not None:   # the run's communication hook (comm.py), on the copy
                register(self.net)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=1e-3, momentum=settings.momentum)
        devices = [ctx.device] if ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):   # the run's random numbers stay as they were
            self.images = torch.randn(settings.batch_size, 3, data.image_size, data.image_size, device=ctx.device)
            self.labels = torch.randint(0, data.num_classes, (settings.batch_size,), device=ctx.device)
        if channels_last_on(settings, ctx.device):
            self.images = self.images.contiguous(memory_format=torch.channels_last)
        self.step()

    def step(self) -> float:
        """Seconds of one step."""
        _sync(self.ctx)
        start = time.perf_counter()
        with autocast(self.dtype, self.ctx.device):
            loss = F.cross_entropy(self.net(self.images), self.labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _sync(self.ctx)
        return time.perf_counter() - start


def _time_compute(model, settings, ctx, data, rounds: int = 3) -> float:
    """Seconds per step of a ``Stepper``: the median of ``rounds`` steps after its warm-up, so that one step slowed
    by something else on the machine does not move the prediction."""
    stepper = Stepper(model, settings, ctx, data)
    return statistics.median(stepper.step() for _ in range(rounds))


class _LocalBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """BatchNorm of any input rank (what a SyncBatchNorm was: 1-d, 2-d or 3-d), statistics of this rank only."""

    def _check_input_dim(self, input):
        pass


def local_batchnorm(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every SyncBatchNorm replaced by a plain BatchNorm of the same weights and statistics.

    The probe times a copy of the model on rank 0 alone while the others wait: a SyncBatchNorm there
    would start collectives the other ranks never join (with --sync-bn the probe hung)."""
    if isinstance(module, torch.nn.SyncBatchNorm):
        local = _LocalBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                module.track_running_stats)
        local.load_state_dict(module.state_dict())
        return local.to(next(module.buffers(), torch.empty(0)).device).train(module.training)
    for name, child in module.named_children():
        setattr(module, name, local_batchnorm(child))
    return module


def _slowest(seconds: float, ctx) -> float:
    """The largest of every rank's ``seconds``: the slowest rank sets the pace of a DDP step."""
    t = torch.tensor([seconds], dtype=torch.float64, device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sync(ctx) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)

"""Before training: how fast is the link, and what speed-up can DDP give on it?

Right after the model is built, every rank times

- a few all-reduces of a tensor as large as the model's gradients (what DDP sends every step), and
- a few steps (forward, backward, SGD update) of a copy of the model on a random batch of the run's
  size: the compute of one step, without communication, and
- as many steps of another copy wrapped in DDP as the run's model is: the step with its communication, the
  all-reduces overlapping the backward pass as they will in training. The real model, its statistics and
  the random number generators are left untouched.

The compute is timed both on every rank at once (the step under DDP) and on rank 0 alone while the others wait (the
step of a 1-rank baseline; slower together where ranks share a machine's cores or memory): four rounds of steps
after a warm-up, together (plain, then DDP) and alone in turn, so that a machine slower for a while slows all
alike, and the median of each; the all-reduce, the median of a few rounds. From these: the link's bus bandwidth
(nccl-tests' definition: a ring all-reduce of S bytes over n ranks moves 2 (n-1)/n S bytes through every rank's
link), and a **predicted speed-up** over one rank with the same per-rank batch::

    predicted step     = a DDP step of a copy of the model, timed   (compute + all-reduce where the run has no
                                                                     torch DDP: --build-ddp; no overlap assumed)
    predicted speed-up = n x compute alone / predicted step          (at most n)

The probe takes a few seconds at most (``--no-link-probe`` skips it). Both numbers go into
``results.json``; after training the measured step is printed next to the predicted one.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import distributed
from ..model import ddp_of, unwrap, wrap_ddp
from ..optim import amp_dtype, autocast, channels_last_on

BUDGET_S = 3.0   # time the all-reduce timing may take, after one warm-up round
PAIRS = 4        # compute timings: this many steps on every rank, each followed by one on rank 0 alone


def probe(model, settings, ctx, num_classes: int, image_size: int, log=print) -> dict | None:
    """Time the link and one step's compute on every rank; the same dict on every rank, or None
    with one rank (nothing to communicate) or when ``settings.link_probe`` is off."""
    if not ctx.distributed or not settings.link_probe:
        return None
    params = [p for p in unwrap(model).parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    grads = torch.zeros(numel, dtype=torch.float32, device=ctx.device)
    allreduce_s = _time_allreduce(grads, ctx)
    stepper = Stepper(model, settings, ctx, num_classes, image_size)   # its own copy, warmed up
    # DDP's own step on another copy, wrapped as the run's model is: its all-reduces overlap the backward pass
    # (and on a CPU take cores from it), which the sum compute + all-reduce cannot know. Not for a DDP of your own.
    ddp = Stepper(model, settings, ctx, num_classes, image_size, ddp=True) if ddp_of(model) is not None else None
    together, with_ddp, alone = [], [], []
    for _ in range(PAIRS):   # interleaved: a machine slower for a while (a neighbour, the clock) slows all alike
        together.append(_slowest(stepper.step(), ctx))
        if ddp is not None:
            with_ddp.append(_slowest(ddp.step(), ctx))
        # One rank alone, the others blocked in the collective below: what the 1-rank baseline computes per step.
        # Where ranks share a machine (a rehearsal, or several GPUs of a node sharing its CPU) it is slower together.
        distributed.barrier(ctx)
        alone.append(_slowest(stepper.step() if ctx.is_main else 0.0, ctx))
    compute_s, alone_s = statistics.median(together), statistics.median(alone)
    step_s = statistics.median(with_ddp) if with_ddp else compute_s + allreduce_s
    n = ctx.world_size
    moved = 2 * (n - 1) / n * grads.numel() * grads.element_size()
    result = {"allreduce_s": allreduce_s, "compute_s": compute_s, "compute_alone_s": alone_s,
              "grad_mb": grads.numel() * 4 / 1e6, "link_gbit_s": moved * 8 / allreduce_s / 1e9,
              "ddp_step_s": step_s if with_ddp else None, "predicted_step_s": step_s,
              # never above n: a step together that timed faster than one alone is the timer's noise, not a gain
              "predicted_speedup": min(float(n), n * alone_s / step_s)}
    if ctx.is_main:
        log(describe(result, n))
    return result


def describe(result: dict, world_size: int) -> str:
    compute, allreduce = result["compute_s"], result["allreduce_s"]
    share = allreduce / (compute + allreduce)
    alone = result["compute_alone_s"]
    shared = (f" ({1e3 * alone:.0f} ms for one rank alone: these ranks share a machine)"
              if compute > 1.1 * alone else "")
    step = result.get("ddp_step_s")
    if step is None:   # no DDP step timed (your own DDP): the sum, which assumes no overlap
        ddp, bound = "", f"\n  (ideal {world_size}x; DDP's overlap with the backward pass can do better)"
    else:
        hidden = min(1.0, max(0.0, (compute + allreduce - step) / allreduce))
        ddp = (f"\n  a DDP step of a copy {1e3 * step:.0f} ms, {100 * hidden:.0f} % of its all-reduce hidden behind "
               f"the backward pass;")
        bound = f" (ideal {world_size}x)"
    return (f"link probe: all-reduce of the {result['grad_mb']:.1f} MB of gradients takes "
            f"{1e3 * allreduce:.0f} ms (link {result['link_gbit_s']:.2f} Gbit/s);\n  one step's compute "
            f"{1e3 * compute:.0f} ms{shared};{ddp}\n  so communication is up to {100 * share:.0f} % of a step and "
            f"{world_size} ranks should be about {result['predicted_speedup']:.2f}x one rank{bound}")


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
    nothing communicated; the real model, its optimizer and the run's random numbers are not touched. Built with
    one warm-up step (allocations, cuDNN's choices); ``step()`` times one more."""

    def __init__(self, model, settings, ctx, num_classes: int, image_size: int, ddp: bool = False):
        self.ctx, self.dtype = ctx, amp_dtype(settings, ctx.device)
        self.net = local_batchnorm(copy.deepcopy(unwrap(model))).train()
        if ddp:   # a collective: every rank makes its copy together (rank 0's weights are copied to the others)
            self.net = wrap_ddp(self.net, settings, ctx)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=1e-3, momentum=settings.momentum)
        devices = [ctx.device] if ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):   # the run's random numbers stay as they were
            self.images = torch.randn(settings.batch_size, 3, image_size, image_size, device=ctx.device)
            self.labels = torch.randint(0, num_classes, (settings.batch_size,), device=ctx.device)
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


def _time_compute(model, settings, ctx, num_classes: int, image_size: int, rounds: int = 3) -> float:
    """Seconds per step of a ``Stepper``: the median of ``rounds`` steps after its warm-up, so that one step slowed
    by something else on the machine does not move the prediction."""
    stepper = Stepper(model, settings, ctx, num_classes, image_size)
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

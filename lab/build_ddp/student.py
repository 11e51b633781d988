"""Data parallelism built by hand: YOUR file. Replace each ``raise NotImplementedError(...)`` with code that
does what the docstring above it says: the docstring is the contract, the tests are the specification. Test it,
from the repository's root, with

    python -m pytest lab/build_ddp          # the tests: lab/build_ddp/test_build_ddp.py; README.md says more

Every rank holds a whole copy of the model and trains it on its own shard of each global batch. The copies
stay equal because (1) they start equal: rank 0's weights are copied to every rank, and (2) they take equal
steps: after backward() every gradient is replaced by its average over the ranks, which is the gradient of
the whole global batch (each rank's loss is a mean over a shard of the same size). The parts do (2) ever
faster, then build the collective itself, then shard the optimizer:

  (a) allreduce_gradients: after backward(), one all-reduce per parameter, one after the other.
  (b) OverlapDDP: each parameter's all-reduce starts (async) the moment its gradient is ready, while
      backward() is still computing the earlier layers' gradients; wait for them all before step().
  (c) BucketDDP: as (b), but gradients travel in a few large buckets instead of many small messages,
      as torch's DistributedDataParallel does (25 MiB buckets by default).
  (d) ring_all_reduce: the collective itself, from point-to-point sends and receives.
  (f) ShardedOptimizer: ZeRO-1, each rank keeps the optimizer state of about 1/N of the parameters.
  (Part (e) measures (a) to (d): bench.py.)

Stuck? lab/build_ddp/HINTS.md has hints for each part in three tiers (a nudge, the calls, the pitfalls): open
one at a time. The process group exists (dist.init_process_group) before any of this is called. Nothing here
may depend on the backend or the device: gloo with CPU tensors on a laptop, nccl with CUDA tensors on GPUs.
Use only torch and torch.distributed.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn


# ---------------------------------------------------------------------------------------------------------
# (a) Start equal, then average the gradients after backward()


def broadcast_parameters(module: nn.Module) -> None:
    """Copy rank 0's parameters and buffers into every rank's ``module``, in place.

    Call it once, on every rank, before training: afterwards all ranks hold rank 0's weights (and
    buffers, such as BatchNorm's running statistics), whatever seed each rank built its model with.
    """
    raise NotImplementedError(
        'write broadcast_parameters (part a): the docstring is the contract; lab/build_ddp/README.md '
        '(a) says what the tests check; HINTS.md (a) has hints, one tier at a time')


def allreduce_gradients(module: nn.Module) -> None:
    """After ``loss.backward()``, replace every parameter's ``.grad`` by its average over all ranks.

    Call it on every rank, between ``backward()`` and ``optimizer.step()``. Parameters without a
    gradient (``.grad is None``: frozen, or not used in this forward pass) are left alone; every rank
    must have the same ones.
    """
    raise NotImplementedError(
        'write allreduce_gradients (part a): the docstring is the contract; lab/build_ddp/README.md (a) '
        'says what the tests check; HINTS.md (a) has hints, one tier at a time')


# ---------------------------------------------------------------------------------------------------------
# (b) One asynchronous all-reduce per parameter, started by a gradient hook during backward()


class OverlapDDP(nn.Module):
    """Wraps ``module`` for data-parallel training; each gradient's all-reduce overlaps the backward pass.

    Use it like the module itself, and call ``finish_gradient_sync()`` between ``loss.backward()`` and
    ``optimizer.step()``::

        model = OverlapDDP(net)            # every rank; rank 0's weights and buffers are copied to all
        loss_fn(model(x), y).backward()    # all-reduces start while backward() runs
        model.finish_gradient_sync()       # wait: every .grad is now the mean over the ranks
        optimizer.step()

    Each trainable parameter's all-reduce starts during backward(), as soon as that parameter's gradient
    is complete, without waiting for it. Every rank runs the same backward, so the all-reduces start in
    the same order everywhere. A parameter that this forward pass did not use gets no gradient and is
    not sent. ``self.module`` is the wrapped module (checkpoints save ``model.module.state_dict()``).

    Gradient accumulation: inside ``with model.no_sync():`` backward() only adds to the ``.grad`` on this
    rank; the next backward() outside it sends the accumulated gradients.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        raise NotImplementedError(
            'write OverlapDDP.__init__ (part b): the docstring is the contract; lab/build_ddp/README.md (b) '
            'says what the tests check; HINTS.md (b) has hints, one tier at a time')

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate this rank's gradients; nothing is sent."""
        raise NotImplementedError(
            'write OverlapDDP.no_sync (part b): the docstring is the contract; lab/build_ddp/README.md (b) '
            'says what the tests check; HINTS.md (b) has hints, one tier at a time')
        yield   # a context manager: use it as `with model.no_sync():`

    def finish_gradient_sync(self) -> None:
        """Wait until every all-reduce started in this backward is done; then each ``.grad`` is the mean."""
        raise NotImplementedError(
            'write OverlapDDP.finish_gradient_sync (part b): the docstring is the contract; '
            'lab/build_ddp/README.md (b) says what the tests check; HINTS.md (b) has hints, one tier at a time')


# ---------------------------------------------------------------------------------------------------------
# (c) Buckets: fewer, larger all-reduces, each started as soon as its bucket is full


class BucketDDP(nn.Module):
    """As :class:`OverlapDDP`, but the gradients travel in buckets of at most ``bucket_bytes`` bytes.

    One all-reduce per parameter pays one message's latency per parameter: a ResNet-18 has 62 of them.
    Buckets send the same bytes in a few messages. A bucket holds parameters whose gradients backward()
    produces one after the other, at most ``bucket_bytes`` of them (a parameter larger than that gets a
    bucket of its own); the moment a bucket's last gradient is ready, one asynchronous all-reduce starts
    for all of it. From the second step on, the buckets follow the order in which the first step's
    gradients arrived (before the first backward that order is unknown: torch's DDP rebuilds its buckets
    after the first step for the same reason). A parameter this step did not use leaves its bucket
    short; ``finish_gradient_sync()`` still sends the rest of it, then waits for every bucket and writes
    the means back into each ``.grad``. ``no_sync()`` as for OverlapDDP. Usage as for OverlapDDP.
    """

    def __init__(self, module: nn.Module, bucket_bytes: int = 25 * 2**20):
        super().__init__()
        self.module = module
        self.bucket_bytes = bucket_bytes
        raise NotImplementedError(
            'write BucketDDP.__init__ (part c): the docstring is the contract; lab/build_ddp/README.md (c) '
            'says what the tests check; HINTS.md (c) has hints, one tier at a time')

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate this rank's gradients; nothing is sent."""
        raise NotImplementedError(
            'write BucketDDP.no_sync (part c): the docstring is the contract; lab/build_ddp/README.md (c) '
            'says what the tests check; HINTS.md (c) has hints, one tier at a time')
        yield   # a context manager: use it as `with model.no_sync():`

    def finish_gradient_sync(self) -> None:
        """Send what is left, wait for every bucket's all-reduce, then copy the means back into each ``.grad``."""
        raise NotImplementedError(
            'write BucketDDP.finish_gradient_sync (part c): the docstring is the contract; '
            'lab/build_ddp/README.md (c) says what the tests check; HINTS.md (c) has hints, one tier at a time')


# ---------------------------------------------------------------------------------------------------------
# (d) The all-reduce itself: a ring of point-to-point messages


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place, as torch.distributed's all-reduce does, and return it.

    ``tensor`` is contiguous, of any shape and size (not necessarily a multiple of the world size), with
    the same shape on every rank. Only point-to-point messages to the two ring neighbours are used:
    split the tensor into world_size chunks, then world_size - 1 steps of reduce-scatter (each rank adds
    the chunk arriving from rank - 1 to its own and passes the sum on to rank + 1; afterwards rank r holds
    the full sum of chunk r + 1) and world_size - 1 steps of all-gather (the finished chunks go round the
    ring once). Each rank sends 2 (world_size - 1) / world_size of the tensor, whatever the world size.
    """
    raise NotImplementedError(
        'write ring_all_reduce (part d): the docstring is the contract; lab/build_ddp/README.md (d) '
        'says what the tests check; HINTS.md (d) has hints, one tier at a time')


# ---------------------------------------------------------------------------------------------------------
# (f) ZeRO-1: the optimizer's state sharded over the ranks


class ShardedOptimizer(torch.optim.Optimizer):
    """Any optimizer, with its state split over the ranks (ZeRO stage 1).

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)`` on every rank
    behaves as ``torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)`` would on one process,
    given gradients that are already the mean over the ranks (DDP's): the same weights after every step.
    But each parameter is stepped by one rank only, its owner, which alone keeps its state (AdamW's two
    moments, SGD's momentum); after its step every parameter is sent from its owner to all ranks. The
    owners are chosen so that each rank steps about 1/N of the parameters' bytes. ``param_groups``,
    ``zero_grad()`` and ``step()`` work as on any torch optimizer (a learning-rate schedule that changes
    ``param_groups[i]["lr"]`` changes the step), and so does ``add_param_group`` (a group added later, on every
    rank alike: fine-tuning's unfrozen layers); ``self.state`` holds the state of this rank's own parameters
    only.
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        raise NotImplementedError(
            'write ShardedOptimizer.__init__ (part f): the docstring is the contract; '
            'lab/build_ddp/README.md (f) says what the tests check; HINTS.md (f) has hints, one tier at a time')

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of parameters and its hyper-parameters, as on any torch optimizer; on every rank, the same
        group. Its parameters get owners as the first ones did; this rank's own are stepped from now on."""
        raise NotImplementedError(
            'write ShardedOptimizer.add_param_group (part f): the docstring is the contract; '
            'lab/build_ddp/README.md (f) says what the tests check; HINTS.md (f) has hints, one tier at a time')

    @torch.no_grad()
    def step(self, closure=None):
        """Step every parameter once, as the unsharded optimizer would: each by its owner, then sent to all ranks."""
        raise NotImplementedError(
            'write ShardedOptimizer.step (part f): the docstring is the contract; lab/build_ddp/README.md '
            '(f) says what the tests check; HINTS.md (f) has hints, one tier at a time')

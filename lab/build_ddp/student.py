"""Data parallelism built by hand: YOUR file. Replace each ``raise NotImplementedError(...)`` with code that
does what the docstring above it says; the message says which calls to use. Test it, from the repository's
root, with

    python -m pytest lab/build_ddp          # the tests are the specification: lab/build_ddp/test_build_ddp.py

Every rank holds a whole copy of the model and trains it on its own shard of each global batch. The copies
stay equal because (1) they start equal: rank 0's weights are copied to every rank, and (2) they take equal
steps: after backward() every gradient is replaced by its average over the ranks, which is the gradient of
the whole global batch (each rank's loss is a mean over a shard of the same size). The four parts do (2)
ever faster:

  (a) allreduce_gradients: after backward(), one all-reduce per parameter, one after the other.
  (b) OverlapDDP: each parameter's all-reduce starts (async) the moment its gradient is ready, while
      backward() is still computing the earlier layers' gradients; wait for them all before step().
  (c) BucketDDP: as (b), but gradients travel in a few large buckets instead of many small messages,
      as torch's DistributedDataParallel does (25 MiB buckets by default).
  (d) ring_all_reduce: the collective itself, from point-to-point sends and receives.

The process group must exist (dist.init_process_group) before any of these is called. Nothing here may
depend on the backend or the device: gloo with CPU tensors on a laptop, nccl with CUDA tensors on GPUs.
Use only torch and torch.distributed (``dist.all_reduce`` as written here: the tests count its calls).
"""
from __future__ import annotations

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
        "write broadcast_parameters (part a): copy rank 0's tensors to every rank in place, one "
        "dist.broadcast(tensor.detach(), src=0) for each tensor of module.parameters() and module.buffers()")


def allreduce_gradients(module: nn.Module) -> None:
    """After ``loss.backward()``, replace every parameter's ``.grad`` by its average over all ranks.

    Call it on every rank, between ``backward()`` and ``optimizer.step()``. Parameters without a
    gradient (``.grad is None``) are left alone; every rank must have the same ones.
    """
    raise NotImplementedError(
        "write allreduce_gradients (part a): for every parameter whose .grad is not None, "
        "dist.all_reduce(param.grad) (a sum: gloo has no ReduceOp.AVG), then divide it by dist.get_world_size()")


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

    During backward(), as soon as a parameter's gradient is complete (a hook registered with
    ``param.register_post_accumulate_grad_hook``), one ``dist.all_reduce(..., async_op=True)`` starts for
    it. Every rank must run the same backward, so that the all-reduces start in the same order everywhere.
    ``self.module`` is the wrapped module (checkpoints save ``model.module.state_dict()``).
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        raise NotImplementedError(
            "write OverlapDDP.__init__ (part b): broadcast_parameters(module), then for every parameter that "
            "requires grad param.register_post_accumulate_grad_hook(hook), where hook(param) starts "
            "dist.all_reduce(param.grad, async_op=True) and keeps the work it returns for finish_gradient_sync")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_sync(self) -> None:
        """Wait until every all-reduce started in this backward is done; then each ``.grad`` is the mean."""
        raise NotImplementedError(
            "write OverlapDDP.finish_gradient_sync (part b): work.wait() for every all-reduce the hooks started "
            "in this backward (each .grad must end as the mean, not the sum), then forget them for the next step")


# ---------------------------------------------------------------------------------------------------------
# (c) Buckets: fewer, larger all-reduces, each started as soon as its bucket is full


class BucketDDP(nn.Module):
    """As :class:`OverlapDDP`, but the gradients travel in buckets of at most ``bucket_bytes`` bytes.

    One all-reduce per parameter pays one message's latency per parameter: a ResNet-18 has 62 of them.
    Buckets send the same bytes in a few messages. The buckets are decided once, in ``__init__``: the
    parameters in reverse order (backward() produces the last layer's gradients first), a bucket closed
    when the next parameter would take it past ``bucket_bytes``; a parameter larger than
    ``bucket_bytes`` gets a bucket of its own. During backward(), the moment a bucket's last gradient is
    ready, its gradients are flattened into one tensor and one ``dist.all_reduce(..., async_op=True)``
    starts for it. ``finish_gradient_sync()`` waits for each bucket and copies the averaged values back
    into the ``.grad`` of its parameters. Usage as for OverlapDDP.
    """

    def __init__(self, module: nn.Module, bucket_bytes: int = 25 * 2**20):
        super().__init__()
        self.module = module
        self.bucket_bytes = bucket_bytes
        raise NotImplementedError(
            "write BucketDDP.__init__ (part c): broadcast_parameters(module); put the parameters, last first, "
            "into buckets of at most bucket_bytes (param.numel() * param.element_size() each); give each a "
            "param.register_post_accumulate_grad_hook that counts its bucket's ready gradients and, when the "
            "bucket is full, starts dist.all_reduce(torch.cat([p.grad.flatten() ...]), async_op=True)")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's all-reduce, then copy the mean gradients back into each ``.grad``."""
        raise NotImplementedError(
            "write BucketDDP.finish_gradient_sync (part c): work.wait() for each bucket, copy its flat tensor "
            "back into the .grad of its parameters (flat.split(sizes), piece.view_as(param.grad), "
            "param.grad.copy_), then reset the buckets' counts for the next step")


# ---------------------------------------------------------------------------------------------------------
# (d) The all-reduce itself: a ring of point-to-point messages


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place, as ``dist.all_reduce(tensor)`` does, and return it.

    ``tensor`` is contiguous, of any shape and size (not necessarily a multiple of the world size), with
    the same shape on every rank. Only point-to-point messages to the two ring neighbours are used:
    split the tensor into world_size chunks, then world_size - 1 steps of reduce-scatter (each rank adds
    the chunk arriving from rank - 1 to its own and passes the sum on to rank + 1; afterwards rank r holds
    the full sum of chunk r + 1) and world_size - 1 steps of all-gather (the finished chunks go round the
    ring once). Each rank sends 2 (world_size - 1) / world_size of the tensor, whatever the world size.
    """
    raise NotImplementedError(
        "write ring_all_reduce (part d): chunks = tensor.view(-1).tensor_split(world_size); world_size - 1 "
        "reduce-scatter steps, then world_size - 1 all-gather steps, each sending one chunk to rank + 1 while "
        "receiving one from rank - 1: dist.batch_isend_irecv([dist.P2POp(dist.isend, chunk, right), "
        "dist.P2POp(dist.irecv, buffer, left)]), then .wait() on what it returns")

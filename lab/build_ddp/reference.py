"""Data parallelism built by hand: the kit's solution of the build-DDP lab (student.py is the same file
with the bodies left for you to write).

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

The process group must exist (dist.init_process_group) before any of these is called. Nothing here
depends on the backend or the device: gloo with CPU tensors on a laptop, nccl with CUDA tensors on GPUs.
"""
from __future__ import annotations

import functools

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
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.detach(), src=0)   # detach: the copy is not part of any gradient


def allreduce_gradients(module: nn.Module) -> None:
    """After ``loss.backward()``, replace every parameter's ``.grad`` by its average over all ranks.

    Call it on every rank, between ``backward()`` and ``optimizer.step()``. Parameters without a
    gradient (``.grad is None``) are left alone; every rank must have the same ones.
    """
    world_size = dist.get_world_size()
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)        # the sum over the ranks (gloo has no ReduceOp.AVG) ...
            param.grad /= world_size           # ... divided by their number: the mean


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
        self.world_size = dist.get_world_size()
        self.pending: list[dist.Work] = []   # the all-reduces started in this backward, not yet waited for
        broadcast_parameters(module)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._start_all_reduce)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _start_all_reduce(self, param: nn.Parameter) -> None:
        """Called by autograd once ``param.grad`` holds this backward's whole gradient."""
        param.grad /= self.world_size   # divide first: the all-reduce's sum is then the mean
        self.pending.append(dist.all_reduce(param.grad, async_op=True))

    def finish_gradient_sync(self) -> None:
        """Wait until every all-reduce started in this backward is done; then each ``.grad`` is the mean."""
        for work in self.pending:
            work.wait()
        self.pending.clear()


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
        self.world_size = dist.get_world_size()
        broadcast_parameters(module)

        self.buckets: list[list[nn.Parameter]] = [[]]
        size = 0   # bytes in the last bucket
        for param in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = param.numel() * param.element_size()
            if self.buckets[-1] and size + nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(param)
            size += nbytes
            param.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, len(self.buckets) - 1))

        self.ready = [0] * len(self.buckets)   # per bucket: how many of its gradients this backward produced
        self.pending: list[tuple[dist.Work, torch.Tensor, list[nn.Parameter]]] = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, index: int, param: nn.Parameter) -> None:
        """Called by autograd once ``param.grad`` is complete; starts bucket ``index`` when it is full."""
        self.ready[index] += 1
        if self.ready[index] == len(self.buckets[index]):
            bucket = self.buckets[index]
            flat = torch.cat([p.grad.flatten() for p in bucket]) / self.world_size   # a new tensor: one message
            self.pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's all-reduce, then copy the mean gradients back into each ``.grad``."""
        for work, flat, bucket in self.pending:
            work.wait()
            pieces = flat.split([p.numel() for p in bucket])
            for param, piece in zip(bucket, pieces):
                param.grad.copy_(piece.view_as(param.grad))
        self.pending.clear()
        self.ready = [0] * len(self.buckets)


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
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    chunks = tensor.view(-1).tensor_split(world_size)   # views: writing a chunk writes the tensor
    incoming = torch.empty_like(chunks[0])              # chunk 0 is the largest

    # Reduce-scatter: at step s, pass on the partial sum of chunk (rank - s), add the left one's to chunk (rank - s - 1).
    for step in range(world_size - 1):
        send, receive = chunks[(rank - step) % world_size], chunks[(rank - step - 1) % world_size]
        buffer = incoming[:receive.numel()]
        _send_and_receive(send, right, buffer, left)
        receive += buffer

    # All-gather: rank r starts with its finished chunk (r + 1); what arrives overwrites the stale chunk.
    for step in range(world_size - 1):
        send, receive = chunks[(rank + 1 - step) % world_size], chunks[(rank - step) % world_size]
        _send_and_receive(send, right, receive, left)
    return tensor


def _send_and_receive(send: torch.Tensor, to: int, receive: torch.Tensor, source: int) -> None:
    """Send ``send`` to rank ``to`` while receiving ``receive`` from rank ``source``; return when both are done.

    Both are posted before waiting for either: every rank sends at the same time, and a send may wait
    until its receiver has posted the matching receive. One ``batch_isend_irecv`` call, because NCCL
    deadlocks on a pair of separate isend/irecv calls between two ranks that send to each other; with
    gloo, ``dist.isend`` then ``dist.irecv`` does the same.
    """
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to), dist.P2POp(dist.irecv, receive, source)])
    for work in works:
        work.wait()

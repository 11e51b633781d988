"""Data parallelism built by hand: the kit's solution of the build-DDP lab (student.py is the same file with the
bodies left for you to write). Not in the student handout: read it after the deadline.

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

The process group must exist (dist.init_process_group) before any of these is called. Nothing here
depends on the backend or the device: gloo with CPU tensors on a laptop, nccl with CUDA tensors on GPUs.
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
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.detach(), src=0)   # detach: the copy is not part of any gradient


def allreduce_gradients(module: nn.Module) -> None:
    """After ``loss.backward()``, replace every parameter's ``.grad`` by its average over all ranks.

    Call it on every rank, between ``backward()`` and ``optimizer.step()``. Parameters without a
    gradient (``.grad is None``: frozen, or not used in this forward pass) are left alone; every rank
    must have the same ones.
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
        self.world_size = dist.get_world_size()
        self.syncing = True                  # False inside no_sync()
        self.pending: list[dist.Work] = []   # the all-reduces started in this backward, not yet waited for
        broadcast_parameters(module)
        for param in module.parameters():
            if param.requires_grad:          # a frozen parameter never gets a gradient: nothing to send
                param.register_post_accumulate_grad_hook(self._start_all_reduce)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate this rank's gradients; nothing is sent."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def _start_all_reduce(self, param: nn.Parameter) -> None:
        """Called by autograd once ``param.grad`` holds this backward's whole gradient (a tied weight's too)."""
        if not self.syncing:
            return
        param.grad /= self.world_size   # divide first: the all-reduce's sum is then the mean
        self.pending.append(dist.all_reduce(param.grad, async_op=True))

    def finish_gradient_sync(self) -> None:
        """Wait until every all-reduce started in this backward is done; then each ``.grad`` is the mean."""
        for work in self.pending:
            work.wait()   # until now .grad may hold a partial sum: the all-reduce writes into it
        self.pending.clear()


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
        self.world_size = dist.get_world_size()
        self.syncing = True
        broadcast_parameters(module)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._make_buckets(list(reversed(self.params)))   # a first guess: backward() runs the layers last to first
        self.rebuilt = False
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._grad_ready)

    def _make_buckets(self, order: list[nn.Parameter]) -> None:
        """Cut ``order`` into buckets of at most bucket_bytes; reset the per-step bookkeeping."""
        self.buckets: list[list[nn.Parameter]] = [[]]
        size = 0   # bytes in the last bucket
        for param in order:
            nbytes = param.numel() * param.element_size()
            if self.buckets[-1] and size + nbytes > self.bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(param)
            size += nbytes
        self.bucket_of = {param: index for index, bucket in enumerate(self.buckets) for param in bucket}
        self._new_step()

    def _new_step(self) -> None:
        self.ready = [0] * len(self.buckets)        # per bucket: how many of its gradients this backward produced
        self.started = [False] * len(self.buckets)
        self.arrived: list[nn.Parameter] = []       # this backward's gradients, in the order they came
        self.pending: list[tuple[dist.Work, torch.Tensor, list[nn.Parameter]]] = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """Backward passes inside only accumulate this rank's gradients; nothing is sent."""
        return OverlapDDP.no_sync(self)   # the same switch as OverlapDDP's

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Called by autograd once ``param.grad`` is complete; starts its bucket when that is full."""
        if not self.syncing:
            return
        self.arrived.append(param)
        index = self.bucket_of[param]
        self.ready[index] += 1
        if self.ready[index] == len(self.buckets[index]):
            self._start(index)

    def _start(self, index: int) -> None:
        bucket = [p for p in self.buckets[index] if p.grad is not None]   # an unused parameter has none
        flat = torch.cat([p.grad.flatten() for p in bucket]) / self.world_size   # a new tensor: one message
        self.pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))
        self.started[index] = True

    def finish_gradient_sync(self) -> None:
        """Send what is left, wait for every bucket's all-reduce, then copy the means back into each ``.grad``."""
        for index, bucket in enumerate(self.buckets):   # short of a gradient this forward pass did not make
            if not self.started[index] and any(p.grad is not None for p in bucket):
                self._start(index)
        for work, flat, bucket in self.pending:
            work.wait()
            for param, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                param.grad.copy_(piece.view_as(param.grad))
        if not self.rebuilt and self.arrived:   # once: buckets in the order the gradients really came
            came = {id(p) for p in self.arrived}   # by id: `tensor in list` would compare the values
            self._make_buckets(self._agreed(self.arrived + [p for p in reversed(self.params) if id(p) not in came]))
            self.rebuilt = True
        self._new_step()

    def _agreed(self, order: list[nn.Parameter]) -> list[nn.Parameter]:
        """Rank 0's order on every rank: buckets that differ between ranks would pair all-reduces of other sizes."""
        index = {param: i for i, param in enumerate(self.params)}
        message = [[index[p] for p in order]]
        dist.broadcast_object_list(message, src=0)
        return [self.params[i] for i in message[0]]


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
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        self.local: torch.optim.Optimizer | None = None   # the real optimizer, over this rank's own parameters
        self.owner: dict[nn.Parameter, int] = {}           # parameter -> the rank that steps it
        self.owned_bytes = [0] * dist.get_world_size()     # per rank: the bytes of the parameters it steps
        super().__init__(params, kwargs)   # self.param_groups: each group through add_param_group (below)
        self.state = self.local.state      # this rank's parameters' state only: the inner optimizer alone makes it

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of parameters and its hyper-parameters, as on any torch optimizer; on every rank, the same
        group. Its parameters get owners as the first ones did; this rank's own are stepped from now on."""
        super().add_param_group(param_group)   # into self.param_groups: every rank's parameters, defaults filled in
        group, rank = self.param_groups[-1], dist.get_rank()
        for param in sorted(group["params"], key=lambda p: -p.numel() * p.element_size()):   # largest first (stable:
            owner = min(range(len(self.owned_bytes)), key=self.owned_bytes.__getitem__)   # the same order on every
            self.owner[param] = owner                                                     # rank), each to the
            self.owned_bytes[owner] += param.numel() * param.element_size()               # lightest rank so far
        mine = {**group, "params": [p for p in group["params"] if self.owner[p] == rank]}   # may be empty: fine
        if self.local is None:   # torch.optim.Optimizer.__init__ calls this for each group it is given
            self.local = self.optimizer_cls([mine], **self.kwargs)
        else:
            self.local.add_param_group(mine)

    @torch.no_grad()
    def step(self, closure=None):
        """Step every parameter once, as the unsharded optimizer would: each by its owner, then sent to all ranks."""
        for group, mine in zip(self.param_groups, self.local.param_groups):   # a schedule changed ours: pass it on
            mine.update({key: value for key, value in group.items() if key != "params"})
        loss = self.local.step(closure)             # this rank's parameters only
        for group in self.param_groups:             # then every parameter from the rank that stepped it
            for param in group["params"]:
                dist.broadcast(param, src=self.owner[param])
        return loss

"""(c) as the kit's own solution was before the lab's harder tests: buckets in reversed parameters() order, and a
bucket is started only by its last gradient's hook, so a bucket short of a parameter this step did not use never
starts: its gradients are never all-reduced and the ranks drift apart without an error."""
import functools

import torch
import torch.distributed as dist
from torch import nn

from build_ddp import adapter

solution = adapter.solution()
broadcast_parameters, allreduce_gradients, OverlapDDP = (solution.broadcast_parameters, solution.allreduce_gradients,
                                                         solution.OverlapDDP)
ring_all_reduce, ShardedOptimizer = solution.ring_all_reduce, solution.ShardedOptimizer


class BucketDDP(nn.Module):
    def __init__(self, module, bucket_bytes=25 * 2**20):
        super().__init__()
        self.module, self.world_size, self.syncing = module, dist.get_world_size(), True
        broadcast_parameters(module)
        self.buckets, size = [[]], 0
        for param in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = param.numel() * param.element_size()
            if self.buckets[-1] and size + nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(param)
            size += nbytes
            param.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, len(self.buckets) - 1))
        self.ready, self.pending = [0] * len(self.buckets), []

    no_sync = solution.OverlapDDP.no_sync

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, index, param):
        if not self.syncing:
            return
        self.ready[index] += 1
        if self.ready[index] == len(self.buckets[index]):
            bucket = self.buckets[index]
            flat = torch.cat([p.grad.flatten() for p in bucket]) / self.world_size
            self.pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))

    def finish_gradient_sync(self):   # the mistake: a bucket that never filled is never sent
        for work, flat, bucket in self.pending:
            work.wait()
            for param, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                param.grad.copy_(piece.view_as(param.grad))
        self.pending.clear()
        self.ready = [0] * len(self.buckets)

"""(d) without a ring: every rank gathers every rank's tensor (dist.all_gather) and adds them up. The sum is right;
each rank receives the whole tensor N - 1 times instead of 2 (N - 1) / N of it."""
import torch
import torch.distributed as dist

from build_ddp import adapter

solution = adapter.solution()
broadcast_parameters, allreduce_gradients = solution.broadcast_parameters, solution.allreduce_gradients
OverlapDDP, BucketDDP, ShardedOptimizer = solution.OverlapDDP, solution.BucketDDP, solution.ShardedOptimizer


def ring_all_reduce(tensor):
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor)   # the mistake: a collective, no ring
    tensor.copy_(sum(everyone))
    return tensor

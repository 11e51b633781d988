"""(a) without the division: every gradient ends as the sum over the ranks, world_size times the mean."""
import torch.distributed as dist

from build_ddp import adapter

solution = adapter.solution()
broadcast_parameters, OverlapDDP, BucketDDP = solution.broadcast_parameters, solution.OverlapDDP, solution.BucketDDP
ring_all_reduce, ShardedOptimizer = solution.ring_all_reduce, solution.ShardedOptimizer


def allreduce_gradients(module):
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)   # the mistake: no division by the world size

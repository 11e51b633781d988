"""(a) with the wrong reduction: all-reduced with op=ReduceOp.MAX, then divided by the world size."""
import torch.distributed as dist

from build_ddp import adapter

solution = adapter.solution()
broadcast_parameters, OverlapDDP, BucketDDP = solution.broadcast_parameters, solution.OverlapDDP, solution.BucketDDP
ring_all_reduce, ShardedOptimizer = solution.ring_all_reduce, solution.ShardedOptimizer


def allreduce_gradients(module):
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.MAX)   # the mistake: the largest, not the sum
            param.grad /= dist.get_world_size()

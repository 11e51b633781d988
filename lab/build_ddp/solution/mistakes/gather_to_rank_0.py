"""(d) without a ring, from point-to-point messages: every rank sends its whole tensor to rank 0, which adds them up
and sends the sum back to each. The sum is right; rank 0 receives and sends N - 1 whole tensors."""
import torch
import torch.distributed as dist

from build_ddp import adapter

solution = adapter.solution()
broadcast_parameters, allreduce_gradients = solution.broadcast_parameters, solution.allreduce_gradients
OverlapDDP, BucketDDP, ShardedOptimizer = solution.OverlapDDP, solution.BucketDDP, solution.ShardedOptimizer


def ring_all_reduce(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:   # the mistake: everything through rank 0
        incoming = torch.empty_like(tensor)
        for other in range(1, world_size):
            dist.recv(incoming, src=other)
            tensor += incoming
        for other in range(1, world_size):
            dist.send(tensor, dst=other)
    else:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)
    return tensor

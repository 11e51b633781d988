"""(d) a ring whose chunk arithmetic holds for 2 ranks only: in the reduce-scatter, what arrives is added to the
chunk after the one sent ((rank + step + 1), the same as (rank - step - 1) when there are 2 ranks)."""
import torch.distributed as dist

from build_ddp import adapter

solution = adapter.solution()
broadcast_parameters, allreduce_gradients = solution.broadcast_parameters, solution.allreduce_gradients
OverlapDDP, BucketDDP, ShardedOptimizer = solution.OverlapDDP, solution.BucketDDP, solution.ShardedOptimizer


def ring_all_reduce(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    chunks = tensor.view(-1).tensor_split(world_size)
    incoming = chunks[0].clone()
    for step in range(world_size - 1):
        send = chunks[(rank - step) % world_size]
        receive = chunks[(rank + step + 1) % world_size]   # the mistake: (rank - step - 1) % world_size
        buffer = incoming[:receive.numel()]
        solution._send_and_receive(send, right, buffer, left)
        receive += buffer
    for step in range(world_size - 1):
        send, receive = chunks[(rank + 1 - step) % world_size], chunks[(rank - step) % world_size]
        solution._send_and_receive(send, right, receive, left)
    return tensor

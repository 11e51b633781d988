"""(f) whose local optimizer never hears of the schedule: its param_groups keep the first learning rate."""
import torch

from build_ddp import adapter

solution = adapter.solution()
broadcast_parameters, allreduce_gradients = solution.broadcast_parameters, solution.allreduce_gradients
OverlapDDP, BucketDDP, ring_all_reduce = solution.OverlapDDP, solution.BucketDDP, solution.ring_all_reduce


class ShardedOptimizer(solution.ShardedOptimizer):
    @torch.no_grad()
    def step(self, closure=None):
        loss = self.local.step(closure)   # the mistake: the groups' lr is not passed on first
        for group in self.param_groups:
            for param in group["params"]:
                torch.distributed.broadcast(param, src=self.owner[param])
        return loss

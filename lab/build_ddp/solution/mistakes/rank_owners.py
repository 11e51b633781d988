"""(f) whose owners depend on the rank: a tie between the lightest ranks goes to the rank deciding, so each rank
believes it owns the first parameter (and others): both broadcast it, and neither receives."""
import torch.distributed as dist

from build_ddp import adapter

solution = adapter.solution()
broadcast_parameters, allreduce_gradients = solution.broadcast_parameters, solution.allreduce_gradients
OverlapDDP, BucketDDP, ring_all_reduce = solution.OverlapDDP, solution.BucketDDP, solution.ring_all_reduce


class ShardedOptimizer(solution.ShardedOptimizer):
    def add_param_group(self, param_group):
        super(solution.ShardedOptimizer, self).add_param_group(param_group)
        group, rank = self.param_groups[-1], dist.get_rank()
        for param in sorted(group["params"], key=lambda p: -p.numel() * p.element_size()):
            # the mistake: ties go to this rank, so the ranks disagree
            owner = min(range(len(self.owned_bytes)), key=lambda r: (self.owned_bytes[r], r != rank))
            self.owner[param] = owner
            self.owned_bytes[owner] += param.numel() * param.element_size()
        mine = {**group, "params": [p for p in group["params"] if self.owner[p] == rank]}
        if self.local is None:
            self.local = self.optimizer_cls([mine], **self.kwargs)
        else:
            self.local.add_param_group(mine)

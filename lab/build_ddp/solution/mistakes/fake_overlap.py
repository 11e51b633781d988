"""(b) that overlaps nothing: the hooks only count, and the last gradient's hook starts every all-reduce. The
numbers are right, every call is async and inside backward(), yet communication waits for all of backward."""
import torch.distributed as dist

from build_ddp import adapter

solution = adapter.solution()
broadcast_parameters, allreduce_gradients, BucketDDP = (solution.broadcast_parameters, solution.allreduce_gradients,
                                                        solution.BucketDDP)
ring_all_reduce, ShardedOptimizer = solution.ring_all_reduce, solution.ShardedOptimizer


class OverlapDDP(solution.OverlapDDP):
    def __init__(self, module):
        super().__init__(module)
        self.ready = []

    def _start_all_reduce(self, param):
        if not self.syncing:
            return
        self.ready.append(param)
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        if len(self.ready) == len(trainable) or (not self.module.use_aux and len(self.ready) == len(trainable) - 2):
            for p in self.ready:   # the mistake: everything starts from the last hook
                p.grad /= self.world_size
                self.pending.append(dist.all_reduce(p.grad, async_op=True))
            self.ready = []

"""(b) that never waits: finish_gradient_sync() forgets the works, so step() may read a gradient mid-sum."""
from build_ddp import adapter

solution = adapter.solution()
broadcast_parameters, allreduce_gradients, BucketDDP = (solution.broadcast_parameters, solution.allreduce_gradients,
                                                        solution.BucketDDP)
ring_all_reduce, ShardedOptimizer = solution.ring_all_reduce, solution.ShardedOptimizer


class OverlapDDP(solution.OverlapDDP):
    def finish_gradient_sync(self):
        self.pending.clear()   # the mistake: no work.wait()

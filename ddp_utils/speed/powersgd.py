"""PowerSGD's memory kept per parameter, so that it goes into the checkpoint and a resume is exact.

PyTorch's PowerSGD hook (``comm.py``) carries three things from one step to the next, per DDP
*bucket*: the error feedback (what this rank's approximation missed: a flat tensor in the bucket's
layout) and the warm-start matrices P and Q (one slice per compressed gradient, grouped by shape).
The buckets are not fixed: DDP regroups its parameters after its first backward pass (by the order
their gradients became ready), and a resumed run's new DDP starts again from the initial grouping.
Memory saved as it is would be added to other parameters' gradients at the first resumed step.

So ``Memory`` holds what the hook carries *per parameter* whenever the grouping may have changed: at
each bucket it checks which parameters the bucket holds, and when they differ from the bucket the
memory was made for, it takes the memory apart by parameter and lays it out again for the new
buckets. The checkpoint stores it by parameter name: P and Q once (they are the same on every rank
after their all-reduce), the error once per rank: rank 0 fetches the others' one at a time into one buffer and
keeps them on the CPU (a gather would hold every rank's on rank 0's GPU at once: about 6.5 GB for ResNet-50 at 64
ranks), and a resume sends each rank its own (``checkpoint.load_state`` leaves them out of what it broadcasts).

It also draws the first Q of each parameter itself, from the run's seed, the step and the parameter's
position, instead of letting the hook draw one per bucket: then the random start does not depend on
the grouping either (a resume on the very step PowerSGD starts).
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from ..checkpoint import CheckpointError


def hook(memory: "Memory", bucket):
    """PowerSGD, its memory laid out for ``bucket`` first (register it with a ``Memory`` as the state). A
    ``warmup_precision`` of bf16 sends the warm-up's uncompressed gradients in bf16 instead of fp32."""
    state = memory.state
    if memory.warmup_precision == "bf16" and state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)   # what PowerSGD's own warm-up does: it compresses from the same step
        return default_hooks.bf16_compress_hook(state.process_group, bucket)
    memory.prepare(bucket)
    return powerSGD_hook.powerSGD_hook(state, bucket)


class Memory:
    """A PowerSGD state whose memory survives DDP's regrouping of buckets and a resume.

    ``attach`` it to the DDP model before the first step. ``state_dict`` / ``load_state_dict`` are
    collectives (every rank calls them)."""

    def __init__(self, state: powerSGD_hook.PowerSGDState, seed: int, warmup_precision: str = "fp32"):
        self.state, self.seed, self.warmup_precision = state, seed, warmup_precision
        self.names: dict[torch.nn.Parameter, str] = {}   # the DDP model's parameters (``attach``)
        self.order: dict[str, int] = {}                  # a parameter's position, for its random start
        self.plans: dict[int, list] = {}                 # bucket index -> its pieces, for the memory held now
        self.store: dict[str, dict] = {}                 # parameter name -> {"error", "p", "q"} not laid out yet

    # -- laying the memory out ------------------------------------------------------------------------
    def prepare(self, bucket) -> None:
        """Before the hook sees ``bucket``: make its memory the one for the parameters it holds now."""
        state = self.state
        if state.iter < state.start_powerSGD_iter:
            return   # the exact warm-up: no memory yet
        if not self.names:
            raise RuntimeError("powersgd.Memory: attach() it to the DDP model before the first step")
        index = bucket.index()
        names = [self.names[p] for p in bucket.parameters()]
        plan = self.plans.get(index)
        if plan is not None and [piece[0] for piece in plan] == names and index in state.p_memory_dict:
            return   # the same bucket as at the last step: the hook's memory is right as it is
        # A new grouping (DDP regrouped, a new DDP after a resume) or no memory yet: the buckets that held this
        # one's parameters (from earlier steps, so their hooks are done) go into the store by parameter
        mine = set(names)
        for old in [k for k, p in self.plans.items() if k == index or mine.intersection(q[0] for q in p)]:
            self._take_apart(old)
        self.plans[index] = plan = _plan(bucket, names, state)
        self._lay_out(index, plan, bucket.buffer())

    def _take_apart(self, index: int) -> None:
        """One bucket's memory into ``store``, by parameter, and out of the hook's dicts."""
        state = self.state
        plan = self.plans.pop(index)
        if index in state.error_dict and index in state.p_memory_dict:
            self.store.update(_pieces(plan, state, index))
        for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            memory.pop(index, None)

    def _lay_out(self, index: int, plan: list, buffer: torch.Tensor) -> None:
        """The hook's memory for one bucket, from ``store`` (zero error and a random Q where it has none)."""
        state = self.state
        p_size = sum(p_len for _, _, (_, p_len), _ in plan)
        q_size = sum(q_len for _, _, _, (_, q_len) in plan)
        error = torch.zeros_like(buffer)
        p = torch.zeros(p_size, device=buffer.device, dtype=buffer.dtype)
        q = torch.empty(q_size, device=buffer.device, dtype=buffer.dtype)
        for name, (start, numel), (p_start, p_len), (q_start, q_len) in plan:
            saved = self.store.pop(name, None)
            if saved is not None:
                error[start:start + numel] = saved["error"].to(buffer.device).view(-1)
            if not q_len:
                continue
            if saved is not None and "q" in saved:
                p[p_start:p_start + p_len] = saved["p"].to(buffer.device).view(-1)
                q[q_start:q_start + q_len] = saved["q"].to(buffer.device).view(-1)
            else:   # PowerSGD's first step for this parameter: a random Q (the hook orthogonalizes it)
                rng = torch.Generator().manual_seed(self.seed * 1_000_003 + state.iter * 10_007 + self.order[name])
                q[q_start:q_start + q_len] = torch.randn(q_len, generator=rng, dtype=buffer.dtype)
        state.error_dict[index], state.p_memory_dict[index], state.q_memory_dict[index] = error, p, q

    def forget(self) -> None:
        """Drop all memory (after an fp16 overflow put inf in it): the next steps start it afresh."""
        self.plans.clear()
        self.store.clear()
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()

    def attach(self, ddp_model) -> None:
        """Learn the DDP model's parameter names (the checkpoint's keys)."""
        self.names = {p: name for name, p in ddp_model.module.named_parameters()}
        self.order = {name: i for i, name in enumerate(self.names.values())}

    # -- the checkpoint -------------------------------------------------------------------------------
    def by_parameter(self) -> dict[str, dict]:
        """All memory held now, by parameter name (without changing it)."""
        pieces = dict(self.store)
        for index, plan in self.plans.items():
            if index in self.state.error_dict and index in self.state.p_memory_dict:
                pieces.update(_pieces(plan, self.state, index))
        return pieces

    def state_dict(self, ctx) -> dict:
        """What the checkpoint keeps (a collective: every rank's error feedback goes to rank 0, one rank at a time).

        ``{"iter", "start", "rank", "names", "p", "q", "errors"}``: ``p`` / ``q`` by name, ``errors`` one flat tensor per
        rank (the parameters of ``names`` one after the other); empty before PowerSGD's first step."""
        pieces = self.by_parameter()
        names = [name for name in self.order if name in pieces]
        saved = {"iter": self.state.iter, "start": self.state.start_powerSGD_iter,
                 "rank": self.state.matrix_approximation_rank, "names": names,
                 "p": {n: pieces[n]["p"].cpu() for n in names if "p" in pieces[n]},
                 "q": {n: pieces[n]["q"].cpu() for n in names if "q" in pieces[n]}, "errors": []}
        if not names:
            return saved
        error = torch.cat([pieces[n]["error"].view(-1) for n in names])
        saved["errors"] = [error.to("cpu", copy=True)] if ctx.is_main else []   # DDP: rank 0 writes the file
        if ctx.distributed:
            buffer = torch.empty_like(error)
            for rank in range(1, ctx.world_size):   # one rank's at a time: one buffer on the device (_one_by_one)
                if ctx.rank == rank:
                    buffer.copy_(error)
                dist.broadcast(buffer, src=rank)
                if ctx.is_main:
                    saved["errors"].append(buffer.to("cpu", copy=True))
        return saved

    def load_state_dict(self, saved: dict, ctx) -> str:
        """Continue from ``saved`` (a collective where several ranks run). Returns what was restored, in words.

        ``saved["errors"]``: every rank's error feedback on rank 0 (or in one process); on the other ranks the
        number of ranks that saved one (``checkpoint.load_state`` does not broadcast them): rank 0 sends each rank
        its own. Resumed on another number of ranks, every rank takes the ranks' mean error: the averaged
        gradient then gets the same correction it would have got. With another ``--powersgd-rank`` the
        warm-start matrices do not fit: they start afresh."""
        self.forget()
        self.state.iter = saved["iter"]
        # the warm-up the run started with: a resume with more epochs (or ranks) would move it past the step reached,
        # back to the exact all-reduce, then compress again with stale error feedback
        start = saved.get("start", self.state.start_powerSGD_iter)   # checkpoints before this key: this run's
        kept = f"; its warm-up of {start} steps kept" if start != self.state.start_powerSGD_iter else ""
        self.state.start_powerSGD_iter = start
        errors = saved["errors"]
        count = errors if isinstance(errors, int) else len(errors)
        if not saved["names"] or not count:
            return f"PowerSGD continues at step {saved['iter']} (no memory yet{kept})"
        note = kept
        if saved["rank"] != self.state.matrix_approximation_rank:
            saved, note = {**saved, "p": {}, "q": {}}, f"; saved with rank {saved['rank']}: the warm start afresh"
        sizes = {name: p.numel() for p, name in self.names.items()}
        for name in saved["names"]:
            if name not in sizes:
                raise CheckpointError(f"The checkpoint's PowerSGD memory is for a parameter {name!r}, which this "
                                      f"model does not have: it was saved by another model. Resume with the "
                                      f"settings it was saved with, or start a new run.")
        same = count == ctx.world_size
        error = self._own_error(errors, same, sum(sizes[name] for name in saved["names"]), ctx)
        start = 0
        for name in saved["names"]:
            numel = sizes[name]
            piece = {"error": error[start:start + numel]}
            start += numel
            if name in saved["p"]:
                piece["p"], piece["q"] = saved["p"][name], saved["q"][name]
            self.store[name] = piece
        if not same:
            note += f"; the error feedback of {count} ranks, averaged, on each of {ctx.world_size}"
        return f"PowerSGD continues at step {saved['iter']} with its error feedback and warm start{note}"

    def _own_error(self, errors, same: bool, numel: int, ctx) -> torch.Tensor:
        """This rank's saved error feedback (``same``: as many ranks saved one), else the saved ones' mean; rank 0
        holds them all and sends each rank its own, one rank at a time."""
        if not ctx.distributed:
            return errors[0] if same else torch.stack(errors).mean(0)
        device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        dtype = next(iter(self.names)).dtype   # the gradients', hence the error feedback's
        if not same:   # one tensor for every rank
            mean = torch.stack(errors).mean(0).to(device) if ctx.is_main else torch.empty(numel, dtype=dtype,
                                                                                             device=device)
            dist.broadcast(mean, src=0)
            return mean.cpu()
        own, buffer = errors[0] if ctx.is_main else None, torch.empty(numel, dtype=dtype, device=device)
        for rank in range(1, ctx.world_size):   # one rank's at a time, a broadcast on the group all share (_one_by_one)
            if ctx.is_main:
                buffer.copy_(errors[rank])
            dist.broadcast(buffer, src=0)
            if ctx.rank == rank:
                own = buffer.to("cpu", copy=True)   # the buffer takes the next rank's (on gloo .cpu() is no copy)
        return own


# _one_by_one: every rank's error feedback moves between rank 0 and each rank as a broadcast on the default group,
# one rank at a time, not as send/recv: on NCCL a send/recv pair builds a communicator of its own for each pair of
# ranks, one after the other, through a store client whose timeout the kit sets to 10 s, so at 3+ GPU ranks on a
# slow link the epoch-end checkpoint could fail (issue 37, finding 10). A broadcast also reaches the ranks that do
# not need it: one buffer's bytes more on their link per rank, for no new communicator.


def _plan(bucket, names: list[str], state) -> list:
    """Where each parameter's memory lies for this bucket, as the hook lays it out:
    ``[(name, (start, numel) in the flat bucket, (p_start, p_len), (q_start, q_len))]``, lengths 0 when the
    gradient is sent uncompressed. P and Q slices are grouped by matrix shape, in order of first appearance."""
    buffer, grads = bucket.buffer(), bucket.gradients()
    spans, groups = [], defaultdict(list)
    for name, grad in zip(names, grads):
        start = (grad.data_ptr() - buffer.data_ptr()) // grad.element_size()
        spans.append((name, (start, grad.numel())))
        n, m = grad.shape[0], grad.numel() // grad.shape[0]
        rank = min(n, m, state.matrix_approximation_rank)
        if powerSGD_hook._should_compress(n, m, rank, state.min_compression_rate)[0]:
            groups[(n, m)].append((name, n * rank, m * rank))
    slices, p_at, q_at = {}, 0, 0
    for members in groups.values():
        for name, p_len, q_len in members:
            slices[name] = ((p_at, p_len), (q_at, q_len))
            p_at, q_at = p_at + p_len, q_at + q_len
    return [(name, span, *slices.get(name, ((0, 0), (0, 0)))) for name, span in spans]


def _pieces(plan: list, state, index: int):
    """``(name, {"error", "p", "q"})`` for each parameter of a bucket's memory (copies)."""
    error, p, q = state.error_dict[index], state.p_memory_dict[index], state.q_memory_dict[index]
    for name, (start, numel), (p_start, p_len), (q_start, q_len) in plan:
        piece = {"error": error[start:start + numel].clone()}
        if q_len:
            piece["p"] = p[p_start:p_start + p_len].clone()
            piece["q"] = q[q_start:q_start + q_len].clone()
        yield name, piece

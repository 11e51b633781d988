"""Loss and top-k accuracy kept as sums and counts, so that ranks can add them up exactly; and the error raised
when they stop being finite numbers (``Diverged``)."""
from __future__ import annotations

import math

import torch

from . import collectives


def topk_correct(logits: torch.Tensor, target: torch.Tensor, ks=(1, 5)) -> torch.Tensor:
    """How many rows of ``logits`` (N, C) have ``target`` (N,) among their k best, for each k.

    Returns a float tensor of len(ks) counts. k is capped at C (top-5 of 3 classes = top-3).
    """
    kmax = min(max(ks), logits.shape[1])
    top = logits.topk(kmax, dim=1).indices                 # (N, kmax)
    hits = top.eq(target.unsqueeze(1))                     # (N, kmax) bool
    return torch.stack([hits[:, :min(k, kmax)].any(dim=1).sum() for k in ks]).float()


class Meter:
    """Running sums of loss, top-1 and top-5 hits and sample count, on the device (no sync per step).

    ``reduced(ctx)`` adds the sums of all ranks, so every rank gets the same global numbers.
    """

    def __init__(self, device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top1, top5, n

    def update(self, loss_sum: torch.Tensor, logits: torch.Tensor, target: torch.Tensor) -> None:
        """loss_sum: summed (not averaged) loss over the batch. Adds on the device, no host sync."""
        self.sums[0] += loss_sum.detach().double()
        self.sums[1:3] += topk_correct(logits.detach(), target).double()
        self.sums[3] += target.shape[0]   # a Python number: no host-to-device copy per step

    def add(self, other: "Meter") -> None:
        self.sums += other.sums

    def reduced(self, ctx) -> dict:
        """Global {loss, acc1, acc5 (percent), count} over all ranks. A collective: call on every rank."""
        sums = collectives.all_reduce_sum(self.sums.clone(), ctx)
        loss, c1, c5, n = sums.tolist()
        n_safe = max(n, 1.0)
        return {"loss": loss / n_safe, "acc1": 100.0 * c1 / n_safe, "acc5": 100.0 * c5 / n_safe, "count": int(n)}

    def reset(self) -> None:
        self.sums.zero_()


class Diverged(RuntimeError):
    """The loss (or the weights) stopped being finite numbers: training cannot recover by itself.

    Raised on every rank at once: the values checked are the global, all-reduced ones.
    """

    def __init__(self, what: str, step: int, lr: float, message: str = ""):
        self.what, self.step, self.lr = what, step, lr
        super().__init__(message or f"training diverged at step {step}: {what} with lr {lr:.4g}.")

    def explain(self, rank: int, kept: str) -> str:
        kept = (f"{kept}, the last one with finite numbers" if "holds epoch" in kept
                else kept or "rank 0's last.pt, if there is one, holds the last epoch with finite numbers")
        return (f"rank {rank}: training diverged at step {self.step}: {self.what} with lr {self.lr:.4g}. "
                f"Nothing of this epoch was saved; {kept}. Try a smaller lr (a tenth), a longer warm-up "
                f"(--warmup-epochs / WARMUP_EPOCHS), or, if fp16 overflowed, no AMP (--amp off) or bf16 on a GPU "
                f"that has it (compute capability 8.0+, not a T4: --amp bf16; in a notebook amp= in the Settings "
                f"cell); then start again (or resume from that checkpoint with the smaller lr).")


def check_finite(value: float, what: str, step: int, lr: float) -> None:
    if not math.isfinite(value):
        raise Diverged(f"{what} is {value}", step, lr)

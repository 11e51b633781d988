"""Loss and top-k accuracy kept as sums and counts, so that ranks can add them up exactly."""
from __future__ import annotations

import torch

from . import distributed


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
        sums = distributed.all_reduce_sum(self.sums.clone(), ctx)
        loss, c1, c5, n = sums.tolist()
        n_safe = max(n, 1.0)
        return {"loss": loss / n_safe, "acc1": 100.0 * c1 / n_safe, "acc5": 100.0 * c5 / n_safe, "count": int(n)}

    def reset(self) -> None:
        self.sums.zero_()

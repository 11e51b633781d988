"""A whole run in one call: process group, data, model, logger, ``fit``, teardown.

This is what ``python -m ddp_utils train`` does; the notebooks make the same calls one cell at a time.
"""
from __future__ import annotations

import os

import torch

from . import checkpoint, distributed
from .data import build_data
from .model import build_model, prepare_model
from .runlog import make_logger
from .train import evaluate_only, fit


def run(settings, resume: str | None = None, evaluate: bool = False, log=print) -> dict:
    """Train (or, with ``evaluate``, only evaluate ``resume``) and return the results on every rank."""
    if evaluate and not resume:
        raise ValueError("--evaluate needs --resume PATH: the checkpoint whose weights to evaluate")
    if resume and not evaluate and not settings.run_dir:
        # Continue writing into the folder the checkpoint came from (evaluation gets a new folder).
        settings = settings.replace(run_dir=os.path.dirname(os.path.abspath(resume)))
    with distributed.session(settings, log=log) as ctx:
        torch.manual_seed(settings.seed)   # DDP: same initial weights on every rank
        data = build_data(settings, ctx.rank, ctx.world_size, ctx.device)
        distributed.agree(data.fingerprint(), ctx, what="data")   # DDP: same data on every node
        model = prepare_model(build_model(settings.arch, data.num_classes), settings, ctx)
        # On resume, TensorBoard drops what the interrupted run logged after its checkpoint.
        resume_step = checkpoint.load_checkpoint(resume)["step"] if resume and not evaluate and ctx.is_main else None
        logger = make_logger(settings, ctx.rank, resume=bool(resume) and not evaluate, resume_step=resume_step)
        try:
            logger.model_summary(model, (3, data.image_size, data.image_size))
            if evaluate:
                return evaluate_only(settings, ctx, data, model, logger, resume)
            return fit(settings, ctx, data, model, logger, resume=resume)
        except RuntimeError as exc:
            if ctx.distributed and _lost_a_peer(exc):
                raise PeerLost(_peer_lost_text(settings, ctx, logger, exc)) from exc
            raise
        finally:
            logger.close()


class PeerLost(RuntimeError):
    """Another rank stopped answering in the middle of training."""


_PEER_SIGNS = ("connection", "closed", "reset", "peer", "timed out", "timeout", "broken pipe", "nccl")


def _lost_a_peer(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(sign in text for sign in _PEER_SIGNS)


def _peer_lost_text(settings, ctx, logger, exc) -> str:
    first_line = (str(exc).strip().splitlines() or ["?"])[0][:200]
    where = f"{logger.run_dir}/last.pt" if logger.run_dir else "last.pt in rank 0's run folder"
    return (f"rank {ctx.rank}: training stopped because another rank stopped answering ({first_line}). "
            f"Its node may have crashed, been interrupted or lost the network. The last completed epoch is "
            f"saved as {where}. Restart every rank with --resume pointing at that file on rank 0 "
            f"(in the notebooks: RESUME); rank 0 sends it to the others, so the nodes need no shared folder.")

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
        finally:
            logger.close()

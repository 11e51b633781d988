"""``prepare()``: everything a run needs, made in one order by every entry point.

The command line, the three notebooks, the labs and the benchmarks all call it, so a resume, the
TensorBoard purge or a lost peer behave the same everywhere::

    job = prepare(settings, resume=None)    # process group, threads, data, resume state, model, run folder
    with job:                               # closes the logs; after an error also leaves the group
        results = fit(job)                  # train.fit: the epochs

``run_job(settings)`` does both and always leaves the process group: ``python -m ddp_utils train``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import checkpoint, distributed
from .data import build_data
from .datasets import Data
from .model import build_model, prepare_model
from .runlog import NullLogger, RunLogger, make_logger
from .threads import set_threads
from .train import evaluate_only, fit


@dataclass
class Job:
    """What ``prepare`` made: pass it to ``fit`` (or ``evaluate_only``)."""
    settings: object                  # the Settings of the run (run_dir filled in on a resume)
    ctx: distributed.DistContext      # rank, world size, device, backend
    data: Data                        # this rank's loaders
    model: torch.nn.Module            # on the device; DDP-wrapped with several ranks
    logger: RunLogger | NullLogger    # rank 0 writes the run folder, the others get a NullLogger
    state: dict | None = None         # the checkpoint to continue from (or to evaluate), on every rank
    resume: str | None = None         # its path on rank 0
    model_table: str = ""             # the layer table (rank 0), also in model_summary.txt

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:      # the run folder says why the run ended
            self.logger.error(f"{exc_type.__name__}: {exc}" if not str(exc).startswith("rank") else str(exc))
        self.logger.close(exit_code=0 if exc_type is None else 1)
        if exc_type is not None:      # DDP: leave the broken group, so that setup can run again
            distributed.teardown()


def prepare(settings, resume: str | None = None, evaluate: bool = False, log=print) -> Job:
    """Set up the process group and build the data, model and logger of a run, on this rank.

    ``resume``: rank 0's path to a last.pt / best.pt; training continues after its epoch, in its
    folder (unless ``settings.run_dir`` says otherwise). With ``evaluate`` its weights are only
    evaluated, into a new run folder. Every rank must call this with the same settings; on an
    error the process group is left, so that calling it again starts cleanly.
    """
    if evaluate and not resume:
        raise ValueError("--evaluate needs --resume PATH: the checkpoint whose weights to evaluate")
    if resume and not evaluate and not settings.run_dir:
        # Continue writing into the folder the checkpoint came from (evaluation gets a new folder).
        settings = settings.replace(run_dir=os.path.dirname(os.path.abspath(resume)))
    ctx = distributed.setup(settings, log)   # DDP: pre-flight, process group, settings agreement
    try:
        set_threads(settings, ctx, log)       # ranks sharing a machine share its cores
        data = build_data(settings, ctx.rank, ctx.world_size, ctx.device)
        distributed.agree(data.fingerprint(), ctx, what="data")   # DDP: same data on every node
        # DDP: loading is a collective (rank 0 reads its file and sends it), so all resume or none.
        distributed.agree({"resume": bool(resume)}, ctx, what="whether to resume")
        state = checkpoint.load_state(resume, ctx) if resume else None
        if state is not None:
            checkpoint.check_matches(state, settings, resume)   # not an 8 KB key dump from load_state_dict
        torch.manual_seed(settings.seed)      # reproducible initial weights; DDP then copies rank 0's to all
        model = prepare_model(build_model(settings.arch, data.num_classes), settings, ctx)   # DDP: wrap
        continuing = state is not None and not evaluate
        # On a resume, TensorBoard drops what the interrupted run logged after its checkpoint.
        logger = make_logger(settings, ctx.rank, resume=continuing, resume_step=state["step"] if continuing else None)
        try:
            table = logger.model_summary(model, (3, data.image_size, data.image_size))
        except BaseException:
            logger.close(exit_code=1)
            raise
    except BaseException:   # also KeyboardInterrupt: never leave a half-made process group
        distributed.teardown()
        raise
    return Job(settings, ctx, data, model, logger, state, resume, table)


def run_job(settings, resume: str | None = None, evaluate: bool = False, log=print) -> dict:
    """``prepare`` + ``fit`` (or ``evaluate_only``), then leave the process group; the results on every rank."""
    try:
        with prepare(settings, resume=resume, evaluate=evaluate, log=log) as job:
            return evaluate_only(job) if evaluate else fit(job)
    finally:
        distributed.teardown()

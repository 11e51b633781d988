"""``prepare()``: everything a run needs, made in one order by every entry point.

The command line, the three notebooks, the labs and the benchmarks all call it, so a resume, the
TensorBoard purge or a lost peer behave the same everywhere::

    job = prepare(settings, resume=None)    # process group, threads, data, resume state, model, run folder
    with job:                               # closes the logs; after an error also leaves the group
        results = fit(job)                  # train.fit: the epochs

``run_job(settings)`` does both and always leaves the process group: ``python -m ddp_utils train``.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from .robust import autoresume
from . import checkpoint, distributed
from .speed import comm, linkprobe
from .data import build_data
from .datasets import Data
from .speed.commtime import CommTimer
from .model import build_model, ddp_of, describe_parallel, parallel_mode, prepare_model
from .runlog import NullLogger, RunLogger, default_run_dir, make_logger
from .optim import use_fast_gpu_kernels
from .robust.threads import set_threads
from .train import evaluate_only, fit, kept_checkpoint


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
    comm: object = None               # commtime.CommTimer on the DDP model (None with one rank)
    probe: dict | None = None         # linkprobe.probe's figures: link bandwidth, predicted speed-up
    parallel: str = "none"            # what runs: ddp, dp or none (model.parallel_mode)
    comm_choice: str = "none"         # the gradient communication used: none, fp16, bf16, powersgd (comm.py)
    comm_reason: str = ""             # why (comm=auto says what the probe predicted)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.logger.close()       # flush TensorBoard, finish the W&B run; the process group stays
        else:
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        """After an error or an interrupt: tell the other ranks why (DDP), write it to the run folder,
        and leave the process group so that its connections close now and setup can run again."""
        own = isinstance(exc, distributed.PeerLost)   # another rank's failure: nothing new to tell
        if not own:
            kept = kept_checkpoint(self.logger.run_dir, self.ctx)
            distributed.report_failure(self.ctx, f"rank {self.ctx.rank} stopped: {describe_failure(exc)}"
                                                 + (f". {kept[0].upper()}{kept[1:]}" if kept else ""))
        self.logger.error(str(exc) if str(exc).startswith("rank") else describe_failure(exc))
        self.logger.close(exit_code=1)
        release_group(self.model)     # DDP
        distributed.teardown(abort=True)   # DDP: the other ranks' collectives fail now, not at a timeout


def describe_failure(exc: BaseException) -> str:
    """``KeyboardInterrupt (Stop pressed, or Ctrl-C)`` or ``DataError: /data/...`` (first line only)."""
    if getattr(exc, "description", None):   # cli.Terminated says what it is itself
        return exc.description
    if isinstance(exc, KeyboardInterrupt):
        return "KeyboardInterrupt (Stop pressed in the notebook, or Ctrl-C)"
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def release_group(model) -> None:
    """Make a DDP model let go of its process group, so that tearing the group down closes its
    connections now. Otherwise the model (still referenced by the notebook and by the traceback of
    the error) keeps them open, and the other ranks wait in their next collective until it times out."""
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP
    while model is not None:
        if isinstance(model, DDP):
            for name in ("reducer", "logger", "process_group", "_comm_hooks"):
                model.__dict__.pop(name, None)
            break
        model = getattr(model, "_orig_mod", None)   # torch.compile's wrapper
    gc.collect()


def prepare(settings, resume: str | None = None, evaluate: bool = False, log=print) -> Job:
    """Set up the process group and build the data, model and logger of a run, on this rank.

    ``resume``: rank 0's path to a last.pt / best.pt; training continues after its epoch, in its
    folder (unless ``settings.run_dir`` says otherwise). ``"auto"``: continue the unfinished run of
    these settings if rank 0 has one (``autoresume.py``), else start a new one; it says which.
    With ``evaluate`` its weights are only evaluated, into a new run folder. Every rank must call
    this with the same settings; on an
    error the process group is left, so that calling it again starts cleanly.
    """
    if evaluate and (not resume or resume == "auto"):
        raise ValueError("--evaluate needs --resume PATH: the checkpoint whose weights to evaluate")
    if resume and resume != "auto" and not evaluate and not settings.run_dir:
        # Continue writing into the folder the checkpoint came from (evaluation gets a new folder).
        settings = settings.replace(run_dir=os.path.dirname(os.path.abspath(resume)))
    ctx = distributed.setup(settings, log)   # DDP: pre-flight, process group, settings agreement
    try:
        if resume == "auto":   # DDP: rank 0 has the run folders; it decides for every rank
            resume, run_dir, why = distributed.broadcast_object(autoresume.decide(settings) if ctx.is_main else None,
                                                                ctx)
            if ctx.is_main:
                log(f"resume auto: {why}")
            settings = settings.replace(run_dir=run_dir)
        set_threads(settings, ctx, log)       # ranks sharing a machine share its cores
        data = build_data(settings, ctx.rank, ctx.world_size, ctx.device)
        # DDP: reading the data can take minutes on one node (a cold disk): wait for it explicitly
        distributed.wait_for_all("reading the data", ctx, settings.init_timeout, log)
        distributed.agree(data.fingerprint(), ctx, what="data")   # DDP: same data on every node
        # DDP: loading is a collective (rank 0 reads its file and sends it), so all resume or none.
        distributed.agree({"resume": bool(resume)}, ctx, what="whether to resume")
        state = checkpoint.load_state(resume, ctx, settings.init_timeout) if resume else None
        if state is not None:
            checkpoint.check_matches(state, settings, resume)   # not an 8 KB key dump from load_state_dict
        torch.manual_seed(settings.seed)      # reproducible initial weights; DDP then copies rank 0's to all
        model = prepare_model(build_model(settings.arch, data.num_classes), settings, ctx)   # DDP: wrap
        use_fast_gpu_kernels(ctx.device)
        if ctx.is_main:
            log(describe_parallel(settings, ctx))
        probe = linkprobe.probe(model, settings, ctx, data.num_classes, data.image_size, log)   # DDP: the link
        choice, why = comm.choose(settings, probe) if ctx.distributed else ("none", "one process: nothing to send")
        timer = None
        if ctx.distributed:   # DDP: the gradient all-reduce (or its compressed form), timed
            timer = CommTimer(ctx.device)
            timer.attach(ddp_of(model), *comm.hook_for(choice, settings, ctx.backend))
            if ctx.is_main:
                log(f"gradient communication: {choice} ({why}); buckets of {settings.bucket_mb:g} MB")
        continuing = state is not None and not evaluate
        # On a resume, TensorBoard drops what the interrupted run logged after its checkpoint.
        logger = make_logger(settings, ctx.rank, resume=continuing, resume_step=state["step"] if continuing else None)
        job = Job(settings, ctx, data, model, logger, state, resume, comm=timer, probe=probe,
                  parallel=parallel_mode(settings, ctx), comm_choice=choice, comm_reason=why)
    except BaseException as exc:   # also KeyboardInterrupt: never leave a half-made process group
        if not isinstance(exc, distributed.PeerLost):   # this rank's own failure: tell the others
            distributed.report_failure(ctx, f"rank {ctx.rank} stopped while preparing the run: {describe_failure(exc)}")
        distributed.teardown(abort=True)
        raise
    with _failing(job):
        job.model_table = logger.model_summary(model, (3, data.image_size, data.image_size))
        # DDP: rank 0 may take a while to start W&B; the others wait here, not in the first all-reduce
        distributed.wait_for_all("starting the run", ctx, settings.init_timeout, log)
    return job


@contextlib.contextmanager
def _failing(job: Job):
    """Run a block; on any error let ``job.fail`` tell the others and leave the group."""
    try:
        yield
    except BaseException as exc:
        job.fail(exc)
        raise


def seed_settings(settings, seeds) -> list:
    """One Settings per seed, each with its own run folder ``RUN_DIR-seed<N>`` (siblings)."""
    base = settings.run_dir.rstrip("/") or str(default_run_dir(settings))
    return [settings.replace(seed=seed, run_dir=f"{base}-seed{seed}") for seed in seeds]


def run_seeds(settings, seeds, log=print) -> list[dict]:
    """``run_job`` once per seed, one after the other (every rank must pass the same seeds); the
    results of each. ``python -m ddp_utils report RUN_DIR-seed*`` gives their mean +- std."""
    out = []
    for i, one in enumerate(seed_settings(settings, seeds)):
        if settings.rank == 0:
            log(f"=== seed {one.seed} ({i + 1} of {len(seeds)}): {one.run_dir} ===")
        out.append(run_job(one, log=log))
    return out


def run_job(settings, resume: str | None = None, evaluate: bool = False, log=print) -> dict:
    """``prepare`` + ``fit`` (or ``evaluate_only``), then leave the process group; the results on every rank."""
    try:
        with prepare(settings, resume=resume, evaluate=evaluate, log=log) as job:
            return evaluate_only(job) if evaluate else fit(job)
    except BaseException:
        if settings.distributed and settings.rank == 0:
            time.sleep(2.0)   # rank 0 hosts the store: let the others read why before this process exits
        raise
    finally:
        distributed.teardown()

"""How DDP sends the gradients: plain fp32 all-reduce, half precision, or PowerSGD compression.

On a slow link (1 Gbit/s between cloud nodes, 45 MB of ResNet-18 gradients at every step) the
all-reduce can take longer than the step's compute. DDP lets a *communication hook* replace its
all-reduce; PyTorch ships the ones used here:

- ``none``: DDP's default, an fp32 all-reduce of each bucket (exact);
- ``fp16`` / ``bf16``: cast each bucket to half precision, all-reduce, cast back: half the bytes,
  a rounding of the averaged gradient (fp16 keeps more digits, bf16 more range);
- ``powersgd``: send a rank-``powersgd_rank`` approximation of each gradient matrix (Vogels et al.,
  2019), with error feedback (what the approximation missed is added to the next step's gradient)
  and warm start; the first steps use the exact all-reduce (``powersgd_warmup``: a quarter of the run by
  default), and a gradient that rank-r would shrink less than ``powersgd_min_compression`` times (a small
  classifier) is always sent exact. Far fewer bytes, some extra compute per step. Its memory (error
  feedback, warm start) is kept by parameter (``powersgd.py``) and goes into the checkpoint: a resume is bit-exact;
- ``localsgd``: no gradient all-reduce; each rank steps on its own gradients and the weights are averaged
  every ``average_every`` steps (``localsgd.py``);
- ``auto``: decided from the link probe (``linkprobe.py``): when communication is predicted to
  take more than ``comm_auto_share`` of a step, half precision (fp16 under fp16 AMP, bf16 otherwise: see
  ``choose``); else the exact all-reduce. **auto never trades accuracy**: PowerSGD and local SGD are taken only
  by name. On 16 fresh seeds PowerSGD was not shown non-inferior to exact DDP (docs/benchmarks.md, "PowerSGD
  on fresh seeds"), and local SGD is another algorithm (the ranks' weights differ between averages). Where
  half precision still leaves communication above the share, auto's line says what each would give on this
  link (its predicted share of a step) and where its cost in accuracy is measured. The choice and the reason
  are printed, the algorithm is on every epoch line (``algorithm``) and both are kept in ``results.json``.
  Gradient accumulation is never chosen for you either: it changes the recipe (a larger global batch, fewer
  optimizer steps). ``auto_local_sgd`` (``--auto-local-sgd``) is kept for old command lines and changes nothing.

Every rank takes the same decision: the probe's figures are the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from .. import own_ddp
from ..communication import COMMS, Comm, register_comm
from ..concerns import TimeSplit
from ..model import ddp_of, unwrap
from ..observers import Ask, Observer, register
from ..optim import optimizer_steps, precision_name
from . import linkprobe, powersgd, sharding
from .commtime import CommTimer

# What comm=auto may resolve to: the choices that average the exact gradients (half precision rounds each
# average, within fp16's or bf16's precision). PowerSGD and local SGD trade accuracy: by name only.
AUTO_CHOICES = ("none", "fp16", "bf16")
# Where the accuracy those two cost is measured (the pages' anchors)
TRADES = 'docs/benchmarks.md, "PowerSGD on fresh seeds" and "A slow link: local SGD"'
# PowerSGD's exact warm-up when powersgd_warmup_steps is 0: PyTorch's guidance for start_powerSGD_iter is to start
# from 10 % of the training steps and raise it until the accuracy is kept; over 1 Gbit, 8 seeds, a tenth lost 1.6
# points of Acc@1 against exact DDP and a quarter 0.3 (docs/benchmarks.md, "PowerSGD's settings"; on 16 fresh seeds
# a quarter was not shown non-inferior: "PowerSGD on fresh seeds"). At least 10 (short runs), at most 1000 (PyTorch's
# default)
WARMUP_SHARE, WARMUP_MIN, WARMUP_MAX = 0.25, 10, 1000


@dataclass
class Communication:
    """How a DDP model's gradients travel in this run, decided once before its first step."""
    timer: CommTimer | None = None   # times the hook per step (None with one rank: nothing is sent)
    probe: dict | None = None        # linkprobe.probe's figures: link bandwidth, predicted speed-up
    choice: str = "none"             # the hook used: none, fp16, bf16, powersgd, localsgd
    reason: str = ""                 # why (comm=auto says what the probe predicted)


def gradient_communication(model, settings, ctx, data, log=print, kept: dict | None = None) -> Communication:
    """Probe the link, choose the hook (``settings.comm``, ``auto`` from the probe), predict the step with it and
    register it, timed, on the DDP model. With one rank: nothing to send, nothing registered.

    ``data``: the run's Data (its classes and image size; the probe times a few batches of its ``train`` loader,
    whose steps also set PowerSGD's default warm-up: a share of the run's optimizer steps). ``kept``: a resumed
    run's checkpoint's ``comm`` (the hook it names, PowerSGD's memory and warm-up). comm=auto keeps its hook,
    whatever the probe says now, so that the resumed run continues the same run (and stays bit-exact)."""
    total_steps = settings.epochs * optimizer_steps(len(data.train), settings.accumulate) if data.train is not None else 0
    if not ctx.distributed:
        return Communication(reason="one process: nothing to send")
    if sharding.is_fsdp(unwrap(model)):   # no DDP to hook into, no gradient all-reduce to probe
        return Communication(reason="fsdp: FSDP reduce-scatters the gradients itself")
    # the probe in two parts: the choice needs its timings, its prediction needs the choice
    measured = linkprobe.measure(model, settings, ctx, data)
    if ddp_of(model) is None:   # --build-ddp: your own DDP; the loop times its finish_gradient_sync()
        probe = linkprobe.predict(measured, "none", log=log) if measured is not None else None
        return Communication(CommTimer(ctx.device), probe, "none", "your DDP (lab/build_ddp): no comm hook")
    kept = kept or {}
    choice, why = choose(settings, measured.figures if measured is not None else None, kept.get("choice"),
                         precision_name(settings, ctx.device))
    probe = (linkprobe.predict(measured, choice, on_a_copy(choice, settings, ctx.backend), log)
             if measured is not None else None)
    hook, state = hook_for(choice, settings, ctx.backend, total_steps)
    if choice == "powersgd":
        why += warmup_said(settings, total_steps, kept)
    if isinstance(state, powersgd.Memory):
        state.attach(ddp_of(model))   # its memory is kept by parameter name
    timer = CommTimer(ctx.device)
    timer.attach(ddp_of(model), hook, state)
    if ctx.is_main:
        log(f"gradient communication: {choice} ({why}); buckets of {settings.bucket_mb:g} MB")
    return Communication(timer, probe, choice, why)


def on_a_copy(choice: str, settings, backend: str | None):
    """``register(ddp_copy)``: the hook of ``choice`` on the link probe's DDP copy, with state of its own (the run's
    is not touched); PowerSGD compresses from the copy's third step (the run's warm-up would time the exact
    all-reduce). None for the exact all-reduce (DDP's default) and local SGD (the probe times no DDP step)."""
    if choice in ("none", "localsgd"):
        return None

    def register(ddp_copy) -> None:
        hook, state = hook_for(choice, replace(settings, powersgd_warmup_steps=2), backend)
        if isinstance(state, powersgd.Memory):
            state.attach(ddp_copy)
        ddp_copy.register_comm_hook(state, hook)
    return register


def choose(settings, probe: dict | None, kept: str | None = None, precision: str = "fp32") -> tuple[str, str]:
    """``(choice, why)``: the hook ``settings.comm`` asks for, ``auto`` resolved from the probe (or ``kept``):
    always one of AUTO_CHOICES.

    ``precision``: the run's (optim.precision_name). Halving the bytes takes fp16 only where fp16 AMP's loss
    scale lifts the gradients into fp16's range; a bf16 or fp32 run has none, so its small gradients would
    flush to zero in fp16: it gets bf16, which has fp32's range."""
    if settings.comm != "auto":
        return settings.comm, f"--comm {settings.comm}"
    if kept in AUTO_CHOICES:
        now, _ = choose(settings, probe, precision=precision)
        return kept, (f"comm=auto: {kept}, as this run chose when it started (its checkpoint says so), so that "
                      f"the resume continues it" + ("" if now == kept else f";\n  the link probe would choose {now} now"))
    older = (f"; this run's checkpoint says {kept} (an older kit's auto), which trades accuracy: the resume "
             f"continues without it" if kept in COMMS else "")
    if probe is None:
        return "none", f"comm=auto without a link probe (one rank, or --no-link-probe): no compression{older}"
    compute, allreduce, limit = probe["compute_s"], probe["allreduce_s"], settings.comm_auto_share
    share = allreduce / (compute + allreduce)
    if share <= limit:
        return "none", (f"comm=auto: the all-reduce is predicted at {100 * share:.0f} % of a step, under "
                        f"{100 * limit:.0f} %: no compression{older}")
    half = (allreduce / 2) / (compute + allreduce / 2)
    halved = "fp16" if precision == "fp16" else "bf16"
    why = (f"comm=auto: the all-reduce is predicted at {100 * share:.0f} % of a step; {halved} halves the bytes, to "
           f"about {100 * half:.0f} %" + ("" if halved == "fp16" else
           f" ({precision} run: no loss scale, so bf16, with fp32's range, not fp16)"))
    if half > limit:
        why += "\n  " + beyond_half(settings, probe)
    return halved, why + older


def beyond_half(settings, probe: dict) -> str:
    """What the two choices that trade accuracy would give on this link, for comm=auto's line: each one's
    predicted share of a step, and where its cost is measured. Never taken for the student."""
    compute, allreduce = probe["compute_s"], probe["allreduce_s"]
    parts = []
    if probe.get("grad_mb") and probe.get("powersgd_mb") is not None:
        sent = allreduce * probe["powersgd_mb"] / probe["grad_mb"]
        parts.append(f"PowerSGD (--comm powersgd) about {100 * sent / (compute + sent):.0f} %")
    every = settings.average_every   # local SGD: one bf16 average of the weights every `every` steps
    local = allreduce / 2 / every
    parts.append(f"local SGD (--comm localsgd, averaging every {every} steps) about {100 * local / (compute + local):.0f} %")
    return (f"still above {100 * settings.comm_auto_share:.0f} %: {' and '.join(parts)} of a step; both trade "
            f"accuracy ({TRADES}), so auto never takes them")


def algorithm(choice: str, world_size: int, parallel: str = "ddp", own: str = "") -> str:
    """What trains, in words, for the epoch line, results.json and the report: DDP's algorithm (one model, the
    gradients averaged at every step; how they travel) or local SGD, which is another one; ``parallel`` zero1
    (DDP's, the optimizer state sharded) or fsdp (parameters, gradients and optimizer state sharded). ``own``: the
    class of lab/build_ddp that trains instead of torch's (``OverlapDDP (yours)``), named as such."""
    if world_size == 1:
        return "one process"
    if parallel == "fsdp":
        return "FSDP (fully sharded)"
    if own and parallel == "zero1":
        return f"{_algorithm(choice)} + ZeRO-1 by {own}"
    if own:
        return own
    return _algorithm(choice) + (" + ZeRO-1" if parallel == "zero1" else "")


def _algorithm(choice: str) -> str:
    return COMMS[choice].algorithm if choice in COMMS else choice


def hook_for(choice: str, settings, backend: str | None = None, total_steps: int = 0):
    """``(hook, state)`` to register on a DDP model for ``choice`` (``total_steps``: the run's optimizer steps)."""
    if choice not in COMMS:
        raise ValueError(f"comm={choice!r} is not one of {', '.join(COMMS)}")
    hook, state = COMMS[choice].hook(settings, total_steps)
    if choice == "powersgd" and backend == "gloo":
        hook = one_bucket_at_a_time(hook)
    return hook, state


def one_bucket_at_a_time(hook):
    """Wait for each bucket's PowerSGD before the next bucket starts.

    PowerSGD issues its second all-reduce from the first one's completion callback. Gloo completes
    work on threads of its own, so with several buckets those follow-up all-reduces can be issued in
    a different order on each rank: a collective mismatch that kills the job ("Received data size
    doesn't match expected size"). NCCL runs the callbacks in issue order, so it needs no wait.
    """
    def serial(state, bucket):
        future = hook(state, bucket)
        future.wait()
        return future
    serial.blocking = True   # commtime counts all of its time as waited for
    return serial


def forget_overflow(state) -> None:
    """After a step whose gradients overflowed (fp16: the scaler skipped it), drop what PowerSGD carried over
    from it. Its error feedback (what the approximation missed, added to the next step) and its warm-start
    matrices hold inf / NaN now, so every later step would overflow too and be skipped: the loss freezes and
    nothing else complains. Cleared, they are rebuilt at the next step (zeros, fresh random matrices), as at
    the start. The other hooks keep no state between steps."""
    if isinstance(state, powersgd.Memory):
        state.forget()


def powersgd_warmup(settings, total_steps: int) -> int:
    """Optimizer steps of exact all-reduce before PowerSGD compresses: ``powersgd_warmup_steps`` when set, else
    a quarter of ``total_steps`` within 10..1000; never under 2 (DDP rebuilds its buckets after step 1)."""
    if settings.powersgd_warmup_steps:
        return max(2, settings.powersgd_warmup_steps)
    return max(2, WARMUP_MIN, min(WARMUP_MAX, round(WARMUP_SHARE * total_steps)))


def warmup_said(settings, total_steps: int, kept: dict) -> str:
    """PowerSGD's warm-up, in words: a resumed run's is the one its checkpoint keeps (``kept``, the checkpoint's
    ``comm``; powersgd.Memory.load_state_dict restores it), so the run says one figure, not this run's and then that."""
    how = "exact" if settings.powersgd_warmup_precision == "fp32" else "uncompressed in bf16"
    start = (kept.get("powersgd") or {}).get("start") or powersgd_warmup(settings, total_steps)
    return (f";\n  {how} for the first {start} of {total_steps} steps, and exact for the gradients rank "
            f"{settings.powersgd_rank} would shrink less than {settings.powersgd_min_compression:g}x")


def _powersgd(settings, total_steps: int = 0):
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=settings.powersgd_rank,
        start_powerSGD_iter=powersgd_warmup(settings, total_steps),
        min_compression_rate=settings.powersgd_min_compression,
        use_error_feedback=True, warm_start=True, random_seed=settings.seed)
    return powersgd.hook, powersgd.Memory(state, settings.seed, settings.powersgd_warmup_precision)


register_comm(Comm("none", "fp32 all-reduce, DDP's default", "DDP",
                   lambda settings, steps: (default_hooks.allreduce_hook, None)))
register_comm(Comm("fp16", "half-precision gradients: half the bytes", "DDP, fp16 gradients",
                   lambda settings, steps: (default_hooks.fp16_compress_hook, None)))
register_comm(Comm("bf16", "half-precision gradients with fp32's range: half the bytes", "DDP, bf16 gradients",
                   lambda settings, steps: (default_hooks.bf16_compress_hook, None)))
register_comm(Comm("powersgd", "low-rank compression with error feedback: far fewer bytes, some compute",
                   "DDP, PowerSGD gradients", _powersgd))


@register(after=(TimeSplit,))   # inside the time split: the wait for your DDP's all-reduces is part of a step
class Gradients(Observer):
    """How the gradients travel, decided when training starts (``gradient_communication``: the link probe, then
    the hook, registered and timed) and told to the loop (``Ask.comm``, read by the time split); the hook's timer
    told of each step, PowerSGD's memory kept in the checkpoint and restored on a resume, your DDP (--build-ddp)
    waited for, a skipped fp16 step forgotten."""
    comm = memory = None

    def start(self, loop) -> Ask:
        s = loop.settings
        kept = (loop.state or {}).get("comm") or {}   # a resume: comm=auto's choice at the start, PowerSGD's memory
        self.comm = comm = gradient_communication(loop.model, s, loop.ctx, loop.data, loop.log, kept)
        state = comm.timer.state if comm.timer is not None else None
        self.memory = state if isinstance(state, powersgd.Memory) else None
        saved = ((loop.state or {}).get("comm") or {}).get("powersgd")
        if self.memory is not None and saved:   # its error feedback and warm start: the resume is exact
            loop.logger.info(self.memory.load_state_dict(saved, loop.ctx))
        parallel = loop.meta.get("parallel", "ddp")
        return Ask(comm=comm, meta={"comm": comm.choice, "comm_reason": comm.reason,
                                    "algorithm": algorithm(comm.choice, loop.ctx.world_size, parallel,
                                                           own_ddp.label(s))})

    def after_backward(self, loop) -> None:
        if own_ddp.is_own(loop.model):   # --build-ddp: your DDP waits for its all-reduces here
            timer = self.comm.timer if self.comm is not None else None
            started = timer.span() if timer is not None else None
            loop.model.finish_gradient_sync()
            if timer is not None:
                timer.end_span(started)

    def after_step(self, loop) -> None:
        timer = self.comm.timer if self.comm is not None else None
        if not loop.updated or timer is None:
            return
        if loop.skipped:   # PowerSGD's memory of this step is inf now: it would poison every later one
            forget_overflow(timer.state)
        timer.step_done()

    def epoch_end(self, loop, record: dict) -> Ask:
        return Ask(keep={"comm": {"choice": loop.meta.get("comm", "none"),   # gathered: a collective
                                  "powersgd": self.memory.state_dict(loop.ctx) if self.memory is not None else None}})

    def results(self, loop, results: dict) -> None:
        probe = self.comm.probe if self.comm is not None else None
        results.update(link_gbit_s=probe["link_gbit_s"] if probe else None, probe=probe,
                       predicted_speedup=probe["predicted_speedup"] if probe else None)

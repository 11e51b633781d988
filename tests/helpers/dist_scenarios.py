"""Per-rank code for the distributed tests.

    python -m tests.helpers.dist_scenarios NAME RANK WORLD PORT [MASTER_ADDR [INIT_TIMEOUT]]

Each scenario prints ``CHECK name=value`` lines that tests/test_distributed.py reads, and errors
as ``ERROR <type>: <message>`` (exit code 3) so the tests can check the message text.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from ddp_utils import collectives, distributed
from ddp_utils.robust import peers
from ddp_utils.settings import Settings


def check(name: str, value) -> None:
    print(f"CHECK {name}={json.dumps(value)}", flush=True)


def basics(s: Settings) -> None:
    """Init, collectives, idempotent setup, re-init with changed settings."""
    inits = []
    real_init = dist.init_process_group
    dist.init_process_group = lambda *a, **k: (inits.append(1), real_init(*a, **k))[1]
    ctx = distributed.setup(s)
    check("env", {v: os.environ.get(v) for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")})
    t = torch.full((3,), float(ctx.rank + 1))
    check("sum", collectives.all_reduce_sum(t, ctx).tolist())
    check("broadcast", collectives.broadcast_object({"from": ctx.rank}, ctx))
    group = dist.group.WORLD  # also keeps the old group (and its store) alive, as a DDP model would
    # issue 43, finding 9: torch's group keeps init_timeout on its store; the kit's messages have their own client
    check("store_timeouts", [dist.distributed_c10d._get_default_store().timeout.total_seconds(),
                             peers._store.timeout.total_seconds()])
    check("same_ctx", distributed.setup(s) is ctx)
    check("same_group", dist.group.WORLD is group)
    check("inits_after_same", len(inits))
    ctx2 = distributed.setup(s.replace(epochs=s.epochs + 1))
    check("inits_after_changed", len(inits))
    check("new_group", dist.group.WORLD is not group and dist.is_initialized())
    # a new run folder (the notebook's Settings cell re-run) needs no new process group
    check("same_ctx_new_run_dir", distributed.setup(s.replace(epochs=s.epochs + 1, run_dir="elsewhere")) is ctx2)
    collectives.barrier(ctx2)
    check("sum_after_reinit", collectives.all_reduce_sum(torch.ones(2) * (ctx2.rank + 1), ctx2).tolist())
    distributed.teardown()
    distributed.teardown()  # twice is fine
    check("initialized_after_teardown", dist.is_initialized())
    try:
        with distributed.session(s):
            raise RuntimeError("a failing training cell")
    except RuntimeError:
        pass
    check("initialized_after_session_error", dist.is_initialized())


def joined(s: Settings) -> None:
    """Just join and sum the ranks (the unreachable-master and network-namespace tests)."""
    with distributed.session(s) as ctx:
        check("interface", os.environ.get("GLOO_SOCKET_IFNAME"))
        check("sum", collectives.all_reduce_sum(torch.tensor([float(ctx.rank + 1)]), ctx).tolist())


def mismatch(s: Settings) -> None:
    """The worker's notebook was edited: a different batch size."""
    try:
        distributed.setup(s.replace(batch_size=64 + 32 * s.rank))
    finally:
        check("initialized_after_error", dist.is_initialized())


def init_fails(s: Settings) -> None:
    """Rank 1's init_process_group breaks after both ranks arrived (say, a blocked Gloo port)."""
    if s.rank == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("Gloo connectFullMesh failed: simulated\nsecond line of C++ noise")
        dist.init_process_group = broken
    distributed.setup(s)


def interrupted(s: Settings) -> None:
    """Ctrl-C (a notebook's interrupt button) while rank 0 waits for a worker that never comes."""
    threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        distributed.setup(s)
    except KeyboardInterrupt:
        check("seconds_to_interrupt", round(time.monotonic() - start, 2))
        check("initialized_after_interrupt", dist.is_initialized())


def stopped_in_setup(s: Settings, where: str) -> None:
    """Stop pressed on rank 1 while it builds the process group (``where``: in init_process_group, or in the
    settings agreement after it), as rank 0 waits for it there: rank 0 must hear of it at once."""
    if s.rank == 1:
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt
        if where == "init":
            dist.init_process_group = interrupted
        else:
            collectives.agree = lambda values, ctx, *a: (time.sleep(1.0), interrupted())   # rank 0 waits in it
    try:
        distributed.setup(s)
    except KeyboardInterrupt:
        check("interrupted", True)
    finally:
        check("initialized_after_error", dist.is_initialized())


def devices(s: Settings) -> None:
    """The ranks' GPUs are emulated (tests/helpers/gpu_emulation.py) from DEVICES, a JSON list by rank: "T4" for a GPU,
    null for none; equal names on one machine are one shared GPU. BACKEND is the requested backend. Prints
    the backend every rank agreed on (gloo runs for real; nccl would need a real GPU, so it stops there)."""
    from tests.helpers.gpu_emulation import T4, pretend_gpu
    mine = json.loads(os.environ["DEVICES"])[s.rank]
    if mine:
        pretend_gpu(setattr, T4)
    backend = os.environ["BACKEND"]
    if backend == "nccl" or mine:
        dist.is_nccl_available = lambda: True
    real_init = dist.init_process_group

    def init(chosen, **kw):
        check("backend", chosen)
        if chosen == "nccl":
            raise SystemExit(0)   # the agreement is what is tested; a real nccl group needs a real GPU
        return real_init(chosen, **kw)
    dist.init_process_group = init
    distributed.setup(s.replace(backend=backend, amp=os.environ.get("AMP", "auto")))
    distributed.teardown()


def slow_rank0_writes(s: Settings) -> None:
    """Rank 0 writes the profiler's traces and a mended best.pt on a disk slower than the collective timeout (1 s):
    the next collective must still find every rank (they wait for rank 0 through the store, not in it)."""
    import tempfile
    from pathlib import Path
    from ddp_utils import checkpoint
    from ddp_utils.speed import profile
    ctx = distributed.setup(s)
    if not distributed.set_collective_timeout(1.0):
        check("skipped", "this torch keeps gloo's timeout")
        return
    run_dir = Path(tempfile.mkdtemp(prefix="slow-writes-"))
    slow = lambda real: lambda *a, **k: (time.sleep(3 if ctx.is_main else 0), real(*a, **k))[1]   # noqa: E731
    profile.atomic_write = slow(profile.atomic_write)
    prof = profile.StepProfiler((0, 1), ctx, run_dir if ctx.is_main else None, log=lambda *_: None, wait_s=30)
    prof.before(0)
    torch.ones(4).sum()
    prof.after(1)
    check("sum_after_traces", collectives.all_reduce_sum(torch.ones(1), ctx).tolist())
    check("traces", sorted(p.name for p in (run_dir / "profile").glob("*.json")) if ctx.is_main else None)
    checkpoint.save_checkpoint = slow(checkpoint.save_checkpoint)
    state = {"history": [{"val": {"acc1": 50.0}}], "best_acc1": 50.0, "model": {}}
    check("mended", checkpoint.mend_best(state, run_dir, ctx, 30))
    check("sum_after_best", collectives.all_reduce_sum(torch.ones(1), ctx).tolist())
    distributed.teardown()


def left_group(s: Settings, mode: str) -> None:
    """Rank 1 fails after a training step and leaves the group as ``Job.fail`` does, its model and optimizer still
    referenced (a notebook's kernel lives on, holding them); rank 0 then waits in a collective rank 1 never joins.
    It must fail at once, not when rank 1's process ends (12 s later) or at the collective timeout (60 s)."""
    from tests.helpers.mode_matrix import batches, build, settings_for, train
    from ddp_utils.job import release_group
    settings = settings_for(mode, ("sgd", 0.9, "nchw"), s.rank, s.world_size, s.master_port)
    ctx = distributed.setup(settings)
    distributed.set_collective_timeout(60.0)
    model, optimizer, scheduler, scaler = build(settings, ctx)
    train(model, optimizer, scheduler, scaler, settings, ctx, batches(1, ctx.rank, 2))
    peers.wait_for_all("trained", ctx, 60)
    if ctx.rank == 1:
        release_group(model, optimizer)
        distributed.teardown(abort=True)
        check("left", True)
        time.sleep(12)   # the kernel lives on
        return
    start = time.monotonic()
    try:
        collectives.all_reduce_sum(torch.ones(1), ctx)
        check("collective", "completed")
    except RuntimeError as e:
        check("collective", f"failed: {str(e)[:80]}")
    check("seconds_in_collective", round(time.monotonic() - start, 1))
    distributed.teardown()


SCENARIOS = {"slow_rank0_writes": slow_rank0_writes,
             **{f"left_group_{mode}": lambda s, mode=mode: left_group(s, mode) for mode in ("ddp", "zero1", "fsdp")}, "devices": devices, "basics": basics, "joined": joined, "mismatch": mismatch, "init_fails": init_fails,
             "interrupted": interrupted, "stopped_in_init": lambda s: stopped_in_setup(s, "init"),
             "stopped_in_agree": lambda s: stopped_in_setup(s, "agree")}

if __name__ == "__main__":
    name, rank, world, port = sys.argv[1], *map(int, sys.argv[2:5])
    addr = sys.argv[5] if len(sys.argv) > 5 else "127.0.0.1"
    timeout = float(sys.argv[6]) if len(sys.argv) > 6 else 30.0
    settings = Settings(epochs=2, rank=rank, world_size=world, master_addr=addr, master_port=port,
                        backend="gloo", init_timeout=timeout, workers=0)
    start = time.monotonic()
    try:
        SCENARIOS[name](settings)
    except distributed.DistSetupError as e:
        check("seconds_to_error", round(time.monotonic() - start, 2))
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        sys.exit(3)

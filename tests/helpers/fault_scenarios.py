"""Runs one rank of a fault scenario, as a notebook kernel would: ``python -m tests.helpers.fault_scenarios NAME RANK PORT DIR [ADDR]``.

The rank prepares and trains on fake data (2 ranks, gloo, loopback). What the scenario does differently:
- ``interrupt``: rank 0 gets SIGINT (the notebook's Stop button) during its 2nd epoch, then stays alive
  (the kernel survives an interrupt) for 20 s, holding its job, model and traceback.
- ``rerun``: as ``interrupt``, then both processes run prepare + fit again with a resume (Run All).
- ``slow_start``: rank 0 takes 8 s to start W&B (longer than the collective timeout of 4 s).
- ``plain``: nothing (collective timeout 8 s, the others 4 s).
- ``slow_compile``: --compile, whose first step takes rank 1 8 s (emulated: torch.compile returns a wrapper that
  sleeps on its first call), longer than the collective timeout of 3 s; 1 epoch of 5 steps.
- ``paced``: the notebook's cells one at a time (collective timeout 3 s); before each cell that meets the other
  rank (data, model, run, Train) rank 1 pauses 6 s, longer than a collective may wait and than the watch's first
  beats take: a student reading between cells. 2 epochs of 8 steps.
- ``patient`` / ``default``: nothing, with a collective timeout of 600 s / the default 60 s: only the kit's own
  watch (heartbeat.py) can stop a rank whose peer went silent within seconds.
- ``stuck_loader``: rank 1's data loader blocks for good at the 5th batch (a stuck worker, a hung file system)
  while its beat thread goes on; collective timeout 24 s (the watch names it after 12 s).
- ``stuck_loader_ignoring_sigint``: the same in ranks that ignore SIGINT, as one started by ``cmd &`` in a script.
- ``stuck_val_loader``: the same in rank 1's validation loader, at its 2nd batch of the first evaluation.
- ``own_error``: once rank 0 has saved epoch 1, rank 1's next forward pass raises a RuntimeError whose text names
  NCCL (a fault of its own GPU, emulated), while rank 0 is alive and well.
Prints ``CHECK name=value`` lines the tests read.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

from ddp_utils.job import prepare
from ddp_utils.runlog import RunLogger
from ddp_utils.settings import Settings
from ddp_utils.train import fit


def main(name: str, rank: int, port: int, folder: str, addr: str = "127.0.0.1") -> None:
    timeout = {"plain": 8, "patient": 600, "default": Settings.collective_timeout, "slow_compile": 3,
               "paced": 3, "stuck_loader": 24, "stuck_loader_ignoring_sigint": 24,
               "stuck_val_loader": 24}.get(name, 4)
    settings = Settings(dataset="fake", image_size=32, workers=0, wandb="disabled", backend="gloo", world_size=2,
                        rank=rank, master_addr=addr, master_port=port, init_timeout=60,
                        collective_timeout=timeout, epochs=30,
                        batch_size=16, max_steps_per_epoch=40, progress="off", run_dir=f"{folder}/run{rank}")
    if name == "slow_start" and rank == 0:
        real = RunLogger._start_wandb
        RunLogger._start_wandb = lambda self, *a: (time.sleep(8), real(self, *a))[1]
    if name == "slow_compile":
        settings = settings.replace(compile=True, epochs=1, max_steps_per_epoch=5)
        slow_compile(rank)
    if name == "rerun":
        return rerun(settings)
    if name == "paced":
        return paced(settings.replace(epochs=2, max_steps_per_epoch=8))
    try:
        job = prepare(settings)
        if name == "interrupt" and rank == 0:
            # Python ignores SIGINT in a process started in the background (`cmd &` in a script): what Stop does to
            # a kernel must raise KeyboardInterrupt however this scenario was started
            signal.signal(signal.SIGINT, signal.default_int_handler)
            last = os.path.join(settings.run_dir, "last.pt")

            def stop_in_epoch_2():
                while not os.path.exists(last):
                    time.sleep(0.05)
                time.sleep(0.5)
                print(f"CHECK interrupted_at={time.time()}", flush=True)
                os.kill(os.getpid(), signal.SIGINT)
            threading.Thread(target=stop_in_epoch_2, daemon=True).start()
        if name == "slow_start":
            settings = settings.replace(epochs=1)
            job.settings = settings
        if name.startswith("stuck_"):
            # as in a kernel (see "interrupt"); or as a rank started by `cmd &` in a script, which ignores SIGINT
            signal.signal(signal.SIGINT, signal.SIG_IGN if name.endswith("ignoring_sigint") else
                          signal.default_int_handler)
            if rank == 1 and name == "stuck_val_loader":
                job.data.val = StuckAt(job.data.val, at=1)
            elif rank == 1:
                stick_the_loader(job.data.train, at=5)
        if name == "own_error" and rank == 1:
            fail_after_epoch_1(job.model, os.path.join(folder, "run0", "last.pt"))
        with job:
            fit(job)
        print("CHECK finished=true", flush=True)
    except KeyboardInterrupt:
        print("CHECK rank0_caught_interrupt=true", flush=True)
        time.sleep(20)   # the kernel stays alive, with everything still referenced
    except Exception as e:   # noqa: BLE001 - the test reads the message
        print(f"CHECK stopped_at={time.time()}", flush=True)
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        sys.exit(2)


def paced(settings, pause: float = 6.0) -> None:
    """main.ipynb's cells, one call each; rank 1 reads for ``pause`` s before each cell that needs rank 0."""
    from ddp_utils.data import build_data
    from ddp_utils.distributed import setup
    from ddp_utils.job import open_run
    from ddp_utils.model import build_model, prepare_model

    def cell():
        if settings.rank == 1:
            time.sleep(pause)
    ctx = setup(settings)
    cell()
    data = build_data(settings, ctx)
    cell()
    model = prepare_model(build_model(settings.arch, data.num_classes, settings.seed, data.image_size), settings,
                          ctx)
    cell()
    job = open_run(settings, ctx, data, model, resume="auto")
    cell()
    with job:
        results = fit(job)
    print(f"CHECK acc1={results['acc1']}", flush=True)
    print("CHECK finished=true", flush=True)


def stick_the_loader(loader, at: int) -> None:
    """The loader's ``at``-th batch of the first epoch never comes (the main thread waits, as for a stuck worker)."""
    real = loader.epoch

    def epoch(number):
        for i, batch in enumerate(real(number)):
            if i == at:
                print(f"CHECK stuck_at={time.time()}", flush=True)
                time.sleep(600)
            yield batch
    loader.epoch = epoch


class StuckAt:
    """A validation loader whose ``at``-th batch of the first pass never comes."""

    def __init__(self, loader, at: int):
        self.loader, self.at, self.passes = loader, at, 0

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        self.passes += 1
        for i, batch in enumerate(self.loader):
            if i == self.at and self.passes == 1:
                print(f"CHECK stuck_at={time.time()}", flush=True)
                time.sleep(600)
            yield batch


def fail_after_epoch_1(model, last: str) -> None:
    """The first forward pass after ``last`` exists raises an NCCL-worded error of this rank's own."""
    import types
    from ddp_utils.model import unwrap
    net = unwrap(model)

    def forward(self, *args, **kwargs):
        if os.path.exists(last):
            print(f"CHECK failed_at={time.time()}", flush=True)
            raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1936, unhandled cuda error (run with "
                               "NCCL_DEBUG=INFO for details): an emulated fault of this rank's own GPU")
        return type(self).forward(self, *args, **kwargs)
    # a method bound to the model: a copy of it (the link probe times copies) computes with its own weights
    net.forward = types.MethodType(forward, net)


def slow_compile(rank: int) -> None:
    import torch

    class Compiled(torch.nn.Module):   # what torch.compile returns: the model as ._orig_mod
        def __init__(self, model):
            super().__init__()
            self._orig_mod, self.calls = model, 0

        def forward(self, *args, **kwargs):
            if self.calls == 0 and rank == 1:
                time.sleep(8)   # compiling, on a cold cache
            self.calls += 1
            return self._orig_mod(*args, **kwargs)
    torch.compile = lambda model, **kwargs: Compiled(model)


def rerun(settings) -> None:
    """Stop pressed in rank 0's notebook, then "Run All" again in the same two processes (kernels),
    resuming from last.pt: the port, the group and the loaders must all be usable again."""
    from ddp_utils.robust.peers import PeerLost
    settings = settings.replace(epochs=3, max_steps_per_epoch=20)
    last = os.path.join(f"{os.path.dirname(settings.run_dir)}/run0", "last.pt")
    if settings.rank == 0:
        def stop_in_epoch_2():
            while not os.path.exists(last):
                time.sleep(0.05)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=stop_in_epoch_2, daemon=True).start()
    try:
        job = prepare(settings)
        with job:
            fit(job)
    except (KeyboardInterrupt, PeerLost) as e:
        print(f"CHECK first_run_stopped={type(e).__name__}", flush=True)
    job = prepare(settings, resume=last)          # Run All again: the same cells, RESUME set
    with job:
        results = fit(job)
    print(f"CHECK resumed_epochs_run={results['epochs_run']}", flush=True)


# -- the launcher's side: the tests and benchmarks/fault_times.py start and stop the ranks with these --------
def start_ranks(name, port, folder, prefixes=((), ()), addr="127.0.0.1", real=False):
    """Both ranks of a fault scenario as processes of their own (killed by ``stop_all``); ``real``: not from the
    suite's fork server (a test that sends SIGSTOP must stop the rank itself, not a client of the server)."""
    import subprocess

    from tests.helpers.procs import base_env, popen, python
    return [popen([*prefixes[r], *python("-m", "tests.helpers.fault_scenarios", name, str(r), str(port), str(folder), addr)],
                  base_env(), real=real, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(2)]


def stop_all(procs) -> None:
    from tests.helpers.procs import stop
    stop(procs)


def wait_for_epoch_1(folder, procs, bound: float = 120.0) -> None:
    import time as _time
    deadline = _time.monotonic() + bound
    while not (folder / "run0" / "last.pt").exists():
        assert _time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate()[0][-2000:] for p in procs if p.poll() is not None]
        _time.sleep(0.1)


def signal_rank_1_after_epoch_1(name, sig, folder, victim: int = 1) -> tuple:
    """Both ranks of scenario ``name``; once epoch 1 is saved rank ``victim`` gets ``sig`` (SIGSTOP: frozen, SIGKILL:
    gone). The other rank's (return code, seconds from the signal to its exit, output after the signal)."""
    from tests.helpers.procs import free_port
    procs = start_ranks(name, free_port(), folder, real=sig == signal.SIGSTOP)
    survivor = procs[1 - victim]
    try:
        wait_for_epoch_1(folder, procs)
        before = printed_so_far(survivor)   # what it printed before the signal
        # a SIGKILL goes to the rank's own command, not the fork server's client that stands for it (tests/helpers/zygote.py:
        # the client's death reaches the command only when the server sees it, after the others may have looked)
        from tests.helpers import zygote
        os.kill((zygote.command_of(procs[victim].pid) if sig == signal.SIGKILL else None) or procs[victim].pid, sig)
        sent = time.monotonic()
        out = output_of(survivor, 60)
        return survivor.returncode, time.monotonic() - sent, out if victim == 0 else before + out
    finally:
        stop_all(procs)


def cut_link_after_epoch_1(name, folder, hosts, bound: float) -> tuple[list, list, list]:
    """Both ranks of scenario ``name`` on two namespace hosts (``netns.two_hosts``); once epoch 1 is saved rank 1's
    link goes down. Each rank's return code, seconds from the cut to its exit (waited at most ``bound``), output."""
    import subprocess
    from tests.helpers.procs import free_port
    procs = start_ranks(name, free_port(), folder, prefixes=(hosts.exec_prefix(0), hosts.exec_prefix(1)),
                        addr=hosts.addrs[0])
    try:
        wait_for_epoch_1(folder, procs)
        subprocess.run(["ip", "-n", hosts.names[1], "link", "set", hosts.veths[1], "down"], check=True)
        cut, outs, stopped = time.monotonic(), [], []
        for p in procs:
            outs.append(output_of(p, bound))
            stopped.append(time.monotonic() - cut)
    finally:
        stop_all(procs)
    return [p.returncode for p in procs], stopped, outs


def printed_so_far(proc) -> str:
    """What ``proc`` has written to its stdout pipe until now (read from the pipe itself: nothing has read it yet)."""
    fd, chunks = proc.stdout.fileno(), []
    os.set_blocking(fd, False)
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    finally:
        os.set_blocking(fd, True)
    return b"".join(chunks).decode(errors="replace")


def output_of(proc, bound: float) -> str:
    import subprocess
    try:
        return proc.communicate(timeout=bound)[0]
    except subprocess.TimeoutExpired:
        return ""


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6])

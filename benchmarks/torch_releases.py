"""What the torch this runs under offers where releases differ, probed for real, beside the path the kit takes.

    python benchmarks/torch_releases.py          # in a venv with the torch to look at (CPU is enough)

Prints one Markdown row of docs/gpu.md's table "Every torch from the floor to the newest": whether the default
(libuv) TCPStore takes a listening socket, which abort calls exist, and whether a gloo collective honours a timeout
set after init (two processes on loopback: the group is made with 30 s, set to 2 s, and rank 1 comes 6 s late),
and whether destroying a gloo group right after a collective hangs (3 runs of 15 join-gather-destroy cycles: a race,
so "0 of 3" shows no more than that it is rare).
Then the paths ddp_utils/robust/compat.py picks on this torch, which must agree with the probes.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddp_utils.robust import compat  # noqa: E402
from results import RESULTS, Recorder  # noqa: E402  (benchmarks/results.py)


def libuv_takes_a_listening_socket() -> bool:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port, fd = sock.getsockname()[1], sock.detach()
    try:
        dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False,
                      master_listen_fd=fd, use_libuv=True)
        return True
    except NotImplementedError:
        os.close(fd)
        return False


def _late_rank(rank: int, port: int, answer) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    dist.barrier()
    c10d = dist.distributed_c10d
    (c10d.set_timeout if hasattr(c10d, "set_timeout") else c10d._set_pg_timeout)(timedelta(seconds=2))
    if rank == 1:
        time.sleep(6)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError:
        pass
    if rank == 0:
        answer.put(time.monotonic() - start < 5)   # ended by the 2 s timeout, not by rank 1's arrival


def gloo_takes_a_new_timeout() -> bool:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    answer = ctx.Queue()
    procs = [ctx.Process(target=_late_rank, args=(r, port, answer)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    return answer.get(timeout=5)


def _cycles(rank: int, ports: list[int]) -> None:
    """Join, gather, destroy at once, once per port, with plain torch (no settle): a setup cell run again and again."""
    for cycle, port in enumerate(ports):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        out: list = [None, None]
        dist.all_gather_object(out, {"cycle": cycle})
        dist.destroy_process_group()


def _free_ports(n: int) -> list[int]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


def gloo_destroy_deadlocks(runs: int = 3, cycles: int = 15) -> tuple[int, int]:
    """(hung, failed otherwise): of ``runs`` two-process runs, those where a gloo group destroyed right after a
    collective never returned (a rank still alive after 60 s), and those that failed some other way."""
    hung = failed = 0
    ctx = mp.get_context("spawn")
    for _ in range(runs):
        ports = _free_ports(cycles)
        procs = [ctx.Process(target=_cycles, args=(r, ports)) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 60
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        alive = [p.is_alive() for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        hung += any(alive)
        failed += not any(alive) and any(p.exitcode != 0 for p in procs)
    return hung, failed


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def main() -> None:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="One row a run: run it in a venv "
                                     "with the torch to look at.")
    release = torch.__version__.split("+")[0]
    parser.add_argument("--out", default=str(RESULTS / f"torch_releases-{release}.json"),
                        help="the JSON file the probes go to (default benchmarks/results/torch_releases-RELEASE.json)")
    parser.add_argument("--allow-dirty", action="store_true", help="measure a tree with uncommitted changes (a trial)")
    args = parser.parse_args()
    recorder = Recorder("torch_releases", args)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    probed = {"libuv store takes a listening socket": libuv_takes_a_listening_socket(),
              "ProcessGroup.abort": hasattr(dist.ProcessGroup, "abort"),
              "ProcessGroupNCCL.abort": hasattr(nccl, "abort"),
              "_abort_process_group": hasattr(dist.distributed_c10d, "_abort_process_group"),
              "gloo honours a new timeout": gloo_takes_a_new_timeout()}
    hangs, failed = gloo_destroy_deadlocks()
    print("| torch | " + " | ".join(probed) + " | gloo destroyed right after a collective |")
    print(f"| {torch.__version__} | " + " | ".join(yes(v) for v in probed.values())
          + f" | hung in {hangs} of 3 runs of 15{f' ({failed} failed otherwise)' if failed else ''} |")
    picks = {**compat.paths("gloo"), "hung nccl collective": compat.abort_path("nccl")[0]}
    print("\nddp_utils picks:\n" + "\n".join(f"  {k}: {v}" for k, v in picks.items()))
    agrees = (("legacy" not in picks["store"]) == probed["libuv store takes a listening socket"]
              and compat.timeout_changes_after_init("gloo") == probed["gloo honours a new timeout"]
              and (hangs == 0 or compat.destroy_path("gloo") != "at once"))
    print("compat agrees with the probes" if agrees else "compat DISAGREES with the probes: fix robust/compat.py")
    recorder.save({"release": release, "probed": probed, "destroy_hung": hangs, "destroy_runs": 3,
                   "destroy_failed": failed, "picks": picks, "compat_agrees": agrees})
    sys.exit(0 if agrees else 1)


if __name__ == "__main__":
    main()

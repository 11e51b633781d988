"""Sixteen ranks on eight hosts: a run trains, and a killed, a frozen or a cut-off rank stops every rank in time.

    sudo python benchmarks/scale.py            # root: the hosts are network namespaces on one bridge

Eight namespace hosts (tests/netns.py ``many_hosts``) run two ranks each (``python -m ddp_utils train``, gloo,
world size 16, fake data). Cases: the run trains two epochs; rank 7 (host 4) is killed (SIGKILL) or frozen
(SIGSTOP) once rank 0 has written its first checkpoint; host 4's link goes down. For each fault: the seconds from
the fault to the last surviving rank's exit, and whether every surviving rank's paragraph names the lost rank and
its host's address (a cut-off host's own ranks name rank 0, whose store they lost). Also the store requests of one
beat round of the watch at 2 to 16 ranks (tests/counting_store.py): a few per rank, so linear in the ranks.
"""
from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from ddp_utils.settings import Settings  # noqa: E402
from tests import netns  # noqa: E402
from tests.procs import REPO as REPO_DIR, base_env, free_port, python  # noqa: E402
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)

HOSTS, PER_HOST = 8, 2
WORLD = HOSTS * PER_HOST
LOST = 7                      # rank 7: host 4's second rank
LOST_HOST = LOST // PER_HOST  # host index 3 (10.213.9.4)
BOUND = 30.0                  # every rank stops within this after the fault


def start(hosts, folder: Path, epochs: int) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(WORLD):
        host = rank // PER_HOST
        settings = Settings(dataset="fake", image_size=32, workers=0, wandb="disabled", backend="gloo",
                            world_size=WORLD, rank=rank, local_rank=rank % PER_HOST, master_addr=hosts.addrs[0],
                            master_port=port, epochs=epochs, batch_size=8, max_steps_per_epoch=3, link_probe=False,
                            progress="off", init_timeout=600, run_dir=str(folder / "run"))
        argv = python("-m", "ddp_utils", "train", *settings.to_argv())
        procs.append(subprocess.Popen(hosts.exec_prefix(host) + argv, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=base_env(), cwd=REPO_DIR,
                                      start_new_session=True))
    return procs


def wait_for(path: Path, procs, bound: float) -> None:
    deadline = time.monotonic() + bound
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"no {path} within {bound:g} s, or a rank ended:\n" + finish(procs, 5)[0][:3000])
        time.sleep(0.5)


def finish(procs, bound: float) -> tuple[str, list[float | None]]:
    """Every rank's output (rank 0's first) and when each ended (monotonic; None: still running at the bound)."""
    ended: list[float | None] = [None] * len(procs)
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and any(e is None for e in ended):
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            with_signal(p, signal.SIGCONT)
            with_signal(p, signal.SIGKILL)
    outs = [p.communicate()[0] for p in procs]
    return "\n".join(f"--- rank {r}\n{o}" for r, o in enumerate(outs)), ended


def with_signal(p: subprocess.Popen, sig) -> None:
    try:
        p.send_signal(sig)
    except ProcessLookupError:
        pass


def fault_case(name: str, hosts, folder: Path) -> dict:
    procs = start(hosts, folder, epochs=50)
    try:
        wait_for(folder / "run" / "last.pt", procs, 600)
        time.sleep(1.0)   # inside epoch 2
        fault_at = time.monotonic()
        if name == "killed":
            procs[LOST].send_signal(signal.SIGKILL)
        elif name == "frozen":
            procs[LOST].send_signal(signal.SIGSTOP)
        else:
            subprocess.run(["ip", "-n", hosts.names[LOST_HOST], "link", "set", hosts.veths[LOST_HOST], "down"],
                           check=True)
        text, ended = finish(procs, 120)
    finally:
        for p in procs:
            if p.poll() is None:
                with_signal(p, signal.SIGCONT)
                with_signal(p, signal.SIGKILL)
    outs = text.split("\n--- rank ")
    lost_ranks = {LOST} if name != "cut" else {r for r in range(WORLD) if r // PER_HOST == LOST_HOST}
    survivors = [r for r in range(WORLD) if r not in lost_ranks]
    named, stopped = [], []
    for r in survivors:
        out = outs[r]
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        said = errors[-1] if errors else ""
        names_it = any(f"rank {lost}'s last sign of life" in said or f"rank {lost} " in said
                       for lost in lost_ranks) and hosts.addrs[LOST_HOST] in said
        named.append(names_it)
        stopped.append(None if ended[r] is None else ended[r] - fault_at)
    cut_off_named = None
    if name == "cut":   # the cut-off host's ranks lost rank 0's store
        cut_off_named = all("rank 0's store gave no answer" in outs[r] and hosts.addrs[0] in outs[r]
                            for r in lost_ranks)
    slowest = max((s for s in stopped if s is not None), default=None)
    return {"case": name, "survivors": len(survivors), "stopped": sum(s is not None for s in stopped),
            "slowest_s": None if slowest is None else round(slowest, 1),
            "within_bound": all(s is not None and s < BOUND for s in stopped),
            "named": sum(named), "cut_off_named_rank0": cut_off_named,
            "example": next((line for line in outs[0].splitlines() if line.startswith("error:")), "")[:400],
            "unnamed_example": next((outs[r].splitlines()[-1] for r, ok in zip(survivors, named) if not ok), "")}


def trains(hosts, folder: Path) -> dict:
    procs = start(hosts, folder, epochs=2)
    text, ended = finish(procs, 900)
    ok = [p.returncode == 0 for p in procs]
    acc = re.search(r"epoch 2/2: .*", text)
    return {"case": "trains", "finished": sum(ok), "last_epoch_line": acc.group(0) if acc else text[-2000:]}


def store_requests() -> list[dict]:
    from ddp_utils import distributed
    from tests.counting_store import CountingStore, requests_per_beat_round
    rows, before = [], distributed._store
    try:
        for n in (2, 4, 8, 16):
            distributed._store = CountingStore()
            counts = requests_per_beat_round(n)
            rows.append({"ranks": n, "per_round": sum(counts), "per_rank": max(counts)})
    finally:
        distributed._store = before
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=["trains", "killed", "frozen", "cut"])
    add_out(parser, "scale")
    args = parser.parse_args()
    recorder = Recorder("scale", args)
    results = []
    for case in args.cases:
        with tempfile.TemporaryDirectory() as tmp, netns.many_hosts(HOSTS) as hosts:
            row = trains(hosts, Path(tmp)) if case == "trains" else fault_case(case, hosts, Path(tmp))
        print(row, flush=True)
        results.append(row)
    requests = store_requests()
    print(requests)
    table = [["case", "ranks stopped", "slowest stop after the fault (s)", "ranks naming the lost rank and host"]]
    for row in results:
        if row["case"] == "trains":
            table.append(["the run trains 2 epochs", f"{row['finished']} of {WORLD} finished", "-", "-"])
        else:
            what = {"killed": f"rank {LOST} killed (SIGKILL)", "frozen": f"rank {LOST} frozen (SIGSTOP)",
                    "cut": f"host {LOST_HOST + 1}'s link down (ranks {LOST - 1}, {LOST})"}[row["case"]]
            table.append([what, f"{row['stopped']} of {row['survivors']}", row["slowest_s"],
                          f"{row['named']} of {row['survivors']}"])
    recorder.save(figures={"cases": results, "store_requests": requests, "world": WORLD, "hosts": HOSTS,
                           "bound_s": BOUND}, table=table)


if __name__ == "__main__":
    main()

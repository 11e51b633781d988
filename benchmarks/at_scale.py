"""World size 16: eight namespace hosts on one switch, two `train` processes each (gloo, fake data).

    sudo python benchmarks/at_scale.py        # root: network namespaces; ~10 min on a 2-core VM

Four runs, each of 16 processes started as `python -m ddp_utils train --world-size 16 --rank R ...` inside their
host's namespace (hosts 10.214.0.1 to .8; ranks 2h and 2h+1 on host h+1):
- nothing goes wrong: every rank exits 0 and rank 0's results.json says world size 16;
- rank 7 (host 4) killed (SIGKILL) once rank 0 has written the first checkpoint;
- rank 7 frozen (SIGSTOP: a suspended VM) likewise;
- host 4's link cut (its veth down): ranks 6 and 7 lose everyone else.
For the three faults it records, for every rank, the seconds from the fault to its exit and its last error line,
and whether that line names the lost rank with its host's address (ranks 6 and 7 behind the cut link lost rank 0
and its store: their line names rank 0 and 10.214.0.1). The bound is 30 s. Then the store requests the kit's watch
makes per beat round (every rank's one beat), at 2 to 64 ranks, counted with tests/helpers/counting_store.py.
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
from tests.helpers import netns, zygote  # noqa: E402
from tests.helpers.procs import base_env, free_port, popen, python, stop  # noqa: E402
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)

HOSTS, PER_HOST, LOST, BOUND = 8, 2, 7, 30.0


def host_of(rank: int) -> int:
    return rank // PER_HOST


def cut_off() -> list[int]:
    """The ranks on LOST's host: the ones a cut link takes away."""
    return [r for r in range(HOSTS * PER_HOST) if host_of(r) == host_of(LOST)]


def start(hosts, folder: Path, real: int | None = None) -> list:
    """The 16 ranks (rank ``real`` as a process of its own, for a signal that must reach it, not a fork client)."""
    port, procs = free_port(), []
    for rank in range(HOSTS * PER_HOST):
        settings = Settings(dataset="fake", image_size=32, workers=0, threads=1, batch_size=8, epochs=6,
                            max_steps_per_epoch=6, world_size=HOSTS * PER_HOST, rank=rank,
                            master_addr=hosts.addrs[0], master_port=port, wandb="disabled", progress="off",
                            run_dir=str(folder / "run"))
        argv = [*hosts.exec_prefix(host_of(rank)), *python("-m", "ddp_utils", "train", *settings.to_argv())]
        procs.append(popen(argv, base_env(), real=rank == real, cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True))
    return procs


def wait_for_checkpoint(folder: Path, procs: list, bound: float = 600.0) -> None:
    deadline = time.monotonic() + bound
    while not (folder / "run" / "last.pt").exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError("no checkpoint: " + "\n".join(p.communicate()[0][-1500:] for p in procs
                                                             if p.poll() is not None)[-4000:])
        time.sleep(0.2)


def ends(procs: list, since: float, bound: float) -> list:
    """Each rank's (seconds from ``since`` to its exit, or None past ``bound``; exit code; output)."""
    seconds = [None] * len(procs)
    while time.monotonic() < since + bound and any(s is None for s in seconds):
        for r, p in enumerate(procs):
            if seconds[r] is None and p.poll() is not None:
                seconds[r] = round(time.monotonic() - since, 1)
        time.sleep(0.1)
    stop(procs)
    return [(s, p.returncode, p.communicate()[0]) for s, p in zip(seconds, procs)]


def error_line(output: str) -> str:
    """The first line of the rank's last ``error:`` paragraph (why it stopped), else its last line."""
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    return lines[-1] if lines else (output.strip().splitlines() or ["(nothing)"])[-1]


def names_the_loss(rank: int, line: str, lost: list, hosts) -> bool:
    """Whether ``line`` names the ranks this rank lost, each with its host's address, and no other: the lost ones
    for a survivor (one of them is enough); rank 0 (and its store) for a rank behind the cut link."""
    expected = [0] if rank in lost else lost
    named = re.findall(r"rank (\d+)'s (?:last sign of life: \d+ s ago|store)(?: \(on [^,]+, ([\d.]+)\))?", line)
    ranks = {int(r) for r, _ in named}
    placed = {int(r) for r, addr in named if addr and addr == hosts.addrs[host_of(int(r))]}
    return bool(ranks) and ranks <= set(expected) and ranks == placed


def fault_case(name: str, hosts, folder: Path) -> dict:
    lost = cut_off() if name == "cut" else [LOST]
    ranks = [r for r in range(HOSTS * PER_HOST) if name == "cut" or r != LOST]   # the ones watched to their end
    procs = start(hosts, folder, real=LOST if name in ("killed", "frozen") else None)
    try:
        wait_for_checkpoint(folder, procs)
        since = time.monotonic()
        if name == "cut":
            subprocess.run(["ip", "-n", hosts.names[host_of(LOST)], "link", "set", hosts.veths[host_of(LOST)],
                            "down"], check=True)
        else:
            procs[LOST].send_signal(signal.SIGKILL if name == "killed" else signal.SIGSTOP)
        results = ends([procs[r] for r in ranks], since, BOUND + 30)
    finally:
        if name == "frozen":
            procs[LOST].send_signal(signal.SIGKILL)
        stop(procs)
    rows = {r: {"stopped_after_s": s, "exit": code, "says": error_line(out)[:400],
                "names_the_loss": names_the_loss(r, error_line(out), lost, hosts)}
            for r, (s, code, out) in zip(ranks, results)}
    slowest = max((row["stopped_after_s"] or float("inf")) for row in rows.values())
    return {"lost": lost, "ranks": rows, "slowest_s": slowest,
            "passed": slowest <= BOUND and all(row["names_the_loss"] and row["exit"] != 0 for row in rows.values())}


def clean_run(hosts, folder: Path) -> dict:
    import json
    procs = start(hosts, folder)
    results = ends(procs, time.monotonic(), 900)
    saved = json.loads((folder / "run" / "results.json").read_text()) if (folder / "run" / "results.json").exists() \
        else {}
    return {"exits": [code for _, code, _ in results], "world_size": saved.get("world_size"),
            "seconds": max(s or 0 for s, _, _ in results),
            "passed": all(code == 0 for _, code, _ in results) and saved.get("world_size") == HOSTS * PER_HOST}


def store_requests() -> dict:
    from ddp_utils.robust import peers
    from tests.helpers.counting_store import CountingStore, requests_per_beat_round
    kept = peers._store
    try:
        peers._store = CountingStore()
        return {n: sum(requests_per_beat_round(n)) for n in (2, 4, 8, 16, 32, 64)}
    finally:
        peers._store = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="trains,killed,frozen,cut", help="which runs (default: all four)")
    add_out(parser, "at_scale")
    args = parser.parse_args()
    recorder = Recorder("at_scale", args)
    figures = {}
    with tempfile.TemporaryDirectory() as tmp, netns.many_hosts(HOSTS, "10.214.0") as hosts:
        for case in args.cases.split(","):
            started = time.monotonic()
            folder = Path(tmp) / case
            figures[case] = clean_run(hosts, folder) if case == "trains" else fault_case(case, hosts, folder)
            print(f"{case}: {'passed' if figures[case]['passed'] else 'FAILED'} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    zygote.stop_servers()   # the ranks were its children: reaped now, they count as this benchmark's own CPU
    figures["store_requests_per_beat_round"] = store_requests()
    table = ["| fault (world size 16, 8 hosts x 2) | every rank stopped within (s) | ranks naming the lost rank "
             "and its host |", "| --- | ---: | ---: |"]
    what = {"killed": f"rank {LOST} killed (SIGKILL)", "frozen": f"rank {LOST} frozen (SIGSTOP)",
            "cut": f"host {host_of(LOST) + 1}'s link cut (ranks {', '.join(map(str, cut_off()))})"}
    for case in ("killed", "frozen", "cut"):
        if case in figures:
            rows = figures[case]["ranks"].values()
            table.append(f"| {what[case]} | {figures[case]['slowest_s']} | "
                         f"{sum(r['names_the_loss'] for r in rows)} of {len(rows)} |")
    print("\n".join(table))
    print("store requests per beat round:", figures["store_requests_per_beat_round"])
    for case in ("killed", "frozen", "cut"):
        for rank, row in figures.get(case, {}).get("ranks", {}).items():
            print(f"{case} rank {rank}: {row['stopped_after_s']} s, exit {row['exit']}: {row['says']}")
    recorder.save(figures, table)


if __name__ == "__main__":
    main()

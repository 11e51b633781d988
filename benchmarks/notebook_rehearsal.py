"""Benchmark: the two DDP notebooks rehearsed on one machine against the single notebook, as a ratio.

    sudo python benchmarks/notebook_rehearsal.py               # default parameters of the notebooks
    sudo python benchmarks/notebook_rehearsal.py --epochs 4 --rounds 3

What a student does before renting two GPU nodes: ``main.ipynb`` and ``worker.ipynb`` run at the same
time on one machine, here in two network namespaces joined by a veth pair (two "hosts" with their
own addresses, as two nodes are), then ``single.ipynb`` alone on the same machine. Every notebook runs
with papermill, with its committed parameters except the run folder, the data folder, TensorBoard off
and MASTER_ADDR (host 1's address). OMP_NUM_THREADS is unset, so each kernel takes the threads the kit
gives it (cores / ranks on the machine). single.ipynb runs twice: with the threads one DDP rank got
(THREADS, so that it stands for one node, as each rank does: the comparison the homework makes) and
with every core (the same hardware as both ranks together, so DDP cannot beat it by much). The figures
are global training images/s from each run's results.json (training loops only), DDP over single,
median over ``--rounds`` rounds.
Needs root (``ip netns``) and the test dependencies (papermill, ipykernel).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.helpers import netns  # noqa: E402  (the test suite's two-host helper)
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)

NOTEBOOKS = REPO / "notebooks"


def papermill(name: str, out: Path, params: dict, prefix=()) -> list[str]:
    return [*prefix, sys.executable, "-m", "papermill", str(NOTEBOOKS / f"{name}.ipynb"), str(out),
            "-y", json.dumps(params), "--cwd", str(NOTEBOOKS), "-k", "python3", "--no-progress-bar"]


def run_together(cmds: list[list[str]], timeout: float) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(p.args[:6])} exited with {p.returncode}:\n{out[-3000:]}")


def one_round(tmp: Path, hosts, port: int, data: str, changes: dict) -> dict:
    """main + worker together on the two hosts, then single with one rank's threads, then with all cores."""
    params = {"DATA_DIR": data, "TENSORBOARD": False, **changes}
    ddp = {**params, "MASTER_ADDR": hosts.addrs[0], "MASTER_PORT": port, "RUN_DIR": str(tmp / "ddp")}
    run_together([papermill("main", tmp / "main.out.ipynb", ddp, hosts.exec_prefix(0)),
                  papermill("worker", tmp / "worker.out.ipynb", ddp, hosts.exec_prefix(1))], timeout=1800)
    runs = {"ddp": json.loads((tmp / "ddp" / "results.json").read_text())}
    for name, threads in (("single_node", runs["ddp"]["threads"]), ("single_all", 0)):
        run_together([papermill("single", tmp / f"{name}.out.ipynb",
                                {**params, "THREADS": threads, "RUN_DIR": str(tmp / name)})], timeout=1800)
        runs[name] = json.loads((tmp / name / "results.json").read_text())
    return runs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--epochs", type=int, default=None, help="EPOCHS of every notebook (default: theirs)")
    p.add_argument("--workers", type=int, default=None, help="WORKERS of every notebook (default: theirs)")
    p.add_argument("--loader", default=None, help="LOADER of every notebook (default: theirs)")
    add_out(p, "notebook_rehearsal")
    args = p.parse_args()
    recorder = Recorder("notebook_rehearsal", args)
    changes = {name: value for name, value in (("EPOCHS", args.epochs), ("WORKERS", args.workers),
                                               ("LOADER", args.loader)) if value is not None}
    from ddp_utils.demo_data import prepare_demo
    from ddp_utils.runlog import cpu_name
    rounds = []
    with tempfile.TemporaryDirectory() as tmp, netns.two_hosts("10.213.7") as hosts:
        data = str(prepare_demo(Path(tmp) / "demo"))
        for i in range(args.rounds):
            folder = Path(tmp) / f"round{i}"
            folder.mkdir()
            rounds.append(one_round(folder, hosts, 29500 + i, data, changes))
            print("round {}: ".format(i + 1) + "; ".join(
                f"{name} {r['images_per_s']:.0f} img/s ({r['world_size']} x {r['threads']} thread(s), "
                f"Acc@1 {r['acc1']:.1f})" for name, r in rounds[-1].items()), flush=True)
    ratio = {name: statistics.median(r["ddp"]["images_per_s"] / r[name]["images_per_s"] for r in rounds)
             for name in ("single_node", "single_all")}
    first = rounds[0]
    print(f"notebook rehearsal ({os.cpu_count()} CPU cores, {cpu_name()}; demo, {first['ddp']['epochs']} epochs, "
          f"notebook defaults{', ' + str(changes) if changes else ''}, two namespace hosts; median of "
          f"{len(rounds)} round(s)), DDP training images/s over:\n"
          f"  single.ipynb with one rank's threads ({first['single_node']['threads']}), i.e. one node: "
          f"{ratio['single_node']:.2f}x (target >= 1.4x)\n"
          f"  single.ipynb with every core ({first['single_all']['threads']}): {ratio['single_all']:.2f}x "
          f"(the same hardware in one process: about 1x at best)")
    ips = {name: statistics.median(r[name]["images_per_s"] for r in rounds) for name in ("ddp", *ratio)}
    threads = {name: first[name]["threads"] for name in ("ddp", *ratio)}
    table = ["| DDP notebooks (2 ranks x 1 thread) against | DDP | single | ratio |", "| --- | ---: | ---: | ---: |"]
    for name, what in (("single_node", f"`single.ipynb` with one rank's threads (`THREADS = {threads['single_node']}`): "
                                        "one node against two, the homework's comparison"),
                       ("single_all", f"`single.ipynb` with every core ({os.cpu_count()} threads): the same machine "
                                      "in one process")):
        table.append(f"| {what} | {ips['ddp']:,.0f} img/s | {ips[name]:,.0f} img/s | **{ratio[name]:.2f}x** |")
    recorder.save({"ratio": ratio, "images_per_s": ips, "threads": threads, "epochs": first["ddp"]["epochs"],
                   "rounds": [{name: r[name]["images_per_s"] for name in r} for r in rounds],
                   "acc1": {name: statistics.median(r[name]["acc1"] for r in rounds) for name in ips}}, table)


if __name__ == "__main__":
    main()

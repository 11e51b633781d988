"""Communication share and predicted vs measured speed-up, on an unshaped and a 1 Gbit/s link.

    sudo python benchmarks/link_speedup.py            # root: two network namespaces, tc on their link
    sudo python benchmarks/link_speedup.py --rate 500mbit --steps 12

Three runs of the same configuration (fake data, ResNet-18 at 32 px, batch 64 per rank, one CPU
thread per process, no worker processes), one after the other:

1. one rank alone (the baseline; inside the first namespace),
2. two ranks on two namespace "hosts" joined by an unshaped veth pair,
3. the same two ranks with both ends of the link shaped to ``--rate`` (tc tbf).

The two-rank runs train with ``--comm`` (default auto: the link probe chooses, and predicts the step with
what it chose). For each it prints the time split of the last epoch (the first one warms up), the link
probe's bandwidth and predicted speed-up, and the speed-up measured against run 1 (images/s of the last
epoch), medians over ``--rounds``; and round by round, on each link, the comm chosen, the predicted and
the measured speed-up and whether the prediction is within 15 % of the measured one (JSON: figures.per_round).
Figures are ratios measured side by side in one run: take them on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from ddp_utils.settings import Settings  # noqa: E402
from tests.helpers import netns  # noqa: E402
from tests.helpers.procs import base_env, describe, free_port, python, run_all  # noqa: E402
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)

WITHIN = 0.15   # the probe's goal (issue 46): within 15 % of the measured speed-up, in every round, on both links


def train(run_dir: Path, rank: int, world_size: int, addr: str, port: int, args) -> list[str]:
    settings = Settings(dataset="fake", arch=args.arch, image_size=32, batch_size=64, threads=1, workers=0,
                        comm=args.comm if world_size > 1 else "none",
                        wandb="disabled", progress="off", epochs=2, max_steps_per_epoch=args.steps, backend="gloo",
                        run_dir=str(run_dir), rank=rank, world_size=world_size, master_addr=addr, master_port=port)
    return python("-m", "ddp_utils", "train", *settings.to_argv())


def run(hosts, run_dir: Path, world_size: int, args) -> dict:
    port = free_port()
    results = run_all([[*hosts.exec_prefix(r), *train(run_dir, r, world_size, hosts.addrs[0], port, args)]
                       for r in range(world_size)], timeout=900, env=base_env(OMP_NUM_THREADS="1"))
    if any(r.returncode != 0 for r in results):
        raise SystemExit(describe(results))
    return json.loads((run_dir / "results.json").read_text())


def shape(hosts, rate: str) -> None:
    for name, veth in zip(hosts.names, hosts.veths):
        subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", rate,
                        "burst", "256kbit", "latency", "50ms"], check=True)


def figures(results: dict, baseline: dict | None) -> dict:
    """The last epoch's numbers of one run (the first epoch warms up)."""
    last = results["history"][-1]["train"]
    probe = results.get("probe") or {}
    return {"img_s": last["images_per_s"],
            **{key: 100 * last[key] / last["wall_s"] for key in ("data_s", "compute_s", "comm_s", "idle_s")},
            "in_flight": 100 * last["comm_total_s"] / last["wall_s"],
            "probe_ms": 1e3 * probe["compute_s"] if probe else None,
            "train_ms": 1e3 * last["compute_s"] / last["steps"],
            "link": results.get("link_gbit_s"), "predicted": results.get("predicted_speedup"),
            "comm": results.get("comm"), "loader_ms": 1e3 * probe["loader_s"] if probe.get("loader_timed") else None,
            "measured": last["images_per_s"] / baseline["history"][-1]["train"]["images_per_s"] if baseline else 1.0}


def medians(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds; a word (the comm) where every round has the same, else all of them."""
    out = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        if any(isinstance(v, str) for v in values):
            out[key] = values[0] if len(set(values)) == 1 else "/".join(map(str, values))
        else:
            out[key] = statistics.median(values) if None not in values else None
    return out


def per_round(unshaped: list[dict], shaped: list[dict]) -> list[dict]:
    """Round by round, on each link: the comm chosen, the predicted and measured speed-up, the prediction's error
    and whether it is within ``WITHIN`` of the measured one."""
    def link(f: dict) -> dict:
        error = f["predicted"] / f["measured"] - 1 if f["predicted"] else None
        return {"comm": f["comm"], "predicted": f["predicted"], "measured": f["measured"], "error": error,
                "within_15": error is not None and abs(error) <= WITHIN}
    return [{"round": i + 1, "unshaped": link(u), "shaped": link(s)}
            for i, (u, s) in enumerate(zip(unshaped, shaped))]


def median_row(name: str, rounds: list[dict]) -> str:
    m = medians(rounds)
    probe = f"{m['probe_ms']:.0f}" if m["probe_ms"] is not None else "-"
    link = f"{m['link']:.2f}" if m["link"] else "-"
    predicted = f"{m['predicted']:.2f}x" if m["predicted"] else "-"
    off = f" ({100 * (m['predicted'] / m['measured'] - 1):+.0f} %)" if m["predicted"] else ""
    return (f"| {name} | {m['comm']} | {m['img_s']:.0f} | {m['data_s']:.0f} / {m['compute_s']:.0f} / "
            f"{m['comm_s']:.0f} / "
            f"{m['idle_s']:.0f} | {m['in_flight']:.0f} | {probe} / {m['train_ms']:.0f} | {link} | {predicted}{off} "
            f"| {m['measured']:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="tc rate of the shaped link (default 1gbit)")
    # 40: the measured speed-up is one epoch's images/s over another run's; at 15 steps (about 9 s on the 2-core
    # VM) one round of five measured 1.27x on the unshaped link where the other four gave 1.50-1.79x
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch (2 epochs per run; default 40)")
    parser.add_argument("--arch", default="resnet18", help="model (default resnet18: 45 MB of gradients)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three runs; medians (default 5)")
    parser.add_argument("--comm", default="auto", help="gradient communication of the 2-rank runs (default auto)")
    add_out(parser, "link_speedup")
    args = parser.parse_args()
    recorder = Recorder("link_speedup", args)
    names = ["1 rank", "2 ranks, unshaped veth", f"2 ranks, link shaped to {args.rate}"]
    rounds: dict[str, list] = {name: [] for name in names}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp, netns.two_hosts("10.213.9") as hosts:
            one = run(hosts, Path(tmp, "one"), 1, args)
            rounds[names[0]].append(figures(one, None))
            rounds[names[1]].append(figures(run(hosts, Path(tmp, "two"), 2, args), one))
            shape(hosts, args.rate)
            rounds[names[2]].append(figures(run(hosts, Path(tmp, "slow"), 2, args), one))
    print(f"{args.arch}, 32 px, batch 64 per rank, 1 thread per process, fake data, last of 2 epochs "
          f"({args.steps} steps each), --comm {args.comm}, medians of {args.rounds} rounds\n")
    table = ["| run | comm | img/s | time: data / compute / comm waited / idle (%) | comm in flight (%) "
             "| compute per step (ms): probe / training | link (Gbit/s) | predicted speed-up (vs measured) "
             "| measured speed-up |", "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    table += [median_row(name, rounds[name]) for name in names]
    print("\n".join(table))
    figs = {key: medians(rounds[name]) for key, name in zip(("one", "unshaped", "shaped"), names)}
    # the prediction's error in each round, against the speed-up measured in that round: what a student sees
    figs["errors"] = {key: [r["predicted"] / r["measured"] - 1 for r in rounds[name]]
                      for key, name in (("unshaped", names[1]), ("shaped", names[2]))}
    print("\nthe prediction's error per round: " + "; ".join(
        f"{key} " + ", ".join(f"{100 * e:+.0f} %" for e in errs) for key, errs in figs["errors"].items()))
    figs["per_round"] = per_round(rounds[names[1]], rounds[names[2]])
    figs["within_15"] = {key: all(r[key]["within_15"] for r in figs["per_round"]) for key in ("unshaped", "shaped")}
    for r in figs["per_round"]:
        print(f"round {r['round']}: " + "; ".join(
            f"{key} {r[key]['comm']}: predicted {r[key]['predicted']:.2f}x, measured {r[key]['measured']:.2f}x "
            f"({100 * r[key]['error']:+.0f} %, {'within' if r[key]['within_15'] else 'NOT within'} 15 %)"
            for key in ("unshaped", "shaped")))
    recorder.save(figs, table, rounds=rounds)


if __name__ == "__main__":
    main()

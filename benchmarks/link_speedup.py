"""Communication share and predicted vs measured speed-up, on an unshaped and a 1 Gbit/s link.

    sudo python benchmarks/link_speedup.py            # root: two network namespaces, tc on their link
    sudo python benchmarks/link_speedup.py --rate 500mbit --steps 12

Three runs of the same configuration (fake data, ResNet-18 at 32 px, batch 64 per rank, one CPU
thread per process, no worker processes), one after the other:

1. one rank alone (the baseline; inside the first namespace),
2. two ranks on two namespace "hosts" joined by an unshaped veth pair,
3. the same two ranks with both ends of the link shaped to ``--rate`` (tc tbf).

For each it prints the time split of the last epoch (the first one warms up), the link probe's
bandwidth and predicted speed-up, and the speed-up measured against run 1 (images/s of the last
epoch). Figures are ratios measured side by side in one run: take them on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests import netns  # noqa: E402
from tests.procs import base_env, describe, free_port, python, run_all  # noqa: E402


def train(run_dir: Path, rank: int, world_size: int, addr: str, port: int, args) -> list[str]:
    return python("-m", "ddp_utils", "train", "--dataset", "fake", "--arch", args.arch, "--image-size", "32",
                  "--batch-size", "64", "--threads", "1", "--workers", "0", "--wandb", "disabled",
                  "--progress", "off", "--epochs", "2", "--max-steps-per-epoch", str(args.steps),
                  "--backend", "gloo", "--run-dir", str(run_dir), "--rank", str(rank), "--world-size",
                  str(world_size), "--master-addr", addr, "--master-port", str(port))


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


def row(name: str, results: dict, baseline: dict | None) -> str:
    last = results["history"][-1]["train"]
    share = {key: 100 * last[key] / last["wall_s"] for key in ("data_s", "compute_s", "comm_s", "idle_s")}
    measured = last["images_per_s"] / baseline["history"][-1]["train"]["images_per_s"] if baseline else None
    link = f"{results['link_gbit_s']:.2f}" if results.get("link_gbit_s") else "-"
    predicted = f"{results['predicted_speedup']:.2f}x" if results.get("predicted_speedup") else "-"
    steps = last["steps"]
    probe = f"{1e3 * results['probe']['compute_s']:.0f} / " if results.get("probe") else "- / "
    compute = f"{probe}{1e3 * last['compute_s'] / steps:.0f}"
    return (f"| {name} | {last['images_per_s']:.0f} | {share['data_s']:.0f} / {share['compute_s']:.0f} / "
            f"{share['comm_s']:.0f} / {share['idle_s']:.0f} | {100 * last['comm_total_s'] / last['wall_s']:.0f} | "
            f"{compute} | {link} | {predicted} | {f'{measured:.2f}x' if measured else '1.00x (baseline)'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="tc rate of the shaped link (default 1gbit)")
    parser.add_argument("--steps", type=int, default=15, help="steps per epoch (2 epochs per run; default 15)")
    parser.add_argument("--arch", default="resnet18", help="model (default resnet18: 45 MB of gradients)")
    args = parser.parse_args()
    lines = []
    with tempfile.TemporaryDirectory() as tmp, netns.two_hosts("10.213.9") as hosts:
        one = run(hosts, Path(tmp, "one"), 1, args)
        lines.append(row("1 rank", one, None))
        two = run(hosts, Path(tmp, "two"), 2, args)
        lines.append(row("2 ranks, unshaped veth", two, one))
        shape(hosts, args.rate)
        slow = run(hosts, Path(tmp, "slow"), 2, args)
        lines.append(row(f"2 ranks, link shaped to {args.rate}", slow, one))
    print(f"{args.arch}, 32 px, batch 64 per rank, 1 thread per process, fake data, last of 2 epochs "
          f"({args.steps} steps each)\n")
    print("| run | img/s | time: data / compute / comm waited / idle (%) | comm in flight (%) "
          "| compute per step (ms): probe / training | link (Gbit/s) | predicted speed-up | measured speed-up |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

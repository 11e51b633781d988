"""Gradient compression on a slow link: throughput against 2 x one rank, and accuracy over seeds.

    sudo python benchmarks/comm_hooks.py                 # root: two network namespaces, tc on their link
    sudo python benchmarks/comm_hooks.py --seeds 2 --epochs 3 --rates 500mbit
    sudo python benchmarks/comm_hooks.py --comms powersgd --powersgd-rank 1 --rates 1gbit
    sudo python benchmarks/comm_hooks.py --seeds 1,2,3,4,5 --runs 1gbit/none,1gbit/auto,unshaped/none \
        --out benchmarks/results/comm_hooks-auto.json           # comm=auto against none over 5 seeds

For each seed, one after the other: one rank alone (the baseline), then two ranks on two namespace
"hosts" joined by a veth pair, for each of ``--rates`` (a tc tbf rate, or ``unshaped``: the bare
veth pair), once per ``--comm`` setting (none, localsgd, auto, powersgd, none+acc4). The model is torchvision's ResNet-18 (45 MB of gradients) at 32 px on the
bundled demo digits with the in-memory loader (so that decoding does not hide the link), batch 64
per rank, one CPU thread per process. Throughput is the mean images/s of the epochs after the
first; "of 2x" = two ranks' images/s / (2 x one rank's); "of the unshaped link" = images/s / the unshaped link's
with --comm none, seed by seed. ``none+acc4`` adds ``--accumulate 4`` (one all-reduce every 4 batches), ``localsgd+avg4``
``--average-every 4``. Accuracy is the final Acc@1 on the demo's
validation split. Per step (the same epochs, each rank's mean): compute, and the communication the step
waited for (with PowerSGD on gloo that includes the compression's own arithmetic, which
``benchmarks/powersgd_cost.py`` measures alone). Prints a table of means +- std over the seeds. Take
the figures on an idle machine.
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

COMMS = ("none", "localsgd", "auto", "powersgd", "none+acc4")


EXTRAS = {"acc": ("accumulate", int), "avg": ("average_every", int), "wu": ("powersgd_warmup_steps", int),
          "mc": ("powersgd_min_compression", float), "wp": ("powersgd_warmup_precision", str)}


def setting(name: str) -> dict:
    """The settings of a compared name: ``fp16``; ``none+acc4`` (--accumulate 4: all-reduce every 4 batches);
    ``localsgd+avg4`` (--average-every 4: average the weights every 4 steps); ``powersgd+wu20+mc2``
    (--powersgd-warmup-steps 20, --powersgd-min-compression 2); ``powersgd+wpbf16`` (--powersgd-warmup-precision
    bf16)."""
    comm, *extras = name.split("+")
    out = {"comm": comm}
    for extra in extras:
        prefix = extra[:3] if extra[:3] in EXTRAS else extra[:2]
        key, kind = EXTRAS[prefix]
        out[key] = kind(extra[len(prefix):])
    return out


def paired(row: list[float], base: list[float]) -> list[float]:
    """Seed by seed: a run's figure minus the exact all-reduce's (none) on the same link and seed."""
    return [a - b for a, b in zip(row, base)]


def interval90(values: list[float]) -> tuple[float, float]:
    """The 90 % t-interval of the mean of ``values`` (two or more)."""
    from scipy import stats
    mean, sem = statistics.mean(values), statistics.stdev(values) / len(values) ** 0.5
    half = stats.t.ppf(0.95, len(values) - 1) * sem
    return mean - half, mean + half


def train(run_dir: Path, rank: int, world_size: int, addr: str, port: int, seed: int, name: str, args) -> list[str]:
    settings = Settings(dataset="demo", data_dir=str(args.data), loader="memory", arch="resnet18", batch_size=64,
                        lr=args.lr, epochs=args.epochs, threads=1, workers=0, wandb="disabled", progress="off",
                        backend="gloo", seed=seed, **setting(name), powersgd_rank=args.powersgd_rank,
                        run_dir=str(run_dir), rank=rank,
                        world_size=world_size, master_addr=addr, master_port=port)
    return python("-m", "ddp_utils", "train", *settings.to_argv())


def run(hosts, run_dir: Path, world_size: int, seed: int, comm: str, args) -> dict:
    port = free_port()
    results = run_all([[*hosts.exec_prefix(r), *train(run_dir, r, world_size, hosts.addrs[0], port, seed, comm, args)]
                       for r in range(world_size)], timeout=1800, env=base_env(OMP_NUM_THREADS="1"))
    if any(r.returncode != 0 for r in results):
        raise SystemExit(describe(results))
    return json.loads((run_dir / "results.json").read_text())


def throughput(results: dict, first: int = 1) -> float:
    """Mean images/s of the epochs from index ``first`` on (the first one warms up)."""
    later = results["history"][first:] or results["history"]
    return statistics.mean(h["train"]["images_per_s"] for h in later)


def shape(hosts, rate: str) -> None:
    """Both ends of the link at ``rate`` (tc tbf), or bare for ``unshaped``."""
    for name, veth in zip(hosts.names, hosts.veths):
        tc = ["ip", "netns", "exec", name, "tc", "qdisc"]
        subprocess.run([*tc, "del", "dev", veth, "root"], capture_output=True)   # none there yet: fine
        if rate != "unshaped":
            subprocess.run([*tc, "add", "dev", veth, "root", "tbf", "rate", rate, "burst", "256kbit", "latency",
                            "50ms"], check=True)


def per_step_ms(results: dict, key: str, first: int = 1) -> float:
    """Mean milliseconds of ``key`` (compute_s, comm_s) per training step, epochs from ``first`` on."""
    later = results["history"][first:] or results["history"]
    return 1000 * sum(h["train"][key] for h in later) / sum(h["train"]["steps"] for h in later)


def pm(values: list[float], fmt: str) -> str:
    if len(values) < 2:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} +- {format(statistics.stdev(values), fmt.lstrip('+'))}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1gbit,unshaped",
                        help="tc rates of the link, or 'unshaped' (default 1gbit,unshaped)")
    parser.add_argument("--seeds", default="2,4,42", help="seeds (default 2,4,42)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs per run (default 8, the demo's recipe)")
    parser.add_argument("--lr", type=float, default=0.1, help="lr at a global batch of 256 (default 0.1: exact DDP's "
                        "Acc@1 within 1 point sd over 16 fresh seeds, benchmarks/recipe_spread.py; 0.2, the files "
                        "before it, collapsed on some seeds; the demo recipe's 0.8 is too high for ResNet-18)")
    parser.add_argument("--comms", default=",".join(COMMS), help=f"settings to compare (default {','.join(COMMS)}); "
                        "'+accK' adds --accumulate K, e.g. none+acc4 (a global batch K times larger: the lr scales)")
    parser.add_argument("--powersgd-rank", type=int, default=Settings().powersgd_rank,
                        help=f"PowerSGD's rank (default {Settings().powersgd_rank}, the kit's)")
    parser.add_argument("--runs", default="", help="only these LINK/COMM pairs, e.g. 1gbit/none,1gbit/auto,"
                        "unshaped/none (default: every rate with every comm)")
    add_out(parser, "comm_hooks")
    args = parser.parse_args()
    recorder = Recorder("comm_hooks", args)
    seeds = [int(s) for s in args.seeds.split(",")]
    comms, rates = args.comms.split(","), args.rates.split(",")
    pairs = ([tuple(pair.split("/")) for pair in args.runs.split(",")] if args.runs else
             [(r, c) for r in rates for c in comms])
    rows: dict[tuple, dict[str, list]] = {key: {"ips": [], "ratio": [], "late": [], "acc1": [], "val_loss": [],
                                                "chose": [], "comm": [], "compute_ms": [], "comm_ms": []}
                                          for key in [("-", "1 rank"), *pairs]}
    with tempfile.TemporaryDirectory() as tmp, netns.two_hosts("10.213.10") as hosts:
        args.data = Path(tmp, "demo")
        from ddp_utils.demo_data import prepare_demo
        prepare_demo(args.data)
        for seed in seeds:
            one = run(hosts, Path(tmp, f"one-{seed}"), 1, seed, "none", args)
            base = throughput(one)
            alone = rows[("-", "1 rank")]
            alone["ips"].append(base)
            alone["ratio"].append(0.5)
            alone["late"].append(0.5)
            alone["acc1"].append(one["acc1"])
            alone["val_loss"].append(one["history"][-1]["val"]["loss"])
            alone["compute_ms"].append(per_step_ms(one, "compute_s"))
            for rate, comm in pairs:
                shape(hosts, rate)
                two = run(hosts, Path(tmp, f"{rate}-{comm}-{seed}"), 2, seed, comm, args)
                row = rows[(rate, comm)]
                row["ips"].append(throughput(two))
                row["ratio"].append(throughput(two) / (2 * base))
                # the second half of the run: PowerSGD's exact warm-up steps are over by then
                half = len(two["history"]) // 2
                row["late"].append(throughput(two, half) / (2 * throughput(one, half)))
                row["acc1"].append(two["acc1"])
                row["val_loss"].append(two["history"][-1]["val"]["loss"])
                row["chose"].append(two["comm"])
                row["comm"].append(100 * two["comm_s"] / two["train_time_s"])
                row["compute_ms"].append(per_step_ms(two, "compute_s"))
                row["comm_ms"].append(per_step_ms(two, "comm_s"))
            print(f"seed {seed} done", file=sys.stderr, flush=True)
    print(f"ResNet-18 at 32 px on the demo digits (memory loader), batch 64 per rank, lr {args.lr} at 256, "
          f"{args.epochs} epochs, PowerSGD rank {args.powersgd_rank}, 1 thread "
          f"per process, links {args.runs or args.rates}; mean +- std over seeds {args.seeds}\n")
    fast = rows.get(("unshaped", "none"), {}).get("ips")   # the goal: a slow link as fast as this one
    table = ["| run | link | --comm (chosen) | img/s | of 2 x one rank | the same, second half of the run | of the "
             "unshaped link, none | comm waited (% of train time) | per step: compute / comm waited (ms) | final Acc@1 "
             "(%) | Acc@1 vs none, paired (points) | val loss vs none, paired (90 % interval) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (rate, name), row in rows.items():
        chosen = "-" if name == "1 rank" else f"{name} ({'/'.join(sorted(set(row['chose'])))})"
        comm = pm(row["comm"], ".0f") if row["comm"] else "-"
        label = "1 rank" if name == "1 rank" else "2 ranks"
        step = pm(row["compute_ms"], ".0f") + (f" / {pm(row['comm_ms'], '.0f')}" if row["comm_ms"] else "")
        if fast and label == "2 ranks":
            row["of_unshaped"] = [a / b for a, b in zip(row["ips"], fast)]
        of_fast = pm(row["of_unshaped"], ".2f") if "of_unshaped" in row else "-"
        exact = rows.get((rate, "none"))
        vs_acc = vs_loss = "-"
        if exact is not None and name != "none" and label == "2 ranks":
            row["acc1_vs_none"] = paired(row["acc1"], exact["acc1"])
            row["val_loss_vs_none"] = paired(row["val_loss"], exact["val_loss"])
            vs_acc = pm(row["acc1_vs_none"], "+.2f")
            vs_loss = pm(row["val_loss_vs_none"], "+.3f")
            if len(seeds) > 1:
                vs_loss += " ({:+.3f} .. {:+.3f})".format(*interval90(row["val_loss_vs_none"]))
        table.append(f"| {label} | {rate} | {chosen} | {pm(row['ips'], '.0f')} | {pm(row['ratio'], '.2f')} | "
                     f"{pm(row['late'], '.2f')} | {of_fast} | {comm} | {step} | {pm(row['acc1'], '.2f')} | "
                     f"{vs_acc} | {vs_loss} |")
    print("\n".join(table))
    # figures["1gbit/localsgd"]["acc1"] = {"mean": ..., "std": ..., "values": [one a seed]}
    recorder.save({f"{rate}/{name}" if rate != "-" else name: {
        key: {"mean": statistics.mean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0, "values": v}
        if key != "chose" else sorted(set(v)) for key, v in row.items() if v} for (rate, name), row in rows.items()},
        table)


if __name__ == "__main__":
    main()

"""Part (e) of the lab, measure: what your collectives and your DDP cost, next to torch's.

Run from the repository root (BUILD_DDP=reference measures the kit's solution instead of your student.py):

    python lab/build_ddp/bench.py collectives                  # 2 ranks, 4 KiB .. 256 MiB, 5 rounds: minutes
    python lab/build_ddp/bench.py collectives --ranks 4 --max-mib 16
    python lab/build_ddp/bench.py step                         # 6 trainings, 5 rounds: about 15 minutes
    sudo python lab/build_ddp/bench.py step --hosts netns --rate 1gbit   # two "hosts" joined by a 1 Gbit/s link
    python lab/build_ddp/bench.py step --variants a,b,ddp --steps 10 --repeat 3   # a subset, shorter

Every figure is measured --repeat times (default 5, in rounds: every size or variant once, then again, so that a
machine that slows down for a while spreads every figure alike rather than biasing one), and printed as the median
with the spread, the lowest and highest round (``12.3 (11.8-14.0)``). Two figures whose spreads overlap are
"within each other's spread": the measurement cannot tell them apart, and the tables say so instead of ranking
them. Measure on an idle machine: another program on the same cores widens every spread.

collectives: times your ring_all_reduce, dist.all_reduce and one point-to-point exchange with the ring
neighbours, for float32 tensors of 4 KiB to --max-mib MiB (powers of 4). It fits the alpha-beta model
t(n) = alpha + n * beta to the point-to-point times (alpha: the fixed cost of a message, 1/beta: the bandwidth),
once on the medians and once per round (the rounds' fits give alpha's and beta's spread), and predicts the ring
from it: 2 (N - 1) messages of n / N bytes, t = 2 (N - 1) (alpha + (n / N) beta).
Across nodes, run the same command on every node with --nodes, --node-rank, --master-addr and --master-port
(ranks are split in blocks, as in harness.py); --backend nccl gives each rank its own GPU.

step: trains the kit's wide MLP (fake data, 32 px, batch 32 per rank, one thread per rank, two epochs; the
figures are the second epoch's: the first warms up) with your part (a), (b), (c) at 1, 8 and 64 MB buckets
and with torch's DistributedDataParallel, one after the other, on this machine's loopback or (--hosts netns,
root) on two network namespaces whose link tc shapes to --rate. Runs (a) and (b) leave a torch.profiler
trace of two steps: open it in https://ui.perfetto.dev or chrome://tracing.

Every run writes into its own new folder (default runs/build_ddp_bench/<date-time>/). Take figures to keep
on an idle machine: other programs on the same cores change them.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE.parent), str(REPO)]   # the lab's package (its adapter: which file is measured) and the kit
from build_ddp import adapter  # noqa: E402

KIB, MIB = 2**10, 2**20
STAGES = ("checking the result", "ring_all_reduce", "dist.all_reduce", "point-to-point")


class BenchError(Exception):
    """What went wrong, in a sentence or two for the student (printed without a traceback)."""


def out_folder(out: str | None) -> Path:
    """A new folder for this run's files (made when there is something to write): never one that holds files."""
    if out is None:
        base = Path("runs", "build_ddp_bench", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        return next(p for n in range(1, 100) if not (p := Path(f"{base}-{n}" if n > 1 else base)).exists())
    if Path(out).exists() and any(Path(out).iterdir()):
        raise BenchError(f"--out {out}: that folder already holds files; name a new folder (nothing is overwritten)")
    return Path(out)


def size_name(nbytes: int) -> str:
    return f"{nbytes / MIB:g} MiB" if nbytes >= MIB else f"{nbytes / KIB:g} KiB"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def about() -> dict:
    """What every result file records besides its figures."""
    return {"implementation": str(adapter.path_of(adapter.chosen())), "torch": torch.__version__,
            "cpus": os.cpu_count(), "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": sys.argv}


# -- collectives: what runs on every rank ------------------------------------------------------------------------

def sizes(max_mib: float) -> list[int]:
    """4 KiB, 16 KiB, 64 KiB, ... up to max_mib MiB: powers of 4, evenly spaced on a log-log plot."""
    return [4 * KIB * 4**k for k in range(20) if 4 * KIB * 4**k <= max_mib * MIB]


def repeats_for(nbytes: int) -> int:
    """Calls timed per round (a round's figure is their median). Small messages are fast and noisy: many; a 256 MiB
    all-reduce takes about a second on gloo: one (the rounds repeat it)."""
    return 10 if nbytes <= 256 * KIB else 5 if nbytes <= 4 * MIB else 2 if nbytes <= 64 * MIB else 1


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) of a figure's rounds."""
    return statistics.median(values), min(values), max(values)


def within(a: list[float], b: list[float]) -> bool:
    """Whether two figures' spreads overlap: the measurement cannot tell them apart."""
    return min(a) <= max(b) and min(b) <= max(a)


def compared(a: list[float], b: list[float]) -> str:
    """``within each other's spread``, or the ratio of the medians (a / b) beyond it."""
    if within(a, b):
        return "within each other's spread"
    ratio = statistics.median(a) / statistics.median(b)
    return f"{ratio:.2f}x, beyond the spread"


def shown(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    """``median (lowest-highest)`` of a figure's rounds, times ``scale``."""
    mid, low, high = (v * scale for v in spread(values))
    return f"{mid:.{digits}g} ({low:.{digits}g}-{high:.{digits}g})"


def agreed_time(op, repeats: int, device) -> float:
    """The median over repeats of the slowest rank's time (a collective is done when its last rank is done)."""
    op()   # warm-up: the first call sets up connections and buffers
    times = []
    for _ in range(repeats):
        dist.barrier()   # start together: a rank that arrives late would add its lateness to the others' time
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        op()
        if device.type == "cuda":   # NCCL returns before the GPU has finished: wait for it
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def check_ring(ring, nbytes: int, device) -> None:
    """Raise BenchError on every rank if ring_all_reduce's sum differs from dist.all_reduce's at this size."""
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(1000 * rank + nbytes % 997)
    # small whole numbers: their sum is exact in float32 whatever the order of the additions, so equal means right
    data = torch.randint(-8, 9, (nbytes // 4,), generator=generator).float().to(device)
    expected, got = data.clone(), data.clone()
    dist.all_reduce(expected)
    ring(got)
    wrong = torch.tensor([0.0 if torch.equal(got, expected) else 1.0], device=device)
    dist.all_reduce(wrong, op=dist.ReduceOp.MAX)   # every rank stops, not only the ones that saw it
    if wrong.item():
        worst = (got - expected).abs().max().item()
        raise BenchError(f"ring_all_reduce gave a wrong sum at {size_name(nbytes)} ({nbytes // 4} float32 values; "
                         f"on rank {rank} the largest difference from dist.all_reduce is {worst:g}): its times would "
                         f"be a wrong algorithm's. Fix part (d) first: python -m pytest lab/build_ddp -k part_d")


def measure(max_mib: float, repeat: int, device, progress) -> list[dict]:
    """Every size's times, each a list of ``repeat`` rounds, the same on every rank (agreed_time)."""
    ring = adapter.implementation().ring_all_reduce
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [{"bytes": nbytes, "repeats": repeats_for(nbytes), "ring_s_rounds": [], "all_reduce_s_rounds": [],
             "p2p_s_rounds": []} for nbytes in sizes(max_mib)]
    for row in rows:   # a wrong ring is said before any time is taken
        progress[0].value, progress[1].value = row["bytes"], 0   # where we are, for the parent if we hang
        check_ring(ring, row["bytes"], device)
    for _ in range(repeat):   # rounds: every size once, then again
        for row in rows:
            buffer = torch.zeros(row["bytes"] // 4, device=device)   # zeros: the sums stay 0 however often we repeat
            incoming = torch.empty_like(buffer)

            def exchange():   # one message to the right neighbour while one arrives from the left
                for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, buffer, (rank + 1) % world),
                                                    dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]):
                    work.wait()
            ops = {"ring_s": lambda: ring(buffer), "all_reduce_s": lambda: dist.all_reduce(buffer), "p2p_s": exchange}
            progress[0].value = row["bytes"]
            for stage, (key, op) in enumerate(ops.items(), start=1):
                progress[1].value = stage
                row[f"{key}_rounds"].append(agreed_time(op, row["repeats"], device))
    return rows


def rank_main(rank: int, world: int, per_node: int, launch: dict, progress, conn) -> None:
    """One rank: join the group, measure, send ("ok", rows) or ("error", message) to the parent."""
    try:
        torch.set_num_threads(1)   # several ranks share this machine's cores
        device = torch.device("cpu")
        if launch["backend"] == "nccl":
            device = torch.device("cuda", rank % per_node)
            torch.cuda.set_device(device)
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):   # the interface towards the master, unless set
            os.environ.setdefault(var, launch["ifname"])
        dist.init_process_group(launch["backend"], init_method=f"tcp://{launch['addr']}:{launch['port']}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=launch["time_limit"]))
        rows = measure(launch["max_mib"], launch["repeat"], device, progress)
        dist.barrier()
        conn.send(("ok", rows if rank == 0 else None))
    except BenchError as error:
        conn.send(("error", str(error)))
    except BaseException:   # noqa: B036 (the student's NotImplementedError, a Ctrl-C, ...)
        conn.send(("error", f"rank {rank} failed:\n{traceback.format_exc(limit=-3)}"))


# -- collectives: the parent process -----------------------------------------------------------------------------

def run_ranks(args) -> list[dict] | None:
    """Start this node's ranks, wait at most --time-limit s; rank 0's rows (None on a node without rank 0)."""
    from ddp_utils.robust.preflight import choose_interface
    per_node = -(-args.ranks // args.nodes)
    local = [r for r in range(args.ranks) if r // per_node == args.node_rank]
    launch = {"backend": args.backend, "addr": args.master_addr, "port": args.master_port or free_port(),
              "max_mib": args.max_mib, "repeat": args.repeat, "time_limit": args.time_limit, "ifname": choose_interface(args.master_addr)[0]}
    # forkserver: torch is imported once and each rank forked from it (seconds saved per rank, as in harness.py)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed"])
    processes, readers, progress, results = {}, {}, {}, {}
    try:
        for rank in local:
            progress[rank] = (context.Value("q", 0, lock=False), context.Value("i", 0, lock=False))
            readers[rank], writer = context.Pipe(duplex=False)
            processes[rank] = context.Process(target=rank_main, daemon=True,
                                              args=(rank, args.ranks, per_node, launch, progress[rank], writer))
            processes[rank].start()
            writer.close()
        deadline = time.monotonic() + args.time_limit
        while len(results) < len(local) and time.monotonic() < deadline:
            waiting = {readers[r]: r for r in local if r not in results}
            waiting.update({processes[r].sentinel: r for r in local if r not in results})
            for rank in {waiting[ready] for ready in wait(list(waiting), timeout=deadline - time.monotonic())}:
                results[rank] = readers[rank].recv() if readers[rank].poll() else (
                    "error", f"rank {rank} ended without a word (exit code {processes[rank].exitcode})")
                if results[rank][0] == "error":   # the others get a moment to say why they failed too
                    deadline = min(deadline, time.monotonic() + 3)
    finally:
        for process in processes.values():   # also after Ctrl-C: no rank outlives the script
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    errors = [message for status, message in results.values() if status == "error"]
    if errors:   # a wrong sum first: the other ranks' errors are its echoes
        raise BenchError(min(errors, key=lambda e: not e.startswith("ring_all_reduce gave")))
    if len(results) < len(local):
        nbytes, stage = progress[min(set(local) - set(results))]
        raise BenchError(f"the ranks were still running after {args.time_limit:.0f} s (--time-limit), at "
                         f"{size_name(nbytes.value)}, {STAGES[stage.value]}: a rank waiting for ever usually waits "
                         f"for a message no rank sends (a receive without its send, or ranks in another order)")
    return results[0][1] if 0 in results else None


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """alpha (s) and beta (s per byte) of t(n) = alpha + n * beta, by least squares on the relative error.

    Plain least squares would fit the largest sizes only (their seconds dwarf the microseconds of the small ones,
    which are all alpha); dividing each equation by its t makes every size count alike. Minimise
    sum((alpha / t + beta * n / t - 1)^2): two normal equations in alpha and beta.
    """
    a = [1 / t for t in seconds]
    b = [n / t for n, t in zip(nbytes, seconds)]
    saa, sab, sbb = sum(x * x for x in a), sum(x * y for x, y in zip(a, b)), sum(y * y for y in b)
    sa, sb = sum(a), sum(b)
    det = saa * sbb - sab * sab
    alpha, beta = (sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det
    if alpha < 0:   # noise on a fast link: a message cannot cost less than nothing; fit the bandwidth alone
        alpha, beta = 0.0, sb / sbb
    return alpha, beta


def ring_prediction(nbytes: float, world: int, alpha: float, beta: float) -> float:
    """2 (N - 1) steps (reduce-scatter, then all-gather), each one message of n / N bytes."""
    return 2 * (world - 1) * (alpha + nbytes / world * beta)


def busbw(nbytes: float, world: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth (GB/s): the bytes each rank sends, 2 (N - 1) / N * n, per second."""
    return 2 * (world - 1) / world * nbytes / seconds / 1e9


def collectives(args) -> None:
    if args.ranks < 2:
        raise BenchError("--ranks must be at least 2: a ring of one rank sends nothing")
    out = out_folder(args.out) if args.node_rank == 0 else None
    print(f"collectives: {args.ranks} ranks ({args.backend}), 4 KiB to {args.max_mib:g} MiB, {args.repeat} rounds, "
          f"implementation {adapter.path_of(adapter.chosen())}", flush=True)
    rows, world = run_ranks(args), args.ranks
    if rows is None:
        print(f"node {args.node_rank}: its ranks finished; node 0 prints and writes the results")
        return
    fit = fit_with_spread(rows, world)
    for row in rows:
        for key in ("ring_s", "all_reduce_s", "p2p_s", "predicted_ring_s"):
            row[key] = statistics.median(row[f"{key}_rounds"])
            row[f"{key}_range"] = [min(row[f"{key}_rounds"]), max(row[f"{key}_rounds"])]
        row.update(ring_busbw_gbs=busbw(row["bytes"], world, row["ring_s"]),
                   all_reduce_busbw_gbs=busbw(row["bytes"], world, row["all_reduce_s"]),
                   ring_vs_all_reduce=compared(row["ring_s_rounds"], row["all_reduce_s_rounds"]),
                   ring_vs_predicted=compared(row["ring_s_rounds"], row["predicted_ring_s_rounds"]))
    a_lo, a_hi = min(fit["alpha_us_rounds"]), max(fit["alpha_us_rounds"])
    b_lo, b_hi = min(fit["bandwidth_gbs_rounds"]), max(fit["bandwidth_gbs_rounds"])
    lines = [f"alpha-beta fit of the point-to-point times: alpha = {fit['alpha_us']:.3g} us ({a_lo:.3g}-{a_hi:.3g}), "
             f"1/beta = {fit['bandwidth_gbs']:.3g} GB/s ({b_lo:.3g}-{b_hi:.3g}): the fit of the medians (and the "
             f"lowest-highest of the rounds' own fits); the ring's prediction: 2 (N-1) (alpha + (n/N) beta)", "",
             "| size | ring ms | all_reduce ms | point-to-point ms | predicted ring ms | ring / all_reduce | "
             "ring / predicted |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {size_name(r['bytes'])} | {shown(r['ring_s_rounds'], 1e3)} | {shown(r['all_reduce_s_rounds'], 1e3)} | "
              f"{shown(r['p2p_s_rounds'], 1e3)} | {shown(r['predicted_ring_s_rounds'], 1e3)} | "
              f"{r['ring_vs_all_reduce']} | {r['ring_vs_predicted']} |" for r in rows]
    lines += ["", f"median (lowest-highest) of {args.repeat} rounds; \"within each other's spread\": these rounds "
                  f"cannot tell the two apart", "", summary(rows)]
    text = "\n".join(lines)
    print(f"\n{text}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "collectives.md").write_text(text + "\n")
    (out / "collectives.json").write_text(json.dumps({"rows": rows, "fit": fit, "ranks": world, "nodes": args.nodes,
                                                      "repeat": args.repeat, "backend": args.backend, **about()},
                                                     indent=2))
    plot_collectives(rows, fit, f"{world} ranks, {args.backend}, {args.repeat} rounds", out / "collectives.png")
    print(f"\nwritten: {out / 'collectives.md'}, {out / 'collectives.json'}, {out / 'collectives.png'}")


def fit_with_spread(rows: list[dict], world: int) -> dict:
    """The alpha-beta fit of the medians, and one fit per round (the spread of alpha and beta); each row gets the
    ring's predicted time of every round's fit (``predicted_ring_s_rounds``)."""
    nbytes = [r["bytes"] for r in rows]
    alpha, beta = fit_alpha_beta(nbytes, [statistics.median(r["p2p_s_rounds"]) for r in rows])
    if beta <= 0:
        raise BenchError(f"the exchanges did not take longer as the size grew to {size_name(rows[-1]['bytes'])}: too "
                         f"small to see the link's bandwidth through the noise; measure up to 4 MiB at least "
                         f"(--max-mib 4)")
    rounds = [fit_alpha_beta(nbytes, [r["p2p_s_rounds"][k] for r in rows]) for k in range(len(rows[0]["p2p_s_rounds"]))]
    rounds = [(a, b) for a, b in rounds if b > 0] or [(alpha, beta)]   # a round too noisy to fit says nothing
    for row in rows:
        row["predicted_ring_s_rounds"] = [ring_prediction(row["bytes"], world, a, b) for a, b in rounds]
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "alpha_us": alpha * 1e6, "bandwidth_gbs": 1e-9 / beta,
            "alpha_us_rounds": [a * 1e6 for a, _ in rounds], "bandwidth_gbs_rounds": [1e-9 / b for _, b in rounds]}


def summary(rows: list[dict]) -> str:
    """What the rounds can show: at which sizes the ring is apart from dist.all_reduce and from its prediction."""
    def sizes_where(key: str, test) -> str:
        return ", ".join(size_name(r["bytes"]) for r in rows if test(r[key])) or "none"
    beyond = [r for r in rows if not within(r["ring_s_rounds"], r["all_reduce_s_rounds"])]
    ratios = [r["ring_s"] / r["all_reduce_s"] for r in beyond]
    lines = [f"ring against dist.all_reduce: within each other's spread at "
             f"{sizes_where('ring_vs_all_reduce', lambda v: v.startswith('within'))}; apart at "
             f"{', '.join(size_name(r['bytes']) for r in beyond) or 'none'}"
             + (f" (the ring takes {min(ratios):.2f}x-{max(ratios):.2f}x dist.all_reduce's time there)" if ratios
                else ""),
             f"ring against the fit's prediction: within each other's spread at "
             f"{sizes_where('ring_vs_predicted', lambda v: v.startswith('within'))}"]
    return "\n".join(lines)


def plot_collectives(rows: list[dict], fit: dict, title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")   # no window: a file
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker below)
    x = [r["bytes"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, style, label in (("ring_s", "o-", "your ring_all_reduce"), ("all_reduce_s", "s-", "dist.all_reduce"),
                              ("p2p_s", "^-", "one exchange with the neighbours"),
                              ("predicted_ring_s", "--", "ring predicted from the fit")):
        mid = [r[key] * 1e3 for r in rows]
        bars = [[m - r[f"{key}_range"][0] * 1e3 for m, r in zip(mid, rows)],
                [r[f"{key}_range"][1] * 1e3 - m for m, r in zip(mid, rows)]]
        ax.errorbar(x, mid, yerr=bars, fmt=style, capsize=3, label=label)
    ax.plot(x, [(fit["alpha_s"] + n * fit["beta_s_per_byte"]) * 1e3 for n in x], ":", color="grey",
            label=f"fit: {fit['alpha_us']:.0f} us + n / {fit['bandwidth_gbs']:.2f} GB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(x, [size_name(n) for n in x], rotation=45)
    ax.minorticks_off()
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set(xlabel="tensor size (float32)", ylabel="time (ms); bars: lowest to highest round", title=title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- step: the kit's training, with each DDP ---------------------------------------------------------------------

VARIANTS = {   # name: (what the table calls it, the train settings that make it)
    "a": ("(a) allreduce_gradients", {"build_ddp": "a"}),
    "b": ("(b) OverlapDDP", {"build_ddp": "b"}),
    "c1": ("(c) BucketDDP, 1 MB", {"build_ddp": "c", "bucket_mb": 1.0}),
    "c8": ("(c) BucketDDP, 8 MB", {"build_ddp": "c", "bucket_mb": 8.0}),
    "c64": ("(c) BucketDDP, 64 MB", {"build_ddp": "c", "bucket_mb": 64.0}),
    "ddp": ("torch DDP, 25 MB", {"bucket_mb": 25.0}),
}
TRACED = ("a", "b")


def train_argv(name: str, run_dir: Path, rank: int, world: int, addr: str, port: int, steps: int,
               traced: bool = True) -> list[str]:
    from ddp_utils.settings import Settings
    # Trace two steps of the first epoch: the profiler's cost stays out of the second epoch, the one compared.
    profile = f"{max(min(1, steps - 1), steps - 2)}:{steps}" if traced and name in TRACED else ""
    settings = Settings(dataset="fake", arch="mlp", image_size=32, batch_size=32, threads=1, workers=0, epochs=2,
                        max_steps_per_epoch=steps, wandb="disabled", progress="off", backend="gloo",
                        link_probe=False,   # the probe times all-reduces before training: seconds we need not spend
                        profile_steps=profile, run_dir=str(run_dir), rank=rank, world_size=world,
                        master_addr=addr, master_port=port, **VARIANTS[name][1])
    return [sys.executable, "-m", "ddp_utils", "train", *settings.to_argv()]


def run_training(name: str, commands: list[list[str]], logs: Path, time_limit: float,
                 variant: str | None = None) -> None:
    """Run one variant's ranks, each in a session of its own; all killed at the time bound or on any failure."""
    # this environment (BUILD_DDP too: it picks the file that trains), the kit importable, one thread per rank
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):   # a launcher's, not ours
        env.pop(var, None)
    procs = []
    try:
        for rank, argv in enumerate(commands):
            with open(logs / f"{name}-rank{rank}.log", "w") as log:
                procs.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + time_limit
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):   # one failed: the others would wait for it
                deadline = min(deadline, time.monotonic() + 3)
            time.sleep(0.2)
    finally:
        for p in procs:   # also after Ctrl-C: no rank outlives the script
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    failed = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode != 0]
    if failed:
        rank, code = failed[0]
        log = logs / f"{name}-rank{rank}.log"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        why = f"was still running after {time_limit:.0f} s (--time-limit)" if code < 0 else f"exited with code {code}"
        raise BenchError(f"variant {name} ({VARIANTS[variant or name][0]}): rank {rank} {why}; its log {log} "
                         f"ends:\n{tail}")


@contextlib.contextmanager
def hosts_for(args):
    """(address of rank 0, the command prefix of each rank): this machine, or two fresh namespace "hosts" whose
    link is shaped (tests/helpers/netns.py; deleted on exit with whatever still runs inside, also after Ctrl-C)."""
    if args.hosts == "local":
        yield "127.0.0.1", [[] for _ in range(args.ranks)]
        return
    from tests.helpers import netns
    try:
        with netns.two_hosts("10.213.31") as hosts:
            for name, veth in zip(hosts.names, hosts.veths):   # both ends: each direction of the link that fast
                subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate",
                                args.rate, "burst", "256kbit", "latency", "50ms"], check=True, timeout=20)
            yield hosts.addrs[0], [hosts.exec_prefix(r * 2 // args.ranks) for r in range(args.ranks)]   # in blocks
    except netns.NetnsUnavailable as error:
        raise BenchError(f"--hosts netns: {error}") from None
    except subprocess.CalledProcessError:
        raise BenchError(f"--rate {args.rate}: tc refused it (its message is above); write it as tc does: 1gbit, "
                         f"500mbit") from None


def figures(run_dir: Path) -> dict:
    """The second epoch's time split, per step (results.json's history: the first epoch warms up)."""
    last = json.loads((run_dir / "results.json").read_text())["history"][-1]["train"]
    per_step = 1e3 / last["steps"]
    return {"step_ms": last["wall_s"] * per_step, "compute_ms": last["compute_s"] * per_step,
            "comm_ms": last["comm_s"] * per_step, "comm_share": 100 * last["comm_s"] / last["wall_s"],
            "img_s": last["images_per_s"], "steps": last["steps"]}


def step(args) -> None:
    names = args.variants.split(",")
    if args.ranks < 2 or set(names) - set(VARIANTS):
        raise BenchError(f"--ranks {args.ranks} --variants {args.variants}: at least 2 ranks (one has nothing to "
                         f"all-reduce), and variants among {', '.join(VARIANTS)}")
    if args.hosts == "netns" and os.geteuid() != 0:
        raise BenchError("--hosts netns makes two network namespaces and shapes their link with tc, which needs "
                         "root: run it with sudo (or use --hosts local, this machine's loopback)")
    out = out_folder(args.out)
    (out / "logs").mkdir(parents=True)
    where = f"hosts {args.hosts}" + (f", link {args.rate}" if args.hosts == "netns" else "")
    print(f"step: {len(names)} trainings of {args.ranks} ranks, {args.repeat} rounds, {args.steps} steps per epoch, "
          f"{where}; DDP from {adapter.path_of(adapter.chosen())}; output in {out}", flush=True)
    runs = {name: [] for name in names}
    for k in range(args.repeat):   # rounds: every variant once, then again
        for name in names:
            started, label = time.monotonic(), name if k == 0 else f"{name}-r{k + 1}"
            run_dir = out / "runs" / label
            with hosts_for(args) as (addr, prefixes):   # fresh hosts per run: nothing left from the run before
                port = free_port() if args.hosts == "local" else 29500
                traced = k == 0   # the first round's (a) and (b) leave their traces
                run_training(label, [[*prefixes[r], *train_argv(name, run_dir, r, args.ranks, addr, port, args.steps,
                                                                traced)]
                                     for r in range(args.ranks)], out / "logs", args.time_limit, name)
            for checkpoint in run_dir.glob("*.pt"):   # 100 MB each for this model, and nothing here resumes
                checkpoint.unlink()
            runs[name].append(figures(run_dir))
            print(f"  round {k + 1}, {VARIANTS[name][0]}: {runs[name][-1]['step_ms']:.0f} ms per step "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    rows = step_rows(runs, args.steps)
    lines = [f"mlp, fake data 32 px, batch 32 per rank, {args.ranks} ranks, 1 thread each, second of 2 epochs of "
             f"{args.steps} steps; {where}; median (lowest-highest) of {args.repeat} rounds", "",
             "| variant | step ms | compute ms | comm waited ms per step | comm share of the step % | img/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['name']} | {shown(r['step_ms_rounds'])} | {shown(r['compute_ms_rounds'])} | "
              f"{shown(r['comm_ms_rounds'])} | {shown(r['comm_share_rounds'], digits=2)} | {shown(r['img_s_rounds'])} |"
              for r in rows]
    lines += ["", step_summary(rows)]
    traces = [str(out / "runs" / n / "profile") for n in names if n in TRACED]
    if traces:
        lines += ["", f"traces of two steps of (a) and (b): {', '.join(traces)} (rank<N>.pt.trace.json; open one in "
                      f"https://ui.perfetto.dev or chrome://tracing, find the all-reduces and what runs beside them)"]
    text = "\n".join(lines)
    print(f"\n{text}")
    (out / "step.md").write_text(text + "\n")
    rate = args.rate if args.hosts == "netns" else None
    record = {"rows": rows, "ranks": args.ranks, "steps": args.steps, "repeat": args.repeat, "hosts": args.hosts,
              "rate": rate, "traces": traces}
    (out / "step.json").write_text(json.dumps({**record, **about()}, indent=2))
    print(f"\nwritten: {out / 'step.md'}, {out / 'step.json'}")


def step_rows(runs: dict[str, list[dict]], steps: int) -> list[dict]:
    """One row per variant from its rounds' figures (``figures``): each figure's median, its range and its rounds."""
    rows = []
    for name, rounds in runs.items():
        row = {"variant": name, "name": VARIANTS[name][0], "steps": steps}
        for key in ("step_ms", "compute_ms", "comm_ms", "comm_share", "img_s"):
            row[f"{key}_rounds"] = [run[key] for run in rounds]
            row[key] = statistics.median(row[f"{key}_rounds"])
            row[f"{key}_range"] = [min(row[f"{key}_rounds"]), max(row[f"{key}_rounds"])]
        rows.append(row)
    return rows


def step_summary(rows: list[dict]) -> str:
    """Which step times the rounds can tell apart: each variant against the fastest, in words."""
    best = min(rows, key=lambda r: r["step_ms"])
    said = [f"fastest step: {best['name']}"]
    for row in rows:
        if row is not best:
            verdict = compared(row["step_ms_rounds"], best["step_ms_rounds"])
            said.append(f"{row['name']}: {'within its spread' if verdict.startswith('within') else verdict}")
    return "; ".join(said)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    coll = commands.add_parser("collectives", help="time ring_all_reduce, dist.all_reduce and point-to-point")
    coll.add_argument("--max-mib", type=float, default=256, help="largest tensor in MiB (default 256)")
    coll.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="gloo (CPU) or nccl (a GPU per rank)")
    coll.add_argument("--nodes", type=int, default=1, help="across nodes: how many (run the command on each)")
    coll.add_argument("--node-rank", type=int, default=0, help="across nodes: this node's number, 0 on the master")
    coll.add_argument("--master-addr", default="127.0.0.1", help="across nodes: node 0's address")
    coll.add_argument("--master-port", type=int, default=0, help="across nodes: a port open on node 0")
    steps = commands.add_parser("step", help="train with (a), (b), (c) and torch's DDP; time split per step")
    steps.add_argument("--steps", type=int, default=30, help="steps per epoch (two epochs per run; default 30)")
    steps.add_argument("--hosts", choices=("local", "netns"), default="local",
                       help="local: this machine's loopback; netns: two network namespaces, link shaped (root)")
    steps.add_argument("--rate", default="1gbit", help="--hosts netns: the link's rate, in tc's units (default 1gbit)")
    steps.add_argument("--variants", default=",".join(VARIANTS), help=f"which, in order (default {','.join(VARIANTS)})")
    for sub, limit in ((coll, 600), (steps, 300)):
        sub.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
        sub.add_argument("--repeat", type=int, default=5,
                         help="rounds: each figure measured this many times, printed as median (lowest-highest) "
                              "(default 5)")
        sub.add_argument("--out", help="a new folder for the results (default runs/build_ddp_bench/<date-time>)")
        sub.add_argument("--time-limit", type=float, default=limit,
                         help=f"seconds after which the ranks are stopped (per training for step; default {limit})")
    args = parser.parse_args(argv)
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)   # `kill PID` cleans up as Ctrl-C does
    try:
        (collectives if args.command == "collectives" else step)(args)
    except BenchError as error:
        print(f"\nbench.py {args.command} stopped: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nbench.py {args.command}: interrupted; its processes were stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, before)
    return 0


if __name__ == "__main__":
    sys.exit(main())

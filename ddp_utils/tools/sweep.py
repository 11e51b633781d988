"""The all-reduce payload sweep of ``check``: time, algorithm bandwidth and bus bandwidth over payload sizes.

The figures are nccl-tests' (NVIDIA's all_reduce_perf): for an all-reduce of S bytes over n ranks taking t seconds,
``algbw = S / t`` and ``busbw = algbw x 2 (n - 1) / n``, the bytes a ring all-reduce moves through each rank's link
per second, comparable across world sizes and with the link's own bandwidth (iperf3). Small payloads measure the
latency, large ones the bandwidth; the largest is the model's gradient, what DDP all-reduces every step.
"""
from __future__ import annotations

import json
import statistics
import time
from datetime import datetime
from pathlib import Path

from ..robust.files import atomic_write_text

SMALLEST = 4 << 10     # 4 KiB
REPEATS = 5            # timed rounds per size (after one warm-up); the median is kept


class WrongSum(RuntimeError):
    """The all-reduce returned wrong numbers on some rank; raised by ``run`` on every rank alike."""


def sizes(gradient_bytes: int) -> list[int]:
    """Payload sizes in bytes: 4 KiB, x4 each, up to the gradient's size, which is always the last."""
    out, size = [], SMALLEST
    while size < gradient_bytes:
        out.append(size)
        size *= 4
    return out + [max(gradient_bytes, 4)]


def run(ctx, gradient_bytes: int) -> list[dict]:
    """Every rank: the sweep over ``sizes(gradient_bytes)`` on the process group (the same rows on every rank: each
    time is the slowest rank's median, as a step waits for the slowest). Raises WrongSum on every rank when any
    rank's sum came out wrong."""
    import torch   # here: `report` reads saved sweeps without torch
    import torch.distributed as dist
    rows = []
    for size in sizes(gradient_bytes):
        tensor = torch.ones(max(1, size // 4), dtype=torch.float32, device=ctx.device)
        times = []
        for i in range(REPEATS + 1):
            tensor.fill_(1.0)
            _sync(ctx)
            start = time.perf_counter()
            dist.all_reduce(tensor)
            _sync(ctx)
            if i:   # the first round warms up (NCCL builds its rings, gloo its buffers)
                times.append(time.perf_counter() - start)
        n, nbytes = ctx.world_size, tensor.numel() * 4
        # One MAX all-reduce carries the slowest rank's median and which ranks' ones did not add up to n, so every
        # rank reaches the same verdict: one rank raising alone would leave the others in the next size's all-reduce
        verdict = torch.zeros(1 + n, dtype=torch.float64, device=ctx.device)
        verdict[0] = statistics.median(times)
        verdict[1 + ctx.rank] = float(not bool((tensor == n).all()))
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        slowest, *flags = verdict.tolist()
        wrong = [r for r, flag in enumerate(flags) if flag > 0]
        if wrong:
            raise WrongSum(f"the all-reduce of {nbytes} bytes did not add up to {n} on rank"
                           f"{'s' if len(wrong) > 1 else ''} {', '.join(map(str, wrong))} of {n}: the collective "
                           f"returned wrong numbers")
        seconds = slowest
        algbw = nbytes / seconds
        rows.append({"bytes": nbytes, "seconds": seconds, "algbw_gbit_s": algbw * 8 / 1e9,
                     "busbw_gbit_s": algbw * 2 * (n - 1) / n * 8 / 1e9})
    return rows


def _sync(ctx) -> None:
    import torch
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def table(rows: list[dict]) -> str:
    """The sweep as aligned text lines, nccl-tests' columns (the size in bytes, as its all_reduce_perf prints it)."""
    lines = [f"{'size (B)':>10} {'time':>10} {'algbw':>12} {'busbw':>12}"]
    for r in rows:
        lines.append(f"{r['bytes']:>10} {1e3 * r['seconds']:>7.2f} ms {r['algbw_gbit_s']:>6.2f} Gbit/s "
                     f"{r['busbw_gbit_s']:>6.2f} Gbit/s")
    return "\n".join(lines)


def save(folder: Path, settings, backend: str, rows: list[dict]) -> Path:
    """Rank 0: the sweep as ``folder/allreduce-<YYYYmmdd-HHMMSS>.json`` (a new file each time, never replacing one)."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = folder / f"allreduce-{stamp}.json", 1
    while path.exists():
        n += 1
        path = folder / f"allreduce-{stamp}-{n}.json"
    data = {"when": datetime.now().isoformat(timespec="seconds"), "master": f"{settings.master_addr}:"
            f"{settings.master_port}", "world_size": settings.world_size, "backend": backend, "rows": rows}
    return atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def newest(folder: Path, world_size: int) -> dict | None:
    """The newest sweep saved in ``folder`` for ``world_size`` ranks, with its ``path``; None if there is none."""
    for path in sorted(Path(folder).glob("allreduce-*.json"), reverse=True):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if data.get("world_size") == world_size and data.get("rows"):
            return {**data, "path": str(path)}
    return None


"""``python -m ddp_utils demo``: the whole lesson on one machine in a few minutes, no GPU needed.

Runs DDP with 2 ranks on localhost and then 1 process on the bundled demo images (real handwritten
digits), with the demo preset's recipe and the same per-rank batch in both runs, as the course
homework does, and prints a comparison table. Every process gets one CPU thread (``--threads 1``),
the way each node gets one GPU: the single run stands for one node, not for the whole machine.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ..settings import Settings

# The demo preset's recipe (presets.py) for everything else.
DEMO = Settings(dataset="demo", data_dir="data/demo", workers=0, wandb="disabled", backend="gloo", threads=1,
                master_addr="127.0.0.1", init_timeout=120)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(run_dir: Path, epochs: int, rank: int, world_size: int, port: int, price: float = 0.0) -> list[str]:
    settings = DEMO.replace(epochs=epochs, run_dir=str(run_dir), master_port=port, rank=rank, world_size=world_size,
                            price_per_hour=price)
    return [sys.executable, "-m", "ddp_utils", "train", *settings.to_argv()]


def launch(cmds: list[list[str]], timeout: float, quiet: bool = False) -> None:
    """Start all commands together; rank 0 streams to the console (unless ``quiet``), the others
    stay quiet unless they fail."""
    env = {**os.environ, "WANDB_SILENT": "true"}
    procs = [subprocess.Popen(c, env=env, stdout=None if i == 0 and not quiet else subprocess.PIPE,
                              stderr=None if i == 0 and not quiet else subprocess.STDOUT, text=True)
             for i, c in enumerate(cmds)]
    try:
        deadline = time.monotonic() + timeout
        outs = [p.communicate(timeout=max(1, deadline - time.monotonic()))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(i, p.returncode, out) for i, (p, out) in enumerate(zip(procs, outs)) if p.returncode != 0]
    if failed:
        detail = "\n".join(f"rank {i} exited with {rc}:\n{(out or '')[-3000:]}" for i, rc, out in failed)
        raise RuntimeError(f"demo run failed\n{detail}")


def run_demo(epochs: int | None = None, world_size: int = 2, run_dir: str = "runs/demo", port: int = 0,
             price_per_hour: float = 0.0) -> str:
    from ..demo_data import prepare_demo
    from .report import results_table

    epochs = epochs or DEMO.epochs
    prepare_demo("data/demo")   # once, before the ranks start, so they do not race to write it
    stamp = time.strftime("%Y%m%d-%H%M%S")
    ddp_dir, single_dir = Path(run_dir) / f"{stamp}-ddp{world_size}", Path(run_dir) / f"{stamp}-single"
    port = port or free_port()
    print(f"== DDP: {world_size} ranks on localhost:{port} (gloo), run folder {ddp_dir}")
    launch([train_cmd(ddp_dir, epochs, r, world_size, port, price_per_hour) for r in range(world_size)], timeout=900)
    print(f"\n== single process, run folder {single_dir}")
    launch([train_cmd(single_dir, epochs, 0, 1, port, price_per_hour)], timeout=900)
    table = results_table([ddp_dir, single_dir], baseline=single_dir)
    print("\n" + table)
    print(f"\nTensorBoard: tensorboard --logdir {run_dir}")
    return table

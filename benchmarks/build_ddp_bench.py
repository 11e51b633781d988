"""The build-DDP lab's part (e), as the kit's own solution measures it: the figures a student and a TA compare with.

    sudo python benchmarks/build_ddp_bench.py          # root: step's two namespace hosts and their tc-shaped link

Runs lab/build_ddp/bench.py with the kit's solution (BUILD_DDP=reference), one command after the other on this
machine: ``collectives --ranks 2`` (4 KiB to 256 MiB), ``step --hosts local`` (loopback: a laptop's run, timed)
and ``step --hosts netns --rate 1gbit`` (two namespace hosts joined by a 1 Gbit/s link), each in --repeat rounds
(bench.py's default, 5: every figure a median with its lowest-highest round). Writes
benchmarks/results/build_ddp_bench.json (each command's table, figures and seconds) and images/collectives.png
(the plot the lab's question 12 shows). Take it on an idle machine: the ranks share its cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)

BENCH = REPO / "lab" / "build_ddp" / "bench.py"
COMMANDS = {"collectives": ["collectives", "--ranks", "2"],
            "step_local": ["step", "--hosts", "local"],
            "step_1gbit": ["step", "--hosts", "netns", "--rate", "1gbit"]}


def run(name: str, out: Path, steps: int, repeat: int) -> dict:
    """One bench.py command into ``out``: its JSON, its printed table and its seconds."""
    argv = [*COMMANDS[name], "--out", str(out), "--repeat", str(repeat)] + (
        ["--steps", str(steps)] if name.startswith("step") else [])
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(BENCH), *argv], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "BUILD_DDP": "reference"}, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"bench.py {' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}")
    record = json.loads((out / ("collectives.json" if name == "collectives" else "step.json")).read_text())
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    summary = [line for line in done.stdout.splitlines() if line.startswith(("ring against", "fastest step"))]
    return {"seconds": round(time.perf_counter() - started, 1), "table": table, "summary": summary,
            **{k: record[k] for k in ("rows", "fit", "ranks", "steps", "rate", "repeat") if k in record}}


def by_variant(step: dict) -> dict:
    return {row["variant"]: row for row in step["rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="steps per epoch of step's runs (bench.py's default)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds of every command (bench.py's default)")
    add_out(parser, "build_ddp_bench")
    args = parser.parse_args()
    recorder = Recorder("build_ddp_bench", args)
    figures = {}
    with tempfile.TemporaryDirectory(prefix="build_ddp_bench-") as tmp:
        for name in COMMANDS:
            figures[name] = run(name, Path(tmp, name), args.steps, args.repeat)
            print(f"{name}: {figures[name]['seconds']:.0f} s", flush=True)
        if Path(args.out).resolve().parent == (REPO / "benchmarks" / "results"):   # the pages' run: their picture
            shutil.copy(Path(tmp, "collectives", "collectives.png"), REPO / "images" / "collectives.png")
    for name in ("step_local", "step_1gbit"):
        rows = by_variant(figures[name])
        figures[name]["variants"] = rows
        # what a laptop sees: each overlapping variant's wait against (a)'s, measured in the same run
        figures[name]["comm_vs_a"] = {v: rows[v]["comm_ms"] / rows["a"]["comm_ms"] for v in rows}
    figures["laptop_s"] = figures["collectives"]["seconds"] + figures["step_local"]["seconds"]
    recorder.save(figures, figures["step_1gbit"]["table"])


if __name__ == "__main__":
    main()

"""Hand-ins as a student hands them in (lab/README.md, "What you hand in"), built from real artefacts: run folders
the kit trained, the report it wrote of them, and a student.py made of the lab's solution (or of it with a mistake of
solution/mistakes/ put in)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tests.helpers.procs import REPO, base_env, describe, python, run_all

LAB = Path(REPO) / "lab" / "build_ddp"
SOLUTION = LAB / "solution" / "reference.py"
QUICK = ["--dataset", "fake", "--image-size", "32", "--arch", "convnet", "--workers", "0", "--wandb", "disabled",
         "--epochs", "2", "--max-steps-per-epoch", "2", "--batch-size", "8", "--log-every", "1", "--progress", "off"]
COLUMNS = ("run", "nodes x GPUs", "global batch", "lr", "epochs", "wall time", "images/s (global)", "images/s per GPU",
           "data / compute / comm (%)", "GPU util", "Acc@1", "Acc@5", "speed-up (predicted)", "cost")
REFERENCE_ROW = ("*reference*", "*2 x T4 / 1 x T4*", "*1000 / 500*", "*0.1*", "*2*", "*1:14:47 / 2:24:00*", "",
                 "*about 300*", "", "", "*32.2 / 37.5*", "*58.1 / 64.5*", "*about 1.92x*", "*1.87 / 1.80*")


def train_runs(parent: Path) -> dict[str, Path]:
    """Two real short runs on fake data: ``ddp`` (2 ranks on this machine, ``launch``) and ``single`` (1 process),
    one after the other (the 2-core machine is not shared between them)."""
    runs = {"ddp": ["launch", "--nproc-per-node", "2"], "single": ["train"]}
    for name, command in runs.items():
        done = run_all([python("-m", "ddp_utils", *command, *QUICK, "--run-dir", str(parent / name))],
                       timeout=180, env=base_env())
        assert done[0].returncode == 0, describe(done)
    return {name: parent / name for name in runs}


def write_report(runs: dict[str, Path], out: Path) -> None:
    """The report folder a student hands in: what `report` wrote, with step 5's iperf3.txt copied into it."""
    from ddp_utils.tools.report import write_report as report
    report([runs["ddp"], runs["single"]], out)
    (out / "iperf3.txt").write_text("[  5]   0.00-10.00  sec  5.86 GBytes  5.03 Gbits/sec  receiver\n")


def duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def table_rows(runs: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Step 8's table as a student fills it in from results.json (written here apart from the grader's code)."""
    results = {name: json.loads((folder / "results.json").read_text()) for name, folder in runs.items()}
    per_epoch = {name: r["train_time_s"] / r["epochs_run"] for name, r in results.items()}
    rows = {}
    for name, label in (("ddp", "DDP"), ("single", "single")):
        r = results[name]
        total = sum(r[k] for k in ("data_s", "compute_s", "comm_s", "idle_s"))
        share = " / ".join(f"{100 * r[k] / total:.0f}" for k in ("data_s", "compute_s", "comm_s"))
        speedup = per_epoch["single"] / per_epoch[name]
        predicted = f" ({r['predicted_speedup']:.2f}x)" if r.get("predicted_speedup") else ""
        cells = (label, f"1 x {r['world_size']} cpu", str(r["global_batch_size"]), f"{r['lr']:g}", str(r["epochs"]),
                 duration(r["wall_time_s"]), f"{r['images_per_s']:.0f}", f"{r['images_per_s'] / r['world_size']:.0f}",
                 share, "no GPU", f"{r['acc1']:.2f}", f"{r['acc5']:.2f}", f"{speedup:.2f}x{predicted}", "n/a")
        rows[label] = dict(zip(COLUMNS, cells))
    return rows


def table_text(rows: dict[str, dict[str, str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "| --- | --- |" + " ---: |" * (len(COLUMNS) - 2)]
    lines += ["| " + " | ".join(row[c] for c in COLUMNS) + " |" for row in rows.values()]
    lines.append("| " + " | ".join(REFERENCE_ROW) + " |")
    return "My results (step 8):\n\n" + "\n".join(lines) + "\n"


def student_from_reference() -> str:
    """student.py as a student who got every part right hands it in: the solution, standing alone."""
    return SOLUTION.read_text()


def student_with_forgotten_bucket() -> str:
    """The solution with solution/mistakes/forgotten_bucket.py's BucketDDP in place of its own: part (c) wrong, the
    rest right, and standing alone (the mistake's file builds on the solution through the lab's adapter)."""
    source = SOLUTION.read_text()
    start, end = source.index("class BucketDDP("), source.index("def ring_all_reduce(")
    mistake = (LAB / "solution" / "mistakes" / "forgotten_bucket.py").read_text()
    wrong = mistake[mistake.index("class BucketDDP("):].replace("solution.OverlapDDP", "OverlapDDP")
    source = source[:start] + wrong.rstrip() + "\n\n\n" + source[end:]
    if not re.search(r"^import functools$", source, re.M):   # after the docstring and the __future__ import
        source = re.sub(r"^(from __future__ import .*\n)", r"\1import functools\n", source, count=1, flags=re.M)
    return source


def make_handin(folder: Path, runs: dict[str, Path], report: Path, student: str | None, table: str) -> Path:
    """A hand-in folder in the grader's layout (ddp_utils/tools/handin.py): the run folders without checkpoints."""
    folder.mkdir(parents=True)
    for name, run in runs.items():
        shutil.copytree(run, folder / "runs" / name, ignore=shutil.ignore_patterns("*.pt"))
    shutil.copytree(report, folder / "report")
    (folder / "results-table.md").write_text(table)
    (folder / "answers.md").write_text("1. The DDP run took half as many optimizer steps per epoch ...\n")
    if student is not None:
        (folder / "student.py").write_text(student)
    (folder / "pytest-log.txt").write_text("=================== 21 passed in 31.02s ===================\n")
    (folder / "bench").mkdir()
    (folder / "bench" / "collectives.json").write_text(json.dumps({"rows": [], "ranks": 2, "nodes": 1}))
    return folder

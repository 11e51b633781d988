"""What a benchmark measured, written to a JSON file the pages are generated from.

Every benchmark takes ``--out`` (default ``benchmarks/results/NAME.json``) and writes there its table, its
figures, the command that made them and the machine it ran on: the processor, cores, memory, GPU, torch,
and how busy the machine was meanwhile (the cores other processes used: a figure taken beside a test run
is not the machine's). ``docs/figures.py`` pastes them into docs/benchmarks.md, docs/faults.md and the
README with cog (``python docs/quotes.py pages``), so a page quotes only what a file says.

    recorder = results.Recorder("loop_overhead", args)    # at the start: the clock and the machine's CPU use
    recorder.save(figures={...}, table=[...])             # at the end: writes args.out

Each file also holds a ``calibration``: one thread's fp32 matrix products (GFLOP/s), taken at the start and at the
end of the same run, so that runs of other days, or of a VM whose neighbours were busy, can be set side by side.

A tree with uncommitted changes to the code is refused (``--allow-dirty``: a trial, its commit marked ``+changes``).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))
from ddp_utils.runlog import cpu_name  # noqa: E402


def add_out(parser, name: str) -> None:
    """The ``--out`` and ``--allow-dirty`` flags every benchmark has."""
    parser.add_argument("--out", default=str(RESULTS / f"{name}.json"),
                        help=f"the JSON file the figures go to (default benchmarks/results/{name}.json, which "
                             "the pages quote; give another path for a trial run)")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="measure a tree with uncommitted changes to the code (a trial): the JSON's commit then "
                             "ends in +changes. Without it such a tree is refused: a figure names the code it measured")


def busy_cpu_seconds() -> float:
    """CPU seconds all processes of the machine have used since boot (Linux /proc/stat; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return 0.0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """This process's CPU seconds and those of the children it has waited for (the runs it started), and of the
    fork servers still running: a run started through tests.helpers.procs is forked there (tests/helpers/zygote.py), not here."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + fork_server_cpu_seconds()


def fork_server_cpu_seconds() -> float:
    """CPU seconds of this process's live fork servers and of the children they have reaped (/proc/PID/stat)."""
    try:
        from tests.helpers import zygote
    except ImportError:
        return 0.0
    total = 0
    for server in filter(None, zygote._servers.values()):
        try:
            with open(f"/proc/{server[0].pid}/stat") as f:
                after_name = f.read().rsplit(")", 1)[1].split()
            total += sum(map(int, after_name[11:15]))   # utime, stime, cutime, cstime
        except (OSError, ValueError, IndexError):
            continue   # gone: once waited for, it is in children_* above
    return total / os.sysconf("SC_CLK_TCK")


def calibration() -> float:
    """This machine's speed now, in a second: one thread's 256 x 256 fp32 matrix products, GFLOP/s (the median of
    five 0.1-s rounds). Not a benchmark of anything the kit does: a yardstick taken beside every figure."""
    import statistics
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        for _ in range(3):
            a @ b
        rates = []
        for _ in range(5):
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < 0.1:
                a @ b
                n += 1
            rates.append(n * 2 * 256 ** 3 / (time.perf_counter() - start) / 1e9)
        return round(statistics.median(rates), 2)
    finally:
        torch.set_num_threads(threads)


def gpu_name() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except Exception:   # noqa: BLE001 - a broken CUDA setup is "no GPU" for the record
        pass
    return ""


def machine() -> dict:
    """The hardware and software a figure was measured on."""
    import torch
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "memory_gib": round(memory, 1), "gpu": gpu_name(),
            "torch": torch.__version__.split("+")[0], "python": platform.python_version(),
            "virtual": _virtual()}


def _virtual() -> bool:
    try:
        return "hypervisor" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def commit() -> str:
    if os.environ.get("KIT_COMMIT"):   # a copy whose .git is not the code's (the GPU machine's): the caller names it
        return os.environ["KIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        # changed code, not pages: the pages are regenerated while benchmarks run
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "ddp_utils",
                                "benchmarks/*.py", "tests", "notebooks", "requirements.txt"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+changes" if dirty else "") if sha else ""
    except (OSError, subprocess.SubprocessError):
        return ""


class Recorder:
    """Starts the clock at creation; ``save`` writes the figures with the command and the machine."""

    def __init__(self, name: str, args):
        self.name, self.args = name, args
        self.command = "python " + " ".join(shlex.quote(a) for a in
                                            [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
        self.calibration_start = calibration()
        self.start = (time.perf_counter(), busy_cpu_seconds(), own_cpu_seconds())
        self.date = datetime.datetime.now().strftime("%Y-%m-%d")
        self.commit = commit()   # the code that runs is the code at the start
        if self.commit.endswith("+changes") and not getattr(args, "allow_dirty", False):
            raise SystemExit(f"{name}: the code has uncommitted changes (git status), so no commit names what these "
                             f"figures measure. Commit first, or add --allow-dirty for a trial run (its JSON then "
                             f"says {self.commit}).")

    def others(self) -> float:
        """The cores other processes of the machine used on average since the start."""
        wall = time.perf_counter() - self.start[0]
        theirs = (busy_cpu_seconds() - self.start[1]) - (own_cpu_seconds() - self.start[2])
        return max(0.0, theirs / wall) if wall > 0 else 0.0

    def save(self, figures: dict, table: list[str] | None = None, others: float | None = None, **extra) -> Path:
        """``others``: the benchmark's own measure of the other processes' cores, over its timed part only."""
        others = self.others() if others is None else others
        record = {"benchmark": self.name, "command": self.command, "date": self.date, "commit": self.commit,
                  "seconds": round(time.perf_counter() - self.start[0], 1), "machine": machine(),
                  "other_processes_cores": round(others, 2),
                  "calibration": {"matmul_gflops_1_thread": {"start": self.calibration_start, "end": calibration()}},
                  "args": {k: v for k, v in vars(self.args).items() if k not in ("out", "allow_dirty")},
                  "figures": figures, "table": table or [], **extra}
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, out)
        print(f"figures written to {out}" + (f" (note: other processes used {others:.2f} cores meanwhile: "
                                              "take figures on an idle machine)" if others > 0.2 else ""))
        return out

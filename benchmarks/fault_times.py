"""Measure how fast every rank stops when something goes wrong mid-run: the README's reliability table.

    sudo python benchmarks/fault_times.py      # root: the lost-link case needs network namespaces

Each case starts two ranks (gloo) as the fault suite does (tests/helpers/fault_scenarios.py, tests/test_faults.py),
makes one fail, and prints the seconds from the fault to each rank's exit, with each rank's last line.
The frozen, killed and lost-link cases run at the default --collective-timeout (60 s) and at 600 s, where only
the kit's own watch (ddp_utils/robust/heartbeat.py) can stop a rank within seconds.
"""
from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.helpers import netns  # noqa: E402
from tests.helpers.fault_scenarios import cut_link_after_epoch_1, signal_rank_1_after_epoch_1  # noqa: E402
from tests.helpers.procs import base_env, free_port, python, run_all  # noqa: E402
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(("ERROR", "error:", "CHECK finished"))]
    return (lines[-1] if lines else (output.strip().splitlines() or ["(nothing)"])[-1])[:170]


def stopped_after(result, since: float) -> str:
    found = re.search(r"^CHECK stopped_at=([\d.]+)", result.output, re.M)
    return f"{float(found.group(1)) - since:.1f}" if found else "-"


def frozen_or_killed(name: str, timeout: str, signal_name: str, folder: Path) -> tuple:
    """Rank 1 frozen (SIGSTOP: a suspended VM) or killed (SIGKILL) after epoch 1; rank 0's seconds to stop."""
    _, seconds, out = signal_rank_1_after_epoch_1(name, getattr(signal, signal_name), folder)
    seconds = f"{seconds:.1f}"
    what = "frozen (SIGSTOP)" if signal_name == "SIGSTOP" else "killed (SIGKILL)"
    return (f"rank 1 {what} after epoch 1, collective timeout {timeout}", seconds, "-", last_line(out))


def cut_link(name: str, timeout: str, folder: Path) -> tuple:
    """Rank 1's link between two namespace hosts goes down after epoch 1; each rank's seconds to stop."""
    with netns.two_hosts("10.213.8") as hosts:
        _, stopped, outs = cut_link_after_epoch_1(name, folder, hosts, 120)
    return (f"rank 1's network link down after epoch 1, collective timeout {timeout}", *(f"{s:.1f}" for s in stopped),
            f"{last_line(outs[0])} / {last_line(outs[1])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(parser, "fault_times")
    recorder = Recorder("fault_times", parser.parse_args())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        r0, r1 = run_all([python("-m", "tests.helpers.fault_scenarios", "interrupt", str(r), str(port), f"{tmp}/a")
                          for r in range(2)], timeout=120, env=base_env())
        t = float(re.search(r"^CHECK interrupted_at=([\d.]+)", r0.output, re.M).group(1))
        rows.append(("Stop pressed in rank 0's notebook during epoch 2", "kernel kept", stopped_after(r1, t),
                     last_line(r1.output)))
        if rows[-1][2] == "-":   # rank 1 ended without the kit's message: keep what it printed, to look at
            print(f"rank 1 (exit {r1.returncode}) printed, at the end:\n" + "\n".join(r1.output.splitlines()[-60:]),
                  file=sys.stderr)
        for name, timeout in (("default", "60 s"), ("patient", "600 s")):
            rows.append(frozen_or_killed(name, timeout, "SIGSTOP", Path(tmp) / f"frozen-{name}"))
            rows.append(frozen_or_killed(name, timeout, "SIGKILL", Path(tmp) / f"killed-{name}"))
            rows.append(cut_link(name, timeout, Path(tmp) / f"cut-{name}"))
    table = ["| fault | rank 0 stops after (s) | rank 1 stops after (s) |", "| --- | ---: | ---: |"]
    table += ["| " + " | ".join(row[:3]) + " |" for row in rows]
    print("\n".join(table))
    for row in rows:
        print(f"{row[0]}: {row[3]}")
    recorder.save({row[0]: {"rank0_s": row[1], "rank1_s": row[2], "says": row[3]} for row in rows}, table)


if __name__ == "__main__":
    main()

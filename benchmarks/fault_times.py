"""Measure how fast every rank stops when something goes wrong mid-run: the README's reliability table.

    sudo python benchmarks/fault_times.py      # root: the lost-link case needs network namespaces

Each case starts two ranks (gloo) as the fault suite does (tests/fault_scenarios.py, tests/test_faults.py),
makes one fail, and prints the seconds from the fault to each rank's exit, with each rank's last line.
The lost-link case uses collective_timeout=8 s (the others 4 s); at the default (60 s) it takes about a minute.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests import netns  # noqa: E402
from tests.procs import base_env, free_port, python, run_all  # noqa: E402


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(("ERROR", "error:", "CHECK finished"))]
    return (lines[-1] if lines else output.strip().splitlines()[-1])[:150]


def stopped_after(result, since: float) -> str:
    found = re.search(r"^CHECK stopped_at=([\d.]+)", result.output, re.M)
    return f"{float(found.group(1)) - since:.1f}" if found else "-"


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        r0, r1 = run_all([python("-m", "tests.fault_scenarios", "interrupt", str(r), str(port), f"{tmp}/a")
                          for r in range(2)], timeout=120, env=base_env())
        t = float(re.search(r"^CHECK interrupted_at=([\d.]+)", r0.output, re.M).group(1))
        rows.append(("Stop pressed in rank 0's notebook during epoch 2", "kernel kept", stopped_after(r1, t),
                     last_line(r1.output)))
        with netns.two_hosts("10.213.8") as hosts:
            port, folder, cut = free_port(), f"{tmp}/b", {}

            def cut_link():
                while not Path(folder, "run0", "last.pt").exists():
                    time.sleep(0.1)
                cut["at"] = time.time()
                subprocess.run(["ip", "-n", hosts.names[1], "link", "set", hosts.veths[1], "down"], check=True)
            threading.Thread(target=cut_link, daemon=True).start()
            results = run_all([[*hosts.exec_prefix(r), *python("-m", "tests.fault_scenarios", "plain", str(r),
                                                               str(port), folder, hosts.addrs[0])]
                               for r in range(2)], timeout=150, env=base_env())
            rows.append(("rank 1's network link down after epoch 1", stopped_after(results[0], cut["at"]),
                         stopped_after(results[1], cut["at"]), last_line(results[0].output)))
    print("| fault | rank 0 stops after (s) | rank 1 stops after (s) | what rank 0 / rank 1 says |")
    print("| --- | ---: | ---: | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()

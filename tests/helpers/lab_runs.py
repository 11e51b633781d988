"""Runs the build-DDP lab's tests several times in one process, each as ``BUILD_DDP=<file> python -m pytest
lab/build_ddp <args>`` would: tests/test_build_ddp.py's deliberately wrong files, one after the other.

    python -m tests.helpers.lab_runs SPEC.json

SPEC.json: ``{"out": folder, "runs": [[name, BUILD_DDP, [pytest args]], ...]}``. Each run is ``pytest.main`` with
BUILD_DDP set, the lab's modules (``build_ddp``, ``build_ddp.*`` and the files under test, ``build_ddp_*``) unloaded
first so that each run imports them afresh, as a new process would; its terminal output (file descriptors 1 and 2)
goes to ``out/<name>.log``, its JUnit XML to ``out/<name>.xml`` and ``{"rc": exit code, "seconds": its time}`` to
``out/<name>.json`` once it ended. Why: each ``python -m pytest lab/build_ddp`` imports torch, and its harness starts
a fork server that imports torch again (about 6 CPU-seconds together, for a test of one); here both happen once for
all the runs (the harness gives the ranks each run's BUILD_DDP, whatever the fork server started with).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def unload_lab() -> None:
    for name in [m for m in sys.modules if m == "build_ddp" or m.startswith(("build_ddp.", "build_ddp_"))]:
        del sys.modules[name]


def run_one(out: Path, name: str, build_ddp: str, args: list[str]) -> int:
    import pytest
    unload_lab()
    os.environ["BUILD_DDP"] = build_ddp
    started = time.monotonic()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out / f"{name}.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            rc = int(pytest.main(["lab/build_ddp", "-p", "no:cacheprovider", f"--junitxml={out / name}.xml", *args]))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    (out / f"{name}.json").write_text(json.dumps({"rc": rc, "seconds": time.monotonic() - started}))
    return rc


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    for name, build_ddp, args in spec["runs"]:
        rc = run_one(out, name, build_ddp, args)
        print(f"{name}: exit code {rc}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

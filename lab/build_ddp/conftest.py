"""Lets the tests import this folder's modules as ``build_ddp.<name>`` whatever pytest's import mode, and says in
pytest's header which file is under test."""
from __future__ import annotations

import sys
from pathlib import Path

LAB = str(Path(__file__).resolve().parents[1])   # lab/: the package build_ddp is found there
if LAB not in sys.path:
    sys.path.insert(0, LAB)

from build_ddp import adapter, harness  # noqa: E402  (needs LAB on sys.path)


def pytest_report_header(config):
    try:
        return [f"build_ddp: testing {adapter.path_of(adapter.chosen())} (BUILD_DDP=student, reference or a file's "
                f"path); ranks: {harness.Launch.from_environment().describe()}"]
    except (ValueError, FileNotFoundError) as error:   # the tests fail with the same message
        return [f"build_ddp: {error}"]

"""Lets the tests import this folder's modules (adapter, harness) whatever pytest's import mode, and says in
pytest's header which file is under test."""
from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import adapter  # noqa: E402  (needs HERE on sys.path)
import harness  # noqa: E402


def pytest_report_header(config):
    try:
        return [f"build_ddp: testing {adapter.path_of(adapter.chosen())} (BUILD_DDP=student, reference or a file's "
                f"path); ranks: {harness.Launch.from_environment().describe()}"]
    except (ValueError, FileNotFoundError) as error:   # the tests fail with the same message
        return [f"build_ddp: {error}"]

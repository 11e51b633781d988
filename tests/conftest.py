"""Fixtures shared by the test files. Helpers to import live beside it: procs.py (processes with a time
bound), netns.py (two hosts on one machine), notebook_cells.py, gpu_emulation.py and the *_scenarios.py
programs that the multi-process tests start."""
from __future__ import annotations

import pytest


@pytest.fixture
def clean_env(monkeypatch):
    """No network-interface variables from outside and none remembered as set by the pre-flight; no
    process group left over, before and after the test."""
    from ddp_utils import distributed
    from ddp_utils.robust import preflight
    for var in preflight.IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(preflight, "_we_set", {})
    distributed.teardown()
    yield
    distributed.teardown()


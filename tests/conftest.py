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


# -- pytest -n (pytest-xdist, pytest.ini): the suite in several processes ---------------------------------------
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests that share a module- or session-scoped fixture of the suite (a training run several tests read) go to
    one worker (``xdist_group``, with ``--dist loadgroup``), so that the run is made once; the others are spread."""
    owner: dict[str, str] = {}   # union-find over the shared fixtures' names

    def find(name: str) -> str:
        while owner.setdefault(name, name) != name:
            name = owner[name]
        return name
    uses = {}
    for item in items:
        shared = [f"{defs[-1].func.__module__}.{name}" for name, defs in item._fixtureinfo.name2fixturedefs.items()
                  if defs and defs[-1].scope in ("module", "session")
                  and getattr(defs[-1].func, "__module__", "").startswith("tests.")]
        uses[item] = shared
        for other in shared[1:]:
            owner[find(other)] = find(shared[0])
    for item, shared in uses.items():
        if shared and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(find(shared[0])))

"""``--resume auto`` (the notebooks' ``RESUME = "auto"``): continue the unfinished run these
settings belong to, if there is one; otherwise start a new run. Says which, and why.

Where it looks (rank 0 only: the run folders are on rank 0's disk):

1. the run folder the settings name, if it exists and holds a ``last.pt``;
2. otherwise the sibling run folders next to it (``runs/`` for the default names), newest
   ``last.pt`` first.

A folder is continued when its run is unfinished (a ``last.pt`` and no ``results.json`` written
after it: ``results.json`` is written when a run ends) and its ``settings.json`` agrees with these
settings on everything that decides what is trained (``run_settings``). So "Run All" again after
a crash, an interrupt or a lost node continues the run, and after a finished run starts a new one.
"""
from __future__ import annotations

import json
import time
from pathlib import Path



def run_settings(settings) -> list[str]:
    """What must be equal for a folder to be the same run: what the ranks must agree on (``settings.agreed()``)
    and the data folder; the port and the folder itself may change."""
    return [name for name in settings.agreed() if name != "master_port"] + ["data_dir"]


def decide(settings, now: str | None = None) -> tuple[str | None, str, str]:
    """``(last.pt to continue or None, run folder to write, why)``: rank 0's decision for every rank.

    A new run whose named folder already holds a run goes into a sibling folder ``<name>-<time>``
    (a run folder is never written over)."""
    resume, why = find_resume(settings)
    if resume:
        return resume, str(Path(resume).parent), why
    named = Path(settings.run_dir) if settings.run_dir else None
    if named is not None and (named / "settings.json").exists():
        fresh = f"{named}-{now or time.strftime('%Y%m%d-%H%M%S')}"
        return None, fresh, f"{why}, in {fresh} ({named} holds another run)"
    return None, settings.run_dir, why


def find_resume(settings) -> tuple[str | None, str]:
    """``(path of the last.pt to continue, why)`` or ``(None, why a new run starts)``."""
    named = Path(settings.run_dir) if settings.run_dir else None
    if named is not None and (named / "last.pt").exists():
        ok, why = _continuable(named, settings)
        return (str(named / "last.pt"), why) if ok else (None, f"{named}: {why}; starting a new run")
    parent = named.parent if named is not None else Path("runs")
    folders = sorted((p.parent for p in parent.glob("*/last.pt")), key=lambda f: (f / "last.pt").stat().st_mtime,
                     reverse=True)
    skipped = []
    for folder in folders:
        ok, why = _continuable(folder, settings)
        if ok:
            return str(folder / "last.pt"), why
        skipped.append(f"{folder.name} ({why})")
    seen = "".join(f"\n  not continued: {s}" for s in skipped[:3])   # a line each: names are long
    return None, f"no unfinished run with these settings in {parent}/; starting a new run{seen}"


def _continuable(folder: Path, settings) -> tuple[bool, str]:
    last = folder / "last.pt"
    results = folder / "results.json"
    if results.exists() and results.stat().st_mtime >= last.stat().st_mtime:
        return False, "finished"
    try:
        saved = json.loads((folder / "settings.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False, "no readable settings.json"
    differ = [name for name in run_settings(settings) if name in saved and saved[name] != getattr(settings, name)]
    if differ:
        return False, "other settings: " + ", ".join(f"{n}={saved[n]!r}" for n in differ[:3])
    return True, f"continuing the unfinished run in {folder}"

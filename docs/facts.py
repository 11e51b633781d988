"""What the recorded outputs' timed lines are rendered from, kept beside them as ``docs/output/NAME.facts.json``.

A run prints its epoch lines from one record per epoch (results.json's history) and its results table from
the runs' results.json and settings.json. ``record`` keeps those records with each output, and where in the
output each block rendered from them sits; ``reformat`` renders those blocks again with the current code.
So a change to the epoch line's or the results table's format is re-recorded by one command, on any machine
(nothing is run), and the pages keep the figures of the idle run they were recorded from::

    python docs/quotes.py reformat          # every output; then the pages are pasted again

A line of another shape (a new start-up line, say) still needs ``python docs/quotes.py record NAME``.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace


# -- the facts a run leaves ------------------------------------------------------------------------
def runs_in(folder: Path) -> dict[str, dict]:
    """Every run folder under ``folder`` (keyed by its path relative to it): results.json and settings.json, or
    for a run stopped before its results (the killed launch), what last.pt holds of them."""
    runs = {}
    for results in sorted(folder.rglob("results.json")):
        settings = results.with_name("settings.json")
        if settings.exists():
            runs[str(results.parent.relative_to(folder))] = {"results": _read(results), "settings": _read(settings)}
    for last in sorted(folder.rglob("last.pt")):
        key = str(last.parent.relative_to(folder))
        if key not in runs:
            runs[key] = _from_checkpoint(last)
    return runs


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _from_checkpoint(path: Path) -> dict:
    import torch
    from ddp_utils import own_ddp
    from ddp_utils.settings import Settings
    from ddp_utils.speed.comm import algorithm
    state = torch.load(path, map_location="cpu", weights_only=False)
    s = state["settings"]
    choice = (state.get("comm") or {}).get("choice") or s.get("comm", "none")
    said = algorithm(choice, s["world_size"], s.get("parallel", "ddp"), own_ddp.label(Settings.from_dict(s)))
    return {"results": {"epochs": s["epochs"], "world_size": s["world_size"], "algorithm": said,
                        "history": state["history"]}, "settings": s}


# -- the blocks rendered from them -----------------------------------------------------------------
def epoch_text(run: dict, index: int) -> list[str]:
    """The epoch line of ``run``'s history[index], as the kit prints it now."""
    from ddp_utils.runlog import epoch_line
    results = run["results"]
    record = results["history"][index]
    settings = SimpleNamespace(epochs=results["epochs"], world_size=results["world_size"])
    return epoch_line(settings, record["train"], record["val"], record["epoch"] - 1,
                      results.get("algorithm", "")).splitlines()


def table_text(runs: dict[str, dict], keys: list[str], baseline: str | None) -> list[str]:
    """The results table of the runs ``keys`` (in that order), as the kit prints it now, from their facts
    (written to a temporary folder: the report reads run folders)."""
    from ddp_utils.tools.report import results_table
    with tempfile.TemporaryDirectory(prefix="ddp-facts-") as tmp:
        for key in keys:
            folder = Path(tmp, key)
            folder.mkdir(parents=True, exist_ok=True)
            for name in ("results", "settings"):
                (folder / f"{name}.json").write_text(json.dumps(runs[key][name]), encoding="utf-8")
        dirs = [Path(tmp, key) for key in keys]
        return results_table(dirs, baseline=Path(tmp, baseline) if baseline else None).splitlines()


def render(block: dict, runs: dict[str, dict]) -> list[str]:
    if "epoch" in block:
        return epoch_text(runs[block["epoch"][0]], block["epoch"][1])
    return table_text(runs, block["table"], block["baseline"])


# -- finding them in an output, and rendering them again ---------------------------------------------
def find(lines: list[str], runs: dict[str, dict]) -> list[dict]:
    """Where in ``lines`` each block rendered from ``runs`` sits: ``{"at", "lines", "epoch": [key, index]}`` or
    ``{"at", "lines", "table": [keys], "baseline": key}``. A block is found only where the current code renders
    exactly the printed lines, so ``reformat`` of an unchanged format changes nothing."""
    blocks = []
    candidates = [({"epoch": [key, i]}) for key, run in runs.items() for i in range(len(run["results"]["history"]))]
    for at, line in enumerate(lines):
        if line.startswith("epoch "):
            for c in candidates:
                text = render(c, runs)
                if lines[at:at + len(text)] == text:
                    blocks.append({"at": at, "lines": len(text), **c})
                    break
        elif line.startswith("| run |"):
            blocks += _table_at(lines, at, runs)
    return blocks


def _table_at(lines: list[str], at: int, runs: dict[str, dict]) -> list[dict]:
    names = [row.split("|")[1].strip() for row in lines[at + 2:] if row.startswith("|")]
    by_name = {Path(key).name: key for key in runs}
    if not all(name in by_name for name in names):
        return []
    keys = [by_name[name] for name in names]
    for baseline in [None, *keys]:
        text = table_text(runs, keys, baseline)
        if lines[at:at + len(text)] == text:
            return [{"at": at, "lines": len(text), "table": keys, "baseline": baseline}]
    return []


def reformat(lines: list[str], facts: dict) -> tuple[list[str], dict]:
    """``lines`` with each block of ``facts`` rendered by the current code, and the facts' new places."""
    out, blocks, was = [], [], 0
    for block in sorted(facts["blocks"], key=lambda b: b["at"]):
        out += lines[was:block["at"]]
        text = render(block, facts["runs"])
        blocks.append({**block, "at": len(out), "lines": len(text)})
        out += text
        was = block["at"] + block["lines"]
    return out + lines[was:], {"runs": facts["runs"], "blocks": blocks}


def stale(lines: list[str], facts: dict) -> list[str]:
    """The printed blocks the current code would render otherwise (empty: the output is in today's format)."""
    return [f"line {b['at'] + 1}: {lines[b['at']]!r} is now {render(b, facts['runs'])[0]!r}"
            for b in facts["blocks"] if lines[b["at"]:b["at"] + b["lines"]] != render(b, facts["runs"])]

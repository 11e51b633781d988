"""The commands the walkthrough's pages give for a script, as a student would type them (tests/test_nodes.py,
tests/test_idle_stop.py run each)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.helpers.procs import REPO


def page_commands(script: str, inline: bool = False) -> list[list[str]]:
    """Every command of lab/README.md and lab/nodes.md (in that order) that runs ``script``, as its words after the
    script's path: the code blocks' lines (comments dropped), and with ``inline`` the prose's `code` spans too."""
    found = []
    for page in ("lab/README.md", "lab/nodes.md"):
        for line in (Path(REPO) / page).read_text().splitlines():
            if "`" in line:
                spans = re.findall(r"`([^`]+)`", line) if inline else []
            else:
                spans = [line.split("#")[0].strip()]
            for span in spans:
                if f"lab/scripts/{script} " in span and not span.startswith("|"):
                    words = shlex.split(span)
                    found.append(words[next(i for i, w in enumerate(words) if w.endswith(script)) + 1:])
    return found


def path_rows() -> list[dict[str, str]]:
    """lab/README.md's path table, a dict per row: its cells by column, and the values its commands stand for,
    ``TYPE`` (the AWS instance type, "" off AWS), ``PRICE``, ``DATA_DIR``, ``WORKERS`` and ``BUDGET`` (step 1's
    sentence; "" where the row has none)."""
    text = (Path(REPO) / "lab" / "README.md").read_text()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| you have |"))
    header = [c.strip() for c in lines[start].strip("|").split(" | ")]
    budget_line = " ".join(text[text.index("`BUDGET`:"):].split("\n\n")[0].split())
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        row = dict(zip(header, [c.strip() for c in line.strip("|").split(" | ")], strict=True))
        kind = re.search(r"\bg\w+\.\w+", row["you have"])
        price = re.search(r"\$(\d+\.\d+) per hour", row["you have"])
        budget = re.search(rf"{re.escape(kind.group())} \$(\d+)", budget_line) if kind else None
        rows.append({**row, "TYPE": kind.group() if kind else "", "PRICE": price.group(1) if price else "",
                     "DATA_DIR": row["`DATA_DIR`"].strip("`"), "WORKERS": row["`WORKERS`"],
                     "BUDGET": budget.group(1) if budget else ""})
    return rows


ROW_WORDS = re.compile(r"\b(TYPE|PRICE|DATA_DIR|WORKERS|BUDGET)\b")   # the values a row of the path table gives


def typed(command: list[str], row: dict[str, str]) -> list[str]:
    """A page's command with the row's values typed in for its words in capitals."""
    return [ROW_WORDS.sub(lambda m: row[m.group(1)], word) for word in command]

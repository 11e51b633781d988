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

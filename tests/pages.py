"""The kit's own pages as tests read them: the front-page README and the docs/ pages it links."""
from __future__ import annotations

from pathlib import Path

from tests.procs import REPO


def kit_pages() -> str:
    """README.md and every docs/*.md, as one text (a quoted figure or flag may sit on any of them)."""
    pages = [Path(REPO, "README.md"), *sorted(Path(REPO, "docs").glob("*.md"))]
    return "\n".join(page.read_text(encoding="utf-8") for page in pages)

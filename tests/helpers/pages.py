"""The kit's own pages as tests read them: the front-page README and the docs/ pages it links."""
from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.notebook_cells import parameter_cells, read
from tests.helpers.procs import REPO


def kit_pages() -> str:
    """README.md and every docs/*.md, as one text (a quoted figure or flag may sit on any of them)."""
    pages = [Path(REPO, "README.md"), *sorted(Path(REPO, "docs").glob("*.md"))]
    return "\n".join(page.read_text(encoding="utf-8") for page in pages)


ROOT = Path(REPO)


MD_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "lab").glob("*.md")),
            ROOT / "notebooks" / "lesson.md"]


NOTEBOOK_PAGES = [*(ROOT / "notebooks" / f"{n}.ipynb" for n in ("main", "worker", "single")),
             *sorted((ROOT / "lab").glob("lab*.ipynb"))]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def notebook_text(path: Path) -> str:
    """What a student reads in a notebook: its markdown cells and its parameters cell (the comments)."""
    nb = read(path)
    return "\n\n".join(c.source for c in nb.cells if c.cell_type == "markdown" or c in parameter_cells(nb))


def pages() -> dict[Path, str]:
    """Every page, as text: the markdown files and the notebooks' markdown (with their parameters cell)."""
    out = {page: page.read_text(encoding="utf-8") for page in MD_PAGES}
    out.update({nb: notebook_text(nb) for nb in NOTEBOOK_PAGES})
    return out


# -- (4) prices and instance types -------------------------------------------------------------------------
INSTANCE = re.compile(r"\b[a-z]+\d+[a-z]*\.(?:\d*x?large|metal)\b")


PRICE = re.compile(r"\$?\b(\d+\.\d+)\b")


def quoted_prices(text: str) -> list[tuple[str, str]]:
    """``(instance type, price)`` wherever a page gives one: the first price after the type (before the next
    type, in the same sentence or line), else a price just before it ("0.752 (AWS g4dn.2xlarge, USD)")."""
    pairs = []
    for line in text.splitlines():
        for sentence in re.split(r"(?<=[.;])\s+(?=[A-Z(])", line):
            types = list(INSTANCE.finditer(sentence))
            for i, t in enumerate(types):
                end = types[i + 1].start() if i + 1 < len(types) else len(sentence)
                after = [p for p in PRICE.finditer(sentence, t.end(), end)
                         if re.search(r"per (?:node-)?hour|USD|\$", sentence[p.start() - 1:p.end() + 25])]
                before = [p for p in PRICE.finditer(sentence[max(0, t.start() - 25):t.start()])]
                if after:
                    pairs.append((t.group(0), after[0].group(1)))
                elif before and "USD" in sentence[t.end():t.end() + 12]:
                    pairs.append((t.group(0), before[-1].group(1)))
    return pairs

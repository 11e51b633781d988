"""The package's shape as a reader meets it: one job per module, said up front, and no import circles."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.procs import REPO

PACKAGE = Path(REPO) / "ddp_utils"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))


def imports_of(module: str) -> set[str]:
    """The ddp_utils modules that ``module`` imports, at the top or inside functions."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddp_utils."):
            found.add(node.module.split(".")[1])
    return found & set(MODULES)


def test_the_import_graph_has_no_cycle():
    graph = {m: imports_of(m) for m in MODULES}
    state: dict[str, str] = {}

    def visit(module, path):
        state[module] = "open"
        for nxt in sorted(graph[module]):
            if state.get(nxt) == "open":
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = "done"

    for module in MODULES:
        if module not in state:
            visit(module, [module])


def test_lower_layers_never_import_the_run_assembly():
    """datasets, memdata and distributed are the lesson's building blocks: they know nothing of a run."""
    for module in ("settings", "presets", "datasets", "memdata", "distributed", "rendezvous", "files"):
        assert not imports_of(module) & {"job", "train", "cli", "runlog", "data"}, module


@pytest.mark.parametrize("module", MODULES)
def test_every_module_opens_with_a_comment_saying_its_one_job(module):
    doc = ast.get_docstring(ast.parse((PACKAGE / f"{module}.py").read_text()))
    assert doc and len(doc.splitlines()[0]) > 20, f"{module}.py needs an opening docstring"


def test_the_readme_file_tree_lists_every_module():
    readme = (Path(REPO) / "README.md").read_text()
    for module in MODULES:
        assert re.search(rf"^\s+{module}\.py\s+\S", readme, re.M), f"README file tree lacks {module}.py"

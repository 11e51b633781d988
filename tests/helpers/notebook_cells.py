"""Reading committed notebooks (the kit's and the labs'): their cells, code and parameters cell."""
from __future__ import annotations

import ast
from pathlib import Path

import nbformat

from tests.helpers.procs import REPO


def read(path) -> nbformat.NotebookNode:
    return nbformat.read(str(path), as_version=4)


def code_cells(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def code(path) -> str:
    """All code cells of the notebook at ``path``, as one text."""
    return "\n".join(code_cells(read(path)))


def markdown(path) -> str:
    return "\n".join(c.source for c in read(path).cells if c.cell_type == "markdown")


def parameter_cells(nb) -> list:
    return [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]


def parameters(path) -> dict:
    """``{NAME: value}`` of the parameters cell, which must hold only ``NAME = literal`` lines (papermill
    injects values after it, and students read it as settings, not code)."""
    [cell] = parameter_cells(read(path))
    return {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(cell.source).body}


NOTEBOOKS = Path(REPO) / "notebooks"
MAIN, WORKER, SINGLE = (NOTEBOOKS / f"{n}.ipynb" for n in ("main", "worker", "single"))


# Small, fast settings for every execution (what students would type for a quick try).
QUICK = {"EPOCHS": 1, "MAX_STEPS": 3, "BATCH_SIZE": 32, "WORKERS": 0, "WANDB_MODE": "disabled",
         "TENSORBOARD": False}


DDP = {**QUICK, "BACKEND": "gloo", "INIT_TIMEOUT": 60}  # a stuck join fails well within TIME_BOUND

"""Which file the tests check: your student.py (the default) or the kit's reference.py.

    python -m pytest lab/build_ddp                        # tests student.py
    BUILD_DDP=reference python -m pytest lab/build_ddp    # tests reference.py (what CI does)

The tests only ever call ``implementation()``, so the same tests judge both files.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
CHOICES = ("student", "reference")


def chosen() -> str:
    """The name of the file under test, from the BUILD_DDP environment variable (default: student)."""
    name = os.environ.get("BUILD_DDP") or "student"
    if name not in CHOICES:
        raise ValueError(f"BUILD_DDP={name!r}: say BUILD_DDP=student (your student.py, the default) "
                         f"or BUILD_DDP=reference (the kit's reference.py)")
    return name


def implementation() -> ModuleType:
    """The module under test: student.py or reference.py of this folder."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module(chosen())

"""Which file the tests check: your student.py (the default), the kit's solution, or any file you name.

    python -m pytest lab/build_ddp                                   # tests student.py
    BUILD_DDP=reference python -m pytest lab/build_ddp               # tests the kit's solution (what CI does)
    BUILD_DDP=/path/to/alice/student.py python -m pytest lab/build_ddp   # a TA grading a handed-in file

The tests only ever call ``implementation()``, so the same tests judge every file. The kit's solution lives in
``solution/reference.py``, which the student handout (``lab/scripts/make_handout.py``) and the Docker image
leave out.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
SOLUTION = HERE / "solution" / "reference.py"
CHOICES = ("student", "reference")


def chosen() -> str:
    """What BUILD_DDP names: ``student`` (the default), ``reference``, or the path of a ``.py`` file."""
    name = os.environ.get("BUILD_DDP") or "student"
    if name in CHOICES:
        return name
    if name.endswith(".py"):
        if not Path(name).is_file():
            raise ValueError(f"BUILD_DDP={name!r}: there is no such file")
        return str(Path(name).resolve())
    raise ValueError(f"BUILD_DDP={name!r}: say BUILD_DDP=student (your student.py, the default), "
                     f"BUILD_DDP=reference (the kit's solution), or the path of a .py file to test")


def path_of(name: str) -> Path:
    """The file ``chosen()`` names."""
    if name == "student":
        return HERE / "student.py"
    if name == "reference":
        if not SOLUTION.is_file():
            raise FileNotFoundError(
                f"BUILD_DDP=reference: the kit's solution ({SOLUTION.relative_to(HERE.parent.parent)}) is not in "
                f"this copy of the kit: the student handout and the Docker image leave it out. Test your own "
                f"student.py (no BUILD_DDP), or run from the kit's repository")
        return SOLUTION
    return Path(name)


def implementation() -> ModuleType:
    """The module under test (loaded once per process, under a name of its own: ``build_ddp_<file name>``)."""
    return load(path_of(chosen()))


def solution() -> ModuleType:
    """The kit's solution, whatever BUILD_DDP says (the deliberately wrong files in solution/mistakes/ build on it)."""
    return load(path_of("reference"))


def load(path: Path) -> ModuleType:
    if str(HERE.parent) not in sys.path:   # the file may import the lab's modules (build_ddp.adapter, as the mistakes do)
        sys.path.insert(0, str(HERE.parent))
    path = Path(path).resolve()
    tag = "" if path.parent in (HERE, SOLUTION.parent) else "_" + hashlib.sha1(str(path).encode()).hexdigest()[:8]
    name = f"build_ddp_{path.stem}{tag}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module   # registered first, as an import does (pickling, dataclasses)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]

"""Write the student handout: the kit without the build-DDP lab's solution, for an instructor to hand out.

    python lab/scripts/make_handout.py OUT        # OUT: a new folder (or an empty one)

What is left out, and why:
- ``lab/build_ddp/solution/``: the answer key (``reference.py``) and the deliberately wrong student files the
  kit's tests run (each is the solution with one mistake, so it would give the answer away);
- ``.ci/``: the kit's own CI.
Everything else the kit tracks in git is copied as it is (a checkout without git: every file but the usual
build, run and data folders). Then the handout is checked: no file of it may hold the solution's code (three
of its lines in a row; HINTS.md may quote one call, not the solution). OUT is written beside itself and renamed
at the end, so a failure leaves no half-made handout. Students run the lab there as in the kit: ``python -m pytest lab/build_ddp``
tests their ``student.py``; ``BUILD_DDP=reference`` says the solution is not in the handout.
"""
from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOLUTION = "lab/build_ddp/solution/"
LEFT_OUT = (SOLUTION, ".ci/")
NOT_KIT = {".git", ".venv", "runs", "data", "wandb", "reports", "__pycache__", ".pytest_cache", ".ipynb_checkpoints"}


def kit_files(repo: Path) -> list[str]:
    """The kit's files, relative to ``repo``: git's list when it is a checkout, else every file but NOT_KIT's."""
    if (repo / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True).stdout
        return [name for name in listed.decode().split("\0") if name and (repo / name).is_file()]
    return [str(path.relative_to(repo)) for path in sorted(repo.rglob("*"))
            if path.is_file() and not NOT_KIT & set(path.relative_to(repo).parts)]


WINDOW = 3   # lines of code in a row: one call may be quoted (HINTS.md gives the calls); three are the solution


def code_lines(source: str) -> list[str]:
    """The lines of code of a Python file, stripped, without comments, blank lines and docstrings."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and ast.get_docstring(node):
            docstrings.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return [code for number, line in enumerate(source.splitlines(), start=1)
            if number not in docstrings and (code := line.split("#")[0].strip())]


def windows(lines: list[str]) -> set[str]:
    return {"\n".join(lines[i:i + WINDOW]) for i in range(len(lines) - WINDOW + 1)}


def solution_windows(repo: Path) -> set[str]:
    """Every WINDOW lines of the solution's code in a row that student.py does not share (its signatures and
    given lines): what no file of a handout may hold."""
    solution = {run for run in windows(code_lines((repo / SOLUTION / "reference.py").read_text()))
                if len(run) >= 80}   # not `try:` / `yield` / `finally:`: lines that are the solution's own
    return solution - windows(code_lines((repo / "lab/build_ddp/student.py").read_text()))


def leaks(folder: Path, solution: set[str]) -> list[str]:
    """``file: the lines`` for every run of solution lines found in a text file of ``folder``."""
    found = []
    for path in sorted(folder.rglob("*")):
        try:
            text = path.read_text() if path.is_file() else ""
        except (UnicodeDecodeError, OSError):
            continue   # a picture, a binary
        lines = [line.split("#")[0].strip() for line in text.splitlines()]
        found += [f"{path.relative_to(folder)}: {run.splitlines()[0]} ..." for run in windows([x for x in lines if x])
                  & solution]
    return found


def make_handout(out: Path, repo: Path = REPO) -> list[str]:
    """Write the handout to ``out`` (new, or empty); return the files written. Raises ValueError when ``out`` is in
    use or the handout would hold the solution (nothing is left at ``out`` then)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not empty: give a new folder (the handout never overwrites files)")
    if out.resolve().is_relative_to(repo.resolve()):
        raise ValueError(f"{out} is inside the kit ({repo}): give a folder outside it")
    files = [name for name in kit_files(repo) if not name.startswith(LEFT_OUT)]
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        for name in files:
            (partial / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / name, partial / name)
        found = leaks(partial, solution_windows(repo))
        if found:
            raise ValueError("the handout would hold the solution's code; nothing was written:\n  " + "\n  ".join(found))
        if out.exists():
            out.rmdir()   # empty, checked above
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="a new (or empty) folder for the handout")
    args = parser.parse_args(argv)
    try:
        files = make_handout(args.out)
    except ValueError as error:
        print(f"make_handout: {error}", file=sys.stderr)
        return 1
    print(f"wrote the handout to {args.out}: {len(files)} files, without {', '.join(LEFT_OUT)} "
          f"(the lab's solution and the kit's CI).\nStudents: python -m pytest lab/build_ddp (tests their student.py); "
          f"TAs grade a handed-in file with BUILD_DDP=/path/to/student.py python -m pytest lab/build_ddp -rA in the kit")
    return 0


if __name__ == "__main__":
    sys.exit(main())

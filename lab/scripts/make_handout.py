"""Write the student handout: the kit as committed, without the build-DDP lab's solution, checked in place.

    python lab/scripts/make_handout.py OUT             # OUT: a new folder (or an empty one), outside the kit
    python lab/scripts/make_handout.py OUT --ref v2.1  # from a tag or commit instead of HEAD

What goes in: the files of the commit (HEAD unless --ref names another), read from git, never from the working
tree: a student.py you solved to try the lab, left uncommitted, stays out (the command names such files).
What is left out, and why:
- ``lab/build_ddp/solution/``: the answer key (``reference.py``) and the deliberately wrong student files the
  kit's tests run (each is the solution with one mistake, so it would give the answer away);
- the kit's own tests that run that solution (found by what they name: ``BUILD_DDP=reference``, the solution's
  folder), which could only fail without it; ``.ci/``: the kit's own CI.
Then the handout is checked before it is named OUT:
- no file of it holds the solution's code: three lines in a row of a function the student writes, compared on
  the code (docstrings, comments and the skeleton's signatures do not count), so a committed student.py that is
  the solution, or a paste of it anywhere, is refused;
- in the handout, ``python -m pytest lab/build_ddp`` fails every test with its part's NotImplementedError
  ("write ... (part x)"): what a student meets first.
It is written beside OUT in a temporary folder of its own and renamed at the end: a refusal or an error leaves
nothing behind and touches nothing else. Students run the lab there as in the kit (``python -m pytest
lab/build_ddp``); ``BUILD_DDP=reference`` there says the solution is not in the handout.
"""
from __future__ import annotations

import argparse
import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOLUTION = "lab/build_ddp/solution/"
LEFT_OUT = (SOLUTION, ".ci/")
# a test file of the kit that runs the lab's solution (it could only fail in the handout)
RUNS_SOLUTION = re.compile(r"""BUILD_DDP[="\s:,]*reference|solution/reference|["']solution["']|\bsolution\(\)|"""
                           r"""build_ddp/solution""")
# the functions of the solution that student.py keeps written (the student writes every other one)
GIVEN = {"OverlapDDP.forward", "BucketDDP.forward"}
WINDOW = 3   # lines of code in a row: one call may be quoted (HINTS.md gives the calls); three are the solution
CHECK_LIMIT_S = 300


def git(repo: Path, *args: str) -> bytes:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True)
    if done.returncode != 0:
        raise ValueError(f"git {' '.join(args)} failed in {repo}: {done.stderr.decode().strip()}")
    return done.stdout


def committed_files(repo: Path, ref: str = "HEAD") -> dict[str, tuple[bytes, int]]:
    """``{path: (content, mode)}`` of every file of commit ``ref``, as git holds them (the working tree unread)."""
    if not (repo / ".git").exists():
        raise ValueError(f"{repo} is not a git checkout: the handout is made from what the kit's repository has "
                         f"committed, never from files on disk. Run it in your clone of the kit")
    files = {}
    with tarfile.open(fileobj=io.BytesIO(git(repo, "archive", "--format=tar", ref))) as tar:
        for member in tar.getmembers():
            if member.isfile():
                files[member.name] = (tar.extractfile(member).read(), member.mode)
    return files


def uncommitted(repo: Path, ref: str = "HEAD") -> list[str]:
    """The files of the working tree that differ from ``ref`` (what the handout does not take)."""
    listed = git(repo, "diff", "--name-only", "-z", ref).decode().split("\0")
    return [name for name in listed if name]


def handout_files(files: dict[str, tuple[bytes, int]]) -> dict[str, tuple[bytes, int]]:
    """The committed files minus the solution, the kit's CI and the kit's tests that run the solution."""
    def runs_solution(name: str, content: bytes) -> bool:
        return name.startswith("tests/") and name.endswith(".py") and bool(RUNS_SOLUTION.search(content.decode()))
    return {name: item for name, item in files.items()
            if not name.startswith(LEFT_OUT) and not runs_solution(name, item[0])}


def code_lines(source: str) -> list[str]:
    """The lines of code of a Python source, stripped, without comments, blank lines and docstrings."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and ast.get_docstring(node):
            docstrings.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return [code for number, line in enumerate(source.splitlines(), start=1)
            if number not in docstrings and (code := line.split("#")[0].strip())]


def windows(lines: list[str]) -> set[str]:
    return {"\n".join(lines[i:i + WINDOW]) for i in range(len(lines) - WINDOW + 1)}


def written_functions(source: str) -> list[str]:
    """The body of each function of the solution that the student writes (every one but GIVEN's), methods
    included, without its signature (the skeleton shares it): the code a handout must not hold."""
    found, tree = [], ast.parse(source)
    lines = source.splitlines()

    def visit(body, prefix=""):
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and prefix + node.name not in GIVEN:
                found.append("\n".join(lines[node.body[0].lineno - 1:node.end_lineno]))
    visit(tree.body)
    return found


def solution_windows(solution_source: str) -> set[str]:
    """Every WINDOW lines in a row of the code the student writes in the solution (bodies, not docstrings nor
    comments) that are the solution's own: not ``try:`` / ``yield`` / ``finally:`` (under 80 characters together)."""
    import textwrap
    runs = set()
    for function in written_functions(solution_source):
        runs |= windows(code_lines(textwrap.dedent(function)))
    return {run for run in runs if len(run) >= 80}


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


def lab_failures(folder: Path) -> list[str]:
    """Run ``python -m pytest lab/build_ddp`` in ``folder`` (a handout); return what is wrong: every test must fail
    with its own part's NotImplementedError message, ``write <function> (part <x>): ...``."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "lab.xml"
        env = {k: v for k, v in os.environ.items() if k != "BUILD_DDP"}   # the handout's own student.py
        env["PYTHONDONTWRITEBYTECODE"] = "1"   # the handout gets no __pycache__ from its check
        try:
            subprocess.run([sys.executable, "-m", "pytest", "lab/build_ddp", "-p", "no:cacheprovider", "-q",
                            f"--junitxml={report}"], cwd=folder, env=env, capture_output=True, text=True,
                           timeout=CHECK_LIMIT_S)
        except subprocess.TimeoutExpired:
            return [f"python -m pytest lab/build_ddp did not end within {CHECK_LIMIT_S} s"]
        if not report.exists():
            return ["python -m pytest lab/build_ddp wrote no report (it could not start)"]
        problems, cases = [], list(ET.parse(report).getroot().iter("testcase"))
        for case in cases:
            name = case.get("name", "")
            part = re.match(r"test_part_([a-z])_", name)
            failure = case.find("failure")
            if failure is None:
                failure = case.find("error")
            said = (failure.get("message") or "") if failure is not None else "it passed"
            if not part or not re.match(rf"NotImplementedError: write \S+ \(part {part[1]}\)", said):
                problems.append(f"{name}: {said.splitlines()[0] if said else 'no message'}")
        if not cases:
            problems.append("python -m pytest lab/build_ddp collected no test")
        return problems


def make_handout(out: Path, repo: Path = REPO, ref: str = "HEAD", check_lab: bool = True) -> list[str]:
    """Write the handout of commit ``ref`` to ``out`` (new, or empty); return the files written. Raises ValueError
    when ``out`` is in use or cannot be written, or the handout would hold the solution or fail its check (nothing
    is left at ``out``, or beside it, then)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not empty: give a new folder (the handout never overwrites files)")
    if out.resolve().is_relative_to(repo.resolve()):
        raise ValueError(f"{out} is inside the kit ({repo}): give a folder outside it")
    committed = committed_files(repo, ref)
    if SOLUTION + "reference.py" not in committed:
        raise ValueError(f"{ref} has no {SOLUTION}reference.py: the handout's check compares with the solution, "
                         f"so make it from the kit's repository, where the solution is committed")
    files = handout_files(committed)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as error:
        raise ValueError(f"cannot write beside {out} ({error.strerror}): give a folder you can write") from None
    try:
        for name, (content, mode) in sorted(files.items()):
            (partial / name).parent.mkdir(parents=True, exist_ok=True)
            (partial / name).write_bytes(content)
            (partial / name).chmod(mode & 0o777)
        found = leaks(partial, solution_windows(committed[SOLUTION + "reference.py"][0].decode()))
        if found:
            raise ValueError(f"the handout of {ref} would hold the solution's code (is the solution committed as "
                             f"student.py?); nothing was written:\n  " + "\n  ".join(found))
        problems = lab_failures(partial) if check_lab else []
        for path in sorted(partial.rglob("*"), reverse=True):   # anything the check left (only the files go out)
            name = path.relative_to(partial).as_posix()
            if path.is_file() and name not in files:
                path.unlink()
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        if problems:
            raise ValueError(f"in the handout of {ref}, python -m pytest lab/build_ddp must fail every test with its "
                             f"part's NotImplementedError, and these did not (nothing was written):\n  "
                             + "\n  ".join(problems))
        if out.exists():
            out.rmdir()   # empty, checked above
        partial.rename(out)
    except OSError as error:
        raise ValueError(f"cannot write the handout to {out} ({error}): nothing was written") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="a new (or empty) folder for the handout, outside the kit")
    parser.add_argument("--ref", default="HEAD", help="the commit, tag or branch to make it from (default HEAD)")
    args = parser.parse_args(argv)
    try:
        changed = uncommitted(REPO, args.ref) if (REPO / ".git").exists() else []
        files = make_handout(args.out, ref=args.ref)
    except ValueError as error:
        print(f"make_handout: {error}", file=sys.stderr)
        return 1
    print(f"wrote the handout of {args.ref} to {args.out}: {len(files)} files, without {', '.join(LEFT_OUT)} and the "
          f"kit's tests that run the solution; checked: no solution code, and every lab test fails "
          f"with its part's NotImplementedError.")
    if changed:
        print(f"Not in it (it takes {args.ref}'s files, not the working tree's): your uncommitted changes to "
              + ", ".join(changed[:8]) + (" ..." if len(changed) > 8 else ""))
    print("Students: python -m pytest lab/build_ddp (tests their student.py). Grading: python -m ddp_utils grade "
          "HANDIN, in the kit's repository (lab/instructors.md).")
    return 0


if __name__ == "__main__":
    sys.exit(main())

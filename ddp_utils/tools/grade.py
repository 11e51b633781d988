"""``python -m ddp_utils grade HANDIN``: the instructor's grader, a student's hand-in checked against its sources.

    python -m ddp_utils grade handins/alice                          # the sheet goes to grades/alice/<time>/
    python -m ddp_utils grade handins/alice --tests hidden/ --out sheets/alice --world-sizes 2,3

The hand-in's layout is in handin.py's docstring. What it checks, each a line of the sheet (pass, fail, or note)
with why:

- hand-in: every file of the layout is there and readable (JSON that parses, a table that parses);
- student.py: read as text, never imported here, it must not import the kit (ddp_utils: own_ddp loads the
  solution), the lab's modules (build_ddp, lab: the adapter's solution()), the solution (reference), nor use
  torch's own answer to a part (DistributedDataParallel, ZeroRedundancyOptimizer, FSDP), nor load code the
  grader cannot read (exec, eval, compile, __import__, importlib, runpy, a path to reference.py);
- lab tests: the lab's tests (and --tests, the instructor's hidden ones) run by pytest in a subprocess, in a new
  temporary copy of lab/build_ddp without its solution, against a copy of student.py (BUILD_DDP), with a time bound
  (--time-limit) on the whole run, no process of it allowed to import from the kit's lab folder (the solution), with
  no GPU, no proxy but a closed port on loopback, W&B and the Hugging Face hub off; one line per part (a, b, c,
  d, f) from pytest's JUnit XML (or, when the bound stopped it, from its -v lines);
- table: each figure of the student's table against the run folder of its row, within the table's printed
  rounding (1.78x: 0.005; 0:00:29: half a second; "about": 5 %);
- runs: each run is what the table says (nodes, world size, GPU, epochs) and all trained the same data set
  (--dataset: that one) and model;
- sources: settings.json, results.json, its history, log.txt, the TensorBoard events and the report's
  results.md against each other.

Exit 0 when the sheet (sheet.md, sheet.json, and the lab run's output) was written, whatever it says; 2 on bad
input (HANDIN not a folder, --tests or --out unusable), with a sentence. A hand-in is untrusted code: grade inside
the course's container or a throwaway machine, with its network off (lab/instructors.md).
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from .handin import (SECTIONS, TABLE_FILE, Sheet, check_files, check_report, check_same_data, check_sources,
                     check_table, read_table, report_folder, text_of)
from ..robust.preflight import choose_interface
from .report import new_report_dir

KIT = Path(__file__).resolve().parents[2]
LAB = KIT / "lab" / "build_ddp"
PARTS = ("a", "b", "c", "d", "f")
TIME_LIMIT_S = 600.0   # the whole lab takes a minute or two on a laptop; a hung test is stopped by the lab at 60 s
FORBIDDEN_MODULES = {"ddp_utils": "the kit (its own_ddp loads the solution)", "build_ddp": "the lab's modules "
                     "(the adapter's solution())", "lab": "the kit's lab folder", "solution": "the kit's solution",
                     "reference": "the kit's solution", "tests": "the kit's tests",
                     "importlib": "code loaded by name or path", "runpy": "code loaded by name or path"}
FORBIDDEN_NAMES = ("DistributedDataParallel", "ZeroRedundancyOptimizer", "FullyShardedDataParallel", "fully_shard")
FORBIDDEN_CALLS = ("exec", "eval", "compile", "__import__")
OWN = "write the part, do not wrap torch's"
# In every process of the lab's run (sitecustomize.py on its PYTHONPATH): nothing of the kit's lab folder (its solution,
# its adapter) may be imported; the run's own copy of the lab is elsewhere. (ddp_utils itself stays importable: the
# harness uses it, and its own_ddp finds the copy's adapter, whose solution() is not there.)
BLOCKER = '''"""Written by python -m ddp_utils grade: nothing of the kit's own lab folder (its solution) is imported here."""
import sys

KIT_LAB = {lab!r}


class GraderRefuses:
    def find_spec(self, name, path=None, target=None):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if (spec.origin or "").startswith(KIT_LAB):
                    raise ImportError(f"{{name}}: the grader refuses the kit's lab files ({{spec.origin}})")
                return spec
        return None


sys.meta_path.insert(0, GraderRefuses())
'''


@dataclasses.dataclass
class Options:
    """What the instructor chose: hidden tests, the time bound, which world sizes, a -k, the data set."""
    tests: Path | None = None
    time_limit: float = TIME_LIMIT_S
    world_sizes: tuple[int, ...] = ()
    keyword: str | None = None
    dataset: str | None = None


# -- the command -----------------------------------------------------------------------------------------------
def grade_command(args) -> int:
    """``grade``'s flags checked (ValueError: exit 2 with its sentence), then the hand-in graded; 0 once written."""
    handin = Path(args.handin)
    if not handin.is_dir():
        raise ValueError(f"{handin} is not a folder: pass the folder of one student's hand-in (its layout: "
                         f"lab/instructors.md)")
    if not LAB.is_dir():
        raise ValueError(f"the lab's tests are not in this copy of the kit ({LAB}): grade from the kit's repository")
    if args.time_limit is not None and args.time_limit <= 0:
        raise ValueError(f"--time-limit {args.time_limit:g}: give the seconds the lab's tests may take, above 0")
    options = Options(tests=Path(args.tests) if args.tests else None, time_limit=args.time_limit or TIME_LIMIT_S,
                      world_sizes=tuple(args.world_sizes or ()), keyword=args.k, dataset=args.dataset)
    extra_tests(options.tests)   # refused before the long run, not after
    out = sheet_dir(args.out, handin)
    sheet = grade(handin, out, options)
    print(f"{sheet['verdict'].upper()}: {sheet['counts']['fail']} check(s) failed, {sheet['counts']['pass']} "
          f"passed; wrote {out / 'sheet.md'} and {out / 'sheet.json'}")
    return 0


def sheet_dir(out, handin: Path) -> Path:
    """``--out`` (new or empty), else a new ``grades/<hand-in>/<YYYYmmdd-HHMMSS>/``: a sheet never replaces a file."""
    if out is None:
        return new_report_dir(Path("grades") / handin.resolve().name)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} is a file or a folder that holds something: give a new or an empty folder, "
                         f"so that a sheet never replaces a file")
    return out


def extra_tests(path: Path | None) -> list[Path]:
    """The instructor's test files: ``path`` itself, or the .py files of the folder ``path`` (not copied by name
    over the lab's own)."""
    if path is None:
        return []
    if not path.exists():
        raise ValueError(f"--tests {path}: there is no such file or folder")
    files = sorted(path.glob("*.py")) if path.is_dir() else [path]
    clash = [f.name for f in files if (LAB / f.name).exists()]
    if clash or not files:
        raise ValueError(f"--tests {path}: " + (f"{', '.join(clash)} would replace the lab's own file(s): rename "
                                                 f"them" if clash else "holds no .py file"))
    return files


def grade(handin: Path, out: Path, options: Options | None = None) -> dict:
    """Grade the hand-in folder ``handin`` and write the sheet into ``out``; return the sheet as in sheet.json."""
    options = options or Options()
    sheet = Sheet(Path(handin))
    runs = _guarded(sheet, "hand-in", "files", check_files, sheet, sheet.handin) or []
    _guarded(sheet, "student.py", "student.py", check_student, sheet, options, out)
    table = _guarded(sheet, "table", TABLE_FILE, read_table, sheet, sheet.handin / TABLE_FILE)
    if table and runs:
        _guarded(sheet, "table", TABLE_FILE, check_table, sheet, table, runs)
    _guarded(sheet, "runs", "runs/", check_same_data, sheet, runs, options.dataset)
    for run in runs:
        _guarded(sheet, "sources", f"runs/{run['name']}", check_sources, sheet, run)
    _guarded(sheet, "sources", "report/results.md", check_report, sheet, runs, report_folder(sheet.handin))
    return write_sheet(sheet, out, options)


def _guarded(sheet: Sheet, section: str, item: str, check, *args):
    """``check(*args)``; an error it did not foresee (a hand-in stranger than expected) is a line, not a crash."""
    try:
        return check(*args)
    except Exception as error:   # noqa: BLE001 (the sheet must be written whatever the hand-in holds)
        sheet.add(section, item, False, f"could not be checked: {type(error).__name__}: {error}")
        return None


# -- student.py: read, then tested in a throwaway copy ------------------------------------------------------------
def forbidden(source: str) -> list[str]:
    """What ``source`` (student.py's text, parsed, never run) uses that it may not, a sentence per line of it."""
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        return [f"line {error.lineno}: not Python ({error.msg})"]
    found = {}
    for node in ast.walk(tree):
        says = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""] if not node.level else [""]
            says += [f"uses torch's {a.name}: {OWN}" for a in node.names if a.name in FORBIDDEN_NAMES]
        else:
            modules = []
        says += [f"imports {m or 'a relative module'}: {FORBIDDEN_MODULES.get(m.split('.')[0], 'the lab folder')}"
                 for m in modules if not m or m.split(".")[0] in FORBIDDEN_MODULES]
        name = getattr(node, "attr", None) or getattr(node, "id", None)
        if name in FORBIDDEN_NAMES and not isinstance(node, ast.alias):
            says.append(f"uses torch's {name}: {OWN}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in FORBIDDEN_CALLS:
            says.append(f"calls {node.func.id}(): code the grader cannot read")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(r"reference\.py|solution/",
                                                                                        node.value):
            says.append("names the kit's solution's file")
        for said in says:
            found.setdefault(f"line {getattr(node, 'lineno', '?')}: {said}", None)
    return list(found)


def check_student(sheet: Sheet, options: Options, out: Path) -> None:
    """student.py read for what it may not use, then the lab's tests run against a copy of it."""
    student = sheet.handin / "student.py"
    if not student.is_file():
        sheet.add("lab tests", "lab", False, "student.py is missing: the lab's tests were not run")
        return
    found = forbidden(student.read_text(encoding="utf-8", errors="replace"))
    for line in found:
        sheet.add("student.py", line.split(":")[0], False, line.split(": ", 1)[1])
    if not found:
        sheet.add("student.py", "imports", True, "no kit, lab or solution module, no torch DDP, ZeRO or FSDP, no code "
                                                 "loaded by name")
    with tempfile.TemporaryDirectory(prefix="grade-") as work:
        run = run_lab(student, Path(work), options)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(work) / "output.txt", out / "lab-tests.txt")
        if (Path(work) / "junit.xml").is_file():
            shutil.copyfile(Path(work) / "junit.xml", out / "lab-junit.xml")
    sheet.lab = run
    lab_lines(sheet, run, options)
    claimed = re.findall(r"=+ (.*(?:passed|failed|error).*) in [\d.]+s", text_of(sheet.handin / "pytest-log.txt"))
    if claimed:
        sheet.add("lab tests", "pytest-log.txt", None, f"the handed-in log says {claimed[-1]}; this run: "
                                                       f"{run['summary'] or 'no summary'}")


def selection(options: Options) -> list[str]:
    """pytest's ``-k`` for --world-sizes (tests without a ranks id kept) and -k."""
    parts = []
    if options.world_sizes:
        parts.append("(" + " or ".join(f"[{n}-ranks]" for n in options.world_sizes) + " or not -ranks])")
    if options.keyword:
        parts.append(f"({options.keyword})")
    return ["-k", " and ".join(parts)] if parts else []


def lab_env(student: Path, work: Path) -> dict:
    """A clean environment: nothing of the grader's but PATH and the locale; loopback only, nothing phones home."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "SYSTEMROOT")}
    closed = "http://127.0.0.1:9"   # the discard port: a client that honours a proxy gets nowhere
    env.update(BUILD_DDP=str(student), PYTHONPATH=os.pathsep.join([str(work / "site"), os.environ.get("PYTHONPATH", "")]),
               HOME=str(work / "home"), TMPDIR=str(work / "tmp"), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", CUDA_VISIBLE_DEVICES="", WANDB_MODE="disabled", WANDB_SILENT="true",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PIP_NO_INDEX="1",
               http_proxy=closed, https_proxy=closed, HTTP_PROXY=closed, HTTPS_PROXY=closed, ALL_PROXY=closed,
               no_proxy="127.0.0.1,localhost", NO_PROXY="127.0.0.1,localhost",
               GLOO_SOCKET_IFNAME=choose_interface("127.0.0.1")[0])
    return env


def run_lab(student: Path, work: Path, options: Options) -> dict:
    """pytest on a copy of the lab (no solution) and of ``student``, in ``work``, killed at the time bound."""
    lab = work / "lab" / "build_ddp"
    shutil.copytree(LAB, lab, ignore=shutil.ignore_patterns("solution", "student.py", "__pycache__", "*.pyc"))
    for path in extra_tests(options.tests):
        shutil.copyfile(path, lab / path.name)
    for folder in ("handin", "site", "home", "tmp"):
        (work / folder).mkdir()
    shutil.copyfile(student, work / "handin" / "student.py")
    (work / "site" / "sitecustomize.py").write_text(BLOCKER.format(lab=str(KIT / "lab") + os.sep))
    command = [sys.executable, "-m", "pytest", "lab/build_ddp", "-p", "no:cacheprovider", "-v", "-rA",
               f"--junitxml={work / 'junit.xml'}", *selection(options)]
    started = time.monotonic()
    with open(work / "output.txt", "w") as output:
        proc = subprocess.Popen(command, cwd=work, env=lab_env(work / "handin" / "student.py", work),
                                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=options.time_limit)
        except subprocess.TimeoutExpired:
            rc = None
        finally:   # the ranks and the fork server too: everything of the run's session
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = text_of(work / "output.txt")
    summary = re.findall(r"^=+ (.*) in [\d.]+s.* =+$", text, re.M)
    return {"command": "python " + " ".join(command[1:]), "rc": rc, "timed_out": rc is None, "seconds": time.monotonic() - started,
            "time_limit": options.time_limit, "summary": summary[-1] if summary else "",
            "tests": junit_tests(work / "junit.xml", text)}


def junit_tests(junit: Path, output: str) -> dict[str, dict]:
    """``{test id: {part, outcome, message}}`` from pytest's JUnit XML, else from its -v lines (a run stopped
    at the time bound writes no XML)."""
    tests = {}
    try:
        cases = list(ET.parse(junit).iter("testcase"))
    except (OSError, ET.ParseError):
        cases = None
    for case in cases or []:
        problem = next((case.find(tag) for tag in ("failure", "error", "skipped") if case.find(tag) is not None), None)
        outcome = "passed" if problem is None else {"failure": "failed"}.get(problem.tag, problem.tag)
        message = "" if problem is None else _first_error(problem.get("message") or "", problem.text or "")
        tests[f"{case.get('classname')}::{case.get('name')}"] = {"part": _part(case.get("name")), "outcome": outcome,
                                                                  "message": message}
    if cases is None:
        for path, name, outcome in re.findall(r"^(\S+?\.py)::(\S+) (PASSED|FAILED|ERROR|SKIPPED)", output, re.M):
            tests[f"{Path(path).stem}::{name}"] = {"part": _part(name), "outcome": outcome.lower(), "message": ""}
    return tests


def _part(name: str | None) -> str | None:
    match = re.match(r"test_part_([a-z])_", name or "")
    return match.group(1) if match else None


def _first_error(message: str, text: str) -> str:
    """The failure's own sentence: pytest's message, or for a collection error the traceback's ``E`` line."""
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    if (not message or message == "collection failure") and errors:
        message = errors[-1]
    return " ".join(message.split())[:400]


def lab_lines(sheet: Sheet, run: dict, options: Options) -> None:
    """A line per part (and one for other tests): passed, failed with its first failure, or why it did not run."""
    tests = run["tests"]
    broken = [t["message"] for t in tests.values() if t["part"] is None and t["outcome"] == "error"]
    if broken:
        sheet.add("lab tests", "collection", False, f"the tests could not start (student.py crashed at import?): "
                                                    f"{broken[0]}")
    if run["timed_out"]:
        where = f"after {len(tests)} test(s)" if tests else "before any test ended: student.py hung at import?"
        sheet.add("lab tests", "time bound", False, f"still running after {run['time_limit']:.0f} s (--time-limit), "
                                                    f"stopped {where}")
    groups = {f"part ({p})": [t for t in tests.items() if t[1]["part"] == p] for p in PARTS}
    groups["other tests"] = [t for t in tests.items() if t[1]["part"] not in PARTS and t[1]["outcome"] != "error"]
    for item, mine in groups.items():
        failed = [(name, t) for name, t in mine if t["outcome"] in ("failed", "error")]
        if failed:
            name, test = failed[0]
            sheet.add("lab tests", item, False, f"{len(failed)} of {len(mine)} failed; {name.split('::')[-1]}: "
                                                f"{test['message']}")
        elif mine:
            sheet.add("lab tests", item, True, f"{len(mine)} test(s) passed")
        elif item != "other tests":
            selected = bool(selection(options)) and not broken and not run["timed_out"]
            sheet.add("lab tests", item, None if selected else False,
                      "not selected (--world-sizes, -k)" if selected else "no test of it ran")


# -- the sheet ----------------------------------------------------------------------------------------------------
def write_sheet(sheet: Sheet, out: Path, options: Options) -> dict:
    """sheet.json and sheet.md in ``out``; returns what sheet.json holds."""
    counts = {result: sum(line["result"] == result for line in sheet.lines) for result in ("pass", "fail", "note")}
    data = {"handin": str(sheet.handin), "graded": datetime.datetime.now().isoformat(timespec="seconds"),
            "options": dataclasses.asdict(options), "verdict": sheet.verdict, "counts": counts, "lines": sheet.lines,
            "lab": sheet.lab}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sheet.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (out / "sheet.md").write_text(sheet_markdown(data))
    return data


def sheet_markdown(data: dict) -> str:
    """The sheet for a person: the verdict, a count per section, then every line, failures first."""
    name, counts = Path(data["handin"]).name, data["counts"]
    lines = [f"# Score sheet: {name}", "",
             f"**{data['verdict'].upper()}**: {counts['fail']} check(s) failed, {counts['pass']} passed, "
             f"{counts['note']} note(s). Hand-in `{data['handin']}`, graded {data['graded']} by `python -m ddp_utils "
             f"grade`.", "", "| section | passed | failed | notes |", "| --- | ---: | ---: | ---: |"]
    for section in SECTIONS:
        mine = [line["result"] for line in data["lines"] if line["section"] == section]
        lines.append(f"| {section} | {mine.count('pass')} | {mine.count('fail')} | {mine.count('note')} |")
    if data["lab"]:
        lab = data["lab"]
        lines += ["", f"The lab's tests: `{lab['command']}`, {lab['seconds']:.0f} s"
                      f"{' (stopped at the time bound)' if lab['timed_out'] else ''}: {lab['summary'] or 'no summary'};"
                      f" their output is lab-tests.txt (and lab-junit.xml when pytest ended)."]
    order = {"fail": 0, "note": 1, "pass": 2}
    for section in SECTIONS:
        mine = sorted((line for line in data["lines"] if line["section"] == section), key=lambda l: order[l["result"]])
        if mine:
            lines += ["", f"## {section}", "", "| item | result | why |", "| --- | --- | --- |"]
            lines += [f"| {_cell(line['item'])} | {line['result']} | {_cell(line['why'])} |" for line in mine]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")

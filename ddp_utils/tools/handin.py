"""A student's hand-in, read for ``grade``: its files, its results table against its run folders, and the run
folders' sources (settings.json, results.json, log.txt, TensorBoard, the report) against each other.

The layout (lab/README.md, "What you hand in"), one folder per student::

    results-table.md   the filled-in results table of step 8 (Markdown; a row per run, named DDP, single or
                       after its run folder; the *reference* row is left out)
    answers.md         the answers to step 9's questions (or answers.txt, answers.pdf)
    report/            the reports/<YYYYmmdd-HHMMSS>/ folder `report` wrote, with iperf3.txt copied into it
    runs/              the run folders of the table's rows: settings.json, results.json, log.txt, tb/ (no *.pt)
    student.py         question 12: lab/build_ddp/student.py
    pytest-log.txt     question 12: python -m pytest lab/build_ddp -rA > pytest-log.txt
    bench/             question 12: the folder bench.py wrote (runs/build_ddp_bench/<date-time>/)

A figure of the table agrees with its run folder within the table's printed rounding (1.78x: 0.005; 0:00:29:
half a second; "about": 5 %). Nothing here runs the student's code: it reads files.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from .report import format_duration, load_run, results_table, scaling_rows, time_shares
from .report.write import REPORT_FILES

SECTIONS = ("hand-in", "student.py", "lab tests", "table", "runs", "sources")
TABLE_FILE = "results-table.md"


@dataclasses.dataclass
class Sheet:
    """The score sheet: one line per check, ``{section, item, result: pass|fail|note, why}``."""
    handin: Path
    lines: list[dict] = dataclasses.field(default_factory=list)
    lab: dict = dataclasses.field(default_factory=dict)

    def add(self, section: str, item: str, ok: bool | None, why: str = "") -> None:
        result = "note" if ok is None else "pass" if ok else "fail"
        self.lines.append({"section": section, "item": item, "result": result, "why": why})

    @property
    def verdict(self) -> str:
        return "fail" if any(line["result"] == "fail" for line in self.lines) else "pass"


# -- the hand-in's files -----------------------------------------------------------------------------------------
def report_folder(handin: Path) -> Path:
    """``report/``, or the one ``reports/<stamp>/`` folder the student copied as it was."""
    stamped = sorted(p for p in (handin / "reports").glob("*") if p.is_dir()) if (handin / "reports").is_dir() else []
    return stamped[0] if len(stamped) == 1 and not (handin / "report").is_dir() else handin / "report"


def check_files(sheet: Sheet, handin: Path) -> list[dict]:
    """A line per expected file; returns the run folders that load (results.json and settings.json readable)."""
    def found(path: Path, what: str) -> None:
        there = path.exists() and (path.is_dir() or path.stat().st_size > 0)
        sheet.add("hand-in", str(path.relative_to(handin)), there, what if there else f"missing or empty: {what}")

    found(handin / TABLE_FILE, "the filled-in results table of step 8")
    answers = next((p for p in (handin / f"answers.{ext}" for ext in ("md", "txt", "pdf")) if p.exists()),
                   handin / "answers.md")
    found(answers, "the answers to step 9's questions")
    report = report_folder(handin)
    for name in (*REPORT_FILES, "iperf3.txt"):
        found(report / name, "written by python -m ddp_utils report" if name != "iperf3.txt" else "step 5's iperf3")
    found(handin / "student.py", "question 12's lab/build_ddp/student.py")
    found(handin / "pytest-log.txt", "question 12's python -m pytest lab/build_ddp -rA")
    bench = sorted((handin / "bench").rglob("*.json")) if (handin / "bench").is_dir() else []
    readable = [p for p in bench if _json(p) is not None]
    sheet.add("hand-in", "bench/", bool(readable), f"{len(readable)} readable JSON file(s) of bench.py" if readable
              else "missing: the folder bench.py wrote (collectives.json or step.json)")
    folders = sorted(p for p in (handin / "runs").glob("*") if p.is_dir()) if (handin / "runs").is_dir() else []
    if not folders:
        sheet.add("hand-in", "runs/", False, "missing: the run folders of the table's rows")
    runs = []
    for folder in folders:
        try:
            run = load_run(folder)
        except (OSError, ValueError) as error:
            sheet.add("hand-in", f"runs/{folder.name}", False, f"not a finished run folder: {error}")
            continue
        except (AttributeError, TypeError):   # JSON, but a list or a number: load_run cannot add to it
            run = {}
        if not isinstance(run.get("world_size"), int) or not isinstance(run.get("settings"), dict):
            sheet.add("hand-in", f"runs/{folder.name}", False, "not a finished run folder: its results.json or "
                                                               "settings.json is not a run's (no world_size)")
            continue
        runs.append(run)
        for name in ("log.txt", "tb"):
            found(folder / name, "written by the run: the figures are checked against it")
    return runs


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def text_of(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


# -- the student's table ------------------------------------------------------------------------------------------
COLUMNS = (("nodes x", "nodes"), ("global batch", "global_batch"), ("lr", "lr"), ("epochs", "epochs"),
           ("wall time", "wall_time"), ("images/s (global", "images_per_s"), ("images/s per", "images_per_gpu"),
           ("data / compute / comm", "shares"), ("gpu util", "gpu_util"), ("acc@1", "acc1"), ("acc@5", "acc5"),
           ("speed-up", "speedup"), ("cost", "cost"))


def markdown_table(text: str) -> tuple[list[str], list[list[str]]] | None:
    """``(header, rows)`` of the first Markdown table of ``text`` whose first column is ``run``, or None."""
    lines = [line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|?(\s*:?-{3,}:?\s*\|?)+", lines[i + 1]):
            header = _cells(line)
            if header[0].lower() == "run":
                rows = []
                for row in lines[i + 2:]:
                    if not row.startswith("|"):
                        break
                    rows.append(_cells(row))
                return header, rows
    return None


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def read_table(sheet: Sheet, path: Path):
    table = markdown_table(text_of(path)) if path.is_file() else None
    if path.is_file() and not table:
        sheet.add("table", TABLE_FILE, False, "holds no Markdown table whose first column is 'run' (a header row, a "
                                              "--- row, a row per run)")
    return table


def row_run(label: str, runs: list[dict]) -> tuple[dict | None, str]:
    """The run a row is about: the run folder its first cell names, else the one DDP or single run."""
    named = sorted((r for r in runs if r["name"] in label), key=lambda r: -len(r["name"]))
    if named:
        return named[0], ""
    kind = "single" if re.search(r"single|one gpu|1 x", label, re.I) else "ddp" if "ddp" in label.lower() else None
    fits = [r for r in runs if (r["world_size"] == 1) == (kind == "single")] if kind else []
    if len(fits) == 1:
        return fits[0], ""
    return None, (f"{len(fits) or 'no'} run folder(s) fit it: name its folder in the run cell "
                  f"({', '.join(r['name'] for r in runs)})")


def check_table(sheet: Sheet, table, runs: list[dict]) -> None:
    header, rows = table
    keys = [next((key for start, key in COLUMNS if " ".join(h.lower().split()).startswith(start)), None)
            for h in header]
    for h, key in zip(header[1:], keys[1:]):
        if key is None:
            sheet.add("table", f"column {h!r}", None, "not a column of step 8's table: not checked")
    student_rows = [row for row in rows if row and row[0] and "reference" not in row[0].lower()]
    paired = [(row, *row_run(row[0], runs)) for row in student_rows]
    single = next((run for _, run, _ in paired if run and run["world_size"] == 1), None)
    speedups = {r.name: r.speedup for r in scaling_rows(runs, baseline=single["run_dir"] if single else None)}
    for row, run, why in paired:
        if run is None:
            sheet.add("table", f"row {row[0]!r}", False, why)
            continue
        agree, cells = 0, 0
        for cell, key in zip(row[1:], keys[1:]):
            if key in ("nodes", "epochs"):
                check_run_cell(sheet, row[0], key, cell, run)
            elif key:
                wrong = compare_cell(key, cell, expected(key, run, speedups))
                agree, cells = agree + (not wrong), cells + 1
                for problem in wrong:
                    sheet.add("table", f"{row[0]}: {header[keys.index(key)]}", False, f"{problem} ({run['name']})")
        sheet.add("table", f"{row[0]}", True if agree == cells else None,
                  f"{agree} of {cells} cells agree with runs/{run['name']}")
    if not paired:
        sheet.add("table", TABLE_FILE, False, "no row of the student's own runs")


def expected(key: str, run: dict, speedups: dict) -> list[tuple[str, object]]:
    """``[(what, value from the run folder)]`` for a column, in the order the cell prints them (None: none)."""
    shares, ranks, gpu = time_shares(run), run["world_size"], run.get("gpu_util")
    numeric = lambda v: v if isinstance(v, (int, float)) and not isinstance(v, bool) else None  # noqa: E731
    return {"global_batch": [("global batch", run.get("global_batch_size"))], "lr": [("lr", run.get("lr"))],
            "wall_time": [("wall time", run.get("wall_time_s"))],
            "images_per_s": [("images/s", run.get("images_per_s"))],
            "images_per_gpu": [("images/s per GPU", (run.get("images_per_s") or 0) / ranks)],
            "shares": [(f"{part} %", 100 * shares[f"{part}_s"] if shares else None)
                       for part in ("data", "compute", "comm")],
            "gpu_util": [("GPU util %", numeric(gpu))], "acc1": [("Acc@1", run.get("acc1"))],
            "acc5": [("Acc@5", run.get("acc5"))],
            "speedup": [("speed-up", speedups.get(run["name"])), ("predicted speed-up", run.get("predicted_speedup"))],
            "cost": [("cost", run.get("cost"))]}[key]


def figures(key: str, cell: str) -> list[tuple[float, float, str]]:
    """``[(value, tolerance, as printed)]`` of a cell; the tolerance is half its last printed digit (5 % when it
    says about)."""
    if key == "wall_time":
        return [duration] if (duration := parse_duration(cell)) else []
    text = cell.rsplit("=", 1)[1] if key == "lr" and "=" in cell else cell
    found = []
    for match in re.finditer(r"\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?", text):
        printed = match.group().replace(",", "")
        mantissa, _, exponent = printed.lower().partition("e")
        decimals = len(mantissa.partition(".")[2]) - int(exponent or 0)
        value = float(printed)
        tolerance = max(0.5 * 10 ** -decimals, 0.05 * value if re.search(r"about|~|≈", cell) else 0)
        found.append((value, tolerance, match.group()))
    return found


def parse_duration(cell: str) -> tuple[float, float, str] | None:
    """``1:14:47``, ``14:47`` or ``1h 14m 47s`` in seconds, with half its last unit."""
    if match := re.search(r"(\d+):(\d\d):(\d\d)|(\d+):(\d\d)", cell):
        h, m, s = (match.groups()[:3] if match.group(1) else (0, *match.groups()[3:]))
        return int(h) * 3600 + int(m) * 60 + int(s), 0.5, match.group()
    units = re.findall(r"(\d+(?:\.\d+)?)\s*(h|min|m|s)\b", cell)
    if not units:
        return None
    size = {"h": 3600, "min": 60, "m": 60, "s": 1}
    return sum(float(n) * size[u] for n, u in units), 0.5 * min(size[u] for _, u in units), cell.strip()


def compare_cell(key: str, cell: str, wanted: list[tuple[str, object]]) -> list[str]:
    """What disagrees between a cell and the run folder's figures, a sentence each (empty when they agree)."""
    printed, wrong = figures(key, cell), []
    for i, (what, want) in enumerate(wanted):
        if i >= len(printed):
            if want is not None:
                wrong.append(f"{what}: not filled in; the run folder gives {_show(want, key)}")
            continue
        value, tolerance, text = printed[i]
        if want is None:
            wrong.append(f"{what}: the table says {text}, the run folder has none")
        elif abs(value - float(want)) > tolerance + 1e-9 * max(1.0, abs(float(want))):
            wrong.append(f"{what}: the table says {text}, the run folder gives {_show(want, key)}")
    return wrong


def _show(value, key: str = "") -> str:
    return format_duration(value) if key == "wall_time" else f"{value:.6g}" if isinstance(value, float) else str(value)


def check_run_cell(sheet: Sheet, label: str, key: str, cell: str, run: dict) -> None:
    """The run is what its row says: ``2 x T4`` (nodes x GPU; ``1 x 2 cpu``: 2 ranks on one node), epochs."""
    item, name = f"{label}: {'nodes x GPUs' if key == 'nodes' else 'epochs'}", run["name"]
    if key == "epochs":
        said = figures(key, cell)
        ok = bool(said) and int(said[0][0]) == run.get("epochs") == run["settings"].get("epochs")
        resumed = "" if run.get("epochs_run", run.get("epochs")) == run.get("epochs") else \
            f"; it trained {run.get('epochs_run')} of them in this folder (resumed or stopped)"
        sheet.add("runs", item, ok, f"the table says {cell or 'nothing'}, runs/{name} trained {run.get('epochs')} "
                                    f"epoch(s) (settings.json: {run['settings'].get('epochs')}){resumed}")
        return
    match = re.match(r"\s*(\d+)\s*x\s*(?:(\d+)\s+)?(.*)", cell)
    nodes, ranks, device = run.get("nodes", 1), run["world_size"], str(run.get("device_name", "?"))
    if not match:
        sheet.add("runs", item, False, f"the table says {cell or 'nothing'}, runs/{name} ran {ranks} rank(s) on "
                                       f"{nodes} node(s), {device}")
        return
    said_nodes, per_node = int(match.group(1)), int(match.group(2) or 1)
    words = set(re.findall(r"[a-z0-9]+", match.group(3).lower())) - {"gpu", "gpus", "rank", "ranks", "each"}
    gpu_ok = all(w in device.lower() for w in words)
    sheet.add("runs", item, said_nodes == nodes and said_nodes * per_node == ranks and gpu_ok,
              f"the table says {cell}; runs/{name}: {ranks} rank(s) on {nodes} node(s), {device}")


def check_same_data(sheet: Sheet, runs: list[dict], dataset: str | None) -> None:
    """Every run trained the same data set and model, as settings.json and results.json both say."""
    if not runs:
        return
    for key in ("dataset", "arch"):
        values = {run["name"]: (run.get(key), run["settings"].get(key)) for run in runs}
        seen = {v for pair in values.values() for v in pair}
        want = dataset if key == "dataset" and dataset else None
        ok = len(seen) == 1 and (want is None or seen == {want})
        sheet.add("runs", key, ok, ", ".join(f"{n}: {a}" + (f" (settings.json: {b})" if a != b else "")
                                             for n, (a, b) in values.items()) + (f"; --dataset {want}" if want else ""))


# -- the sources against each other ------------------------------------------------------------------------------
def check_sources(sheet: Sheet, run: dict) -> None:
    """settings.json, results.json, its history, log.txt and TensorBoard's events: the same figures."""
    name, settings = run["name"], run["settings"]
    pairs = [(k, run.get(k), settings.get(k), 0) for k in ("world_size", "epochs", "dataset", "arch")]
    if run.get("parallel") != "dp":
        batch = settings.get("batch_size", 0) * settings.get("world_size", 0) * settings.get("accumulate", 1)
        pairs.append(("global batch (batch_size x world_size x accumulate)", run.get("global_batch_size"), batch, 0))
    disagree = [f"{k}: results.json {a}, settings.json {b}" for k, a, b, tol in pairs if not _same(a, b, tol)]
    last = (run.get("history") or [{}])[-1].get("val", {})
    disagree += [f"{k}: results.json {run.get(k)}, its history's last epoch {last[k]}" for k in ("acc1", "acc5", "loss")
                 if k in last and not _same(run.get(k), last[k], 1e-9)]
    log = text_of(Path(run["run_dir"]) / "log.txt")
    epoch = re.findall(r"^epoch \d+/(\d+): .*\| val loss (\S+) acc1 (\S+) acc5 (\S+)", log, re.M)
    batch = re.findall(r"global batch (\d+) = \d+ per rank x (\d+) rank\(s\).*?; lr (?:.* = )?([\d.e+-]+)", log)
    if epoch:
        for (k, tol), printed in zip((("epochs", 0), ("loss", 5e-5), ("acc1", 0.005), ("acc5", 0.005)), epoch[-1]):
            if not _same(run.get(k), float(printed), tol):
                disagree.append(f"{k}: results.json {run.get(k)}, log.txt's last epoch line {printed}")
    if batch:
        for (k, tol), printed in zip((("global_batch_size", 0), ("world_size", 0), ("lr", 5e-4)), batch[-1]):
            if not _same(run.get(k), float(printed), tol * abs(float(printed))):
                disagree.append(f"{k}: results.json {run.get(k)}, log.txt {printed}")
    disagree += _tensorboard(run)
    for problem in disagree:
        sheet.add("sources", f"runs/{name}", False, problem)
    if not disagree:
        sheet.add("sources", f"runs/{name}", True, "settings.json, results.json, its history" + (
            ", log.txt" if epoch and batch else " (log.txt: no epoch line)") + " and TensorBoard agree")


def _same(a, b, tolerance: float) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= tolerance + 1e-9 * max(1.0, abs(b))
    return a == b


def _tensorboard(run: dict) -> list[str]:
    """results.json against the last validation point of the run's TensorBoard events."""
    if not (Path(run["run_dir"]) / "tb").is_dir():
        return []
    from ..runlog import read_scalars   # here, not at the top: it loads torch and TensorBoard
    scalars = read_scalars(run["run_dir"])
    return [f"{key}: results.json {run.get(key)}, TensorBoard's {tag} {scalars[tag][-1][1]:.6g}"
            for key, tag in (("acc1", "acc1/val"), ("acc5", "acc5/val"), ("loss", "Loss/val"))
            if scalars.get(tag) and not _same(run.get(key), scalars[tag][-1][1], 1e-4 + 1e-5 * abs(run.get(key) or 0))]


def check_report(sheet: Sheet, runs: list[dict], folder: Path) -> None:
    """The report's results.md table against the same table made now from the handed-in run folders."""
    table = markdown_table(text_of(folder / "results.md"))
    if table is None or not runs:
        return
    header, rows = table
    by_name = {run["name"]: run for run in runs}
    missing = [row[0] for row in rows if row[0] not in by_name]
    for name in missing:
        sheet.add("sources", f"report: {name}", False, "a row of results.md with no run folder in runs/")
    ordered = [by_name[row[0]] for row in rows if row[0] in by_name]
    if not ordered:
        return
    now_header, now_rows = markdown_table(results_table(ordered))
    now = {row[0]: dict(zip(now_header, row)) for row in now_rows}
    wrong = [f"{row[0]}, {h}: results.md says {cell}, the run folder gives {now[row[0]][h]}"
             for row in rows if row[0] in now for h, cell in zip(header, row) if now[row[0]].get(h, cell) != cell]
    for problem in wrong:
        sheet.add("sources", "report/results.md", False, problem)
    if not wrong:
        sheet.add("sources", "report/results.md", True, f"its table agrees with runs/ ({len(ordered)} row(s))")

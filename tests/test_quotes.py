"""The kit's output quoted on the pages is a recorded run's (docs/quotes.py, docs/output/), and still the kit's.

Fast tier: every page is in sync with docs/output/ (`python docs/quotes.py pages` pastes it), every ```text
block is either generated or marked, and an illustrative block (GPU nodes) quotes only lines the kit prints.
Slow tier: the recorded commands, run again now, print the same lines in the same order (numbers, temporary
paths and ports aside); after changing a printed line, `python docs/quotes.py record` and `pages`.
"""
from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

import pytest

from docs import quotes
from tests.helpers.procs import REPO

FENCE = re.compile(r"^( *)```text\n(.*?)^\1```$", re.M | re.S)
REGION = re.compile(r"<!-- \[\[\[cog quote\(\"([\w-]+)\".*?\]\]\] -->\n(.*?)<!-- \[\[\[end\]\]\] -->", re.S)
MARK = re.compile(r"<!-- (illustrative|not the kit's)[^>]* -->\n *$")


# Lines only a GPU node prints (illustrative blocks may quote them; nothing here records them).
GPU_ONLY = [
    "backend nccl; GPUs: Tesla T4; NCCL 2.x.y; torch 2.6.0a0+ecf3bae40a.nv25.01",
    "  rank 0's store: legacy TCPStore on a socket bound to master_addr only (the libuv one takes no such socket "
    "before torch 2.8)",
    "  a hung collective is stopped by the NCCL backend's abort() (torch 2.6 has no ProcessGroup.abort)",
    "  the NCCL backend's abort() (torch 2.6 has no ProcessGroup.abort)",
    "data imagenet at /data/imagenet: train 1281167 images / 1000 classes, val 50000 images / 1000 classes",
    "rank 0: joined tcp://172.31.9.80:29500 as rank 0 of 2 (nccl, cuda:0) in 0.7 s",
    "rank 1: joined tcp://172.31.9.80:29500 as rank 1 of 2 (nccl, cuda:0) in 0.9 s",
    "all-reduce over the process group (nccl, 2 ranks), up to the 46.8 MB of resnet18's gradients; busbw as nccl-tests "
    "defines it:",
    "      4096 ...",
    "  46758048 ...",
    # the feed check's paragraph (docs/time-split.md; tests/test_feed.py checks it is feed.describe's text)
    "feed check: the data loader bounds this run on rank 1. Over 20 steps it delivered 312 img/s,",
    "  where this GPU trains 880 img/s when fed (its own time for those steps): it waited for data",
    "  61 % of the time. 2 worker(s) gave 156 img/s each:",
    "  at that rate about 6 would feed it; this node has 8 CPUs, one for training:",
    "  set WORKERS to 6.",
    "  A copy resized once, on the local disk (lab/data.md), decodes 1.46x the images per",
    "  core (measured: docs/benchmarks.md, ImageNet input).",
]


def blocks() -> list[tuple[str, str | None, str | None, list[str]]]:
    """(page, quote name, illustrative/not-the-kit's, lines) of every ```text block of the pages."""
    found = []
    for page in quotes.PAGES:
        text = Path(REPO, page).read_text(encoding="utf-8")
        regions = [(m.start(2), m.end(2), m.group(1)) for m in REGION.finditer(text)]
        for m in FENCE.finditer(text):
            name = next((n for start, end, n in regions if start <= m.start() < end), None)
            mark = MARK.search(text, max(0, m.start() - 200), m.start())
            lines = [line[len(m.group(1)):] for line in m.group(2).splitlines()]
            found.append((page, name, mark and mark.group(1), lines))
    return found


def test_every_page_is_in_sync_with_the_recorded_output():
    assert quotes.pages(check=True) == 0, "run: python docs/quotes.py pages (then commit docs/output and the pages)"


def test_every_output_block_is_generated_or_marked_illustrative():
    for page, name, mark, lines in blocks():
        assert name or mark, f"{page}: a ```text block neither generated nor marked illustrative: {lines[:2]}"
        assert name is None or name in quotes.QUOTES, (page, name)


def test_every_recorded_output_names_its_command_and_machine_and_is_quoted():
    quoted = {name for _, name, _, _ in blocks() if name}
    for run, spec in quotes.RUNS.items():
        for proc in spec.procs:
            head, lines = quotes.recorded(proc)
            assert head.startswith(f"# {quotes.command(run)} | machine: ") and " cores, torch " in head, \
                f"docs/output/{proc}.txt is not a recording of RUNS[{run!r}]: python docs/quotes.py record {run}"
            assert lines, proc
    every = {proc for run in quotes.RUNS.values() for proc in run.procs}
    used = {quotes.QUOTES[name][0] for name in quoted}
    if "[[[cog cells() ]]]" in Path(REPO, "lab", "README.md").read_text(encoding="utf-8"):
        used |= {"notebook-main", "notebook-worker"}      # step 6's table of what each cell prints
    assert used == every, f"recorded outputs no page quotes: {every - used}"


# A GPU node's names for what the recorded runs call otherwise (the same line of the kit).
NODE_NAMES = [(r"interface ens5\b", "interface lo"), (r"model resnet18\b", "model convnet"),
              (r"precision torch.float16; device cuda:0", "precision fp32; device cpu")]


def _pattern(line: str) -> re.Pattern:
    """An illustrative line as a pattern over shapes: `...` and `..` stand for anything."""
    for name, recorded in NODE_NAMES:
        line = re.sub(name, recorded, line)
    parts = re.split(r"\.\.\.?", quotes.shape(line))
    return re.compile(".*".join(re.escape(p) for p in parts))


def test_illustrative_blocks_quote_only_lines_the_kit_prints():
    printed = {quotes.shape(line) for run in quotes.RUNS.values() for proc in run.procs
               for line in quotes.recorded(proc)[1]}
    unknown = [f"{page}: {line}" for page, _, mark, lines in blocks() if mark == "illustrative" for line in lines
               if line not in GPU_ONLY and line != "..." and not any(_pattern(line).fullmatch(p) for p in printed)]
    assert not unknown, "illustrative lines the kit prints nowhere in docs/output/ (nor GPU_ONLY):\n" + "\n".join(unknown)


def test_shorten_keeps_epochs_one_to_three_and_the_last():
    lines = [x for e in range(1, 9) for x in (f"epoch {e}/8: loss", f"  {e} img/s")] + ["GPU use: none"]
    assert quotes.shorten_epochs(lines) == lines[:6] + ["..."] + lines[14:]


# -- issue 44: a format change re-recorded from the kept records, the figures kept ---------------------------
EPOCH = re.compile(r"epoch \d+/\d+: ")


def test_every_recorded_epoch_line_and_table_is_rendered_from_kept_records_in_todays_format():
    """Each recorded output keeps the records its epoch lines and results table were printed from; what the
    current code renders from them is what the output shows (a format change fails here, in the fast tier)."""
    from docs import facts
    for path in sorted(quotes.OUTPUT.glob("*.facts.json")):
        proc = path.name[:-len(".facts.json")]
        lines = quotes.recorded(proc)[1]
        assert facts.stale(lines, json.loads(path.read_text())) == [], \
            f"docs/output/{proc}.txt is in an old format: run python docs/quotes.py reformat"
    for proc in sorted(p.stem for p in quotes.OUTPUT.glob("*.txt")):
        lines = quotes.recorded(proc)[1]
        kept = quotes.OUTPUT / f"{proc}.facts.json"
        covered = {b["at"] for b in json.loads(kept.read_text())["blocks"]} if kept.exists() else set()
        for at, line in enumerate(lines):
            if EPOCH.match(line) or line.startswith("| run |"):
                assert at in covered, f"docs/output/{proc}.txt line {at + 2}: no record kept: {line[:60]}"


def test_reformat_renders_a_new_format_with_the_recorded_figures_and_back(tmp_path, monkeypatch):
    """The epoch line and the results table in a new format, rendered from the kept records: the figures are
    the recording's (nothing is run), the other lines untouched; the old format back gives the same bytes."""
    import shutil
    from ddp_utils import runlog
    from ddp_utils.tools import report
    shutil.copytree(quotes.OUTPUT, tmp_path / "output")
    monkeypatch.setattr(quotes, "OUTPUT", tmp_path / "output")
    before = {p.name: p.read_text() for p in (tmp_path / "output").iterdir()}
    old_line, old_table = runlog.epoch_line, report.results_table
    monkeypatch.setattr(runlog, "epoch_line", lambda *a: "NEW " + old_line(*a).replace("\n  ", " || "))
    monkeypatch.setattr(report, "results_table", lambda *a, **k: "TABLE\n" + old_table(*a, **k))
    assert set(quotes.reformat([])) >= {"demo", "report", "resume", "notebook-main", "launch-kill"}
    lines, old = quotes.recorded("demo")[1], before["demo.txt"].splitlines()[1:]
    new_epochs = [line for line in lines if line.startswith("NEW epoch ")]
    old_epochs = [f"{a} || {b.strip()}" for a, b in zip(old, old[1:]) if EPOCH.match(a)]
    assert [line[len("NEW "):] for line in new_epochs] == old_epochs   # the recording's figures, one line each
    assert lines[lines.index("TABLE") + 1:lines.index("TABLE") + 5] == [line for line in old if line.startswith("|")]
    def outside(lines: list[str], kept: str) -> list[str]:
        inside = {i for b in json.loads(kept)["blocks"] for i in range(b["at"], b["at"] + b["lines"])}
        return [line for i, line in enumerate(lines) if i not in inside]
    assert outside(lines, (quotes.OUTPUT / "demo.facts.json").read_text()) == outside(old, before["demo.facts.json"])
    monkeypatch.setattr(runlog, "epoch_line", old_line)
    monkeypatch.setattr(report, "results_table", old_table)
    quotes.reformat([])
    assert {p.name: p.read_text() for p in (tmp_path / "output").iterdir()} == before


# -- slow: the commands run again print the recorded lines ---------------------------------------------
@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """Each recorded command run once now, when a test first asks (the demo once: the report reads its runs)."""
    from tests.helpers import zygote
    tmp, done = str(tmp_path_factory.mktemp("quotes")), {}
    # from the fork server (no 8-s import each): the commands (not one a test acts on: it finds its processes by
    # their parents) and torchrun's workers
    fork = {"wrap": zygote.wrap, "extra_env": {"PYTHON_EXEC": zygote.python_exec()}} if zygote.enabled() else {}

    def output(run: str, proc: str) -> str:
        if run == "report" and "demo" not in done:
            done["demo"] = quotes.execute("demo", tmp, **fork)
        if run not in done:
            done[run] = quotes.execute(run, tmp, **fork)
        return done[run][proc]
    output.tmp = Path(tmp)   # where the commands ran: the demo's runs are in runs/demo
    return output


@pytest.mark.slow
@pytest.mark.floor
def test_demo_trains_ddp_and_single_and_prints_the_comparison_table(fresh):
    """The demo's own command, as the pages quote it (its run made once for this module: quotes.execute fails
    unless every process exits 0)."""
    output = fresh("demo", "demo")
    table = [line for line in output.splitlines() if line.startswith("|")]
    assert len(table) == 4, output      # header, rule, DDP row, single row
    assert re.search(r"ddp2 \| 2 \|", table[2]) and re.search(r"single \| 1 \|", table[3]), table
    assert len(list((fresh.tmp / "runs" / "demo").glob("*/results.json"))) == 2


@pytest.fixture(scope="module")
def demo_runs(fresh) -> dict[str, Path]:
    """The demo's two run folders (DDP on 2 ranks, then one process), from its run above."""
    fresh("demo", "demo")
    runs = fresh.tmp / "runs" / "demo"
    [ddp], [single] = runs.glob("*-ddp2"), runs.glob("*-single")
    return {"ddp": ddp, "single": single}


# -- the demo's runs: the default recipe learns, and they hold every figure the homework asks for -------------
@pytest.mark.slow
@pytest.mark.parametrize("run", ["ddp", "single"])
def test_demo_at_default_settings_reaches_95_percent(demo_runs, run):
    """The default recipe (the demo's; a run of `train --dataset demo` with nothing else set has it too) learns."""
    from ddp_utils.settings import Settings
    results = json.loads((demo_runs[run] / "results.json").read_text())
    assert results["acc1"] >= 95.0, results["acc1"]
    saved = json.loads((demo_runs[run] / "settings.json").read_text())
    assert (saved["arch"], saved["epochs"], saved["batch_size"], saved["lr"]) == ("convnet", 8, 32, 0.8)
    defaults = Settings()
    assert (defaults.arch, defaults.epochs, defaults.batch_size, defaults.lr) == ("convnet", 8, 32, 0.8)


def answer_sources() -> dict[int, list[str]]:
    """``{question number: ["time.png", "results.json: comm_s, ...", ...]}`` from lab/README.md's step 9."""
    text = (Path(REPO) / "lab" / "README.md").read_text()
    section = text.split("## 9. Questions to answer")[1].split("## 10.")[0]
    sources, question, answer = {}, None, False
    for line in section.splitlines():
        start = re.match(r"(\d+)\. \*\*", line)
        if start:
            question, answer = int(start.group(1)), False
        answer = (answer and line.strip() != "" and not line.lstrip().startswith("* ")) or "*Answer from:*" in line
        if answer:
            sources.setdefault(question, []).extend(re.findall(r"`([^`]+)`", line))
    return sources


# Sources the demo's two runs do not make, and the test that makes them instead.
MADE_ELSEWHERE = {"runs/check/allreduce-*.json": "tests/test_cli.py, tests/test_mesh.py: check saves its sweep",
                  "runs/iperf3.txt": "the student's own iperf3 (step 5); no kit code writes it"}
# Questions answered from other runs than the demo's pair, each with the tests whose runs make those sources.
OTHER_RUNS = {12: "tests/test_grid.py (train --grid, report's grid section and grid.png); "
                  "tests/test_build_ddp_bench.py (bench.py step's step.md)",
              13: "tests/test_own_ddp.py (--build-ddp a and c in the notebooks, comm_s); tests/test_build_ddp.py "
                  "(the lab's pytest log); tests/test_build_ddp_bench.py (collectives.png, collectives.json, step.md); "
                  "tests/test_sharding.py (--build-ddp f's memory)",
              14: "tests/test_sharding.py (zero1 and fsdp runs, report's memory table)"}


# questions 12 and 13's sources that lab/build_ddp writes or runs: the text its source must hold
LAB_BENCH = {"bench.py step": 'add_parser("step"', "bench.py": 'add_parser("collectives"',
             "step.md": '"step.md"', "collectives.png": '"collectives.png"', "collectives.json": '"collectives.json"',
             "python -m pytest lab/build_ddp -rA": "def test_part_a_"}


def lab_source() -> str:
    lab = Path(REPO) / "lab" / "build_ddp"
    return (lab / "bench.py").read_text() + (lab / "test_build_ddp.py").read_text()


def report_source() -> str:
    return "\n".join(p.read_text() for p in (Path(REPO) / "ddp_utils" / "tools" / "report").glob("*.py"))


def kit_source() -> str:
    return "\n".join(p.read_text() for p in (Path(REPO) / "ddp_utils").rglob("*.py"))


@pytest.mark.slow
def test_every_homework_question_names_figures_that_the_demo_runs_produced(demo_runs, tmp_path):
    from ddp_utils.tools import report
    from ddp_utils.runlog import read_scalars
    runs = [demo_runs["ddp"], demo_runs["single"]]
    out = tmp_path / "report"
    report.write_report(runs, out)
    sources = answer_sources()
    assert sorted(sources) == list(range(1, 15)), sources   # every question says where its answer is
    written = (out / "results.md").read_text()
    for question, items in sources.items():
        for item in items:
            kind, _, names = item.partition(": ")
            where = f"question {question}: {item}"
            if item in MADE_ELSEWHERE:   # not by a demo run: the test named there makes it
                continue
            if question in OTHER_RUNS:   # a grid, your own DDP, ZeRO/FSDP: the runs of OTHER_RUNS[question]
                if kind == "results.md":
                    assert f"## {names}" in report_source(), where   # the report writes that section
                elif kind == "results.json":
                    assert all(f'"{name}"' in kit_source() for name in names.split(", ")), where
                elif kind in LAB_BENCH:   # the lab's own commands and what bench.py writes
                    assert LAB_BENCH[kind] in lab_source(), where
                else:
                    assert kind in ("grid.png", "time.png") or kind.startswith("the epoch lines") \
                        or kind.endswith(".md"), where
                continue
            if kind == "results.md" and names:              # a section of the report over the demo runs
                assert f"## {names}" in written, where
                continue
            if kind == "compare":                           # the table `python -m ddp_utils compare RUN...` prints
                table = report.compare_table(runs)
                assert "| single |" in table and "| DDP |" in table, where   # both runs, one row each
                continue
            if kind == "report":                            # the command that wrote `out`
                assert (out / "results.md").is_file(), where
                continue
            if not names:                                   # a file of the report
                assert (out / kind).is_file(), where
                continue
            names = [name.strip() for name in names.split(",")]
            for run in runs:
                if kind == "results.json":
                    results = json.loads((run / "results.json").read_text())
                    assert all(name in results for name in names), where
                elif kind == "TensorBoard":
                    scalars = read_scalars(run)
                    assert all(scalars.get(name) for name in names), where
                elif kind == "run folder":
                    assert all((run / name).is_file() for name in names), where
                elif kind == "log.txt":
                    assert all(name in (run / "log.txt").read_text() for name in names), where
                else:
                    raise AssertionError(f"{where}: unknown kind of source {kind!r}")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("run,proc", [(r, p) for r, run in quotes.RUNS.items() for p in run.procs])
def test_the_recorded_command_still_prints_the_recorded_lines(run, proc, fresh):
    head, lines = quotes.recorded(proc)
    compare = quotes.RUNS[run].compare
    want = [quotes.shape(line) for line in compare(lines)]
    got = [quotes.shape(line) for line in compare(fresh(run, proc).splitlines())]
    assert got == want, (f"`{head[2:]}` now prints other lines than docs/output/{proc}.txt; if that is intended: "
                         f"python docs/quotes.py record {run} && python docs/quotes.py pages\n"
                         + "\n".join(difflib.unified_diff(want, got, "recorded", "now", lineterm="")))


# -- generated sentences make sense, not only match a record --------------------------------------------
GENERATED = re.compile(r"<!-- \[\[\[cog (.*?)\]\]\] -->\n(.*?)<!-- \[\[\[end\]\]\] -->", re.S)


def generated_prose() -> list[tuple[str, str, str]]:
    """(page, cog call, text) of every generated region of the pages, without its ```text blocks and tables."""
    found = []
    for page in quotes.PAGES:
        text = Path(REPO, page).read_text(encoding="utf-8")
        for m in GENERATED.finditer(text):
            prose = re.sub(r"^( *)```text\n.*?^\1```$", "", m.group(2), flags=re.M | re.S)
            prose = "\n".join(line for line in prose.splitlines() if not line.lstrip().startswith("|"))
            found.append((page, m.group(1)[:60], " ".join(prose.split())))
    return found


def test_generated_percentages_are_between_0_and_100():
    """A figure read from the wrong column once made step 0 say the runs 'end at 145 % (DDP) and 160 % (single)'."""
    wrong = [f"{page} [{call}]: ...{prose[max(0, m.start() - 60):m.end()]}" for page, call, prose in generated_prose()
             for m in re.finditer(r"(?<![\w.+-])(-?\d+(?:\.\d+)?) ?%", prose) if not 0 <= float(m.group(1)) <= 100]
    assert not wrong, "generated percentages outside 0..100:\n" + "\n".join(wrong)


def test_the_recorded_tables_speed_up_and_efficiency_agree():
    for row in quotes.table_rows(quotes.recorded("demo")[1]):
        speedup, ranks = float(row["speed-up"].rstrip("x")), int(row["ranks"])
        assert 0 < speedup <= ranks * 1.1, row   # more than linear would be a measuring error on one machine
        assert float(row["efficiency"].rstrip(" %")) == pytest.approx(100 * speedup / ranks, abs=1.0), row


def test_step_0_quotes_the_demo_tables_speed_up_and_acc1_by_column_name():
    """Step 0's sentences against the table printed above them, read by the header's names."""
    ddp, single = quotes.table_rows(quotes.recorded("demo")[1])[:2]
    [step0] = [prose for page, call, prose in generated_prose() if call.strip() == "step0()"]
    assert f"the single run stands for one node: {ddp['speed-up']}, not 2x" in step0, step0
    ends = (f"both runs end at {ddp['Acc@1']} %" if ddp["Acc@1"] == single["Acc@1"] else
            f"the runs end at {ddp['Acc@1']} % (DDP) and {single['Acc@1']} % (single)")
    assert ends in step0, step0
    assert f"({ddp['global batch']} against {single['global batch']})" in step0, step0


def test_table_rows_reads_columns_by_name_whatever_their_order():
    lines = ["| run | Acc@1 | speed-up |", "| --- | ---: | ---: |", "| a | 97.2 | 1.9x |"]
    swapped = ["| speed-up | run | Acc@1 |", "| ---: | --- | ---: |", "| 1.9x | a | 97.2 |"]
    assert quotes.table_rows(lines) == quotes.table_rows(swapped) == [{"run": "a", "Acc@1": "97.2", "speed-up": "1.9x"}]

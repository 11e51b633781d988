"""The benchmarks' figures on the pages come from the files the benchmarks write (docs/figures.py).

Every benchmark writes benchmarks/results/NAME.json (benchmarks/results.py) with its command and machine; the
pages paste tables and figures from those files with cog, so these tests fail when a page quotes a figure no
file holds, a file no page quotes, a file lacks its machine, or a benchmark no longer starts.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from docs import figures
from tests.helpers.procs import REPO as _REPO

REPO = Path(_REPO)

BENCHMARKS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if "__main__" in p.read_text(encoding="utf-8"))
RESULTS = sorted((REPO / "benchmarks" / "results").glob("*.json"))
PAGES = ["README.md", "docs/benchmarks.md", "docs/faults.md", "docs/gpu.md", "lab/data.md"]
HAND_CHECKED = ["README.md", "docs/benchmarks.md", "docs/faults.md"]   # whose figures are all measurements
CALL = re.compile(r"figures\.(?:say|table|bench|chose)\(\"([\w.-]+)\"")
# Measured figures as a page would hand-write them: img/s, ms, a speed-up, seconds with a decimal.
MEASURED = re.compile(r"\b\d[\d,]*(?:\.\d+)? ?(?:img/s|ms)\b|\b\d+\.\d+x\b|\b\d+\.\d+ s\b")
REFERENCE = ["about 300 img/s"]   # the course's reference figures (lab/README.md), not this kit's measurements
GENERATED = re.compile(r"<!-- \[\[\[cog\n.*?<!-- \[\[\[end\]\]\] -->|<!-- \[\[\[cog .*?<!-- \[\[\[end\]\]\] -->",
                       re.S)


@pytest.mark.slow
def test_every_benchmark_starts(tmp_path):
    """`--help` of every script in one process: a renamed module breaks a benchmark nobody runs in CI."""
    script = ("import os, runpy, sys\n"
              "for path in sys.argv[1:]:\n"
              "    sys.argv = [path, '--help']\n"
              "    sys.path.insert(0, os.path.dirname(path))   # as `python benchmarks/x.py` does\n"
              "    try:\n"
              "        runpy.run_path(path, run_name='__main__')\n"
              "    except SystemExit as e:\n"
              "        assert e.code in (0, None), (path, e.code)\n"
              "    print('STARTED', path, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script, *map(str, BENCHMARKS)], cwd=REPO, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("STARTED") == len(BENCHMARKS), out.stdout[-2000:]
    for path in BENCHMARKS:
        if path.name not in ("torch_releases.py",):   # one file per release: torch_releases-RELEASE.json
            assert "--out" in path.read_text(encoding="utf-8") or "add_out(" in path.read_text(encoding="utf-8"), \
                f"{path.name} writes no results file"


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_every_results_file_names_its_command_machine_and_date(path):
    r = json.loads(path.read_text(encoding="utf-8"))
    script = re.match(r"python (benchmarks/(\w+)\.py)( |$)", r["command"])
    assert script and (REPO / script.group(1)).is_file(), r["command"]
    assert r["benchmark"] == script.group(2) and path.stem.startswith(r["benchmark"]), (path.name, r["benchmark"])
    if r["benchmark"] == "torch_releases":   # one file per release, named by it
        assert path.stem == f"torch_releases-{r['figures']['release']}", path.name
    elif path.stem != r["benchmark"]:   # a second run of the same benchmark names its own file
        assert f"--out benchmarks/results/{path.name}" in r["command"], r["command"]
    assert r["machine"]["cpu"] and r["machine"]["cores"] >= 1 and r["machine"]["torch"], r["machine"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]) and r["commit"], (r["date"], r["commit"])
    assert r["figures"], "no figures"
    for line in r["table"]:
        assert line.startswith("|") and line.endswith("|"), line


def test_every_results_file_is_quoted_and_every_quote_has_its_file():
    texts = [(REPO / page).read_text(encoding="utf-8") for page in PAGES]
    quoted = {name for text in texts for name in CALL.findall(text)}
    assert quoted, "no page quotes a benchmark"
    files = {p.stem for p in RESULTS}
    if any("figures.releases(" in text for text in texts):   # it quotes every torch_releases-RELEASE.json
        quoted |= {name for name in files if name.startswith("torch_releases-")}
    assert quoted - files == set(), f"pages quote benchmarks/results/{sorted(quoted - files)}.json, which is missing"
    assert files - quoted == set(), f"no page quotes {sorted(files - quoted)}"


@pytest.mark.parametrize("page", HAND_CHECKED)
def test_no_measured_figure_is_written_by_hand(page):
    """Outside the generated regions a page names no images/s, milliseconds, speed-up or measured seconds."""
    text = GENERATED.sub("", (REPO / page).read_text(encoding="utf-8"))
    for reference in REFERENCE:
        text = text.replace(reference, "")
    found = [m.group(0) for m in MEASURED.finditer(text)]
    assert not found, f"{page} writes figures by hand (generate them from benchmarks/results/): {found}"


def test_the_machine_is_named_and_a_busy_one_is_said(tmp_path, monkeypatch):
    r = {"command": "python benchmarks/x.py", "date": "2026-11-25", "other_processes_cores": 0.0, "args": {},
         "commit": "abc1234", "calibration": {"matmul_gflops_1_thread": {"start": 30.0, "end": 31.0}},
         "machine": {"cpu": "AMD EPYC", "cores": 2, "memory_gib": 23.5, "gpu": "", "torch": "2.6.0",
                     "virtual": True}, "figures": {"speedup": {"mean": 1.234, "std": 0.05}}, "table": []}
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    (tmp_path / "x.json").write_text(json.dumps(r))
    assert figures.machine_of("x") == "an idle 2-core AMD EPYC VM (24 GiB, no GPU), torch 2.6.0, 2026-11-25"
    assert figures.fill("x", "{f[speedup]:pm2} ({machine})").startswith("1.23 +- 0.05 (an idle 2-core")
    (tmp_path / "x.json").write_text(json.dumps({**r, "other_processes_cores": 0.9}))
    assert figures.machine_of("x").startswith("a busy (other processes used 0.9 cores meanwhile) 2-core")


def test_a_recorder_writes_the_figures_the_command_and_the_load_beside_it(tmp_path):
    """A benchmark run beside another load says so in its file (and so on the page)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import results
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    recorder = results.Recorder("b", argparse.Namespace(out=str(tmp_path / "b.json"), rounds=3, allow_dirty=True))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(2)
        path = recorder.save({"ratio": 1.5}, ["| a |"])
    finally:
        busy.kill()
        busy.wait()
    saved = json.loads(Path(path).read_text())
    assert saved["figures"] == {"ratio": 1.5} and saved["table"] == ["| a |"] and saved["args"] == {"rounds": 3}
    assert saved["command"].startswith("python ") and saved["machine"]["cores"] >= 1
    assert saved["other_processes_cores"] > 0.5, saved["other_processes_cores"]
    assert not list(tmp_path.glob(".*.tmp")), "a temporary file was left"
    # issue 58: a yardstick of the machine's speed at the start and the end of the same run (days compare by it)
    calibration = saved["calibration"]["matmul_gflops_1_thread"]
    assert calibration["start"] > 0 and calibration["end"] > 0, calibration


def test_a_recorder_refuses_a_tree_with_uncommitted_changes_unless_told_and_then_says_so(tmp_path, monkeypatch):
    """Issue 46: a figure names the code it measured. A dirty tree is refused; --allow-dirty (a trial) marks it."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import results
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    monkeypatch.setattr(results, "commit", lambda: "abc1234+changes")
    with pytest.raises(SystemExit, match="uncommitted changes .* --allow-dirty"):
        results.Recorder("b", argparse.Namespace(out=str(tmp_path / "b.json")))
    recorder = results.Recorder("b", argparse.Namespace(out=str(tmp_path / "b.json"), allow_dirty=True))
    saved = json.loads(Path(recorder.save({"ratio": 1.0})).read_text())
    assert saved["commit"] == "abc1234+changes" and "allow_dirty" not in saved["args"]


# Loader and training benchmarks whose figures hold only past the batches made ahead (benchmarks/steady.py)
STEADY = ("student_job", "loader_alone", "imagenet_input", "data_loading", "gpu_peak")
GPU_QUOTES = {"run_on_a_gpu": ("student_job", "gpu_peak")}   # figures.py functions that quote them by name


def quoting_blocks() -> list[tuple[str, str, set[str]]]:
    """(page, generated block, the STEADY benchmarks it quotes) for every cog block of the pages."""
    found = []
    for page in PAGES:
        for block in GENERATED.findall((REPO / page).read_text(encoding="utf-8")):
            names = set(CALL.findall(block)) | {n for fn, ns in GPU_QUOTES.items() if f"figures.{fn}(" in block
                                                for n in ns}
            if names & set(STEADY):
                found.append((page, block, names & set(STEADY)))
    return found


def holds(name: str) -> str:
    """'' when benchmarks/results/NAME.json may be quoted as it stands: measured from a clean commit over a steady
    window of at least 200 steps; else what it lacks."""
    r = json.loads((REPO / "benchmarks" / "results" / f"{name}.json").read_text(encoding="utf-8"))
    lacks = []
    if not r.get("commit") or r["commit"].endswith("+changes"):
        lacks.append(f"a clean commit (it has {r.get('commit')!r})")
    if r.get("steady_steps", 0) < 200:
        lacks.append(f"a steady window of 200 steps (steady_steps {r.get('steady_steps')})")
    return " and ".join(lacks)


def test_the_loader_benchmarks_quoted_come_from_clean_commits_over_steady_windows():
    """A quoted loader or training figure comes from a clean commit and at least 200 steps timed after the
    batches made ahead; a GPU file not re-run since (the GPU is lent by chance) is quoted only beside the words
    "not yet re-run", and a CPU file never so."""
    blocks = quoting_blocks()
    assert {n for _, _, names in blocks for n in names} == set(STEADY), "a STEADY benchmark is no longer quoted"
    for page, block, names in blocks:
        for name in sorted(names):
            lacks = holds(name)
            gpu = json.loads((REPO / "benchmarks" / "results" / f"{name}.json").read_text())["machine"]["gpu"]
            assert not lacks or (gpu and "not yet re-run" in " ".join(block.split())), \
                f"{page} quotes benchmarks/results/{name}.json, which lacks {lacks}: run it again ({block[:200]})"


def test_a_file_that_breaks_the_rules_says_which_and_a_file_that_keeps_them_says_nothing(monkeypatch):
    """Issue 58: a clean commit, three repetitions (where a file records them), a timed window of 200 steps (where it
    times one; a whole-run figure has none) and a calibration figure."""
    from docs import figures
    kept = {"commit": "abc1234", "args": {"rounds": 3}, "calibration": {"matmul_gflops_1_thread": {}},
            "machine": {"cores": 2, "cpu": "AMD EPYC", "virtual": True, "gpu": ""}}
    files = {"kept": kept, "seeds": {**kept, "args": {"seeds": "1,2"}}, "range": {**kept, "args": {"seeds": "301-316"}},
             "old": {**kept, "commit": "abc1234+changes", "args": {"rounds": 1}, "calibration": None}}
    files["old"].pop("calibration")
    files["short"] = {**kept, "args": {"rounds": 5, "steps": 40}}     # 40 training steps a round
    files["steady"] = {**kept, "args": {"rounds": 5, "steps": 20}, "steady_steps": 200}   # the window it recorded
    monkeypatch.setattr(figures, "bench", lambda name: files[name])
    assert figures.caveat("kept") == "" and figures.where("kept") == "a 2-core AMD EPYC VM"
    assert figures.caveat("seeds") == "; to re-run: 2 rounds" and figures.caveat("range") == ""
    assert figures.where("old") == "a 2-core AMD EPYC VM; to re-run: uncommitted code, 1 round, no calibration"
    assert figures.caveat("short") == "; to re-run: a window of 40 steps" and figures.caveat("steady") == ""
    monkeypatch.setitem(figures.RECORDS, "old", "its code is gone")
    assert figures.caveat("old") == "; a record, not re-run (its code is gone): uncommitted code, 1 round, no calibration"
    assert figures.caveat("kept") == ""   # a record that keeps the rules needs no word


def test_every_section_that_quotes_a_file_breaking_the_rules_says_so():
    """Each page section quoting benchmarks/results/NAME.json that lacks a clean commit, three repetitions or a
    calibration figure names what it lacks (figures.caveat, which {where} and {machine} carry) at least once."""
    from docs import figures
    call = re.compile(r"figures\.(?:say|table|bench|chose|noninferiority|fill)\(\[?\"([\w.-]+)\"")
    silent = []
    for page in PAGES:
        for section in re.split(r"^#{1,4} ", (REPO / page).read_text(encoding="utf-8"), flags=re.M):
            names, rendered = set(), ""
            for block in GENERATED.findall(section):
                code, _, out = block.partition("]]] -->")
                names |= set(call.findall(code))
                rendered += " " + out
            flat = " ".join(rendered.split())
            silent += [f"{page}, {section.splitlines()[0][:50]}: {name}" for name in sorted(names)
                       if figures.caveat(name) and figures.caveat(name).strip("; ") not in flat]
    assert silent == [], "\n".join(silent)


def test_a_passage_that_sets_runs_of_different_sittings_side_by_side_says_where_and_when_each_ran():
    """Issue 58: one rank ran at 88, 121, 297 and 113 img/s on four days of "the 2-core VM". A cog block (one
    passage) that quotes several results files of different machines names each machine, and of one machine on
    different days names each day; files of one sitting need neither."""
    pages = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True)
    unsaid, compared = [], 0
    for page in pages.stdout.split():
        for block in GENERATED.findall((REPO / page).read_text(encoding="utf-8")):
            code, _, out = block.partition("]]] -->")
            names = figures.files_read(code)
            compared += len(names) > 1
            unsaid += [f"{page}: {m}" for m in figures.unsaid_sittings(names, out)]
    assert compared >= 3, "the pages no longer quote several files in one passage: is files_read still right?"
    assert unsaid == [], "\n".join(unsaid)


def test_runs_of_different_days_or_machines_are_placed_and_one_sitting_needs_nothing(monkeypatch):
    from docs import figures as f
    vm = {"cores": 2, "cpu": "AMD EPYC", "gpu": ""}
    files = {"mon": {"date": "2026-11-25", "machine": vm}, "mon2": {"date": "2026-11-25", "machine": vm},
             "tue": {"date": "2026-11-26", "machine": vm},
             "gpu": {"date": "2026-11-25", "machine": {**vm, "cores": 16, "gpu": "1 x NVIDIA H200"}}}
    monkeypatch.setattr(f, "bench", lambda name: files[name])
    assert f.unsaid_sittings({"mon", "mon2"}, "0.95 of the link, against 0.81") == []
    assert len(f.unsaid_sittings({"mon", "tue"}, "0.95 of the link, against 0.81")) == 2
    assert len(f.unsaid_sittings({"mon", "tue"}, "0.95 (2026-11-25) of the link, against 0.81")) == 1
    assert f.unsaid_sittings({"mon", "tue"}, "0.95 (2026-11-25), against 0.81 on\n2026-11-26") == []
    assert f.unsaid_sittings({"mon", "gpu"}, "on a 2-core AMD EPYC VM 90 img/s, on an NVIDIA H200 900") == []
    assert len(f.unsaid_sittings({"mon", "gpu"}, "on a 2-core AMD EPYC VM 90 img/s, on a GPU 900")) == 1
    assert f.files_read('figures.say("comm_hooks", x=figures.bench("comm_hooks-auto"), y="nothing")') == \
        {"comm_hooks", "comm_hooks-auto"}
    assert f.files_read("figures.run_on_a_gpu()") == {"student_job", "gpu_peak"}


def test_noninferiority_judges_the_paired_seeds_of_one_or_several_files_against_the_marks(monkeypatch):
    """PowerSGD's study (issue 46): mean paired Acc@1 >= -0.5 and its 90 % lower bound >= -1.0, the paired
    validation loss's 90 % upper bound <= +0.03, >= 0.90 of the unshaped link; a study run in parts pools its seeds."""
    def row(acc, loss, speed):
        return {"figures": {"1gbit/powersgd": {"acc1_vs_none": {"values": acc}, "val_loss_vs_none": {"values": loss},
                                               "of_unshaped": {"values": speed}}}}
    files = {"close": row([-0.2, 0.1, -0.3, 0.0, 0.2, -0.1, -0.4, 0.1], [0.01, -0.01, 0.0, 0.02, -0.02, 0.01, 0.0,
                                                                          0.01], [0.93] * 8),
             "noisy": row([0.0, 0.3, -2.5, 0.6, -0.8, 0.0, 0.3, -0.3], [0.0, 0.02, 0.09, 0.04, -0.04, 0.05, 0.0,
                                                                         0.01], [0.88] * 8)}
    monkeypatch.setattr(figures, "bench", lambda name: files[name])
    close = figures.noninferiority("close", "powersgd")
    assert close["verdict"] == "non-inferior on every mark" and close["seeds"] == 8
    assert close["acc_mean"] == pytest.approx(-0.075) and close["acc_low"] < close["acc_mean"]
    noisy = figures.noninferiority("noisy", "powersgd")
    assert not noisy["ok"]["loss_high"] and not noisy["ok"]["speed"] and noisy["ok"]["acc_mean"]
    assert "upper bound" in noisy["verdict"] and "0.90x" in noisy["verdict"]
    both = figures.noninferiority(["close", "noisy"], "powersgd")
    assert both["seeds"] == 16 and both["acc_mean"] == pytest.approx((close["acc_mean"] + noisy["acc_mean"]) / 2)
    # the study's power: seeds for the lower bound to reach -1.0 at this mean and spread (none under the mark)
    assert noisy["acc_sd"] == pytest.approx(0.9856, abs=1e-3)
    need = noisy["seeds_needed"]
    assert need is not None and 2 < need
    from scipy import stats
    assert stats.t.ppf(0.95, need - 1) * noisy["acc_sd"] / need ** 0.5 <= noisy["acc_mean"] + 1.0
    assert stats.t.ppf(0.95, need - 2) * noisy["acc_sd"] / (need - 1) ** 0.5 > noisy["acc_mean"] + 1.0
    assert figures.seeds_needed(-1.2, 0.5, -1.0) is None

"""``python -m ddp_utils grade``: the instructor's grader. Three hand-ins built from real artefacts (run folders the kit
trained, its report, the lab's solution as student.py) give the right sheet: a good one passes; one whose table had a
figure changed fails on that figure alone; one whose student.py forgets a bucket fails part (c) alone. A bad hand-in
(files missing, JSON broken, no table, a student.py that hangs, crashes or reaches for the kit's solution) is a line of
the sheet, never a crash; bad command-line input exits 2 with a sentence."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ddp_utils.tools import cli, grade
from ddp_utils.tools.handin import compare_cell, figures
from tests.helpers import handins
from tests.helpers.report_runs import fake_run
from tests.helpers.runs import ours_still_running

LAB_LIMIT_S = 120   # --time-limit of every grade that runs the lab's tests here (each takes 5 to 20 s)


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory) -> dict:
    """Real run folders (2 ranks and 1, two short epochs on fake data) and the report `report` wrote of them."""
    parent = tmp_path_factory.mktemp("artefacts")
    runs = handins.train_runs(parent / "runs")
    handins.write_report(runs, parent / "report")
    return {"runs": runs, "report": parent / "report"}


def handin(tmp_path: Path, artefacts: dict, student: str | None = None, rows: dict | None = None) -> Path:
    rows = rows or handins.table_rows(artefacts["runs"])
    return handins.make_handin(tmp_path / "alice", artefacts["runs"], artefacts["report"], student,
                               handins.table_text(rows))


def graded(tmp_path: Path, folder: Path, *flags: str, capsys=None) -> dict:
    """``python -m ddp_utils grade FOLDER --out ... FLAGS`` (in this process: the grader never imports the hand-in);
    the sheet as sheet.json holds it, with ``md`` (sheet.md) and ``seconds``."""
    out = tmp_path / "sheet"
    started = time.monotonic()
    assert cli.main(["grade", str(folder), "--out", str(out), *flags]) == 0
    sheet = json.loads((out / "sheet.json").read_text())
    return {**sheet, "md": (out / "sheet.md").read_text(), "seconds": time.monotonic() - started, "out": out}


def lines(sheet: dict, result: str | None = None, section: str | None = None) -> list[dict]:
    return [line for line in sheet["lines"] if (result is None or line["result"] == result)
            and (section is None or line["section"] == section)]


def part(sheet: dict, letter: str) -> dict:
    [line] = [line for line in sheet["lines"] if line["item"] == f"part ({letter})"]
    return line


# -- the three prepared hand-ins ---------------------------------------------------------------------------------
HIDDEN = '''"""The instructor's own tests, kept out of the handout: beside the lab's, against the same student.py."""
import inspect

from build_ddp.adapter import implementation


def test_part_c_bucket_ddp_takes_the_bucket_size_by_keyword():
    assert "bucket_bytes" in inspect.signature(implementation().BucketDDP).parameters


def test_the_file_says_what_it_is():
    assert implementation().__doc__
'''


@pytest.mark.slow
def test_a_good_hand_in_passes_every_check_with_the_instructors_hidden_tests_too(tmp_path, artefacts):
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "test_hidden.py").write_text(HIDDEN)
    sheet = graded(tmp_path, handin(tmp_path, artefacts, handins.student_from_reference()), "--world-sizes", "2",
                   "--tests", str(tmp_path / "hidden"), "--time-limit", str(LAB_LIMIT_S))
    assert sheet["verdict"] == "pass", lines(sheet, "fail")
    assert [part(sheet, p)["result"] for p in "abcdf"] == ["pass"] * 5
    tests = sheet["lab"]["tests"]
    assert tests and all(test["outcome"] == "passed" for test in tests.values())
    assert all(name.endswith("[2-ranks]") for name in tests if name.startswith("test_build_ddp::"))
    assert tests["test_hidden::test_part_c_bucket_ddp_takes_the_bucket_size_by_keyword"]["part"] == "c"
    assert [line["why"] for line in lines(sheet) if line["item"] == "other tests"] == ["1 test(s) passed"]
    assert {line["item"] for line in lines(sheet, "pass", "table")} == {"DDP", "single"}
    assert {line["item"] for line in lines(sheet, "pass", "sources")} == {"runs/ddp", "runs/single", "report/results.md"}
    assert "**PASS**" in sheet["md"] and (sheet["out"] / "lab-tests.txt").is_file()


@pytest.mark.slow
def test_a_figure_changed_in_the_table_is_flagged_and_is_the_only_failure(tmp_path, artefacts):
    rows = handins.table_rows(artefacts["runs"])
    measured = json.loads((artefacts["runs"]["ddp"] / "results.json").read_text())["images_per_s"]
    rows["DDP"]["images/s (global)"] = f"{measured * 1.15:.0f}"   # a student who rounded up his own speed
    sheet = graded(tmp_path, handin(tmp_path, artefacts, handins.student_from_reference(), rows),
                   "--world-sizes", "2", "-k", "part_a", "--time-limit", str(LAB_LIMIT_S))
    assert sheet["verdict"] == "fail"
    [wrong] = lines(sheet, "fail")
    assert wrong["item"] == "DDP: images/s (global)"
    assert f"the table says {measured * 1.15:.0f}, the run folder gives {measured:.6g}" in wrong["why"]
    assert "| DDP: images/s (global) | fail |" in sheet["md"]
    assert part(sheet, "a")["result"] == "pass" and part(sheet, "c")["result"] == "note"   # not selected by -k


@pytest.mark.slow
def test_a_student_py_with_a_forgotten_bucket_fails_part_c_and_nothing_else(tmp_path, artefacts):
    sheet = graded(tmp_path, handin(tmp_path, artefacts, handins.student_with_forgotten_bucket()),
                   "--world-sizes", "2", "--time-limit", str(LAB_LIMIT_S))
    assert sheet["verdict"] == "fail"
    assert [line["item"] for line in lines(sheet, "fail")] == ["part (c)"]
    assert "2 of 2 failed" in part(sheet, "c")["why"] and "never all-reduced" in part(sheet, "c")["why"]
    assert [part(sheet, p)["result"] for p in "abdf"] == ["pass"] * 4
    failed = [name for name, test in sheet["lab"]["tests"].items() if test["outcome"] == "failed"]
    assert len(failed) == 2 and all("test_part_c_" in name and "[2-ranks]" in name for name in failed)


# -- bad hand-ins: a line each, never a crash ------------------------------------------------------------------
def test_a_hand_in_missing_every_file_gets_a_line_for_each_and_no_lab_run(tmp_path):
    (tmp_path / "bob").mkdir()
    sheet = graded(tmp_path, tmp_path / "bob")
    missing = {line["item"] for line in lines(sheet, "fail", "hand-in") if line["why"].startswith("missing")}
    assert missing >= {"results-table.md", "answers.md", "report/results.md", "report/iperf3.txt", "student.py",
                       "pytest-log.txt", "bench/", "runs/"}
    assert lines(sheet, "fail", "lab tests")[0]["why"] == "student.py is missing: the lab's tests were not run"
    assert sheet["verdict"] == "fail" and sheet["lab"] == {}


def test_broken_json_a_table_that_does_not_parse_and_a_foreign_results_file_each_get_a_line(tmp_path):
    folder = tmp_path / "carol"
    fake_run(folder / "runs" / "ddp", world_size=2, train_time_s=60.0)
    fake_run(folder / "runs" / "single", world_size=1, train_time_s=100.0)
    fake_run(folder / "runs" / "odd", world_size=1, train_time_s=100.0)
    (folder / "runs" / "ddp" / "results.json").write_text('{"acc1": 50.0, ')   # cut off mid-write
    (folder / "runs" / "odd" / "results.json").write_text("[1, 2, 3]")         # JSON, but not a run's results
    (folder / "results-table.md").write_text("DDP: 1.9x faster, single: slower. (No table, sorry.)\n")
    sheet = graded(tmp_path, folder)
    why = {line["item"]: line["why"] for line in lines(sheet, "fail")}
    assert "is not valid JSON" in why["runs/ddp"] and "results.json" in why["runs/ddp"]
    assert why["runs/odd"].startswith("not a finished run folder")
    assert why["results-table.md"].startswith("holds no Markdown table whose first column is 'run'")
    assert "runs/single" not in {line["item"] for line in lines(sheet, "fail", "hand-in")}   # it loaded


def test_a_figure_that_log_txt_prints_otherwise_than_results_json_is_flagged(tmp_path):
    folder = tmp_path / "dave"
    run = fake_run(folder / "runs" / "single", world_size=1, train_time_s=100.0, acc1=50.0, acc5=90.0, loss=1.5)
    results = json.loads((run / "results.json").read_text())
    results["history"][-1]["val"].update(acc1=50.0, acc5=90.0, loss=1.5)   # the history agrees; the log will not
    (run / "results.json").write_text(json.dumps(results))
    (run / "log.txt").write_text(f"global batch 64 = 64 per rank x 1 rank(s); lr {results['lr']:.4g} (not scaled);\n"
                                 "epoch 2/2: train loss 1.7000 acc1 40.00 | val loss 1.5000 acc1 48.00 acc5 90.00\n")
    sheet = graded(tmp_path, folder)
    sources = [line["why"] for line in lines(sheet, "fail", "sources")]
    assert sources == ["acc1: results.json 50.0, log.txt's last epoch line 48.00"]


@pytest.mark.slow
def test_a_student_py_that_hangs_at_import_is_stopped_at_the_time_limit(tmp_path, artefacts):
    folder = handin(tmp_path, artefacts, "import time\n\ntime.sleep(3600)   # my all-reduce waits for ever\n")
    sheet = graded(tmp_path, folder, "--time-limit", "10")
    [bound] = [line for line in lines(sheet, "fail") if line["item"] == "time bound"]
    assert bound["why"] == "still running after 10 s (--time-limit), stopped before any test ended: student.py hung " \
                           "at import?"
    assert [part(sheet, p)["why"] for p in "abcdf"] == ["no test of it ran"] * 5
    assert sheet["lab"]["timed_out"] and sheet["seconds"] < 10 + 60   # the grader's own start and the report's checks
    work = sheet["lab"]["command"].split("--junitxml=")[1].split("/junit.xml")[0]
    assert not ours_still_running(work), "the stopped run left processes behind"


@pytest.mark.slow
def test_a_student_py_that_crashes_at_import_gets_its_error_as_a_line(tmp_path, artefacts):
    folder = handin(tmp_path, artefacts, 'raise RuntimeError("half-finished: see you after the deadline")\n')
    sheet = graded(tmp_path, folder, "-k", "part_a", "--time-limit", str(LAB_LIMIT_S))
    [collection] = [line for line in lines(sheet, "fail") if line["item"] == "collection"]
    assert "RuntimeError: half-finished: see you after the deadline" in collection["why"]
    assert part(sheet, "a")["why"] == "no test of it ran"


@pytest.mark.slow
def test_a_student_py_that_reaches_for_the_kits_solution_is_named_and_refused_in_the_run(tmp_path, artefacts):
    """Read as text: the import is named. Run: the kit's lab folder (its solution) cannot be imported there."""
    kit = Path(grade.KIT)
    cheat = f"import sys\n\nsys.path.insert(0, {str(kit)!r})\nfrom lab.build_ddp.solution.reference import *\n"
    sheet = graded(tmp_path, handin(tmp_path, artefacts, cheat), "-k", "part_a", "--time-limit", str(LAB_LIMIT_S))
    [named] = lines(sheet, "fail", "student.py")
    assert named["item"] == "line 4" and named["why"].startswith("imports lab.build_ddp.solution.reference")
    [collection] = [line for line in lines(sheet, "fail") if line["item"] == "collection"]
    assert "the grader refuses the kit's lab files" in collection["why"]


def test_student_py_may_import_torch_and_the_standard_library_but_not_the_kit_or_torchs_ddp():
    assert grade.forbidden(handins.SOLUTION.read_text()) == []
    assert grade.forbidden((handins.LAB / "student.py").read_text()) == []
    found = grade.forbidden("import ddp_utils.own_ddp\nfrom build_ddp import adapter\n"
                            "from torch.nn.parallel import DistributedDataParallel\nexec('x = 1')\n"
                            "open('../solution/reference.py')\n")
    assert [f.split(":")[0] for f in found] == ["line 1", "line 2", "line 3", "line 4", "line 5"]
    assert "torch's DistributedDataParallel" in found[2] and "exec()" in found[3] and "solution" in found[4]


# -- rounding, selection, the command line ---------------------------------------------------------------------
def test_a_figure_agrees_within_the_rounding_the_table_printed():
    assert compare_cell("speedup", "1.78x (2.00x)", [("speed-up", 1.784), ("predicted", 1.996)]) == []
    assert compare_cell("speedup", "1.78x", [("speed-up", 1.786), ("predicted", None)])
    assert compare_cell("wall_time", "0:00:29", [("wall time", 29.4)]) == []
    assert compare_cell("wall_time", "1h 15m", [("wall time", 4487.0)]) == []   # 1:14:47 rounded to the minute
    assert compare_cell("wall_time", "1h 14m", [("wall time", 4487.0)])          # ... not cut off
    assert compare_cell("images_per_s", "about 300", [("images/s", 310.0)]) == []
    assert compare_cell("images_per_s", "300", [("images/s", 310.0)])
    assert figures("lr", "0.1 x 1000/256 = 0.3906")[0][:2] == (0.3906, 0.5e-4)
    assert compare_cell("acc1", "", [("Acc@1", 97.21)]) == ["Acc@1: not filled in; the run folder gives 97.21"]


def test_world_sizes_and_k_select_the_lab_tests_keeping_tests_without_ranks():
    options = grade.Options(world_sizes=(2, 3), keyword="part_c")
    assert grade.selection(options) == ["-k", "([2-ranks] or [3-ranks] or not -ranks]) and (part_c)"]
    assert grade.selection(grade.Options()) == []


@pytest.mark.parametrize("flags, says", [
    (["nowhere"], "is not a folder"),
    (["HANDIN", "--tests", "missing.py"], "--tests missing.py: there is no such file or folder"),
    (["HANDIN", "--out", "FULL"], "give a new or an empty folder"),
    (["HANDIN", "--time-limit", "0"], "--time-limit 0: give the seconds"),
])
def test_bad_command_line_input_exits_2_with_a_sentence_and_writes_nothing(tmp_path, capsys, flags, says):
    (tmp_path / "HANDIN").mkdir()
    (tmp_path / "FULL").mkdir()
    (tmp_path / "FULL" / "mine.txt").write_text("keep me")
    flags = [str(tmp_path / f) if f in ("HANDIN", "FULL", "nowhere", "missing.py") else f for f in flags]
    assert cli.main(["grade", *flags]) == 2
    assert says.replace("missing.py", str(tmp_path / "missing.py")) in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FULL", "HANDIN"]

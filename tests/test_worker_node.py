"""The worker node is not a black box: progress and the global lines on every rank, ``--resume auto``
after both ranks were killed, and what a run cost."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest
import torch

from ddp_utils.robust import autoresume
from ddp_utils.tools import report
from ddp_utils.settings import Settings
from ddp_utils.concerns import money
from tests.helpers.procs import REPO, base_env, describe, free_port, popen, stop
from tests.helpers.runs import run_ranks, train_cmd, weights


def epoch_lines(output: str) -> list[str]:
    """Each epoch's two lines (losses and accuracies; speed and where the time went)."""
    return re.findall(r"^epoch \d+/\d+: train loss.*\n  .*$", output, re.M)


# -- progress on every rank ----------------------------------------------------------------------
@pytest.mark.slow
def test_rank_1_shows_its_progress_bar_and_the_same_global_lines_as_rank_0(tmp_path):
    ranks = run_ranks(tmp_path, "bar", 2, "--epochs", "2", "--max-steps-per-epoch", "4", "--batch-size", "8",
                      "--progress", "bar")
    assert "rank 1 epoch 1/2" in ranks[1].output and "rank 1 epoch 2/2" in ranks[1].output   # its own bar
    assert len(epoch_lines(ranks[1].output)) == 2
    assert epoch_lines(ranks[1].output) == epoch_lines(ranks[0].output)   # global numbers, the same text


@pytest.mark.slow
def test_piped_output_of_rank_1_has_one_line_per_epoch_and_the_log_points_with_steps(tmp_path):
    ranks = run_ranks(tmp_path, "steps", 2, "--epochs", "2", "--max-steps-per-epoch", "4", "--batch-size", "8",
                      "--progress", "steps", "--log-every", "2")
    out = ranks[1].output
    assert "\r" not in out
    assert "epoch 1/2 step 2/4: loss" in out and "epoch 2/2 step 4/4: loss" in out
    assert len(epoch_lines(out)) == 2
    assert not (tmp_path / "steps" / "rank1").exists()   # printing, not writing: rank 0 alone writes files


# -- resume auto ---------------------------------------------------------------------------------
# Killed after epoch 1, resumed for epoch 2: what the resume must restore is all in place at the first checkpoint
# (16 px: a quarter of the 32 px compute; the check is bit-exactness, not accuracy)
STEPS = ["--epochs", "2", "--max-steps-per-epoch", "12", "--batch-size", "8", "--arch", "convnet_gn", "--image-size",
         "16"]


def start_and_kill_after_first_checkpoint(run_dir, port, *extra) -> None:
    """Both ranks started, then killed (SIGKILL, no goodbye) as soon as rank 0 saved epoch 1."""
    procs = [popen(train_cmd(run_dir, r, 2, port, *STEPS, *extra), cwd=REPO, env=base_env(),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "last.pt").exists():
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            assert all(p.poll() is None for p in procs), "a rank ended before the first checkpoint"
            time.sleep(0.05)
    finally:
        stop(procs)
    assert not (run_dir / "results.json").exists(), "the run finished before it was killed"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [pytest.param([], marks=pytest.mark.floor), ["--accumulate", "5"],
                                   ["--comm", "localsgd", "--average-every", "5", "--localsgd-warmup-steps", "3"],
                                   pytest.param(["--comm", "powersgd", "--powersgd-warmup-steps", "3", "--bucket-mb",
                                                 "0.02"], marks=pytest.mark.floor),
                                   ["--comm", "powersgd", "--powersgd-warmup-steps", "12", "--bucket-mb", "0.02"],
                                   ["--comm", "auto", "--comm-auto-share", "0.99"]],
                         ids=["every-step", "accumulate-5", "localsgd", "powersgd", "powersgd-starts-at-the-resume",
                              "auto"])
def test_running_the_same_commands_again_with_resume_auto_continues_and_ends_as_if_never_stopped(tmp_path, extra):
    # accumulate 5 of 12 batches an epoch: optimizer steps of 5, 5 and 2 batches, the last one short;
    # localsgd: 3 DDP steps, then local ones, the weights averaged every 5 and (with the momentum) at each
    # epoch's end, so the first checkpoint holds every rank's state;
    # powersgd: its error feedback and warm start in the checkpoint, by parameter, since the resumed run's new DDP
    # groups its buckets differently at its first step (small buckets: several, regrouped after that step);
    # starting at the resume (12 warm-up steps, killed after the first epoch's 12): its random start as well;
    # auto: the resumed run keeps the hook the run chose at its start, whatever its own link probe says (a share
    # of 0.99: the exact all-reduce on loopback even on a loaded machine, so that the straight run chooses the same)
    run_ranks(tmp_path, "straight", 2, *STEPS, *extra)
    start_and_kill_after_first_checkpoint(tmp_path / "killed", free_port(), *extra)
    again = run_ranks(tmp_path, "killed", 2, *STEPS, *extra, "--resume", "auto")
    assert "resume auto: continuing the unfinished run in" in again[0].output, describe(again)
    results = json.loads((tmp_path / "killed" / "results.json").read_text())
    assert results["resumed_from"].endswith("last.pt")
    if "auto" in extra:
        assert results["comm_reason"].startswith("comm=auto: ") and "as this run chose when it started" in \
            results["comm_reason"], results["comm_reason"]
        assert torch.load(tmp_path / "killed" / "last.pt", weights_only=True)["comm"]["choice"] == results["comm"]
    straight, resumed = weights(tmp_path / "straight" / "last.pt"), weights(tmp_path / "killed" / "last.pt")
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


@pytest.mark.slow
def test_resume_auto_after_a_finished_run_starts_a_new_one_beside_it(tmp_path):
    first = run_ranks(tmp_path, "done", 1, "--epochs", "1", "--max-steps-per-epoch", "2", "--resume", "auto")
    assert "resume auto: no unfinished run" in first[0].output
    assert json.loads((tmp_path / "done" / "results.json").read_text())["resumed_from"] is None
    second = run_ranks(tmp_path, "done", 1, "--epochs", "1", "--max-steps-per-epoch", "2", "--resume", "auto")
    assert "done: finished; starting a new run, in" in second[0].output, describe(second)
    siblings = [p for p in tmp_path.iterdir() if p.name.startswith("done-")]
    assert len(siblings) == 1 and (siblings[0] / "results.json").exists()


def test_resume_auto_finds_the_newest_unfinished_run_with_the_same_settings(tmp_path):
    def folder(name, age, **changes):
        f = tmp_path / name
        f.mkdir()
        (f / "settings.json").write_text(Settings(dataset="fake", **changes).to_json())
        (f / "last.pt").write_bytes(b"x")
        os.utime(f / "last.pt", (time.time() - age, time.time() - age))
        return f
    folder("old", 100)
    newest = folder("new", 10)
    folder("other-lr", 1, lr=0.5)
    finished = folder("finished", 0)
    (finished / "results.json").write_text("{}")
    path, why = autoresume.find_resume(Settings(dataset="fake", run_dir=str(tmp_path / "fresh-20260101")))
    assert path == str(newest / "last.pt") and "continuing" in why
    # none to continue: the runs passed over, a short line each (one long line wrapped mid-word in a notebook)
    (newest / "results.json").write_text("{}")
    (tmp_path / "old" / "results.json").write_text("{}")
    path, why = autoresume.find_resume(Settings(dataset="fake", run_dir=str(tmp_path / "fresh-20260101")))
    assert path is None and why.splitlines() == [
        f"no unfinished run with these settings in {tmp_path}/; starting a new run",
        "  not continued: finished (finished)", "  not continued: other-lr (other settings: lr=0.5)",
        "  not continued: new (finished)"]   # the newest three


# -- cost ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def priced(tmp_path_factory):
    """A two-rank run on this machine (a rehearsal) with a price per node-hour."""
    tmp_path = tmp_path_factory.mktemp("priced")
    run_ranks(tmp_path, "priced", 2, "--epochs", "2", "--max-steps-per-epoch", "2", "--price-per-hour", "3.6")
    return tmp_path


@pytest.mark.slow
def test_a_price_per_node_hour_turns_wall_time_into_the_cost_of_the_run_and_of_each_epoch(priced):
    tmp_path = priced
    run_ranks(tmp_path, "free", 1, "--epochs", "2", "--max-steps-per-epoch", "2")
    priced = json.loads((tmp_path / "priced" / "results.json").read_text())
    assert priced["nodes"] == 1   # two ranks on one machine: one machine to pay for
    assert priced["cost"] == pytest.approx(priced["wall_time_s"] / 3600 * 1 * 3.6)
    assert priced["cost_per_epoch"] == pytest.approx(priced["cost"] / 2)
    assert json.loads((tmp_path / "free" / "results.json").read_text())["cost"] is None   # nothing assumed
    table = report.results_table([tmp_path / "priced", tmp_path / "free"])
    assert "cost (per epoch)" in table.splitlines()[0]
    assert f"{money(priced['cost'])} ({money(priced['cost_per_epoch'])})" in table and "| n/a |" in table
    log = (tmp_path / "priced" / "log.txt").read_text()
    assert "its 2 ranks shared 1 machine(s): a rehearsal, priced as what it used" in log


def test_costs_keep_three_significant_digits_so_a_short_run_is_not_0_000():
    assert [money(x) for x in (0.000123, 0.0456, 0.526, 12.345, 0.0)] == ["0.000123", "0.0456", "0.526", "12.35",
                                                                          "0.00"]


@pytest.mark.slow
def test_results_hold_the_start_up_that_wall_time_leaves_out(priced):
    """Homework question 1 asks where the time besides training went: joining and the start of training are figures."""
    results = json.loads((priced / "priced" / "results.json").read_text())
    assert 0 < results["join_s"] < 60 and 0 < results["startup_s"] < 60, results
    first = results["history"][0]["train"]["first_step_s"]
    assert 0 < first <= results["startup_s"]
    assert re.search(r"start-up: [\d.]+ s from the start of training to the end of its first step,\n  besides "
                     r"[\d.]+ s to join the process group", (priced / "priced" / "log.txt").read_text())


@pytest.mark.slow
def test_no_cost_column_without_a_price(tmp_path):
    run_ranks(tmp_path, "free", 1, "--epochs", "1", "--max-steps-per-epoch", "2")
    assert "cost" not in report.results_table([tmp_path / "free"]).splitlines()[0]

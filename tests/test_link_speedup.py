"""benchmarks/link_speedup.py's record: the link probe's prediction against the measured speed-up, round by round
(issue 46, part 7: within 15 % in each round on both links). The benchmark itself needs root and minutes: these
tests hold the shape of what it writes, from made-up rounds."""
from __future__ import annotations

import importlib
import sys

import pytest

from tests.helpers.procs import REPO


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, f"{REPO}/benchmarks")   # as `python benchmarks/link_speedup.py` does (its results.py)
    try:
        yield importlib.import_module("link_speedup")
    finally:
        sys.path.remove(f"{REPO}/benchmarks")


def run_figures(comm: str, predicted: float | None, measured: float) -> dict:
    return {"img_s": 100.0, "data_s": 10.0, "compute_s": 70.0, "comm_s": 20.0, "idle_s": 0.0, "in_flight": 30.0,
            "probe_ms": 200.0, "train_ms": 210.0, "link": 0.9, "predicted": predicted, "comm": comm,
            "loader_ms": 20.0, "measured": measured}


def test_each_round_records_per_link_the_comm_the_predicted_and_measured_speed_up_and_whether_within_15(bench):
    unshaped = [run_figures("none", 1.50, 1.45), run_figures("bf16", 1.40, 1.50)]
    shaped = [run_figures("powersgd", 1.20, 1.00), run_figures("powersgd", 1.10, 1.00)]
    rounds = bench.per_round(unshaped, shaped)
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert set(r) == {"round", "unshaped", "shaped"}
        for link in ("unshaped", "shaped"):
            assert set(r[link]) == {"comm", "predicted", "measured", "error", "within_15"}
    assert rounds[0]["shaped"] == {"comm": "powersgd", "predicted": 1.20, "measured": 1.00,
                                   "error": pytest.approx(0.20), "within_15": False}
    assert rounds[1]["shaped"]["within_15"] and rounds[0]["unshaped"]["within_15"]
    assert rounds[1]["unshaped"]["comm"] == "bf16" and rounds[1]["unshaped"]["error"] == pytest.approx(1.4 / 1.5 - 1)


def test_medians_keep_the_comm_in_words(bench):
    m = bench.medians([run_figures("none", 1.5, 1.4), run_figures("none", 1.7, 1.6), run_figures("none", 1.6, 1.5)])
    assert m["comm"] == "none" and m["predicted"] == 1.6 and m["measured"] == 1.5
    mixed = bench.medians([run_figures("none", 1.5, 1.4), run_figures("bf16", 1.5, 1.4)])
    assert mixed["comm"] == "none/bf16"   # auto chose differently in some round: said, not hidden
    assert bench.medians([run_figures("none", None, 1.0)])["predicted"] is None   # the 1-rank run predicts nothing


class Parsed(Exception):
    """Stops the benchmark once its arguments are read."""


def test_five_rounds_and_comm_auto_by_default(bench, monkeypatch):
    def recorder(name, args):
        raise Parsed(args)
    monkeypatch.setattr(bench, "Recorder", recorder)
    monkeypatch.setattr(sys, "argv", ["link_speedup.py", "--allow-dirty"])
    with pytest.raises(Parsed) as parsed:
        bench.main()
    args = parsed.value.args[0]
    assert args.rounds == 5 and args.comm == "auto"   # the 2-rank runs train as comm=auto chooses

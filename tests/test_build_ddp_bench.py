"""lab/build_ddp/bench.py, part (e) of the lab: the alpha-beta fit finds the alpha and beta it was given, and its
rounds' fits give their spread; figures are medians of rounds with their range, and two whose ranges overlap are
said to be within each other's spread;
``collectives`` writes its rows, fit and figure, and stops, naming the size, at a ring that sums wrong;
``step`` trains each chosen DDP and writes one table of them, stops its ranks on Ctrl-C, and says that --hosts
netns needs root. The processes run the kit's solution (BUILD_DDP=reference) on tiny sizes and a few steps."""
from __future__ import annotations

import importlib.util
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.procs import REPO, base_env

BENCH = Path(REPO) / "lab" / "build_ddp" / "bench.py"
LIMIT_S = 240   # each command; a few seconds to a minute on the 2-core CI machine, four times that beside other tests


def load_bench():
    """bench.py as a module, without leaving its sys.path entries (lab/build_ddp: adapter.py, conftest.py) here."""
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("build_ddp_bench", BENCH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


def bench(*args: str, implementation: str = "reference") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=REPO, env=base_env(BUILD_DDP=implementation),
                          capture_output=True, text=True, timeout=LIMIT_S)


def test_the_fit_finds_alpha_and_beta_from_times_of_every_size():
    b = load_bench()
    sizes = b.sizes(256)
    assert sizes[0] == 4 * 2**10 and sizes[-1] == 256 * 2**20 and all(y == 4 * x for x, y in zip(sizes, sizes[1:]))
    alpha, beta = 50e-6, 1 / 2e9   # 50 us a message, 2 GB/s
    exact = [alpha + n * beta for n in sizes]
    assert b.fit_alpha_beta(sizes, exact) == pytest.approx((alpha, beta), rel=1e-9)
    # +-5 % noise, alternating: plain least squares would miss alpha by far more than the small times' size
    noisy = [t * (1.05 if i % 2 else 0.95) for i, t in enumerate(exact)]
    fitted_alpha, fitted_beta = b.fit_alpha_beta(sizes, noisy)
    assert fitted_alpha == pytest.approx(alpha, rel=0.1) and fitted_beta == pytest.approx(beta, rel=0.1)
    # a ring of 4: 6 messages of a quarter of the tensor
    assert b.ring_prediction(4e6, 4, alpha, beta) == pytest.approx(6 * (alpha + 1e6 * beta))
    assert b.busbw(1e9, 4, 1.0) == pytest.approx(1.5)


def test_the_fit_never_gives_a_negative_alpha():
    b = load_bench()
    sizes = b.sizes(16)
    alpha, beta = b.fit_alpha_beta(sizes, [n / 1e9 * (0.9 if n < 2**20 else 1.0) for n in sizes])
    assert alpha == 0.0 and beta > 0


def test_rounds_give_each_figure_a_median_and_a_range_and_overlapping_ranges_are_not_ranked():
    """Issue 56: three 8-second runs gave alphas 2.5x apart, and bench.py printed medians only. A figure is now
    the median of its rounds with their range, and two figures whose ranges overlap are not told apart."""
    b = load_bench()
    assert b.spread([3.0, 1.0, 2.0, 10.0, 2.5]) == (2.5, 1.0, 10.0)
    assert b.shown([0.001, 0.002, 0.003], 1e3) == "2 (1-3)"
    assert b.within([1.0, 2.0], [1.9, 3.0]) and not b.within([1.0, 2.0], [2.1, 3.0])
    assert b.compared([1.0, 2.0], [1.5, 3.0]) == "within each other's spread"
    assert b.compared([4.0, 4.4, 5.0], [1.9, 2.0, 2.2]) == "2.20x, beyond the spread"
    rows = b.step_rows({"a": [{"step_ms": 10.0, "compute_ms": 5.0, "comm_ms": 4.0, "comm_share": 40.0, "img_s": 60.0},
                              {"step_ms": 12.0, "compute_ms": 5.5, "comm_ms": 5.0, "comm_share": 42.0, "img_s": 50.0},
                              {"step_ms": 11.0, "compute_ms": 6.0, "comm_ms": 4.5, "comm_share": 41.0, "img_s": 55.0}],
                        "ddp": [{"step_ms": 11.5, "compute_ms": 5.0, "comm_ms": 3.0, "comm_share": 26.0, "img_s": 52.0},
                                {"step_ms": 13.0, "compute_ms": 5.0, "comm_ms": 3.1, "comm_share": 24.0, "img_s": 46.0},
                                {"step_ms": 12.5, "compute_ms": 5.0, "comm_ms": 3.2, "comm_share": 25.0, "img_s": 48.0}],
                        "c64": [{"step_ms": 20.0, "compute_ms": 5.0, "comm_ms": 9.0, "comm_share": 45.0, "img_s": 30.0},
                                {"step_ms": 21.0, "compute_ms": 5.0, "comm_ms": 9.1, "comm_share": 43.0, "img_s": 29.0},
                                {"step_ms": 22.0, "compute_ms": 5.0, "comm_ms": 9.2, "comm_share": 42.0, "img_s": 28.0}]}, 30)
    a = rows[0]
    assert a["step_ms"] == 11.0 and a["step_ms_range"] == [10.0, 12.0] and a["step_ms_rounds"] == [10.0, 12.0, 11.0]
    assert b.step_summary(rows) == ("fastest step: (a) allreduce_gradients; torch DDP, 25 MB: within its spread; "
                                    "(c) BucketDDP, 64 MB: 1.91x, beyond the spread")


def test_the_rounds_fits_give_alpha_and_beta_their_spread_and_the_prediction_its_range():
    b = load_bench()
    sizes = b.sizes(64)
    truth = [(40e-6, 1 / 2e9), (60e-6, 1 / 1.5e9), (50e-6, 1 / 1.8e9)]   # three rounds of a drifting machine
    rows = [{"bytes": n, "p2p_s_rounds": [a + n * beta for a, beta in truth]} for n in sizes]
    fit = b.fit_with_spread(rows, world=2)
    assert sorted(fit["alpha_us_rounds"]) == pytest.approx([40, 50, 60], rel=1e-6)
    assert sorted(fit["bandwidth_gbs_rounds"]) == pytest.approx([1.5, 1.8, 2.0], rel=1e-6)
    assert 40 <= fit["alpha_us"] <= 60 and 1.5 <= fit["bandwidth_gbs"] <= 2.0
    for row in rows:   # the ring's prediction of each round's fit: 2 (N - 1) (alpha + n / N beta)
        assert sorted(row["predicted_ring_s_rounds"]) == pytest.approx(
            sorted(b.ring_prediction(row["bytes"], 2, a, beta) for a, beta in truth), rel=1e-6)


def test_step_on_netns_hosts_says_it_needs_root(monkeypatch, capsys, tmp_path):
    b = load_bench()
    monkeypatch.setattr(b.os, "geteuid", lambda: 1000)
    assert b.main(["step", "--hosts", "netns", "--out", str(tmp_path / "out")]) == 1
    assert "needs root: run it with sudo" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_folder_holding_files_is_never_written_to(capsys, tmp_path):
    (tmp_path / "mine.txt").write_text("mine")
    assert load_bench().main(["collectives", "--out", str(tmp_path)]) == 1
    assert "already holds files" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


@pytest.mark.slow
def test_collectives_writes_its_rows_fit_and_figure(tmp_path):
    out = tmp_path / "out"
    done = bench("collectives", "--ranks", "2", "--max-mib", "4", "--repeat", "2", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((out / "collectives.json").read_text())
    assert [row["bytes"] for row in record["rows"]] == [4096 * 4**k for k in range(6)]
    for row in record["rows"]:
        for key in ("ring_s", "all_reduce_s", "p2p_s", "predicted_ring_s", "ring_busbw_gbs"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        for key in ("ring_s", "all_reduce_s", "p2p_s"):   # two rounds each, their median and range
            rounds = row[f"{key}_rounds"]
            assert len(rounds) == 2 and row[f"{key}_range"] == [min(rounds), max(rounds)], (key, row)
            assert row[key] == pytest.approx(sum(rounds) / 2)
        assert row["ring_vs_all_reduce"] in done.stdout and row["ring_vs_predicted"] in done.stdout
    assert record["fit"]["alpha_s"] >= 0 and record["fit"]["bandwidth_gbs"] > 0 and record["repeat"] == 2
    assert len(record["fit"]["alpha_us_rounds"]) <= 2 and "ring against dist.all_reduce: " in done.stdout
    assert (out / "collectives.md").read_text().splitlines()[0].startswith("alpha-beta fit")
    assert record["ranks"] == 2 and record["backend"] == "gloo" and record["implementation"].endswith("reference.py")
    assert (out / "collectives.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 64 KiB |" in done.stdout and "alpha-beta fit" in done.stdout


WRONG_RING = """
from build_ddp import adapter
solution = adapter.solution()
broadcast_parameters, allreduce_gradients = solution.broadcast_parameters, solution.allreduce_gradients
OverlapDDP, BucketDDP = solution.OverlapDDP, solution.BucketDDP

def ring_all_reduce(tensor):   # right up to 4 KiB, one value off from 16 KiB on
    solution.ring_all_reduce(tensor)
    if tensor.numel() >= 4096:
        tensor[-1] += 1
    return tensor
"""


@pytest.mark.slow
def test_collectives_stops_at_a_wrong_ring_and_names_the_size(tmp_path):
    wrong = tmp_path / "wrong_ring.py"
    wrong.write_text(WRONG_RING)
    out = tmp_path / "out"
    done = bench("collectives", "--max-mib", "0.0625", "--out", str(out), implementation=str(wrong))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ring_all_reduce gave a wrong sum at 16 KiB" in done.stderr, done.stderr
    assert not (out / "collectives.json").exists()


@pytest.mark.slow
def test_step_writes_one_table_of_every_variant_and_traces_part_a(tmp_path):
    out = tmp_path / "out"
    done = bench("step", "--hosts", "local", "--steps", "3", "--variants", "a,c1,ddp", "--repeat", "1",
                 "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((out / "step.json").read_text())
    assert [row["variant"] for row in record["rows"]] == ["a", "c1", "ddp"]
    for row in record["rows"]:
        assert row["steps"] == 3 and row["step_ms"] > 0 and row["img_s"] > 0, row
        assert 0 <= row["comm_share"] <= 100 and row["compute_ms"] < row["step_ms"], row
    table = (out / "step.md").read_text()
    for name in ("(a) allreduce_gradients", "(c) BucketDDP, 1 MB", "torch DDP, 25 MB"):
        assert f"| {name} |" in table and f"| {name} |" in done.stdout
    assert sorted(p.name for p in (out / "runs" / "a" / "profile").iterdir()) == ["rank0.pt.trace.json",
                                                                                 "rank1.pt.trace.json"]
    assert "ui.perfetto.dev" in done.stdout and not list(out.glob("runs/*/*.pt"))


@pytest.mark.slow
def test_ctrl_c_during_step_stops_every_rank(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(BENCH), "step", "--variants", "a", "--steps", "50", "--out", str(out)],
                            cwd=REPO, env=base_env(BUILD_DDP="reference"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob("runs/a/log.txt")) and time.monotonic() < deadline:   # training has started
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted; its processes were stopped" in output, output
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not left, f"ranks still running: {left}"

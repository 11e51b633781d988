"""lab/build_ddp/bench.py, part (e) of the lab: the alpha-beta fit finds the alpha and beta it was given;
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
    done = bench("collectives", "--ranks", "2", "--max-mib", "4", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((out / "collectives.json").read_text())
    assert [row["bytes"] for row in record["rows"]] == [4096 * 4**k for k in range(6)]
    for row in record["rows"]:
        for key in ("ring_s", "all_reduce_s", "p2p_s", "predicted_ring_s", "ring_busbw_gbs"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    assert record["fit"]["alpha_s"] >= 0 and record["fit"]["bandwidth_gbs"] > 0
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
    done = bench("step", "--hosts", "local", "--steps", "3", "--variants", "a,c1,ddp", "--out", str(out))
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

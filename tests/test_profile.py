"""--profile-steps A:B (PROFILE_STEPS in the notebooks): one torch.profiler trace per rank in rank 0's run folder, with the
gradient all-reduce in it beside the backward pass it overlaps."""
from __future__ import annotations

import json

import pytest

from ddp_utils.settings import Settings
from ddp_utils.speed.profile import parse_window
from tests.helpers.procs import base_env, describe, free_port, python, run_all


def test_the_window_is_a_slice_of_training_steps():
    assert parse_window("") is None and parse_window("20:25") == (20, 25) and parse_window("0:1") == (0, 1)
    for bad in ("5", "5:5", "6:2", "a:b", "-1:3"):
        with pytest.raises(ValueError, match="profile_steps"):
            parse_window(bad)


def test_settings_refuse_a_window_that_traces_nothing_with_a_sentence_that_says_how_to_write_it():
    with pytest.raises(ValueError, match=r"profile_steps='25:20': write A:B with A < B, .* \(e\.g\. 20:25"):
        Settings(profile_steps="25:20")
    assert Settings(profile_steps="20:25").to_argv()[-2:] == ["--profile-steps", "20:25"]


def test_the_ranks_must_agree_on_the_window_its_end_is_a_collective():
    from ddp_utils.settings import MUST_AGREE
    assert "profile_steps" in MUST_AGREE


def _events(path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def _train(tmp_path, window: str, world_size: int = 2, steps: int = 6, epochs: int = 1):
    port = free_port()
    argv = [python("-m", "ddp_utils", "train", "--dataset", "fake", "--image-size", "32", "--workers", "0",
                   "--wandb", "disabled", "--batch-size", "8", "--max-steps-per-epoch", str(steps), "--epochs",
                   str(epochs), "--no-link-probe", "--backend", "gloo", "--master-port", str(port), "--world-size",
                   str(world_size), "--rank", str(r), "--run-dir", str(tmp_path / "run"), "--profile-steps", window)
            for r in range(world_size)]
    results = run_all(argv, timeout=240, env=base_env(), stagger=1.0)
    assert all(r.returncode == 0 for r in results), describe(results)
    return results


@pytest.mark.slow
def test_two_ranks_leave_one_trace_each_in_rank_0s_folder_with_the_all_reduce_and_the_backward_in_it(tmp_path):
    results = _train(tmp_path, "2:4")
    traces = sorted((tmp_path / "run" / "profile").iterdir())
    assert [p.name for p in traces] == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    for path in traces:
        names = {e.get("name", "") for e in _events(path)}
        assert any("all_reduce" in n or "allreduce" in n for n in names), sorted(names)[:40]   # gloo:all_reduce
        assert any("Backward" in n for n in names), sorted(names)[:40]   # what the all-reduce overlaps
    assert "profile: training steps 2 to 3 traced on 2 rank(s)" in results[0].output, describe(results)
    assert "profile:" not in results[1].output   # rank 0 writes and says it


@pytest.mark.slow
def test_a_window_past_the_epochs_end_is_cut_there_and_traced_once(tmp_path):
    """Steps 4 to 99 of a run of 2 epochs x 6 steps: the trace ends with epoch 1 (a gather every rank reaches) and
    epoch 2 is not traced again; one process too (no gather needed)."""
    results = _train(tmp_path, "4:99", world_size=1, epochs=2)
    assert [p.name for p in (tmp_path / "run" / "profile").iterdir()] == ["rank0.pt.trace.json"]
    assert results[0].output.count("profile: training steps 4 to 5 traced on 1 rank(s)") == 1, describe(results)


def test_a_run_that_leaves_inside_the_window_stops_the_profiler(tmp_path):
    """Issue 55, D6: a run that failed inside its trace window left the profiler recording in the notebook's process
    (Profiling had no hook for the way out). ``close`` runs on every way out of the loop (train.py) and stops it."""
    import types
    import torch
    from ddp_utils.speed.profile import Profiling, StepProfiler
    said = []
    ctx = types.SimpleNamespace(device=torch.device("cpu"), distributed=False, is_main=True, rank=0, world_size=1)
    observer = Profiling()
    observer.profiler = StepProfiler((2, 10), ctx, tmp_path, log=said.append)
    observer.profiler.before(2)
    assert torch._C._autograd._profiler_enabled()
    observer.close(loop=None)   # the step failed: no epoch_trained, no step_end
    assert not torch._C._autograd._profiler_enabled()
    assert said == ["profile: the run ended inside the traced window (from step 2); the profiler is stopped and no "
                    "trace is written"] and not (tmp_path / "profile").exists()
    observer.close(loop=None)   # once only
    assert len(said) == 1


@pytest.mark.gpu
def test_on_a_gpu_the_trace_holds_the_gpu_kernels_too(tmp_path):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _train(tmp_path, "2:4", world_size=1)
    events = _events(tmp_path / "run" / "profile" / "rank0.pt.trace.json")
    assert any(e.get("cat") == "kernel" for e in events), {e.get("cat") for e in events}

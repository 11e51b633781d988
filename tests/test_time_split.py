"""Where a run's time went (data / compute / communication / idle), the link probe, the parallel
mode and early stopping: the figures the homework is answered from."""
from __future__ import annotations

import json
import re

import pytest
import torch

from ddp_utils import checkpoint
from ddp_utils.speed import commtime
from ddp_utils.runlog import read_scalars
from ddp_utils.settings import Settings
from tests.procs import base_env, describe, free_port, python, run_all
from tests.test_training import FAST, run_ranks, weights


# -- the split of one step's communication -----------------------------------------------------
def test_waited_for_communication_starts_when_the_last_bucket_is_ready():
    # bucket A ready at 1 s, done at 3 s; bucket B (the last gradients) ready at 2 s, done at 4 s:
    # from 2 s on the backward pass had nothing left to compute, so 2 s were waited for; the
    # all-reduce was in flight from 1 s to 4 s
    assert commtime.split([(1.0, 3.0), (2.0, 4.0)]) == (2.0, 3.0)


def test_in_flight_time_counts_overlapping_buckets_once_and_gaps_not_at_all():
    waited, in_flight = commtime.split([(0.0, 1.0), (0.5, 1.5), (3.0, 3.5)])
    assert in_flight == pytest.approx(1.5 + 0.5)
    assert waited == pytest.approx(0.5)


def test_an_all_reduce_finished_before_the_backward_pass_ended_was_not_waited_for():
    assert commtime.split([(0.0, 0.2), (1.0, 1.0)]) == (0.0, 0.2)


# -- a real two-rank run -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("split")
    run_ranks(tmp, "run", 2, "--epochs", "2", "--max-steps-per-epoch", "5", "--batch-size", "8")
    return tmp / "run"


@pytest.mark.slow
def test_the_time_split_adds_up_to_the_train_time_on_every_rank(two_ranks):
    results = json.loads((two_ranks / "results.json").read_text())
    assert len(results["per_rank"]) == 2
    for epoch in results["history"]:
        train = epoch["train"]
        for row in train["per_rank"]:
            parts = row["data_s"] + row["compute_s"] + row["comm_s"] + row["idle_s"]
            assert parts == pytest.approx(row["wall_s"], rel=1e-6), row   # each rank's own wall time
        assert 0 < train["comm_s"] <= train["comm_total_s"]   # measured by the hook, not a subtraction
    # top level: the sums over the epochs, as the issue names them
    for key in ("data_s", "compute_s", "comm_s", "comm_total_s", "idle_s"):
        assert results[key] == pytest.approx(sum(h["train"][key] for h in results["history"])), key
    for rank, row in enumerate(results["per_rank"]):   # the whole run's split of each rank
        assert row["rank"] == rank
        assert row["comm_s"] == pytest.approx(sum(h["train"]["per_rank"][rank]["comm_s"] for h in results["history"]))
    assert [row["gpu_util"] for row in results["per_rank"]] == ["no GPU", "no GPU"]   # each rank's GPU use beside it
    assert results["steps"] == 10
    assert results["measured_step_s"] == pytest.approx(results["train_time_s"] / 10)
    assert results["parallel"] == "ddp"
    assert results["gpu_util"] == "no GPU" and results["gpu_mem_peak_mb"] is None


@pytest.mark.slow
def test_the_link_probe_reports_bandwidth_and_a_predicted_speed_up(two_ranks):
    results = json.loads((two_ranks / "results.json").read_text())
    assert results["link_gbit_s"] > 0
    assert 0 < results["predicted_speedup"] <= 2
    probe = results["probe"]
    assert probe["predicted_step_s"] == probe["ddp_step_s"] > 0   # DDP's own step, timed on a copy (issue 36)
    # against one rank alone (the baseline), with the step the ranks make together
    assert results["predicted_speedup"] == pytest.approx(min(2, 2 * probe["compute_alone_s"] / probe["predicted_step_s"]))
    assert probe["link_gbit_s"] == pytest.approx(probe["grad_mb"] * 1e6 * 8 / probe["allreduce_s"] / 1e9)
    log = (two_ranks / "log.txt").read_text()
    assert "per step: predicted" in log and "measured" in log   # side by side after training
    assert "per step: predicted" in log and "(a DDP step of a copy: compute" in log


@pytest.mark.slow
def test_lr_is_logged_at_every_step_from_its_first_value(two_ranks):
    lr = read_scalars(two_ranks)["lr"]
    assert [step for step, _ in lr] == list(range(10))
    settings = Settings(**json.loads((two_ranks / "settings.json").read_text()))
    # the preset's warm-up is 0 epochs for fake data: the first step uses the full (scaled) lr
    assert lr[0][1] == pytest.approx(settings.effective_lr)
    for tag in ("time/data_s", "time/compute_s", "time/comm_s", "time/idle_s"):
        assert len(read_scalars(two_ranks)[tag]) == 2, tag   # once per epoch


@pytest.mark.slow
def test_the_epoch_line_says_where_the_time_went(two_ranks):
    log = (two_ranks / "log.txt").read_text()
    line = re.search(r"^epoch 2/2: .*\n  .*$", log, re.M).group(0)   # the epoch's two lines
    for part in ("data ", "compute ", "comm ", "idle "):
        assert part in line, line


@pytest.mark.slow
def test_the_probe_changes_nothing_in_the_training(tmp_path):
    # it runs a copy of the model under its own random state: same weights with and without it
    steps = ["--epochs", "1", "--max-steps-per-epoch", "3", "--batch-size", "8"]
    run_ranks(tmp_path, "probe", 2, *steps)
    run_ranks(tmp_path, "none", 2, *steps, "--no-link-probe")
    with_probe, without = weights(tmp_path / "probe" / "last.pt"), weights(tmp_path / "none" / "last.pt")
    for name in without:
        assert torch.equal(with_probe[name], without[name]), name
    skipped = json.loads((tmp_path / "none" / "results.json").read_text())
    assert skipped["link_gbit_s"] is None and skipped["predicted_speedup"] is None


@pytest.mark.slow
def test_a_single_process_has_no_communication_and_no_probe(tmp_path):
    run_ranks(tmp_path, "one", 1, "--epochs", "1", "--max-steps-per-epoch", "3", "--batch-size", "8")
    results = json.loads((tmp_path / "one" / "results.json").read_text())
    assert results["comm_s"] == 0 and results["comm_total_s"] == 0
    assert results["link_gbit_s"] is None and results["parallel"] == "none"


# -- parallel modes ------------------------------------------------------------------------------
@pytest.mark.slow
def test_dataparallel_on_a_cpu_is_a_rehearsal_of_its_code_path_and_says_so(tmp_path):
    """Lab 4 on a laptop: DataParallel has no GPU to split over, torch calls the model itself; the run is
    recorded as dp on 0 GPUs, its per-GPU figures empty (the one-GPU twin: the gpu-marked test below)."""
    out = run_ranks(tmp_path, "dp", 1, "--epochs", "1", "--max-steps-per-epoch", "2", "--batch-size", "8",
                    "--parallel", "dp")[0].output
    assert "DataParallel on the CPU (DataParallel splits over GPUs only)" in out and "nothing to split" in out
    results = json.loads((tmp_path / "dp" / "results.json").read_text())
    assert results["parallel"] == "dp" and results["gpus"] == results["job_gpus"] == 0
    assert results["gpu_util"] == "no GPU" and results["gpu_util_per_device"] is None
    run_ranks(tmp_path, "none", 1, "--epochs", "1", "--max-steps-per-epoch", "2", "--batch-size", "8")
    assert "gpu_util_per_device" not in json.loads((tmp_path / "none" / "results.json").read_text())
    dp, plain = weights(tmp_path / "dp" / "last.pt"), weights(tmp_path / "none" / "last.pt")
    assert dp.keys() == plain.keys()   # the checkpoint holds the plain model's keys (unwrap)
    assert all(torch.equal(dp[k], plain[k]) for k in plain)   # the same training, step for step


def test_a_one_process_mode_with_several_ranks_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="parallel=dp runs one process"):
        Settings(parallel="dp", world_size=2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DataParallel over several GPUs needs at least 2 CUDA GPUs")
@pytest.mark.gpu
def test_dataparallel_over_every_gpu_of_the_node(tmp_path):
    run_ranks(tmp_path, "dp", 1, "--epochs", "1", "--max-steps-per-epoch", "3", "--batch-size", "32",
              "--parallel", "dp", "--backend", "nccl")
    results = json.loads((tmp_path / "dp" / "results.json").read_text())
    assert results["parallel"] == "dp" and results["gpus"] == results["job_gpus"] == torch.cuda.device_count()
    assert len(results["gpu_util_per_device"]) == len(results["gpu_mem_peak_mb_per_device"]) == results["gpus"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_dataparallel_over_one_gpu_is_a_rehearsal_that_keeps_the_gpus_figures(tmp_path):
    """Lab 4 on a homework node (one GPU): DataParallel over that GPU runs (torch calls the model directly) and
    results.json has the per-GPU lists, of one. The emulated twin: test_gpu_monitor.py's per-device tests."""
    from tests.test_training import train_cmd
    [result] = run_all([train_cmd(tmp_path / "dp1", 0, 1, free_port(), "--epochs", "1", "--max-steps-per-epoch", "3",
                                  "--batch-size", "32", "--parallel", "dp")],
                       timeout=180, env=base_env(CUDA_VISIBLE_DEVICES="0"))   # one GPU, as on a homework node
    assert result.returncode == 0, describe([result])
    out = result.output
    assert "DataParallel over 1 GPU" in out and "per GPU (DataParallel): cuda:0 " in out
    results = json.loads((tmp_path / "dp1" / "results.json").read_text())
    assert results["parallel"] == "dp" and results["gpus"] == results["job_gpus"] == 1
    assert len(results["gpu_util_per_device"]) == 1 and results["gpu_mem_peak_mb_per_device"][0] > 0
    assert results["torch_mem_peak_mb_per_device"][0] > 0


# -- early stopping ------------------------------------------------------------------------------
@pytest.mark.slow
def test_patience_stops_every_rank_after_epochs_without_a_better_accuracy(tmp_path):
    # lr 0 and GroupNorm: the weights never change, so validation Acc@1 never improves after epoch 1
    results = run_ranks(tmp_path, "stop", 2, "--epochs", "6", "--max-steps-per-epoch", "2", "--batch-size", "8",
                        "--arch", "convnet_gn", "--lr", "0", "--patience", "2")
    assert "early stop after epoch 3 of 6" in results[0].output, describe(results)   # rank 0 prints; both ended
    final = json.loads((tmp_path / "stop" / "results.json").read_text())
    assert final["stopped_early"] == 3 and final["epochs_run"] == 3
    assert "no better validation Acc@1 for 2 epoch(s)" in final["stop_reason"]
    assert checkpoint.load_checkpoint(tmp_path / "stop" / "best.pt")["epoch"] == 0   # epoch 1, the best
    assert checkpoint.load_checkpoint(tmp_path / "stop" / "last.pt")["epoch"] == 2


@pytest.mark.slow
def test_without_patience_every_epoch_runs(tmp_path):
    run_ranks(tmp_path, "all", 1, "--epochs", "3", "--max-steps-per-epoch", "1", "--batch-size", "8",
              "--arch", "convnet_gn", "--lr", "0")
    final = json.loads((tmp_path / "all" / "results.json").read_text())
    assert final["stopped_early"] is None and final["epochs_run"] == 3


# -- seeds -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_seeds_run_the_same_configuration_into_sibling_folders(tmp_path):
    port = free_port()
    cmds = [python("-m", "ddp_utils", "train", *FAST, "--run-dir", str(tmp_path / "run"), "--rank", str(r),
                   "--world-size", "2", "--master-port", str(port), "--epochs", "1", "--max-steps-per-epoch", "2",
                   "--batch-size", "8", "--seeds", "2,4") for r in range(2)]
    results = run_all(cmds, timeout=240, env=base_env())
    assert all(r.returncode == 0 for r in results), describe(results)
    for seed in (2, 4):
        folder = tmp_path / f"run-seed{seed}"
        assert json.loads((folder / "results.json").read_text())["seed"] == seed
        assert json.loads((folder / "settings.json").read_text())["seed"] == seed
    assert not (tmp_path / "run").exists()
    first = weights(tmp_path / "run-seed2" / "last.pt")
    second = weights(tmp_path / "run-seed4" / "last.pt")
    assert any(not torch.equal(first[k], second[k]) for k in first)   # really different seeds


@pytest.mark.parametrize("text", ["2,x", "2,2", ","])
def test_bad_seed_lists_are_refused_with_an_example(text, capsys):
    from ddp_utils.tools import cli
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["train", "--seeds", text])
    assert "e.g. 2,4,42" in capsys.readouterr().err


def test_seeds_and_resume_together_are_refused(capsys):
    from ddp_utils.tools import cli
    assert cli.main(["train", "--seeds", "2,4", "--resume", "x/last.pt"]) == 2
    assert "--seed N instead of --seeds" in capsys.readouterr().err


# -- the pages' TensorBoard tag lists are the tags a run logs ------------------------------------
TAG = re.compile(r"\b((?:Loss|acc1|acc5|throughput|time|gpu)/\w+|lr)\b")


def tag_lists() -> list[tuple[str, set[str]]]:
    """(where, tags) for every list of TensorBoard tags in the pages and in runlog.py's docstring: a paragraph
    (a notebook cell) that names `Loss/train`, with the tags it names."""
    import ddp_utils.runlog
    from tests.test_pages import pages, rel
    found = [("ddp_utils/runlog.py", set(TAG.findall(ddp_utils.runlog.__doc__.split("TensorBoard tags", 1)[1]
                                                      .split("\n\n", 2)[1])))]
    for page, text in pages().items():
        for block in re.split(r"\n\s*\n", text):
            if "`Loss/train`" in block:
                found.append((rel(page), set(re.findall(r"`" + TAG.pattern[2:-2] + r"`", block))))
    return found


@pytest.mark.slow
def test_every_tag_list_on_the_pages_names_the_tags_a_run_logs(two_ranks):
    """A page that lists the curves must list every curve a run writes (the GPU-only ones may be added)."""
    logged = set(read_scalars(two_ranks))
    from tests.procs import REPO
    gpu_only = set(re.findall(r'"(gpu/\w+)"', open(f"{REPO}/ddp_utils/concerns.py").read()))
    lists = tag_lists()
    assert len(lists) >= 5, lists
    for where, tags in lists:
        assert tags - gpu_only == logged, (where, sorted(logged - tags), sorted(tags - logged - gpu_only))



def test_a_probed_step_is_the_median_of_its_rounds_so_one_slow_step_does_not_move_it(monkeypatch):
    """Issue 36: the prediction moved from 1.57x to 2.90x between two identical runs; one slow step among three
    (something else used the core) now leaves the timing at the other two's median."""
    import types
    import torch
    from ddp_utils.distributed import DistContext
    from ddp_utils.settings import Settings
    from ddp_utils.speed import linkprobe
    clock = iter([0.0, 1.0, 1.0, 1.2, 1.2, 6.2, 6.2, 6.5])   # warm-up 1.0 s, then steps of 0.2, 5.0, 0.3 s
    monkeypatch.setattr(linkprobe, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    seconds = linkprobe._time_compute(model, Settings(batch_size=2, channels_last=False), ctx, 3, 2)
    assert seconds == pytest.approx(0.3)   # the mean would say 1.83


def test_the_predicted_speed_up_is_never_above_the_world_size(monkeypatch):
    """A step together that timed faster than one alone is noise: two ranks predict at most 2x."""
    import types
    import torch
    from ddp_utils.distributed import DistContext
    from ddp_utils.settings import Settings
    from ddp_utils.speed import linkprobe
    steps = iter([0.05, 0.10] * linkprobe.PAIRS)   # together, then alone: 2 x 0.10 / (0.05 + 0.01) would be 3.33x
    monkeypatch.setattr(linkprobe, "_time_allreduce", lambda grads, ctx: 0.01)
    monkeypatch.setattr(linkprobe, "Stepper", lambda *args, **kw: types.SimpleNamespace(step=lambda: next(steps)))
    monkeypatch.setattr(linkprobe, "_slowest", lambda seconds, ctx: seconds)
    monkeypatch.setattr(linkprobe.distributed, "barrier", lambda ctx: None)
    ctx = DistContext(0, 2, 0, torch.device("cpu"), "gloo")
    result = linkprobe.probe(torch.nn.Linear(4, 3), Settings(world_size=2), ctx, 3, 2, log=lambda line: None)
    assert result["predicted_speedup"] == 2.0


def test_together_and_alone_are_timed_in_turn_so_a_machine_slowing_down_moves_both_alike(monkeypatch):
    """Issue 36: the steps together and alone were timed one series after the other, so a neighbour that started
    meanwhile slowed only one series (predictions of 0.87x and 1.36x for the same run). Now they alternate."""
    import types
    import torch
    from ddp_utils.distributed import DistContext
    from ddp_utils.settings import Settings
    from ddp_utils.speed import linkprobe
    calls = []

    def step():   # alone takes 0.9 of a step together; from the fifth step on the machine runs at half speed
        calls.append(len(calls))
        together = len(calls) % 2 == 1
        return (1.0 if together else 0.9) * (2 if len(calls) > 4 else 1)
    monkeypatch.setattr(linkprobe, "_time_allreduce", lambda grads, ctx: 0.5)
    monkeypatch.setattr(linkprobe, "Stepper", lambda *args, **kw: types.SimpleNamespace(step=step))
    monkeypatch.setattr(linkprobe, "_slowest", lambda seconds, ctx: seconds)
    monkeypatch.setattr(linkprobe.distributed, "barrier", lambda ctx: None)
    ctx = DistContext(0, 2, 0, torch.device("cpu"), "gloo")
    result = linkprobe.probe(torch.nn.Linear(4, 3), Settings(world_size=2), ctx, 3, 2, log=lambda line: None)
    assert len(calls) == 2 * linkprobe.PAIRS
    assert result["compute_alone_s"] / result["compute_s"] == pytest.approx(0.9)   # in series: 1.8
    assert result["predicted_speedup"] == pytest.approx(2 * 1.35 / (1.5 + 0.5))


def test_with_torch_ddp_the_prediction_is_a_timed_ddp_step_of_a_copy_overlap_included(monkeypatch):
    """Issue 36: on 1 Gbit the sum compute + all-reduce predicted 0.57x where DDP, hiding part of the all-reduce
    behind the backward pass, measured 0.76x. The probe now times DDP's own step on a copy wrapped as the run's."""
    import types
    import torch
    from ddp_utils.distributed import DistContext
    from ddp_utils.settings import Settings
    from ddp_utils.speed import linkprobe
    made = []

    def stepper(*args, ddp=False, **kw):
        made.append(ddp)
        seconds = iter([0.6] * 8) if ddp else iter([0.25, 0.23] * 8)   # DDP step; plain together, alone in turn
        return types.SimpleNamespace(step=lambda: next(seconds))
    monkeypatch.setattr(linkprobe, "Stepper", stepper)
    monkeypatch.setattr(linkprobe, "ddp_of", lambda model: model)       # the run's model is torch's DDP
    monkeypatch.setattr(linkprobe, "_time_allreduce", lambda grads, ctx: 0.5)
    monkeypatch.setattr(linkprobe, "_slowest", lambda seconds, ctx: seconds)
    monkeypatch.setattr(linkprobe.distributed, "barrier", lambda ctx: None)
    ctx = DistContext(0, 2, 0, torch.device("cpu"), "gloo")
    lines = []
    result = linkprobe.probe(torch.nn.Linear(4, 3), Settings(world_size=2), ctx, 3, 2, log=lines.append)
    assert made == [False, True]
    assert result["ddp_step_s"] == result["predicted_step_s"] == 0.6           # not 0.25 + 0.5
    assert result["predicted_speedup"] == pytest.approx(2 * 0.23 / 0.6)
    assert "\n  a DDP step of a copy 600 ms, 30 % of its all-reduce hidden behind the backward pass;\n" in lines[0]
    assert lines[0].endswith("2 ranks should be about 0.77x one rank (ideal 2x)"), lines
    monkeypatch.setattr(linkprobe, "ddp_of", lambda model: None)              # --build-ddp: your own DDP
    made.clear()
    result = linkprobe.probe(torch.nn.Linear(4, 3), Settings(world_size=2), ctx, 3, 2, log=lines.append)
    assert made == [False] and result["ddp_step_s"] is None and result["predicted_step_s"] == 0.75

"""The command line users type: check, demo, and the README's promises about it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.pages import kit_pages
from tests.helpers.folders import RANK1_SEES, data_copies
from tests.helpers.procs import REPO, base_env, describe, free_port, python, run_all, stop
from tests.helpers.runs import tree


def check_cmd(rank, world_size, port, *extra):
    return python("-m", "ddp_utils", "check", "--dataset", "fake", "--backend", "gloo", "--master-addr", "127.0.0.1",
                  "--master-port", str(port), "--rank", str(rank), "--world-size", str(world_size),
                  "--init-timeout", "30", *extra)


@pytest.mark.slow
def test_check_on_two_ranks_proves_the_collective_and_saves_the_all_reduce_sweep(tmp_path):
    """Both checks build the real process group and all-reduce payloads up to the model's gradient; rank 0 saves the
    sweep beside the runs, where `report` finds it."""
    port = free_port()
    run_dir = ("--run-dir", str(tmp_path / "runs" / "x"))
    results = run_all([check_cmd(0, 2, port, *run_dir), check_cmd(1, 2, port, *run_dir)], timeout=120, stagger=1.0)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    master, worker = results
    for r in results:
        assert "joined tcp://127.0.0.1:" in r.output and "all-reduce over the process group (gloo, 2 ranks)" in r.output
        assert re.search(r"^\s+4096\s+[\d.]+ ms\s+[\d.]+ Gbit/s\s+[\d.]+ Gbit/s$", r.output, re.M), r.output
        assert r.output.rstrip().splitlines()[-1] == "READY"
    assert "using interface lo" in worker.output
    from ddp_utils.tools import sweep
    saved = sweep.newest(tmp_path / "runs" / "check", 2)
    assert saved and saved["backend"] == "gloo" and saved["rows"][0]["bytes"] == 4096, saved
    assert saved["rows"][-1]["bytes"] == max(r["bytes"] for r in saved["rows"])   # the gradient's size, last
    assert all(r["busbw_gbit_s"] == pytest.approx(r["algbw_gbit_s"]) for r in saved["rows"])   # 2 (n-1)/n = 1
    assert not list((tmp_path / "runs" / "check").glob("*.tmp"))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["settings", "local"])
def test_check_names_differing_flags_as_settings_and_an_unwritable_runs_folder_as_local_on_every_rank(tmp_path,
                                                                                                       fault):
    """Issue 55, D3 and D4: flags that differ between the nodes were called NOT READY (network); a runs folder rank 0
    could not write was NOT READY (network) on rank 0 and READY on rank 1. Now each is named, the same on every rank,
    and nothing is left in the runs folder."""
    port = free_port()
    runs = tmp_path / "runs"
    extra = {0: ["--run-dir", str(runs / "x")], 1: ["--run-dir", str(runs / "x")]}
    if fault == "settings":
        extra[1] += ["--batch-size", "32"]
    else:
        runs.write_text("a file where rank 0's runs folder should be\n")   # root writes anywhere: a file stops it
    results = run_all([check_cmd(r, 2, port, *extra[r]) for r in (0, 1)], timeout=120, stagger=1.0)
    assert [r.returncode for r in results] == [1, 1], describe(results)
    for r in results:
        assert f"NOT READY ({fault}): " in r.output and "NOT READY (network)" not in r.output, describe([r])
        assert r.output.rstrip().splitlines()[-1] == "NOT READY", describe([r])
    said = results[1].output.split(f"NOT READY ({fault}): ", 1)[1]
    if fault == "settings":
        assert "batch_size" in said and "32" in said, said
        assert not runs.exists()
    else:
        assert said.startswith("rank 0 (on ") and f"could not write the check's results to {runs / 'check'}" in said
        assert "--run-dir" in said and "run the check again on every node" in said, said
        assert runs.read_text() == "a file where rank 0's runs folder should be\n"


@pytest.mark.slow
@pytest.mark.parametrize("rank1", list(RANK1_SEES))
def test_check_on_nodes_whose_data_differ_is_not_ready_on_both_naming_the_data_not_the_network(tmp_path, rank1):
    """Issue 43, finding 4: each rank sized the all-reduce from its own class count, so over gloo one died of
    SIGABRT and the other blamed the network. Now the ranks compare their data first and both say which node has
    which, before any collective whose size depends on it."""
    port = free_port()
    dirs = data_copies(tmp_path, rank1)
    start = time.monotonic()
    results = run_all([python("-m", "ddp_utils", "check", "--dataset", "imagenet", "--arch", "convnet", "--data-dir",
                              str(dirs[r]), "--backend", "gloo", "--master-addr", "127.0.0.1", "--master-port",
                              str(port), "--rank", str(r), "--world-size", "2", "--init-timeout", "30")
                       for r in (0, 1)], timeout=90, stagger=1.0)
    took = time.monotonic() - start
    assert [r.returncode for r in results] == [1, 1], describe(results)
    assert took < 60, f"took {took:.0f} s\n{describe(results)}"
    for r in results:
        said = r.output.split("NOT READY (data): the nodes' data differ", 1)
        assert len(said) == 2, describe([r])
        assert re.search(rf"rank 1 \(on [^)]*\) .*{RANK1_SEES[rank1]}", said[1]), describe([r])
        assert re.search(r"rank 0 \(on [^)]*\) sees train 9 images / 3 classes, val 6 images / 3 classes",
                         said[1]), describe([r])
        assert "rsync" in said[1] and "every node" in said[1], describe([r])
        for never in ("NOT READY (network)", "SIGABRT", "Traceback", "all-reduce over the process group"):
            assert never not in r.output, describe([r])
        assert r.output.rstrip().splitlines()[-1] == "NOT READY", describe([r])


def test_the_data_paragraph_groups_the_ranks_by_node_and_names_other_class_folders_behind_equal_counts():
    from ddp_utils.tools.check import _data_differ

    def rank(r, where, classes, images=9):
        return {"rank": r, "where": where, "classes": classes,
                "splits": {"train": {"images": images, "classes": len(classes)}}}
    a, b = " (on host-a, 10.0.0.1)", " (on host-b, 10.0.0.2)"
    same = [rank(0, a, ["x", "y"]), rank(1, a, ["x", "y"]), rank(2, b, ["x", "y"])]
    assert _data_differ(same) is None
    said = _data_differ([*same[:2], rank(2, b, ["x", "z"]), rank(3, b, ["x", "z"], images=8)])
    assert said.startswith("the nodes' data differ: ranks 0, 1 (on host-a, 10.0.0.1) see train 9 images / 2 classes; "
                           "rank 2 (on host-b, 10.0.0.2) sees train 9 images / 2 classes, but class folders 'z' where "
                           "rank 0 has 'y'; rank 3 (on host-b, 10.0.0.2) sees train 8 images / 2 classes, but class "
                           "folders 'z' where rank 0 has 'y'. Every rank must train on the same data"), said
    failed = _data_differ([{"rank": 0, "where": a, "error": "its data check did not run"}, same[2]])
    assert "rank 0 (on host-a, 10.0.0.1) cannot use its data (its data check did not run;" in failed, failed


@pytest.mark.slow
def test_wrong_sums_on_one_rank_end_the_sweep_on_every_rank_with_the_same_verdict():
    """Issue 43, finding 4: the sweep's wrong-sum check raised on the rank that saw them, and the others went on to
    the next size's all-reduce, waiting for it until their timeout. Now the verdict is agreed (tests/helpers/sweep_ranks.py)."""
    port = free_port()
    results = run_all([python("-m", "tests.helpers.sweep_ranks", str(r), str(port)) for r in (0, 1)], timeout=60)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    for r in results:
        said = dict(re.findall(r"^CHECK (\w+)=(.*)$", r.output, re.M))
        assert said.get("error", "").startswith('"WrongSum: the all-reduce of 65536 bytes did not add up to 2 on '
                                                'rank 1 of 2'), describe([r])
        assert float(said["seconds"]) < 10, describe([r])


@pytest.mark.slow
def test_check_fails_when_nobody_listens_on_the_master_port_and_says_where_it_knocked():
    port = free_port()
    [worker] = run_all([check_cmd(1, 2, port, "--init-timeout", "2")], timeout=60)
    assert worker.returncode == 1, worker.output
    assert f"127.0.0.1:{port}" in worker.output and "NOT READY" in worker.output


@pytest.mark.slow
def test_check_reports_a_missing_data_folder(tmp_path):
    [res] = run_all([python("-m", "ddp_utils", "check", "--dataset", "cinic10", "--data-dir",
                            str(tmp_path / "nope"))], timeout=60)
    assert res.returncode == 1 and str(tmp_path / "nope") in res.output, res.output


def _check_one_node(monkeypatch, shm_bytes, cuda=False, **settings):
    from ddp_utils.settings import Settings
    from ddp_utils.tools import check
    real = check.hardware_report
    monkeypatch.setattr(check, "hardware_report", lambda: {**real(), "cuda": cuda, "shm_bytes": shm_bytes})
    lines = []
    ok = check.run_check(Settings(**{"dataset": "fake", **settings}), log=lines.append)
    return ok, "\n".join(lines)


def test_check_in_nvidia_s_container_without_a_gpu_is_not_ready(monkeypatch):
    """docker run without --gpus: training would run on the CPU for hours; the homework expects a GPU."""
    monkeypatch.setenv("NVIDIA_PYTORCH_VERSION", "25.01")
    ok, text = _check_one_node(monkeypatch, 16 << 30)
    assert not ok and "NOT READY (hardware): this is NVIDIA's PyTorch container 25.01, but it sees no GPU" in text
    assert "--gpus all" in text and text.endswith("NOT READY")
    ok, text = _check_one_node(monkeypatch, 16 << 30, backend="gloo")   # a CPU rehearsal, said on purpose
    assert ok and text.endswith("READY"), text
    monkeypatch.delenv("NVIDIA_PYTORCH_VERSION")
    ok, text = _check_one_node(monkeypatch, 16 << 30)   # a laptop: no container, no GPU expected
    assert ok and text.endswith("READY"), text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_check_in_nvidia_s_container_with_its_gpu_is_ready(monkeypatch):
    from ddp_utils.settings import Settings
    from ddp_utils.tools.check import run_check
    monkeypatch.setenv("NVIDIA_PYTORCH_VERSION", "25.01")
    lines = []
    run_check(Settings(dataset="fake", workers=0), log=lines.append)
    assert not [line for line in lines if "NOT READY (hardware)" in line], lines


def test_check_with_a_small_dev_shm_and_loader_workers_is_not_ready(monkeypatch):
    ok, text = _check_one_node(monkeypatch, 64 << 20, workers=2, loader="workers")
    assert not ok and "NOT READY (hardware): /dev/shm is only 64 MiB, and the 2 DataLoader worker(s)" in text
    assert "--ipc=host" in text and "--workers 0" in text
    ok, text = _check_one_node(monkeypatch, 64 << 20, workers=0)   # no workers: /dev/shm is not used
    assert ok, text


def test_check_with_loader_nvjpeg_says_where_it_decodes_and_refuses_a_png_preset(monkeypatch, tmp_path):
    from tests.helpers.folders import make_cinic, make_imagenet
    imagenet = str(make_imagenet(tmp_path / "imagenet"))
    from tests.helpers.gpu_emulation import A100, pretend_gpu
    for cuda, said in ((False, "no GPU here, so the CPU decodes"),
                       (True, "torchvision decodes the JPEGs on the GPU's hardware JPEG decoder (nvJPEG)")):
        if cuda:
            pretend_gpu(monkeypatch.setattr, A100)   # the line names the GPU's decoder (test_nvjpeg: a T4's)
        ok, text = _check_one_node(monkeypatch, 1 << 30, cuda=cuda, dataset="imagenet", data_dir=imagenet,
                                   loader="nvjpeg")
        assert f"loader nvjpeg: {said}" in text, text
    ok, text = _check_one_node(monkeypatch, 1 << 30, dataset="cinic10", data_dir=str(make_cinic(tmp_path / "c")),
                               loader="nvjpeg")
    assert not ok and "NOT READY (data): loader='nvjpeg' is for imagenet" in text, text


def _interrupted_once(tmp_path, ready, *extra) -> tuple[int, str]:
    """``train`` on fake images into tmp_path/run, sent Ctrl-C (SIGINT) once ``ready()`` holds (180 s at most):
    its exit code and output."""
    cmd = python("-m", "ddp_utils", "train", "--dataset", "fake", "--image-size", "32", "--workers", "0",
                 "--wandb", "disabled", "--batch-size", "8", "--run-dir", str(tmp_path / "run"), *extra)
    proc = subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready(), "the run did not get there in time"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        stop([proc])
    return proc.returncode, out


@pytest.mark.slow
def test_ctrl_c_during_training_leaves_the_last_checkpoint_intact_and_says_how_to_resume(tmp_path):
    last = tmp_path / "run" / "last.pt"
    code, out = _interrupted_once(tmp_path, last.exists, "--epochs", "50", "--max-steps-per-epoch", "2")
    assert code == 130, out
    assert "--resume" in out and "Traceback" not in out
    from ddp_utils import checkpoint
    epoch = checkpoint.load_checkpoint(last)["epoch"]
    assert epoch >= 0
    # issue 55: what exists, named (it was one fixed text that also said "RUN_DIR/last.pt")
    assert (f"interrupted: the process group was torn down and the other ranks were told; the checkpoint {last} "
            f"holds epoch {epoch + 1}: continue with --resume {last}.") in out, out[-2000:]


@pytest.mark.slow
def test_ctrl_c_before_the_first_checkpoint_says_that_none_was_written(tmp_path):
    """Issue 55: the paragraph promised an intact last.pt also when no epoch had finished."""
    log = tmp_path / "run" / "log.txt"
    started = lambda: log.exists() and "global batch" in log.read_text()   # noqa: E731 - training has started
    # an epoch of 1,250 steps takes far longer than this test
    code, out = _interrupted_once(tmp_path, started, "--epochs", "2", "--max-steps-per-epoch", "100000")
    assert code == 130, out
    assert (f"interrupted: the process group was torn down and the other ranks were told; no epoch finished, so no "
            f"checkpoint was written ({tmp_path / 'run'} holds the log): start the run again.") in out, out[-2000:]
    assert not (tmp_path / "run" / "last.pt").exists() and "Traceback" not in out


RO_MOUNT = 'mount --bind "$RO" "$RO" && mount -o remount,ro,bind "$RO" "$RO" && exec "$0" "$@"'


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["a file", "read-only"])
def test_a_run_folder_rank_0_cannot_write_is_named_on_every_rank_before_the_data_and_model(tmp_path, fault):
    """Issue 55: a run folder that could not be written gave a raw PermissionError traceback, exit 1, after the data
    and the model were built; a --run-dir naming a file said "[Errno 17] File exists". Now rank 0 looks first, and
    every rank says its paragraph and exits 2; nothing is written."""
    from tests.helpers.runs import train_cmd
    port, runs = free_port(), tmp_path / "runs"
    runs.mkdir()
    if fault == "a file":
        (runs / "run").write_text("a student's file\n")
        prefix, said = [[], []], f"the run folder {runs / 'run'} is a file, not a folder"
    else:   # root writes through any permission: a read-only mount, for rank 0 alone
        prefix = [["env", f"RO={runs}", "unshare", "-m", "sh", "-c", RO_MOUNT], []]
        said = f"the run folder {runs / 'run'} cannot be written (it would be made in {runs}): Read-only file system"
    before = tree(tmp_path)
    results = run_all([train_cmd(runs / "run", r, 2, port, "--epochs", "1", "--max-steps-per-epoch", "2")
                       for r in range(2)], timeout=120, prefix=prefix)
    assert [r.returncode for r in results] == [2, 2], describe(results)
    for r in results:
        assert said in r.output and "Traceback" not in r.output, describe([r])
        assert "parallel:" not in r.output   # refused before the model was placed (rank 0 says what runs there)
    assert tree(tmp_path) == before and sorted(p.name for p in runs.iterdir()) == (["run"] if fault == "a file"
                                                                                      else [])


@pytest.mark.slow
def test_resuming_a_finished_run_trains_nothing_and_changes_nothing_in_its_folder(tmp_path):
    """Issue 55: it said "continuing at epoch 2" of a 1-epoch run, rewrote results.json (epochs_run 0) and renamed
    settings.json. A relative --resume, as a student types it."""
    from tests.helpers.runs import FAST, run_ranks
    run_ranks(tmp_path, "run", 1, "--epochs", "1", "--max-steps-per-epoch", "2")
    before = tree(tmp_path / "run")
    [res] = run_all([python("-m", "ddp_utils", "train", *FAST, "--epochs", "1", "--max-steps-per-epoch", "2",
                            "--resume", "run/last.pt")], timeout=120, cwd=str(tmp_path))
    assert res.returncode == 2, describe([res])
    assert ("run/last.pt holds epoch 1 of 1: that run finished (its results.json is written), so nothing is left to "
            "train, and nothing in its folder was changed. To train it longer, resume with more epochs (--epochs N; "
            "EPOCHS in the notebook); to evaluate its weights, add --evaluate.") in res.output, describe([res])
    assert "Traceback" not in res.output and tree(tmp_path / "run") == before


def test_ci_types_the_quick_start_as_printed_then_runs_the_tests_sections_commands_in_its_venv():
    from tests.helpers import readme_blocks
    ci = Path(REPO, ".ci", "run").read_text()
    ci_lines = [line.strip() for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    # the student's block, extracted from the README at CI time (never a copy that could drift), on the system Python
    run_quick = next(i for i, line in enumerate(ci_lines) if "tests/helpers/readme_blocks.py quick-start" in line)
    assert any('bash -euo pipefail -c "$quick"' in line and "PATH=/usr/local/sbin:/usr/sbin:/usr/bin" in line
               for line in ci_lines[run_quick:]), ci
    quick = readme_blocks.commands("quick-start")
    assert quick[0].startswith("sudo apt-get update && sudo apt-get install -y python3-venv"), quick
    assert quick[1] == "python3 -m venv .venv && . .venv/bin/activate" and quick[-1] == "python -m ddp_utils demo"
    assert not any(word in " ".join(quick) for word in ("pytest", "chromium", "slurm")), "maintainer lines: Tests"
    # then the Tests section's commands, in order, in that venv; the fast tier is part of the whole suite
    tests = [c for c in readme_blocks.commands("tests") if "not slow" not in c]
    at = [ci_lines.index(c) for c in tests]
    assert at == sorted(at) and at[0] > run_quick, (tests, ci_lines)
    assert tests[0] == ". .venv/bin/activate" and tests[-1] == "tests/floor.sh"
    assert not any(line.rstrip().endswith("|| true") for line in ci_lines), "an install that may fail silently"


def test_the_newest_leg_runs_the_reviewed_torch_the_readme_names():
    """Issue 37: the newest torch CI tested was whatever pip resolved, printed and asserted nowhere."""
    from tests.helpers import newest_torch, readme_blocks
    wanted = newest_torch.pinned()
    assert set(wanted) == {"torch", "torchvision"}
    assert f"to the newest, {wanted['torch']} today" in Path(REPO, "README.md").read_text()
    install = next(c for c in readme_blocks.commands("tests") if "requirements-dev.txt" in c)
    assert "-c tests/newest-constraints.txt" in install
    ci = Path(REPO, ".ci", "run").read_text()
    assert ci.index(install) < ci.index("python tests/helpers/newest_torch.py") < ci.index("python -m pytest")
    assert newest_torch.mismatch({"torch": f"{wanted['torch']}+cu130", "torchvision": wanted["torchvision"]},
                                 wanted) is None
    said = newest_torch.mismatch({"torch": "2.15.0", "torchvision": wanted["torchvision"]}, wanted)
    assert said and f"torch 2.15.0 (pinned {wanted['torch']})" in said and "run the whole suite on it" in said


def test_in_ci_a_skip_for_a_missing_tool_fails_with_its_reason_and_one_for_a_missing_gpu_stays_a_skip(tmp_path):
    """Issue 37: with chromium or slurmd missing, CI went green with the browser or SLURM tests skipped. .ci/run sets
    CI=true; tests/conftest.py then fails a skip whose reason is not a GPU's (or a torch release's known limit)."""
    assert "export CI=true" in Path(REPO, ".ci", "run").read_text()
    (tmp_path / "conftest.py").write_text(f"import sys; sys.path.insert(0, {REPO!r})\n"
                                          "from tests.conftest import pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n"
        "def test_browser():\n    pytest.skip('no Chromium on this machine: apt-get install chromium')\n"
        "def test_gpu():\n    pytest.skip('needs a CUDA GPU')\n")
    for ci in ("true", ""):
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
                              cwd=tmp_path, env={**base_env(), "CI": ci}, capture_output=True, text=True, timeout=120)
        said = done.stdout + done.stderr
        assert ("1 failed, 1 skipped" if ci else "2 skipped") in said, said
        if ci:
            assert "skipped in CI" in said and "no Chromium on this machine" in said, said


@pytest.mark.slow
def test_when_a_worker_dies_mid_run_the_master_stops_with_a_clear_error_and_an_intact_checkpoint(tmp_path):
    port = free_port()
    args = ["--dataset", "fake", "--image-size", "32", "--workers", "0", "--wandb", "disabled", "--backend", "gloo",
            "--batch-size", "8", "--epochs", "50", "--max-steps-per-epoch", "2", "--init-timeout", "20",
            "--master-port", str(port), "--world-size", "2", "--run-dir", str(tmp_path / "run")]
    procs = [subprocess.Popen(python("-m", "ddp_utils", "train", *args, "--rank", str(r)), cwd=REPO, env=base_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in (0, 1)]
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "run" / "last.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (tmp_path / "run" / "last.pt").exists(), "no checkpoint was written in time"
        procs[1].kill()                       # the worker node dies
        out, _ = procs[0].communicate(timeout=120)
    finally:
        stop(procs)
    assert procs[0].returncode == 2, out
    assert "another rank stopped answering" in out and "--resume" in out and "last.pt" in out
    from ddp_utils import checkpoint
    assert checkpoint.load_checkpoint(tmp_path / "run" / "last.pt")["epoch"] >= 0


def test_every_ddp_utils_name_the_readme_uses_exists():
    import ddp_utils
    readme = kit_pages()   # the README and its docs/ pages (the API is in docs/python-api.md)
    names = set(re.findall(r"\bdu\.(\w+)", readme))
    assert {"Settings", "setup", "fit", "teardown"} <= names
    for name in names:
        assert hasattr(ddp_utils, name), f"README uses du.{name}, which ddp_utils does not export"


def test_the_readme_is_a_front_page_with_a_picture_that_links_every_reference_page():
    readme = Path(REPO, "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the README is the front page: reference goes into docs/"
    pictures = re.findall(r"!\[[^\]]+\]\(([^)]+\.png)\)", readme)
    assert pictures and all(Path(REPO, p).is_file() for p in pictures), pictures
    for page in [*sorted(Path(REPO, "docs").glob("*.md")), Path(REPO, "lab", "README.md"),
                 Path(REPO, "notebooks", "lesson.md")]:
        assert f"]({page.relative_to(REPO).as_posix()})" in readme, f"the README does not link {page.name}"


def test_check_on_a_gpu_node_switches_on_nccls_own_log_so_step_5_can_read_its_interface_line(monkeypatch):
    """Emulated: NCCL chosen (a GPU, an NCCL build). NCCL_DEBUG=INFO is set before the group is built, unless the
    user set it; the network failure that follows is still one NOT READY paragraph."""
    from ddp_utils.settings import Settings
    from ddp_utils.tools import check
    from ddp_utils.distributed import DistSetupError
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    monkeypatch.delenv("NCCL_DEBUG_SUBSYS", raising=False)
    monkeypatch.setattr(check, "resolve_backend", lambda settings: "nccl")   # a GPU node
    seen = {}

    def setup(settings, log):
        seen.update(NCCL_DEBUG=os.environ.get("NCCL_DEBUG"), SUBSYS=os.environ.get("NCCL_DEBUG_SUBSYS"))
        raise DistSetupError("rank 1: the ranks reach the master's port 29500, but not each other on other ports")
    monkeypatch.setattr(check.distributed, "setup", setup)
    lines = []
    assert not check._prove_collective(Settings(dataset="fake", world_size=2, rank=1), None, lines.append)
    assert seen == {"NCCL_DEBUG": "INFO", "SUBSYS": "INIT,NET"}
    assert lines == ["NOT READY (network): rank 1: the ranks reach the master's port 29500, but not each other on "
                     "other ports"]
    monkeypatch.setenv("NCCL_DEBUG", "WARN")   # the user's choice is kept
    check._prove_collective(Settings(dataset="fake", world_size=2, rank=1), None, lines.append)
    assert seen["NCCL_DEBUG"] == "WARN"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: two NCCL ranks on one machine")
def test_check_on_two_gpus_prints_nccls_interface_line_and_the_sweep(tmp_path):
    port = free_port()
    argv = [["env", f"LOCAL_RANK={r}", *python("-m", "ddp_utils", "check", "--dataset", "fake", "--master-addr",
                                               "127.0.0.1", "--master-port", str(port), "--world-size", "2", "--rank",
                                               str(r), "--run-dir", str(tmp_path / "runs" / "x"))] for r in (0, 1)]
    results = run_all(argv, timeout=180, stagger=1.0)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    assert "NET/Socket" in results[0].output or "Bootstrap" in results[0].output, describe(results)
    assert "all-reduce over the process group (nccl, 2 ranks)" in results[0].output


def test_every_resend_of_a_dropped_stop_is_cancelled_when_the_command_ends(monkeypatch):
    """Issue 43, finding 8: a Ctrl-C and a SIGTERM both dropped by Python each schedule a resend; only the last
    was kept and cancelled, so the first fired after main() had made the stop (into whatever ran next)."""
    import types
    from ddp_utils.robust import guard, peers
    timers = []

    class Timer:
        def __init__(self, delay, call, args):
            self.cancelled, self.daemon = False, False
            timers.append(self)

        def start(self):
            pass

        def cancel(self):
            self.cancelled = True
    monkeypatch.setattr(guard.threading, "Timer", Timer)
    monkeypatch.setattr(peers, "stop_signal", None)
    before = signal.getsignal(signal.SIGTERM)
    with guard.RunGuard(sigterm=True) as run:
        for exc in (KeyboardInterrupt(), guard.Terminated("SIGTERM")):
            run._unraisable(types.SimpleNamespace(exc_value=exc))
    assert signal.getsignal(signal.SIGTERM) is before   # the kit's handler, re-armed for the resend, taken back
    assert len(timers) == 2 and all(timer.cancelled for timer in timers)

"""benchmarks/student_job.py, the student's ImageNet job on one GPU against its ceiling, runs end to end on a CPU.

Its figures count only on a GPU (docs/benchmarks.md gives the command); here it runs at toy sizes so that a
renamed flag, a changed results.json key or a part that breaks shows before the few minutes of a lent GPU are spent.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.procs import REPO, base_env

REPO_PATH = Path(REPO)


@pytest.mark.slow
def test_student_job_runs_every_part_on_the_cpu_and_writes_its_figures(tmp_path):
    out = tmp_path / "student_job.json"
    argv = [sys.executable, "benchmarks/student_job.py", "--images", "16", "--val-images", "4", "--steps", "2",
            "--batch-size", "4", "--cores", "1,4096", "--ceiling-steps", "1", "--compile-backend", "eager",
            "--data-dir", str(tmp_path / "data"), "--out", str(out), "--allow-dirty"]   # a trial: any tree
    done = subprocess.run(argv, cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    r = json.loads(out.read_text())
    assert r["benchmark"] == "student_job" and r["command"].startswith("python benchmarks/student_job.py --images 16")
    assert r["machine"]["cores"] >= 1 and r["machine"]["torch"] and r["date"]
    f = r["figures"]
    assert f["complete"] and f["errors"] == {}, f["errors"]
    assert f["torch"] == torch.__version__ and f["gpu_figures"] == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert "not a GPU figure" in f["note"] and "CPU ONLY: not GPU figures" in done.stdout
    assert f["photos"]["train"] == 16 and f["photos"]["val"] == 4
    # ImageNet-like files (benchmarks/photos.py): about ImageNet's bytes a pixel, recorded beside the figures
    assert 0.45 <= f["photos"]["files"]["bytes_per_pixel"] <= 0.65 and f["photos"]["files"]["mean_kb"] > 60
    assert len(list((tmp_path / "data" / "imagenet" / "train").glob("*/*.JPEG"))) == 16

    for name in ("eager", "compiled"):
        c = f["ceiling"][name]
        assert c["img_s"] > 0 and c["arch"] == "resnet18" and c["image_size"] == 224 and c["batch"] == 4, c
    assert f["ceiling"]["compiled"]["compile"] == "eager" and f["ceiling"]["eager"]["train_gflop_per_image"] > 5
    assert f["gpu_decode"]["images"] == 16 and f["gpu_decode"]["img_s"] > 0 and f["gpu_decode"]["cpu_1core_img_s"] > 0

    run = f["kit"]["workers-1"]
    assert run["command"].startswith("taskset -c ") and "--loader workers --" in run["command"] + " --"
    assert run["workers"] == 1 and run["steps"] == 2 and run["images"] == 8 and run["images_per_s"] > 0
    assert 0 <= run["data_wait_fraction"] <= 1 and run["of_eager_ceiling"] > 0 and run["of_compiled_ceiling"] > 0
    assert set(run["time_split"]) == {"train_time_s", "data_s", "compute_s", "comm_s", "idle_s", "startup_s"}
    assert "gpu_util" in run and "steady_images_per_s" in run
    # 1 worker makes 2 batches ahead: the window would start after 3, so 2 steps leave none (the pages want 200)
    assert run["steady_after_batches"] == 3 and run["steady_steps"] == 0 and run["steady_images_per_s"] is None
    assert r["steady_after_batches"] == 3 and r["steady_steps"] == 0
    assert "CPUs" in f["kit"]["workers-4096"]["skipped"]   # more cores than the machine has: said, not run
    nvjpeg = f["kit"]["nvjpeg-1"]                           # the kit's own GPU decode path, on the CPU here
    assert "--loader nvjpeg" in nvjpeg["command"] and nvjpeg["steps"] == 2 and nvjpeg["images_per_s"] > 0, nvjpeg
    dali = f["kit"]["dali-1"]
    assert dali.get("images_per_s", 0) > 0 or "DALI does not import" in dali["skipped"], dali
    assert r["table"] and all(line.startswith("|") and line.endswith("|") for line in r["table"])
    assert any("kit `--loader workers`, 1 core," in line for line in r["table"]), r["table"]

    # benchmarks/loader_alone.py on the folder student_job made: what bounds a loader, nothing trained
    alone = tmp_path / "loader_alone.json"
    argv = [sys.executable, "benchmarks/loader_alone.py", "--data-dir", str(tmp_path / "data" / "imagenet"),
            "--batch-size", "4", "--batches", "2", "--cores", "1,4096", "--out", str(alone), "--allow-dirty"]
    done = subprocess.run(argv, cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    a = json.loads(alone.read_text())
    assert a["benchmark"] == "loader_alone" and set(a["figures"]) == {"nvjpeg-1", "workers-1"}   # 4096: skipped
    for name, run in a["figures"].items():
        assert run["images"] == 8 and run["img_s"] > 0 and run["inside_ms_per_batch"] > 0 and run["workers"] == 1
        assert run["steady_after_batches"] == 3 and run["steady_steps"] == 2   # timed after the 3 made ahead
    assert a["steady_after_batches"] == 3 and a["steady_steps"] == 2
    assert len(a["table"]) == 4 and "skipped, " in done.stdout


def test_student_job_says_it_has_not_run_on_a_gpu_until_its_results_exist():
    """The page quotes no figure of it before benchmarks/results/student_job.json exists (tests/test_figures.py
    checks the other way round), and gives the command for the GPU machine."""
    page = (REPO_PATH / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert "python benchmarks/student_job.py" in page
    if not (REPO_PATH / "benchmarks" / "results" / "student_job.json").exists():
        assert "has not run on a GPU yet" in page

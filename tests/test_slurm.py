"""SLURM for real: Debian's slurm-wlm and munge on two namespace hosts (tests/helpers/slurm_cluster.py), and the sbatch
script of docs/commands.md as written there, only smaller (2 nodes x 1 or 2 tasks on CPUs, a tiny model). It
trains; scancel mid-run stops every task with the kit's message and leaves the checkpoint whole; a second sbatch
with ``--resume auto`` continues the run. Skipped, with the reason, where slurm-wlm or munge is not installed or
without root; CI installs them (the README's test setup)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ddp_utils import checkpoint
from tests.helpers import netns
from tests.helpers.procs import REPO
from tests.helpers.slurm_cluster import SlurmUnavailable, slurm_cluster

pytestmark = pytest.mark.slow

AS_WRITTEN = {"#SBATCH -J ddp -N 2 -n 8 -c 8 -t 04:00:00": "-n 8 -c 8 -t 04:00:00",
              "srun python -m ddp_utils train --dataset imagenet --data-dir /data/imagenet --workers 6 --resume auto":
              "--dataset imagenet --data-dir /data/imagenet --workers 6"}
TINY = ("--dataset fake --image-size 32 --arch convnet_gn --workers 0 --threads 1 --wandb disabled --backend gloo "
        "--init-timeout 60 --progress off --no-link-probe --batch-size 8")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        with slurm_cluster(tmp_path_factory.mktemp("slurm")) as made:
            yield made
    except SlurmUnavailable as e:
        pytest.skip(f"no SLURM cluster here: {e}")


def docs_script() -> str:
    text = (Path(REPO) / "docs" / "commands.md").read_text(encoding="utf-8")
    return text.split("An sbatch script for 2 nodes x 4 GPUs:")[1].split("```bash\n")[1].split("```")[0]


def job(folder: Path, tasks: int, flags: str) -> Path:
    """The docs' script with ``tasks`` tasks on 2 nodes, 1 core each, and ``flags`` for the training."""
    script = docs_script()
    for line, part in AS_WRITTEN.items():
        assert line in script, f"docs/commands.md's sbatch script changed: {line!r} is gone"
    script = script.replace("-n 8 -c 8 -t 04:00:00", f"-n {tasks} -c 1 -t 00:10:00")
    script = script.replace("--dataset imagenet --data-dir /data/imagenet --workers 6", f"{TINY} {flags}")
    path = folder / f"job-{tasks}.sh"
    path.write_text(script)
    return path


def submit(cluster, script: Path, out: Path) -> str:
    return cluster.run("sbatch", "--parsable", "--chdir", str(REPO), "--output", str(out), str(script)).stdout.strip()


def test_the_docs_sbatch_script_trains_on_two_nodes_with_two_tasks_each(cluster, tmp_path):
    run, out = tmp_path / "run", tmp_path / "slurm.out"
    job_id = submit(cluster, job(tmp_path, 4, f"--epochs 2 --max-steps-per-epoch 3 --run-dir {run}"), out)
    state = cluster.wait_for_job(job_id, timeout=240)
    text = out.read_text(errors="replace")
    assert state == "COMPLETED", text
    results = json.loads((run / "results.json").read_text())
    assert results["world_size"] == 4 and results["epochs_run"] == 2
    assert f"rank 0: listening on {cluster.nodes[0]}:" in text, text   # the master: the first node, by its name


def test_scancel_stops_every_task_with_the_kits_message_and_a_second_sbatch_continues(cluster, tmp_path):
    run, first, second = tmp_path / "run", tmp_path / "first.out", tmp_path / "second.out"
    script = job(tmp_path, 2, f"--epochs 3 --max-steps-per-epoch 30 --run-dir {run}")   # --resume auto: the docs' own
    job_id = submit(cluster, script, first)
    deadline = time.monotonic() + 180
    while not (run / "last.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (run / "last.pt").exists(), first.read_text(errors="replace")
    cluster.run("scancel", job_id)
    assert cluster.wait_for_job(job_id, timeout=90) == "CANCELLED"
    text = first.read_text(errors="replace")
    assert text.count("terminated (SIGTERM)") == 2, text                  # both tasks, each in its own words
    saved = checkpoint.load_checkpoint(run / "last.pt")                    # whole, loadable
    assert not (run / "results.json").exists()
    job_id = submit(cluster, script, second)
    state = cluster.wait_for_job(job_id, timeout=240)
    text = second.read_text(errors="replace")
    assert state == "COMPLETED", text
    results = json.loads((run / "results.json").read_text())
    done = saved["epoch"] + 1                                             # epochs in the checkpoint
    assert results["resumed_from"] and results["epochs_run"] == 3 - done, text   # continued, not restarted
    assert [h["epoch"] for h in results["history"]] == [1, 2, 3]
    for name in cluster.hosts.names:
        leftover = [p for p in netns.ip("netns", "pids", name).split() if b"ddp_utils" in cmdline(p)]
        assert not leftover, f"training processes left in {name}"


def cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:   # it ended meanwhile
        return b""

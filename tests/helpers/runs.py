"""Training runs as a test starts them: the ``train`` command of a quick fake-data run, ranks on loopback, and what
a finished run left (its weights, its processes)."""
from __future__ import annotations

import json
import os
import re
import types
from pathlib import Path

from ddp_utils import checkpoint
from tests.helpers.procs import base_env, describe, free_port, python, run_all


FAST = ["--dataset", "fake", "--image-size", "32", "--arch", "convnet", "--workers", "0",
        "--wandb", "disabled", "--backend", "gloo", "--init-timeout", "60", "--log-every", "2"]


def train_cmd(run_dir, rank, world_size, port, *extra):
    return python("-m", "ddp_utils", "train", *FAST, "--run-dir", str(run_dir), "--rank", str(rank),
                  "--world-size", str(world_size), "--master-port", str(port), *map(str, extra))


def run_ranks(tmp_path, name, world_size, *extra, timeout=180):
    port = free_port()
    results = run_all([train_cmd(tmp_path / name, r, world_size, port, *extra) for r in range(world_size)],
                      timeout=timeout, env=base_env())
    assert all(r.returncode == 0 for r in results), describe(results)
    return results


def tree(folder) -> dict:
    """{relative path: bytes} of every file under ``folder``: a snapshot to compare (nothing changed, nothing left)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def weights(path):
    return checkpoint.load_checkpoint(path)["model"]


def tiny(dataset="fake"):
    """Fake images (no random crops, which differ per rank) and GroupNorm (no per-rank batch statistics):
    1 x 2B and 2 x B must end with the same weights."""
    data = ["--dataset", "fake", "--image-size", "32"] if dataset == "fake" else ["--dataset", "demo"]
    return [*data, "--arch", "convnet_gn", "--workers", "0", "--threads", "1", "--wandb", "disabled",
            "--backend", "gloo", "--init-timeout", "60", "--log-every", "2", "--progress", "off", "--no-link-probe"]


def train_command(*args):
    return python("-m", "ddp_utils", "train", *map(str, args))


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def ours_still_running(marker: str) -> list[int]:
    """Processes whose command line holds ``marker`` (a test's own folder), zombies aside."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid() and marker in cmdline(int(entry.name)):
            try:
                if " Z " not in (entry / "stat").read_text().split(")", 1)[1][:4]:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                pass
    return found


# -- two ranks on loopback -------------------------------------------------------------------------
def run_two(tmp_path, choice: str, **extra) -> list[dict]:
    port = free_port()
    folder = tmp_path / choice
    results = run_all([python("-m", "tests.helpers.comm_scenarios", choice, str(r), str(port), str(folder), json.dumps(extra))
                       for r in range(2)], timeout=180, env=base_env())
    assert all(r.returncode == 0 for r in results), describe(results)
    checks = [dict(re.findall(r"^CHECK (\w+)=(.*)$", r.output, re.M)) for r in results]
    return [{**c, "output": r.output, "results": json.loads((folder / "results.json").read_text())}
            for c, r in zip(checks, results)]


GPU_RUN = ["--dataset", "fake", "--image-size", "64", "--arch", "resnet18", "--workers", "2", "--wandb", "disabled",
        "--epochs", "1", "--max-steps-per-epoch", "5", "--batch-size", "32", "--progress", "off"]


def train_on_gpu(tmp_path, *extra) -> tuple[str, dict]:
    result = run_all([python("-m", "ddp_utils", "train_on_gpu", *GPU_RUN, "--run-dir", str(tmp_path / "run"), *extra)],
                     timeout=300, env=base_env())[0]
    assert result.returncode == 0, describe([result])
    return result.output, json.loads((tmp_path / "run" / "results.json").read_text())


def run_data(num_classes: int, image_size: int, train=None):
    """What the link probe reads of a run's Data: its classes, image size and train loader (None: not timed)."""
    return types.SimpleNamespace(num_classes=num_classes, image_size=image_size, train=train)

"""torchrun for real, on two simulated hosts (network namespaces): static rendezvous (``--master-addr``,
``--node-rank``) and c10d rendezvous (``--rdzv-endpoint``, with ``--local-addr``: every namespace has the same host
name). With ``--max-restarts 1`` and ``--resume auto``, host 2's training process is SIGKILLed after the first
checkpoint: torchrun restarts the processes, the kit joins them under keys of the new attempt (never the killed
attempt's failures or gloo addresses), the run continues from the checkpoint, and ends with the weights, loss and
accuracy of a run never interrupted. Processes and namespaces are removed also when a test fails."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ddp_utils import checkpoint
from tests.helpers import netns, zygote
from tests.helpers.procs import base_env, describe, free_port, run_all

pytestmark = [pytest.mark.slow, pytest.mark.floor]   # torchrun's store and restarts differ by release

# Fake images and GroupNorm: nothing differs per rank or per attempt but what the kit restores from the checkpoint.
TINY = ["-m", "ddp_utils", "train", "--dataset", "fake", "--image-size", "32", "--arch", "convnet_gn",
        "--workers", "0", "--threads", "1", "--wandb", "disabled", "--backend", "gloo", "--init-timeout", "60",
        "--collective-timeout", "30", "--progress", "off", "--no-link-probe", "--batch-size", "8"]
TRAIN = [*TINY, "--epochs", "3", "--max-steps-per-epoch", "20", "--resume", "auto"]


@pytest.fixture(scope="module")
def hosts():
    with netns.two_hosts_or_skip("10.213.11") as made:
        yield made


def torchrun(hosts, host: int, rdzv: str, port: int, run_dir: Path, restarts: int = 1) -> list[str]:
    """The command a user types on host ``host`` (0 or 1), run inside that host's namespace."""
    if rdzv == "static":
        where = ["--node-rank", str(host), "--master-addr", hosts.addrs[0], "--master-port", str(port)]
    else:   # c10d: the agents elect node ranks themselves. The store is on host 1's address; torchrun finds out
        # whether it is its host by the machine's host name, which every namespace shares, so it is told (is_host)
        where = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addrs[0]}:{port}", "--rdzv-id", "kit",
                 "--local-addr", hosts.addrs[host], "--rdzv-conf", f"is_host={str(host == 0).lower()}"]
    return [*hosts.exec_prefix(host), sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--max-restarts", str(restarts), *where, *TRAIN, "--run-dir", str(run_dir)]


def training_process(namespace: str) -> int | None:
    """The pid of the kit's training process inside ``namespace`` (not torchrun's agent)."""
    for pid in netns.ip("netns", "pids", namespace).split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ddp_utils" in argv and b"torch.distributed.run" not in argv:
            return int(pid)
    return None


def kill_after_first_checkpoint(hosts, run_dir: Path, killed: list, deadline: float) -> None:
    """SIGKILL host 2's training process once epoch 1's last.pt exists (a node lost mid-run)."""
    while time.monotonic() < deadline:
        if (run_dir / "last.pt").exists():
            pid = training_process(hosts.names[1])
            if pid:   # the rank's own command first, as the out-of-memory killer does (see test_launch.kill_rank)
                os.kill(zygote.command_of(pid) or pid, signal.SIGKILL)
                killed.append(pid)
                return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def uninterrupted(hosts, tmp_path_factory):
    """The same run, never interrupted, under torchrun with static rendezvous."""
    run = tmp_path_factory.mktemp("torchrun") / "run"
    port = free_port()
    results = run_all([torchrun(hosts, h, "static", port, run) for h in (0, 1)], timeout=240, env=base_env())
    assert all(r.returncode == 0 for r in results), describe(results)
    return run


def assert_identical(run: Path, reference: Path) -> None:
    ours, theirs = checkpoint.load_checkpoint(run / "last.pt"), checkpoint.load_checkpoint(reference / "last.pt")
    assert ours["step"] == theirs["step"] == 60
    for name, tensor in theirs["model"].items():
        assert torch.equal(ours["model"][name], tensor), name
    a, b = (json.loads((r / "results.json").read_text()) for r in (run, reference))
    assert (a["acc1"], a["loss"]) == (b["acc1"], b["loss"])


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_a_worker_killed_after_the_first_checkpoint_is_restarted_and_the_run_ends_bit_exact(
        hosts, uninterrupted, tmp_path, rdzv):
    run, killed = tmp_path / "run", []
    killer = threading.Thread(target=kill_after_first_checkpoint,
                              args=(hosts, run, killed, time.monotonic() + 200), daemon=True)
    killer.start()
    port = free_port()
    results = run_all([torchrun(hosts, h, rdzv, port, run) for h in (0, 1)], timeout=300, env=base_env())
    killer.join()
    assert killed, "host 2's training process was never seen after the first checkpoint"
    assert all(r.returncode == 0 for r in results), describe(results)
    text = results[0].output + results[1].output
    assert "resuming" in text.lower() or "continu" in text.lower(), describe(results)
    assert_identical(run, uninterrupted)
    for name in hosts.names:
        assert not netns.ip("netns", "pids", name).split(), f"processes left in {name}"


# -- one host: what torchrun shows of the kit ---------------------------------------------------------------------
def one_host(port: int, *flags) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port), *TINY, *map(str, flags)]


def test_seeds_under_torchrun_train_one_run_per_seed(tmp_path):
    """Each seed's run joins the process group afresh, under keys of its own in torchrun's store."""
    [res] = run_all([one_host(free_port(), "--epochs", 1, "--max-steps-per-epoch", 2, "--seeds", "2,4",
                              "--run-dir", tmp_path / "run")], timeout=180, env=base_env())
    assert res.returncode == 0, describe([res])
    for seed in (2, 4):
        results = json.loads((tmp_path / f"run-seed{seed}" / "results.json").read_text())
        assert (results["seed"], results["world_size"]) == (seed, 2)


def test_torchruns_summary_names_the_failing_rank_with_the_kits_paragraph(tmp_path):
    """torchrun's "Root Cause" reads the worker's error file: the kit writes its paragraph there (as torch's
    @record would for an uncaught exception), not leaving "error_file: <N/A>"."""
    (tmp_path / "not-a-folder").write_text("no images here")
    [res] = run_all([one_host(free_port(), "--epochs", 1, "--dataset", "demo", "--data-dir", tmp_path / "not-a-folder",
                              "--run-dir", tmp_path / "run")], timeout=180, env=base_env())
    assert res.returncode != 0, describe([res])
    cause = res.output.split("Root Cause")[-1]
    assert "error_file: <N/A>" not in cause and "not-a-folder" in cause and "is not a demo set" in cause, res.output

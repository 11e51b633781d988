"""`launch`: every GPU of a node from one command or one notebook cell; SLURM's variables; failures named.

On CPU with gloo: `--nproc-per-node 2` stands for a node's GPUs. Every run is time-bounded and its processes
(and namespaces) are removed also when a test fails (tests/helpers/procs.py, tests/helpers/netns.py).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ddp_utils import checkpoint, slurm
from ddp_utils.tools import launch as launch_module
from ddp_utils.settings import Settings
from tests.helpers import netns, zygote
from tests.helpers.procs import REPO, base_env, describe, free_port, python, run_all
from tests.helpers.runs import cmdline, ours_still_running, tiny, train_command

STEPS = ["--epochs", "2", "--max-steps-per-epoch", "3"]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from ddp_utils.demo_data import prepare_demo
    return str(prepare_demo(tmp_path_factory.mktemp("data") / "demo"))


def launch_cmd(*args):
    return python("-m", "ddp_utils", "launch", *map(str, args))


def results(run_dir):
    return json.loads((Path(run_dir) / "results.json").read_text())


def assert_same_training(run, single, world_size):
    """Same weights, same global loss and accuracy, both after 2 x 3 real steps."""
    a, b = checkpoint.load_checkpoint(run / "last.pt"), checkpoint.load_checkpoint(single / "last.pt")
    assert a["step"] == b["step"] == 6
    for name in b["model"]:
        assert torch.allclose(a["model"][name], b["model"][name], atol=1e-5, rtol=1e-4), name
    ours, theirs = results(run), results(single)
    assert ours["world_size"] == world_size and theirs["world_size"] == 1
    assert ours["global_batch_size"] == theirs["global_batch_size"]
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
    assert ours["acc1"] == pytest.approx(theirs["acc1"]) and ours["acc5"] == pytest.approx(theirs["acc5"])


def rank_process(marker: str, rank: int) -> list[int]:
    """The training process of ``rank`` (torchrun gives it RANK in its environment), not torchrun itself."""
    found = []
    for pid in ours_still_running(marker):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and "torch.distributed.run" not in cmdline(pid):
            found.append(pid)
    return found


def kill_rank(pid: int) -> None:
    """SIGKILL a training process as the out-of-memory killer does: the rank's own process dies, and only then does
    what torchrun watches end. A rank the suite's fork server runs is a client (the pid torchrun watches) and its
    command; killing the client first would end the command only when the server sees it gone, a moment after
    torchrun has SIGTERMed the rank's siblings, which then find the killed rank still running (tests/helpers/zygote.py)."""
    os.kill(zygote.command_of(pid) or pid, signal.SIGKILL)


def start(cmd):
    return subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert path.exists(), f"{path} did not appear within {seconds} s"


def kill_all(proc, marker):
    """Cleanup after a test, also a failed one: the launcher's session and anything with our folder."""
    for pid in [proc.pid, *ours_still_running(marker)]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError):
        pass


# -- one node, two processes -------------------------------------------------------------------------
@pytest.mark.slow
def test_launch_two_processes_trains_like_one_process_with_the_doubled_batch(tmp_path):
    port = free_port()
    launched, = run_all([launch_cmd("--nproc-per-node", 2, "--master-port", port, *tiny(), *STEPS, "--batch-size", 8,
                                    "--run-dir", tmp_path / "launch", "--log-dir", tmp_path / "logs")],
                        timeout=180, env=base_env())
    assert launched.returncode == 0, describe([launched])
    single, = run_all([train_command(*tiny(), *STEPS, "--batch-size", 16, "--run-dir", tmp_path / "single")],
                      timeout=180, env=base_env())
    assert single.returncode == 0, describe([single])
    assert_same_training(tmp_path / "launch", tmp_path / "single", world_size=2)
    out = launched.output
    assert "world size 2; this node runs ranks 0..1" in out and "epoch 2/2" in out, out
    assert "[rank 1]" not in out                              # only rank 0 is streamed
    assert "as rank 1 of 2" in (tmp_path / "logs" / "rank1.log").read_text()
    assert "--rank 1 --world-size 2 --local-rank 1" in (tmp_path / "logs" / "commands.txt").read_text()


def start_long_run(tmp_path):
    """Two ranks launched for far more epochs than a test waits for (it stops them itself)."""
    return start(launch_cmd("--nproc-per-node", 2, "--master-port", free_port(), *tiny(), "--epochs", 50,
                            "--max-steps-per-epoch", 10, "--batch-size", 8, "--run-dir", tmp_path / "run",
                            "--log-dir", tmp_path / "logs"))


@pytest.mark.slow
@pytest.mark.floor   # torchrun's flags, logs and summary, as this torch has them
def test_a_rank_killed_mid_run_stops_the_launcher_naming_it_and_nothing_is_left(tmp_path):
    """The out-of-memory killer takes rank 1: the launcher stops rank 0 and says which rank died of what."""
    marker = str(tmp_path)
    proc = start_long_run(tmp_path)
    try:
        wait_for(tmp_path / "run" / "last.pt", 120)
        [rank1] = rank_process(marker, 1)
        killed = time.monotonic()
        kill_rank(rank1)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - killed
        assert proc.returncode == 2, out
        assert took < 20, f"the launcher took {took:.1f} s to stop after rank 1 died"
        assert "rank 1 failed: killed by signal SIGKILL" in out and "rank1.log" in out, out
        assert not ours_still_running(marker), [cmdline(p) for p in ours_still_running(marker)]
        assert checkpoint.load_checkpoint(tmp_path / "run" / "last.pt")["epoch"] >= 0
    finally:
        kill_all(proc, marker)


@pytest.mark.slow
def test_ctrl_c_on_the_launcher_stops_every_rank_cleanly_through_sigterm(tmp_path):
    marker = str(tmp_path)
    proc = start_long_run(tmp_path)
    try:
        wait_for(tmp_path / "run" / "last.pt", 120)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
        assert proc.returncode == 130 and took < 20, (took, out)
        assert "launch: interrupted; every process was sent SIGTERM" in out, out
        for rank in (0, 1):   # each rank stopped the kit's clean way (cli.Terminated), not killed
            assert "terminated (SIGTERM)" in (tmp_path / "logs" / f"rank{rank}.log").read_text(), rank
        assert not ours_still_running(marker)
        assert checkpoint.load_checkpoint(tmp_path / "run" / "last.pt")["epoch"] >= 0
    finally:
        kill_all(proc, marker)


@pytest.mark.slow
def test_the_processes_stop_cleanly_when_the_launcher_itself_is_killed_hard(tmp_path):
    """kill -9 on the launcher (a closed terminal, a killed notebook kernel): no orphan keeps training."""
    marker = str(tmp_path)
    proc = start_long_run(tmp_path)
    try:
        wait_for(tmp_path / "run" / "last.pt", 120)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 30
        while ours_still_running(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not ours_still_running(marker), [cmdline(p) for p in ours_still_running(marker)]
        # the kit's clean stop: rank 0 writes why, its own SIGTERM or rank 1's (whichever came first)
        log = (tmp_path / "run" / "log.txt").read_text()
        errors = [line for line in log.splitlines() if line.startswith("error: ")]
        assert errors and "SIGTERM" in errors[-1], log
    finally:
        kill_all(proc, marker)


@pytest.mark.slow
@pytest.mark.floor   # torchrun's flags, logs and summary, as this torch has them
def test_with_max_restarts_a_killed_rank_is_restarted_and_the_run_continues_from_its_checkpoint(tmp_path):
    """torchrun's agent under launch: rank 1 killed after the first checkpoint, both processes restarted, the run
    continued from last.pt (--resume auto) to its end."""
    marker = str(tmp_path)
    proc = start(launch_cmd("--nproc-per-node", 2, "--master-port", free_port(), "--max-restarts", 1, *tiny(),
                            "--epochs", 3, "--max-steps-per-epoch", 20, "--batch-size", 8, "--resume", "auto",
                            "--run-dir", tmp_path / "run", "--log-dir", tmp_path / "logs"))
    try:
        wait_for(tmp_path / "run" / "last.pt", 120)
        [rank1] = rank_process(marker, 1)
        kill_rank(rank1)
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out
        got = results(tmp_path / "run")
        assert [h["epoch"] for h in got["history"]] == [1, 2, 3], got["history"]
        assert got["resumed_from"] and got["epochs_run"] < 3, got   # continued from last.pt, not started over
        assert "=== attempt_1" in (tmp_path / "logs" / "rank1.log").read_text()
        assert not ours_still_running(marker)
    finally:
        kill_all(proc, marker)


@pytest.mark.slow
def test_launch_refuses_the_flags_it_sets_itself():
    [res] = run_all([launch_cmd("--nproc-per-node", 2, "--rank", 1)], timeout=60, env=base_env())
    assert res.returncode == 2 and "launch sets --rank of each process itself" in res.output, res.output
    assert "Traceback" not in res.output


@pytest.mark.slow   # it starts processes (pytest.ini's slow)
def test_launch_gives_its_ranks_the_nccl_error_handling_that_lets_the_kits_watch_speak_first(tmp_path):
    """Issue 37, finding 1: torchrun gives its workers the agent's TORCH_NCCL_ASYNC_ERROR_HANDLING or else 1
    (SIGABRT of every survivor when NCCL sees a dead peer, before the kit's watch names it). launch starts torchrun
    with the kit's 2 unless the user chose a value; checked in a worker torchrun started with that environment."""
    var = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    script = tmp_path / "show.py"
    script.write_text(f"import os; print('seen', os.environ.get({var!r}))\n")
    user = {k: v for k, v in base_env().items() if k != var}
    for environ, expected in ((user, "2"), ({**user, var: "3"}, "3")):
        env = launch_module.child_env(environ)
        [res] = run_all([python("-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                                str(free_port()), str(script))], timeout=120, env=env)
        assert res.returncode == 0 and f"seen {expected}" in res.output, res.output


# -- the notebook function ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_notebook_function_streams_rank_0s_lines_as_they_come_and_returns_its_results(tmp_path):
    settings = Settings(dataset="fake", image_size=32, arch="convnet_gn", workers=0, threads=1, wandb="disabled",
                        backend="gloo", init_timeout=60, progress="off", link_probe=False, epochs=3,
                        max_steps_per_epoch=3, batch_size=8, run_dir=str(tmp_path / "run"))
    seen = []   # (line, whether results.json existed when the line arrived)
    got = launch_module.launch(settings, nproc_per_node=2, master_port=free_port(), log_dir=str(tmp_path / "logs"),
                               on_line=lambda line: seen.append((line, (tmp_path / "run" / "results.json").exists())),
                               timeout=240)
    early = [line for line, done in seen if not done and line.startswith("epoch ")]
    assert len(early) >= 2, seen   # epoch lines reached the caller while the run was still going
    assert got == results(tmp_path / "run") and got["world_size"] == 2
    assert not ours_still_running(str(tmp_path))


@pytest.mark.slow
def test_the_notebook_function_raises_with_the_failing_ranks_reason(tmp_path):
    """Rank 0 cannot read the checkpoint to resume: the error says rank 0 and why; rank 1 was told."""
    settings = Settings(dataset="fake", image_size=32, workers=0, threads=1, wandb="disabled", backend="gloo",
                        init_timeout=60, progress="off", link_probe=False, run_dir=str(tmp_path / "run"))
    lines = []
    start_ = time.monotonic()
    with pytest.raises(launch_module.LaunchError) as err:
        launch_module.launch(settings, nproc_per_node=2, master_port=free_port(), log_dir=str(tmp_path / "logs"),
                             resume=str(tmp_path / "nowhere" / "last.pt"), on_line=lines.append, timeout=120)
    text = str(err.value)
    assert text.startswith("rank 0 failed: ") and "nowhere/last.pt" in text, text
    assert time.monotonic() - start_ < 90
    assert "stopped because rank 0 stopped" in (tmp_path / "logs" / "rank1.log").read_text()
    assert not ours_still_running(str(tmp_path))


def test_the_failure_named_is_the_one_that_started_it_not_the_others_reaction():
    peer = ["", "error: rank 0: stopped because rank 3 stopped while preparing the run: DataError: /x: no train/"]
    own = ["Traceback (most recent call last):", "  ...", "ZeroDivisionError: division by zero"]
    assert launch_module.root_cause([(0, 2, peer), (1, 1, own)]) == (1, "ZeroDivisionError: division by zero", False)
    assert launch_module.root_cause([(0, 2, peer)]) == (
        3, "stopped while preparing the run: DataError: /x: no train/", True)
    assert "SIGKILL" in launch_module.reason_of(-9, [])
    # rank 1 learnt rank 0's failure and ended first; torchrun's agent then SIGTERMed rank 0 before it said its own
    termed = ["rank 0: joined ...", "terminated (SIGTERM): the process group was torn down ..."]
    told = ["error: rank 1: stopped because rank 0 stopped while preparing the run: FileNotFoundError: No checkpoint"]
    assert launch_module.root_cause([(1, 2, told), (0, 143, termed)]) == (
        0, "stopped while preparing the run: FileNotFoundError: No checkpoint", True)
    assert launch_module.root_cause([(0, 143, termed)])[1] == "terminated (SIGTERM) (a signal from outside the launcher)"
    assert launch_module.reason_of(2, ["", "error: Invalid settings:", "  - lr=-1: must not be negative"]) == \
        "Invalid settings: - lr=-1: must not be negative"


def test_the_plan_gives_every_process_its_rank_and_refuses_impossible_layouts(monkeypatch):
    monkeypatch.setattr(launch_module, "local_gpus", lambda: 0)   # a CPU node, also on a machine with a GPU
    base = Settings(master_addr="10.0.0.1", master_port=1234)
    plans = launch_module.plan(base, nproc_per_node=2, nnodes=3, node_rank=1)
    assert [(s.rank, s.local_rank, s.world_size) for s in plans] == [(2, 0, 6), (3, 1, 6)]
    assert all(s.init_method == "tcp" and s.master_addr == "10.0.0.1" for s in plans)
    argv = launch_module.child_argv(plans[1], resume="r/last.pt", seeds=[2, 4])
    assert argv[:1] == ["train"] and "--seeds" in argv and "2,4" in argv
    with pytest.raises(ValueError, match="--node-rank 2 with --nnodes 2"):
        launch_module.plan(base, nproc_per_node=1, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="loopback"):
        launch_module.plan(Settings(), nproc_per_node=1, nnodes=2)
    assert len(launch_module.plan(Settings())) == 1   # no GPU: one process


def test_on_a_one_gpu_node_processes_may_share_the_gpu_on_gloo_when_asked(monkeypatch, tmp_path):
    """Lab 4 on a homework node (one T4 or A10G): DDP with 2 processes sharing the GPU, a rehearsal on gloo. Each
    process's command names --local-rank 0, which wins over torchrun's LOCAL_RANK 1 (cuda:1 does not exist).
    The emulated GPU count; the twin on a real GPU: test_gpu_paths.py's gpu-marked shared launch."""
    monkeypatch.setattr(launch_module, "local_gpus", lambda: 1)
    base = Settings(master_port=1234)
    with pytest.raises(ValueError, match="this node has 1 GPU.*or share_gpu=True to rehearse"):
        launch_module.plan(base, nproc_per_node=2)
    plans = launch_module.plan(base, nproc_per_node=2, share_gpu=True)
    assert [(s.rank, s.local_rank, s.world_size) for s in plans] == [(0, 0, 2), (1, 0, 2)]
    launcher = launch_module.Launcher(plans, launch_module.LaunchOptions(log_dir=tmp_path))
    assert launcher.train[-2:] == ["--local-rank", "0"] and "all on GPU 0, shared" in launcher.describe()[0]
    with pytest.raises(ValueError, match="need gloo: NCCL refuses two ranks on one GPU"):
        launch_module.plan(base.replace(backend="nccl"), nproc_per_node=2, share_gpu=True)
    assert [s.local_rank for s in launch_module.plan(base, nproc_per_node=1, share_gpu=True)] == [0]
    monkeypatch.setattr(launch_module, "local_gpus", lambda: 2)   # two GPUs: one process each, never shared
    with pytest.raises(ValueError, match="DDP runs one process per GPU. Use --nproc-per-node 2 .*\\.$"):
        launch_module.plan(base, nproc_per_node=3, share_gpu=True)
    plans = launch_module.plan(base, nproc_per_node=2, share_gpu=True)
    assert [s.local_rank for s in plans] == [0, 1]
    assert "--local-rank" not in launch_module.Launcher(plans, launch_module.LaunchOptions(log_dir=tmp_path)).train


# -- two hosts, two processes each ----------------------------------------------------------------------------
@pytest.fixture
def two_hosts():
    with netns.two_hosts_or_skip("10.213.9") as hosts:
        yield hosts


def host_cmds(hosts, port, *flags, data_dirs=None, tmp_path=None):
    return [[*hosts.exec_prefix(h), *launch_cmd("--nnodes", 2, "--node-rank", h, "--nproc-per-node", 2,
                                                 "--master-addr", hosts.addrs[0], "--master-port", port, *flags,
                                                 *(["--data-dir", data_dirs[h]] if data_dirs else []),
                                                 "--log-dir", tmp_path / f"logs-h{h}")] for h in range(2)]


@pytest.mark.slow
def test_two_hosts_with_two_processes_each_train_like_one_process_with_four_times_the_batch(two_hosts, tmp_path):
    port = free_port()
    cmds = host_cmds(two_hosts, port, *tiny(), *STEPS, "--batch-size", 8, "--run-dir", tmp_path / "ddp",
                     tmp_path=tmp_path)
    launched = run_all(cmds, timeout=300, env=base_env())
    assert all(r.returncode == 0 for r in launched), describe(launched)
    assert "world size 4; this node runs ranks 2..3" in launched[1].output, describe(launched)
    single, = run_all([train_command(*tiny(), *STEPS, "--batch-size", 32, "--run-dir", tmp_path / "single")],
                      timeout=180, env=base_env())
    assert single.returncode == 0, describe([single])
    assert_same_training(tmp_path / "ddp", tmp_path / "single", world_size=4)
    assert "as rank 3 of 4" in (tmp_path / "logs-h1" / "rank3.log").read_text()


def start_long_runs_on(hosts, tmp_path, nproc_per_node: int) -> list:
    """`launch` on both hosts for far more epochs than a test waits for (it stops them itself); logs in logs<N>."""
    common = ["--nnodes", 2, "--nproc-per-node", nproc_per_node, "--master-addr", hosts.addrs[0], "--master-port",
              free_port(), *tiny(), "--epochs", 50, "--max-steps-per-epoch", 10, "--batch-size", 8, "--run-dir",
              tmp_path / "run"]
    return [start([*hosts.exec_prefix(n), *launch_cmd("--node-rank", n, *common, "--log-dir", tmp_path / f"logs{n}")])
            for n in (0, 1)]


@pytest.mark.slow
def test_when_a_nodes_torchrun_is_killed_hard_its_launcher_stops_the_orphaned_processes(two_hosts, tmp_path):
    """Issue 37, finding 8: node 1's torchrun agent SIGKILLed (out of memory, kill -9) while node 0's, which holds the
    store, lives on: node 1's worker runs in a session of its own, which no signal to torchrun reaches, and nothing
    in the job broke, so it trained on as an orphan holding its GPU and the port while `launch` exited. Node 1's
    launcher remembers it while torchrun runs and stops it (SIGTERM: the kit's clean stop, then SIGKILL); node 0's
    ranks then stop too, naming it."""
    marker, nodes = str(tmp_path), start_long_runs_on(two_hosts, tmp_path, nproc_per_node=1)
    try:
        wait_for(tmp_path / "run" / "last.pt", 120)
        [agent] = [pid for pid in ours_still_running(f"{tmp_path}/logs1") if "torch.distributed.run" in cmdline(pid)]
        [worker] = rank_process(marker, 1)
        time.sleep(1.5)   # the launcher looks at torchrun's processes every second
        killed = time.monotonic()
        os.kill(agent, signal.SIGKILL)
        out1, _ = nodes[1].communicate(timeout=90)
        assert nodes[1].returncode == 2, out1
        deadline = time.monotonic() + 10
        while Path(f"/proc/{worker}").exists() and " Z " not in Path(f"/proc/{worker}/stat").read_text()[-60:] \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not rank_process(marker, 1), "node 1's worker trains on as an orphan"
        out0, _ = nodes[0].communicate(timeout=90)
        assert nodes[0].returncode == 2 and "rank 1" in out0, out0
        assert time.monotonic() - killed < 60
        assert not ours_still_running(marker), [cmdline(p) for p in ours_still_running(marker)]
        assert checkpoint.load_checkpoint(tmp_path / "run" / "last.pt")["epoch"] >= 0   # whole
    finally:
        for node in nodes:
            kill_all(node, marker)


@pytest.mark.slow
def test_a_rank_killed_on_one_host_is_named_on_the_other_not_its_sibling_that_torchrun_stopped(two_hosts, tmp_path):
    """Issue 37, finding 2: rank 3 (host 1) SIGKILLed reports nothing; host 1's torchrun agent then SIGTERMs rank 2,
    whose report is the first the store holds. Host 0 used to say only "rank 2 stopped: SIGTERM"; rank 2's report
    now names rank 3, which had ended on its machine before."""
    marker, nodes = str(tmp_path), start_long_runs_on(two_hosts, tmp_path, nproc_per_node=2)
    try:
        wait_for(tmp_path / "run" / "last.pt", 180)
        [rank3] = rank_process(marker, 3)
        kill_rank(rank3)
        outs = [node.communicate(timeout=120)[0] for node in nodes]
        assert [node.returncode for node in nodes] == [2, 2], outs
        # host 0's launch names the first failure its ranks were told of (the rank that stopped first there may
        # be SIGTERMed by host 0's own agent next): rank 2's, which names rank 3
        assert re.search(r"rank 2 failed: stopped: SIGTERM .*, after rank 3 on the same machine had ended", outs[0]), \
            outs[0][-3000:]
        assert "rank 3 failed: killed by signal SIGKILL" in outs[1], outs[1][-3000:]
        assert not ours_still_running(marker), [cmdline(p) for p in ours_still_running(marker)]
    finally:
        for node in nodes:
            kill_all(node, marker)


@pytest.mark.slow
def test_a_bad_data_dir_on_one_host_fails_both_launchers_naming_the_rank_and_its_reason(two_hosts, tmp_path, demo_dir):
    port = free_port()
    (tmp_path / "not-a-folder").write_text("no images here")
    cmds = host_cmds(two_hosts, port, *tiny("demo"), *STEPS, "--batch-size", 8, "--run-dir", tmp_path / "ddp",
                     data_dirs=[demo_dir, str(tmp_path / "not-a-folder")], tmp_path=tmp_path)
    started = time.monotonic()
    launched = run_all(cmds, timeout=150, env=base_env())
    took = time.monotonic() - started
    assert [r.returncode for r in launched] == [2, 2], describe(launched)
    assert took < 120, took
    for r in launched:   # host 1 learnt it through the store, host 2 from its own processes
        assert re.search(r"error: rank [23] failed: .*not-a-folder.* is not a demo set", r.output), describe(launched)
    assert "runs on another node" in launched[0].output, launched[0].output
    for name in two_hosts.names:
        assert not netns.ip("netns", "pids", name).split(), f"processes left in {name}"


# -- SLURM ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-04]", ["node01", "node02", "node03", "node04"]),
    ("a,b", ["a", "b"]),
    ("gpu7", ["gpu7"]),
    ("n[08-10,12],login1", ["n08", "n09", "n10", "n12", "login1"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
])
def test_slurm_node_lists_are_expanded_in_order(nodelist, hosts):
    assert slurm.expand_nodelist(nodelist) == hosts


def test_slurm_variables_give_rank_world_size_local_rank_and_the_master(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")   # no scontrol: the node list is parsed
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[03-04]"}
    s = Settings.from_env(env)
    assert (s.rank, s.world_size, s.local_rank, s.master_addr, s.init_method) == (5, 8, 1, "gpu03", "tcp")
    assert Settings.from_env({**env, "MASTER_ADDR": "10.0.0.9"}).master_addr == "10.0.0.9"
    assert Settings.from_env(env, master_addr="10.0.0.7").master_addr == "10.0.0.7"
    torchrun = {**env, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}
    assert (Settings.from_env(torchrun).rank, Settings.from_env(torchrun).world_size) == (0, 2)   # torchrun wins
    with pytest.raises(ValueError, match="SLURM_NTASKS"):
        Settings.from_env({**env, "SLURM_NTASKS": "eight"})


def test_scontrol_expands_the_node_list_where_slurm_is_installed(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "big-node-7\\nbig-node-9\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert slurm.first_host("big-node-[7,9]") == "big-node-7"
    assert Settings.from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                              "SLURM_JOB_NODELIST": "big-node-[7,9]"}).master_addr == "big-node-7"


@pytest.mark.slow
def test_two_processes_started_with_slurms_variables_train_together(tmp_path):
    """What srun does: the same command twice, told apart only by SLURM_PROCID / SLURM_LOCALID."""
    port = free_port()
    tasks = [["env", f"SLURM_PROCID={r}", "SLURM_NTASKS=2", f"SLURM_LOCALID={r}", "SLURM_JOB_NODELIST=localhost",
              f"MASTER_PORT={port}"] for r in range(2)]
    cmd = train_command(*tiny(), "--epochs", 1, "--max-steps-per-epoch", 2, "--batch-size", 8,
                    "--run-dir", tmp_path / "run")
    res = run_all([cmd, cmd], timeout=180, env=base_env(), prefix=tasks)
    assert all(r.returncode == 0 for r in res), describe(res)
    assert f"joined tcp://localhost:{port} as rank 1 of 2" in res[1].output, describe(res)
    assert results(tmp_path / "run")["world_size"] == 2


# -- resuming on more ranks: a node added ------------------------------------------------------------
@pytest.mark.slow
def test_a_two_rank_run_resumes_on_four_ranks_started_by_launch(tmp_path):
    """2 ranks train epoch 1 of 3; ``launch --nproc-per-node 4`` continues it from last.pt to the end: the
    sampler shards every later epoch four ways, the schedule continues at the same share of the run."""
    run, data = tmp_path / "run", [*tiny(), "--max-steps-per-epoch", "0", "--batch-size", "16"]
    first = run_all([launch_cmd("--nproc-per-node", 2, "--master-port", free_port(), *data, "--epochs", 1,
                                "--run-dir", run, "--log-dir", tmp_path / "logs2")], timeout=180, env=base_env())
    assert first[0].returncode == 0, describe(first)
    steps_2 = checkpoint.load_checkpoint(run / "last.pt")["step"]
    resumed = run_all([launch_cmd("--nproc-per-node", 4, "--master-port", free_port(), *data, "--epochs", 3,
                                  "--resume", run / "last.pt", "--log-dir", tmp_path / "logs4")],
                      timeout=240, env=base_env())
    out = resumed[0].output
    assert resumed[0].returncode == 0 and "Traceback" not in out, describe(resumed)
    assert "continuing at epoch 2" in out and "(world size 2); this run takes" in out, out[-3000:]
    done = results(run)
    assert done["world_size"] == 4 and [len(h["train"]["per_rank"]) for h in done["history"]] == [2, 4, 4]
    assert done["per_rank"] == []   # epochs of two world sizes: no per-rank rows mixing them
    steps_4 = checkpoint.load_checkpoint(run / "last.pt")["step"] - steps_2
    assert steps_4 == steps_2, (steps_2, steps_4)   # 2 epochs at half the steps each: every image once an epoch
    assert "rank 3 of 4" in (tmp_path / "logs4" / "rank3.log").read_text()


def test_the_launcher_forgets_the_workers_that_ended():
    """Issue 43, finding 8: the launcher's list of torchrun's processes only grew (every attempt of a run with
    restarts added its workers, and a PID that came back stood for an ended process). What ended is dropped."""
    import subprocess
    import psutil
    from ddp_utils.tools.launch import Launcher
    launcher = Launcher.__new__(Launcher)
    ended = subprocess.Popen(["true"])
    remembered = psutil.Process(ended.pid)
    ended.wait()
    launcher.popen = subprocess.Popen(["sleep", "5"])
    try:
        launcher.workers = {ended.pid: remembered}
        launcher.remember_workers()
        assert launcher.workers == {}
    finally:
        launcher.popen.kill()
        launcher.popen.wait()

"""The process group as notebooks rely on it: bounded, idempotent, agreeing, and clear when it fails.

Every multi-rank scenario runs in separate processes (tests/helpers/dist_scenarios.py) under a hard time
bound; the in-process tests below never leave a process group behind.
"""
from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp_utils import collectives, distributed
from ddp_utils.robust import compat, peers
from ddp_utils.robust import rendezvous
from ddp_utils.settings import Settings
from tests.helpers import netns
from tests.helpers.procs import REPO, base_env, describe, free_port, python, run_all


def scenario(name, rank, world, port, addr="127.0.0.1", init_timeout=30):
    return python("-m", "tests.helpers.dist_scenarios", name, *map(str, (rank, world, port, addr, init_timeout)))


def checks(result) -> dict:
    """The ``CHECK name=value`` lines a scenario printed."""
    out = {}
    for line in result.output.splitlines():
        if line.startswith("CHECK "):
            key, value = line[6:].split("=", 1)
            out[key] = json.loads(value)
    return out


# -- two ranks on loopback --------------------------------------------------------------------
@pytest.mark.slow
def test_what_rank_0_alone_writes_between_collectives_is_waited_for_outside_them():
    """Issue 43, finding 5: rank 0 wrote the profiler's traces and a mended best.pt while the others waited in the
    next collective: a disk slower than its timeout broke training. Now they wait through the store."""
    port = free_port()
    results = run_all([scenario("slow_rank0_writes", r, 2, port) for r in range(2)], timeout=90, env=base_env())
    assert all(r.returncode == 0 for r in results), describe(results)
    main, other = (checks(r) for r in results)
    if "skipped" in main:
        pytest.skip(main["skipped"])
    assert main["traces"] == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    assert main["mended"] is True and other["mended"] is False
    for said in (main, other):
        assert said["sum_after_traces"] == said["sum_after_best"] == [2.0]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "zero1", "fsdp"])
def test_a_rank_that_left_after_an_error_ends_the_others_collective_at_once_in_every_mode(mode):
    """Issue 43, finding 8: a rank that failed left the group as Job.fail does, but under zero1 and fsdp the others'
    next collective waited until that process ended (26.7 s here; a notebook's kernel lives on) or timed out:
    ZeRO's and FSDP's C++ objects kept the freed group's connections open. teardown(abort=True) shuts them."""
    if mode == "fsdp" and compat.fsdp_refusal("cpu", "gloo"):
        pytest.skip(compat.fsdp_refusal("cpu", "gloo"))   # the floor's torch 2.6 runs no FSDP2 on a CPU
    port = free_port()
    results = run_all([scenario(f"left_group_{mode}", r, 2, port) for r in range(2)], timeout=90, env=base_env())
    assert all(r.returncode == 0 for r in results), describe(results)
    waiting, left = (checks(r) for r in results)
    assert left["left"] is True and waiting["collective"].startswith("failed"), describe(results)
    assert waiting["seconds_in_collective"] < 6, describe(results)   # rank 1 lives 12 s on; the timeout is 60 s


@pytest.fixture(scope="module")
def basics():
    """One two-rank run of tests/helpers/dist_scenarios.py:basics; the tests below read its checks."""
    port = free_port()
    results = run_all([scenario("basics", r, 2, port) for r in range(2)], timeout=90, env=base_env())
    assert all(r.returncode == 0 for r in results), describe(results)
    return [checks(r) for r in results], results


@pytest.mark.slow
@pytest.mark.floor
def test_two_ranks_init_and_all_reduce_sum_and_broadcast(basics):
    for c in basics[0]:
        assert c["sum"] == [3.0, 3.0, 3.0]  # (0 + 1) + (1 + 1)
        assert c["broadcast"] == {"from": 0}


@pytest.mark.slow
@pytest.mark.floor
def test_torchs_group_keeps_init_timeout_and_the_kits_messages_have_a_store_client_of_their_own(basics):
    """Issue 43, finding 9: one store client served torch's group and the kit's threads, and the kit set its
    timeout to 10 s after init, so torch's own later use of it (NCCL's new communicators) had 10 s too."""
    for c in basics[0]:
        group, kits = c["store_timeouts"]
        assert 29 < group <= 30 and kits == 10.0   # what was left of the scenarios' init_timeout; the kit's own


@pytest.mark.slow
def test_setup_twice_with_same_settings_keeps_the_process_group(basics):
    for c in basics[0]:
        assert c["same_ctx"] and c["same_group"] and c["inits_after_same"] == 1


@pytest.mark.slow
@pytest.mark.floor
def test_setup_with_changed_settings_reinitialises_and_collectives_still_work(basics):
    checks_, results = basics
    for c, r in zip(checks_, results):
        assert c["inits_after_changed"] == 2 and c["new_group"], describe(results)
        assert c["same_ctx_new_run_dir"], describe(results)
        assert c["sum_after_reinit"] == [3.0, 3.0]
        assert "settings changed (epochs 2 -> 3)" in r.output


@pytest.mark.slow
def test_teardown_twice_and_session_error_leave_no_process_group(basics):
    for c in basics[0]:
        assert c["initialized_after_teardown"] is False
        assert c["initialized_after_session_error"] is False


@pytest.mark.slow
def test_setup_sets_socket_ifname_env_vars_on_every_rank(basics):
    checks_, results = basics
    for rank, (c, r) in enumerate(zip(checks_, results)):
        assert c["env"] == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        assert f"rank {rank}: using interface lo (127.0.0.1) to reach master 127.0.0.1:" in r.output


@pytest.mark.slow
@pytest.mark.floor
def test_settings_mismatch_is_refused_on_both_ranks_naming_the_field():
    port = free_port()
    results = run_all([scenario("mismatch", r, 2, port) for r in range(2)], timeout=90, env=base_env())
    for r in results:
        assert r.returncode == 3, describe(results)
        assert "ERROR SettingsMismatch" in r.output and "batch_size" in r.output
        assert "rank 0 has 64, rank 1 has 96" in r.output and "edit the notebooks/flags" in r.output
        assert checks(r)["initialized_after_error"] is False


# -- failures are bounded and explained -------------------------------------------------------
@pytest.fixture(scope="module")
def failures():
    """Lone or broken ranks run side by side: no master, a busy port, no worker, a failing init,
    an interrupt. Results by name."""
    ports = {name: free_port() for name in ("unreachable", "no_worker", "init_fails")}  # all unused
    with socket.socket() as holder:  # this test process holds the busy port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        ports["busy"] = holder.getsockname()[1]
        runs = {"unreachable": scenario("joined", 1, 2, ports["unreachable"], init_timeout=3),
                "busy": scenario("joined", 0, 2, ports["busy"], init_timeout=20),
                "no_worker": scenario("joined", 0, 2, ports["no_worker"], init_timeout=3),
                "init_fails/0": scenario("init_fails", 0, 2, ports["init_fails"], init_timeout=3),
                "init_fails/1": scenario("init_fails", 1, 2, ports["init_fails"], init_timeout=3),
                "interrupted": scenario("interrupted", 0, 2, free_port(), init_timeout=30)}
        for where in ("init", "agree"):   # init_timeout 30 s: the bound below is the watch's, not a timeout
            ports[f"stopped_in_{where}"] = port = free_port()
            runs.update({f"stopped_in_{where}/{r}": scenario(f"stopped_in_{where}", r, 2, port, init_timeout=30)
                         for r in (0, 1)})
        results = dict(zip(runs, run_all(list(runs.values()), timeout=60, env=base_env())))
    for name, r in results.items():
        ok = 0 if name == "interrupted" or name.endswith("/1") and name.startswith("stopped") else 3
        assert r.returncode == ok, describe(list(results.values()))
    return results, ports


@pytest.mark.slow
@pytest.mark.floor
def test_unreachable_master_fails_within_the_bound_naming_address_and_port(failures):
    r, port = failures[0]["unreachable"], failures[1]["unreachable"]
    assert 3 <= checks(r)["seconds_to_error"] < 30  # retried for init_timeout, then gave up
    assert f"rank 1 cannot reach the master at 127.0.0.1:{port}" in r.output
    assert "tried for 3 s" in r.output and "firewall" in r.output and "random ports" in r.output


@pytest.mark.slow
@pytest.mark.floor
def test_busy_port_fails_fast_naming_the_port_and_the_holding_pid(failures):
    r, port = failures[0]["busy"], failures[1]["busy"]
    assert checks(r)["seconds_to_error"] < 5  # init_timeout is 20 s: nothing waited
    assert f"master_port {port}" in r.output and f"pid {os.getpid()}" in r.output
    assert "restart its notebook kernel" in r.output and "ALL nodes" in r.output


@pytest.mark.slow
@pytest.mark.floor
def test_missing_worker_fails_at_init_timeout_naming_the_missing_rank(failures):
    r, port = failures[0]["no_worker"], failures[1]["no_worker"]
    assert 3 <= checks(r)["seconds_to_error"] < 30
    assert f"rank 0: rank(s) 1 of world_size 2 did not arrive at tcp://127.0.0.1:{port}" in r.output
    assert "init_timeout=3 s" in r.output and "Traceback" not in r.output


@pytest.mark.slow
@pytest.mark.floor
def test_failing_init_process_group_becomes_a_readable_error_on_every_rank(failures):
    port = failures[1]["init_fails"]
    failed, waiting = failures[0]["init_fails/1"], failures[0]["init_fails/0"]
    assert f"rank 1 could not join the process group at tcp://127.0.0.1:{port}" in failed.output
    assert "random ports" in failed.output and "Traceback" not in failed.output
    assert "(PyTorch said: Gloo connectFullMesh failed: simulated)" in failed.output
    # rank 0 waited in init_process_group for rank 1: it stops at once, with rank 1's reason
    assert checks(waiting)["seconds_to_error"] < 3, waiting.output   # 3: init_timeout
    assert re.search(r"rank 0: setup stopped because rank 1 \(on .+, 127\.0\.0\.1\) failed during setup: "
                     rf"DistSetupError: rank 1 could not join the process group at tcp://127\.0\.0\.1:{port}",
                     waiting.output), waiting.output
    assert "Traceback" not in waiting.output


@pytest.mark.slow
@pytest.mark.floor
@pytest.mark.parametrize("where", ["init", "agree"])
def test_a_rank_stopped_during_setup_stops_the_others_at_once_naming_it(failures, where):
    """Stop pressed on rank 1 while rank 0 waits for it inside init_process_group, or in the settings agreement
    after it (C++ waits that no interrupt reaches): rank 0 stops within seconds, not at init_timeout (30 s)."""
    stopped, waiting = failures[0][f"stopped_in_{where}/1"], failures[0][f"stopped_in_{where}/0"]
    assert checks(stopped)["interrupted"] is True and checks(stopped)["initialized_after_error"] is False
    assert checks(waiting)["seconds_to_error"] < 10, waiting.output
    assert re.search(r"rank 0: setup stopped because rank 1 \(on .+, 127\.0\.0\.1\) failed during setup: "
                     r"KeyboardInterrupt \(Stop pressed in the notebook, or Ctrl-C\)\. Deal with that rank's problem, "
                     r"then run setup again on every rank\.", waiting.output), waiting.output
    assert checks(waiting)["initialized_after_error"] is False and "Traceback" not in waiting.output
    assert "frame #" not in waiting.output and "Exception raised from" not in waiting.output   # C++'s, held back


@pytest.mark.slow
@pytest.mark.floor
def test_interrupt_while_waiting_for_workers_stops_at_once_and_tears_down(failures):
    r = failures[0]["interrupted"]
    c = checks(r)
    assert c["seconds_to_interrupt"] < 10 and c["initialized_after_interrupt"] is False  # not 30 s
    assert "rank 0: interrupted during setup; process group torn down" in r.output


# -- one process, in this process ------------------------------------------------------------
def test_world_size_one_creates_no_process_group(clean_env):
    ctx = distributed.setup(Settings(workers=0), log=lambda *_: None)
    assert ctx.backend is None and not ctx.distributed and ctx.is_main
    assert not dist.is_initialized()
    t = torch.ones(2)
    assert collectives.all_reduce_sum(t, ctx) is t and t.tolist() == [1.0, 1.0]
    assert collectives.broadcast_object("x", ctx) == "x"
    collectives.barrier(ctx)


def test_agree_is_a_no_op_with_one_process(clean_env):
    ctx = distributed.setup(Settings(workers=0), log=lambda *_: None)
    assert collectives.agree({"batch_size": 64}, ctx) is None


def test_keyboard_interrupt_after_init_tears_the_group_down(clean_env, monkeypatch):
    real_init = dist.init_process_group

    def init_then_interrupt(backend, **kw):  # a real group exists when the interrupt arrives
        real_init(backend, store=dist.HashStore(), rank=0, world_size=1)
        raise KeyboardInterrupt

    monkeypatch.setattr(dist, "init_process_group", init_then_interrupt)
    monkeypatch.setattr(rendezvous, "wait_for_all_ranks", lambda *args: None)  # no worker here
    monkeypatch.setattr(distributed.mesh, "probe", lambda *args: None)   # (which would wait for it 40 s)
    settings = Settings(world_size=2, rank=0, master_port=free_port(), backend="gloo", init_timeout=5,
                        workers=0)
    with pytest.raises(KeyboardInterrupt):
        distributed.setup(settings, log=lambda *_: None)
    assert not dist.is_initialized() and distributed._active is None


# -- two hosts: network namespaces ------------------------------------------------------------
@pytest.fixture(scope="module")
def two_hosts():
    """Two network namespaces joined by a veth pair: host 1 = 10.213.0.1, host 2 = 10.213.0.2.

    The addresses exist only inside the namespaces; both are deleted afterwards (tests/helpers/netns.py).
    """
    try:
        with netns.two_hosts("10.213.0") as net:
            yield net.names, net.veths
    except netns.NetnsUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def two_host_runs(two_hosts):
    """Ranks 0 and 1 on hosts 1 and 2 with only master_addr set; also a rank 0 on the wrong host."""
    hosts, veths = two_hosts
    port = free_port()
    runs = [(hosts[1], scenario("joined", 1, 2, port, "10.213.0.1")),  # first: it must wait for rank 0
            (hosts[0], scenario("joined", 0, 2, port, "10.213.0.1")),
            (hosts[1], scenario("joined", 0, 2, free_port(), "10.213.0.1")),  # host 2 is not 10.213.0.1
            (hosts[1], scenario("joined", 1, 2, free_port(), "10.213.0.9", init_timeout=10))]  # no such host
    results = run_all([argv for _, argv in runs], timeout=90, env=base_env(), stagger=1.0,
                      prefix=[["ip", "netns", "exec", host] for host, _ in runs])
    return results, veths, port


@pytest.mark.slow
@pytest.mark.floor
def test_two_hosts_join_with_only_master_addr_set(two_host_runs):
    """Gloo alone would announce 127.0.0.1 (the host name's address) and hang; setup picks the veth."""
    (rank1, rank0, *_), veths, port = two_host_runs
    assert rank0.returncode == 0 and rank1.returncode == 0, describe([rank1, rank0])
    assert f"rank 0: listening on 10.213.0.1:{port} (every node's master_addr and master_port" in rank0.output
    assert checks(rank0) == {"interface": veths[0], "sum": [3.0]}
    assert checks(rank1) == {"interface": veths[1], "sum": [3.0]}
    chosen = f"rank 1: using interface {veths[1]} (10.213.0.2) to reach master 10.213.0.1:{port}"
    assert chosen in rank1.output


@pytest.mark.slow
def test_rank0_refuses_a_master_addr_that_is_not_its_own(two_host_runs):
    r = two_host_runs[0][2]
    assert r.returncode == 3, describe([r])
    assert "master_addr 10.213.0.1 (10.213.0.1) is not one of its addresses" in r.output
    assert "private IP" in r.output


@pytest.mark.slow
def test_a_worker_given_a_wrong_master_addr_says_what_the_network_answered_before_its_init_timeout(two_host_runs):
    """A typo in MASTER_ADDR: within seconds the worker names what it tried, the network's answer and what to compare
    (rank 0's 'listening on' line); it stops at init_timeout, as the pages say."""
    (_, _, _, r), veths, _ = two_host_runs
    assert r.returncode == 3, describe([r])
    note = r.output.split("rank 1: no answer yet from the master at 10.213.0.9:", 1)
    assert len(note) == 2, describe([r])   # printed before the 10 s init_timeout ended: the loop stops at it
    said = note[1].split("ERROR", 1)[0]
    assert f"(tried from 10.213.0.2 on {veths[1]})" in said and "No route to host" in said, said
    assert "rank 0: listening on ADDRESS:PORT" in said and "init_timeout\n  (10 s, at" in said, said
    assert 10 <= checks(r)["seconds_to_error"] < 16


@pytest.mark.slow
def test_a_world_size_larger_than_the_ranks_started_stops_every_started_rank_with_the_kits_paragraph(tmp_path):
    import time as _time

    from tests.helpers.procs import base_env, describe, python, run_all
    port = free_port()
    cmds = [python("-m", "ddp_utils", "train", "--dataset", "fake", "--image-size", "32", "--workers", "0",
                   "--wandb", "disabled", "--backend", "gloo", "--world-size", "3", "--rank", str(r),
                   "--master-port", str(port), "--init-timeout", "6", "--run-dir", str(tmp_path / "run"))
            for r in range(2)]   # rank 2 never starts
    t0 = _time.monotonic()
    results = run_all(cmds, timeout=60, env=base_env())
    assert _time.monotonic() - t0 < 30, describe(results)
    for rank, r in enumerate(results):
        assert r.returncode == 2, describe(results)
        assert "rank(s) 2 of world_size 3 did not arrive" in r.output, describe(results)
        assert "Traceback" not in r.output and "Failed to recv" not in r.output, describe(results)


def test_rank_0s_store_listens_on_master_addr_only_not_on_every_interface():
    import psutil
    port = free_port()
    settings = Settings(world_size=2, rank=0, master_addr="127.0.0.1", master_port=port, init_timeout=5, workers=0)
    keys = rendezvous.open_store(settings, log=lambda *_: None)
    try:
        listening = {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert listening == {"127.0.0.1"}, listening   # PyTorch's own would be 0.0.0.0 or ::
        rendezvous.open_store(settings, log=lambda *_: None)   # a re-run setup reuses the same store
    finally:
        del keys


def test_a_restarted_rank_never_joins_a_generation_that_formed_but_whose_rank_0_died_before_closing_it():
    """Issue 37, finding 3: under torchrun the store outlives the attempts. Attempt 1's ranks all arrived in
    generation 5 and its rank 0 was killed before it closed it; restarted, rank 1 joined 5 again, read the old
    arrivals as the new ones and went on with the old attempt's peers. It must wait for the generation the
    restarted rank 0 opens (6)."""
    import datetime
    import threading
    import time as _time

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    server.set(rendezvous.GENERATION, "4")
    server.add(rendezvous.GENERATION, 1)   # generation 5: attempt 1's
    for r in range(2):
        server.set(f"ddp_utils/5/arrived/{r}", json.dumps({"rank": r}))
    settings = Settings(world_size=2, rank=1, master_addr="127.0.0.1", master_port=port, init_timeout=20, workers=0)
    got = {}
    thread = threading.Thread(target=lambda: got.update(keys=rendezvous.open_store(settings, log=lambda *_: None)))
    thread.start()
    _time.sleep(1.0)
    assert "keys" not in got, "rank 1 joined the generation attempt 1 formed"
    server.add(rendezvous.GENERATION, 1)   # the restarted rank 0 opens generation 6 (and closes 5)
    server.set("ddp_utils/5/closed", "1")
    thread.join(15)
    assert got["keys"].prefix == "ddp_utils/6"
    del server


def test_rank_0_goes_on_only_once_every_worker_has_read_the_facts_of_all():
    """CI, stop 59: rank 0 found two ranks on one GPU, stopped and closed its store while rank 1 slept between two
    looks at the arrivals; rank 1 then blamed a closed rendezvous instead of naming the shared GPU. Rank 0 now
    waits until every worker has read every rank's facts (and no longer than READ_WITHIN when one never does)."""
    import threading
    import time as _time

    keys = dist.PrefixStore("ddp_utils/1", dist.HashStore())
    keys.set("arrived/1", json.dumps({"rank": 1, "gpu": "GPU-t4-0000"}))   # rank 1 has arrived, not yet read
    settings = Settings(world_size=2, rank=0, master_addr="127.0.0.1", master_port=29500, init_timeout=20, workers=0)
    got = {}
    mine = {"rank": 0, "gpu": "GPU-t4-0000"}
    thread = threading.Thread(target=lambda: got.update(everyone=rendezvous.wait_for_all_ranks(keys, settings,
                                                                                                facts=mine)))
    thread.start()
    _time.sleep(0.5)
    assert "everyone" not in got, "rank 0 went on before rank 1 had read the facts"
    worker = Settings(world_size=2, rank=1, master_addr="127.0.0.1", master_port=29500, init_timeout=20, workers=0)
    assert [f["rank"] for f in rendezvous.wait_for_all_ranks(keys, worker, facts={"rank": 1, "gpu": "GPU-t4-0000"})] == [0, 1]   # says it has read them
    thread.join(5)
    assert [f["gpu"] for f in got["everyone"]] == ["GPU-t4-0000"] * 2


def test_rank_0_waits_at_most_read_within_for_a_worker_that_never_reads(monkeypatch):
    import time as _time

    monkeypatch.setattr(rendezvous, "READ_WITHIN", 0.3)
    keys = dist.PrefixStore("ddp_utils/1", dist.HashStore())
    for r in range(2):
        keys.set(f"arrived/{r}", json.dumps({"rank": r}))
    settings = Settings(world_size=2, rank=0, master_addr="127.0.0.1", master_port=29500, init_timeout=20, workers=0)
    started = _time.monotonic()
    assert len(rendezvous.wait_for_all_ranks(keys, settings)) == 2
    assert 0.3 <= _time.monotonic() - started < 3


def test_a_worker_that_re_ran_setup_alone_is_told_rank_0_still_runs_the_earlier_group():
    """Issue 43, finding 8: the hint for a worker whose rank 0 still runs the group it formed (closed, and formed)
    was never shown: the text asked `formed` first and said rank 0 had not opened the attempt yet."""
    import datetime
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    server.add(rendezvous.GENERATION, 1)
    for r in range(2):
        server.set(f"ddp_utils/1/arrived/{r}", json.dumps({"rank": r}))
    server.set("ddp_utils/1/closed", "1")   # rank 0 formed its group and trains in it
    settings = Settings(world_size=2, rank=1, master_addr="127.0.0.1", master_port=port, init_timeout=1, workers=0)
    lines = []
    with pytest.raises(distributed.DistSetupError, match=r"still runs an earlier process group \(has rank 0 re-run setup\?\)"):
        rendezvous.open_store(settings, log=lines.append)
    assert any("still runs an earlier process group" in line for line in lines)
    del server


def test_torchruns_store_listens_on_every_interface_as_the_faults_page_says():
    """Issue 37, finding 7: under launch and torchrun the store is torchrun's, a TCPStore made as its rendezvous
    makes it (is_master, host master_addr): it listens on every interface, whatever master_addr says. The faults
    page says so beside the kit's own store, which listens on master_addr only (the test above)."""
    import datetime

    import psutil
    import torch.distributed as dist
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=5))
    try:
        listening = {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert listening and listening <= {"0.0.0.0", "::"}, listening
    finally:
        del store
    page = " ".join((Path(REPO) / "docs" / "faults.md").read_text().split())
    assert "torchrun's, under `launch` and under `torchrun` with static or c10d rendezvous, listens on **every " \
           "interface**" in page and "unpickles" in page


def test_a_rank_that_makes_no_step_says_so_and_names_the_silent_peer(monkeypatch):
    """During training a wait inside a collective is never mute: every ~30 s (here 0.5 s) a line says so."""
    import time as _time

    from ddp_utils.robust.heartbeat import Heartbeat
    monkeypatch.setattr(peers, "_store", dist.HashStore())
    ctx = distributed.DistContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    lines = []
    with Heartbeat(ctx, log=lines.append, every=0.1, note_after=0.5) as beat:
        _time.sleep(1.5)   # rank 1 never beats, and this rank makes no step
        assert beat.silent(older_than=1.0)[0][0] == 1
    assert any(line.startswith("rank 0: no training step for ") and "rank 1's last sign of life" in line
               for line in lines), lines
    assert peers._store.get("watch/1/alive/0")   # this rank's own sign of life is in the store (this fit's keys)


@pytest.fixture
def watched(monkeypatch):
    """A rank 0 of 3 whose store is an in-memory one, and the abort_group calls the watch makes."""
    monkeypatch.setattr(peers, "_store", dist.HashStore())
    monkeypatch.setattr(peers, "_watches", 0)
    aborted = []
    monkeypatch.setattr(peers, "abort_group", aborted.append)
    ctx = distributed.DistContext(rank=0, world_size=3, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return ctx, aborted


def beat_for(store, rank, seconds, every=0.1, value=None):
    """Rank ``rank``'s beat thread, as seen through the store, for ``seconds``."""
    import time as _time
    end = _time.monotonic() + seconds
    while _time.monotonic() < end:
        store.set(f"watch/1/alive/{rank}", value or str(_time.monotonic()))
        _time.sleep(every)


def test_the_watch_aborts_the_group_when_a_rank_goes_silent_and_names_it(watched):
    """The primary path on every backend: no beat from rank 2 for silent_after s -> abort, naming rank 2 only."""
    from ddp_utils.robust.heartbeat import Heartbeat
    ctx, aborted = watched
    with Heartbeat(ctx, log=lambda *_: None, every=0.1, silent_after=1.0) as beat:
        beat_for(peers._store, 1, 2.0)   # rank 1 keeps beating, rank 2 never does
    assert len(aborted) == 1 and beat.verdict == aborted[0], aborted
    assert beat.verdict.startswith("another rank stopped answering (rank 2's last sign of life:"), beat.verdict
    assert "rank 1" not in beat.verdict


def test_the_watch_aborts_the_group_with_the_reason_another_rank_reported(watched):
    from ddp_utils.robust.heartbeat import Heartbeat
    import time as _time
    ctx, aborted = watched
    with Heartbeat(ctx, log=lambda *_: None, every=0.1, silent_after=30.0) as beat:
        rank1 = distributed.DistContext(rank=1, world_size=3, local_rank=0, device=torch.device("cpu"), backend="gloo")
        peers.report_failure(rank1, "rank 1 stopped: KeyboardInterrupt")
        deadline = _time.monotonic() + 5
        while not aborted and _time.monotonic() < deadline:
            _time.sleep(0.05)
    assert aborted == ["rank 1 stopped: KeyboardInterrupt"] and beat.verdict == aborted[0]


@pytest.mark.parametrize("world_size", [4, 16])
def test_the_watch_and_the_waits_ask_rank_0s_store_a_few_times_per_rank_whatever_the_world_size(
        monkeypatch, world_size):
    """Every rank polls the store (a beat every 2 s, a wait every 0.2 s): requests per rank that grow with the
    number of ranks would make rank 0's store serve N x N of them (768 per beat round at 16 ranks)."""
    from tests.helpers.counting_store import CountingStore, context, requests_per_beat_round
    store = CountingStore()
    monkeypatch.setattr(peers, "_store", store)
    assert max(requests_per_beat_round(world_size)) <= 4   # its beat, the others' beats, any failure reported
    ctx = context(3, world_size)
    store.requests = 0
    assert peers._failure_in_store(ctx) is None and store.requests == 1   # a wait's poll for failures
    peers.report_failure(context(world_size - 2, world_size), "rank N: disk full")
    assert peers._failure_in_store(ctx) == "rank N: disk full"


def test_a_rank_that_finished_is_never_judged_silent(watched):
    from ddp_utils.robust.heartbeat import Heartbeat
    ctx, aborted = watched
    peers._store.set("watch/1/alive/1", "done")
    peers._store.set("watch/1/alive/2", "done")
    with Heartbeat(ctx, log=lambda *_: None, every=0.1, silent_after=0.5):
        __import__("time").sleep(1.5)
    assert aborted == []
    assert peers._store.get("watch/1/alive/0") == b"done"   # and this one says so on leaving


def test_a_rank_that_lost_rank_0s_store_names_rank_0(watched, monkeypatch):
    """A cut link seen from rank 1: every store call fails; the verdict names rank 0 (the store's host)."""
    from ddp_utils.robust.heartbeat import Heartbeat
    ctx, aborted = watched
    ctx = distributed.DistContext(rank=1, world_size=3, local_rank=0, device=torch.device("cpu"), backend="gloo")

    class Unreachable:
        def __getattr__(self, name):
            raise RuntimeError("Connection reset by peer")
    monkeypatch.setattr(peers, "watch_store", lambda: Unreachable())
    with Heartbeat(ctx, log=lambda *_: None, every=0.1, silent_after=1.0) as beat:
        __import__("time").sleep(2.0)
    assert aborted and beat.verdict.startswith("another rank stopped answering (rank 0's store gave no answer for")


def test_a_peer_whose_beats_stopped_is_silent_not_stuck_in_its_loader(watched):
    """A cut link stops rank 0's beats while its last one said it was fetching a batch: the watch must not add the
    silence to that wait and blame rank 0's data loader (CI saw that verdict for a downed link)."""
    import time as _time

    from ddp_utils.robust.heartbeat import Heartbeat
    ctx, _ = watched
    beat = Heartbeat(ctx, log=lambda *_: None, every=1.0, stall_after=lambda: 5.0)   # not entered: no threads
    now = _time.monotonic()
    beat.progress_at = now - 100   # this rank has waited long in a collective
    beat.seen = {1: ("0|5|3.0", now - 4.0), 2: ("0|5|-1.0", now)}   # rank 1's last beat: 4 s old, fetching 3 s then
    assert beat.stall() is None
    beat.seen[1] = ("0|5|6.0", now)   # a fresh beat saying it has waited 6 s for its batch: that is a stall
    assert beat.stall().startswith("rank 1") and beat.stalled == 1


def test_the_failure_named_is_the_first_reported_not_the_lowest_ranks(monkeypatch):
    """Issue 37, finding 2: rank 2 failed and reported; rank 1, stopped as a consequence (its launcher's SIGTERM),
    reported after it. Rank 0 names rank 2, the cause; rank 2 itself reads rank 1's (the first that is not its own)."""
    monkeypatch.setattr(peers, "_store", dist.HashStore())

    def ctx(rank):
        return distributed.DistContext(rank=rank, world_size=3, local_rank=0, device=torch.device("cpu"),
                                       backend="gloo")
    peers.report_failure(ctx(2), "rank 2 stopped: DataError: /data/bad.JPEG ...")
    peers.report_failure(ctx(1), "rank 1 stopped: SIGTERM (the process was told to stop)")
    assert peers._failure_in_store(ctx(0)).startswith("rank 2 stopped: DataError")
    assert peers._failure_in_store(ctx(2)).startswith("rank 1 stopped: SIGTERM")


def test_a_failure_report_over_a_store_that_blocks_returns_within_its_bound(monkeypatch):
    """Issue 37, finding 4: Stop pressed just after the link died: the report's store write blocks (a dead link, or
    the beat thread holding the shared client's lock) far longer than any store timeout; the cell must go on."""
    import threading
    import time as _time

    class Blocking:
        def __init__(self):
            self.release = threading.Event()

        def set(self, key, value):
            self.release.wait(60)

        def add(self, key, n):
            return 1
    store = Blocking()
    monkeypatch.setattr(peers, "_store", store)
    monkeypatch.setattr(peers, "REPORT_S", 0.5)
    ctx = distributed.DistContext(rank=1, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    start = _time.monotonic()
    peers.report_failure(ctx, "rank 1 stopped: KeyboardInterrupt")
    assert _time.monotonic() - start < 2.0
    store.release.set()


def test_a_setup_failure_report_to_a_store_that_hangs_returns_within_its_bound(monkeypatch):
    """Issue 55, the last round's leftover: setup_watch.report wrote to the store on the main thread, unbounded; a
    link that just went down held a failing rank (and a notebook's cell) there for minutes."""
    import threading
    import time as _time

    from ddp_utils.robust import failures, setup_watch
    release = threading.Event()

    class Hanging:
        def set(self, key, value):
            release.wait(60)

        def add(self, key, n):
            release.wait(60)
            return 1
    monkeypatch.setattr(failures, "REPORT_S", 0.3)
    monkeypatch.setattr(setup_watch, "FIRST_S", 0.2)
    start = _time.monotonic()
    assert setup_watch.report(Hanging(), 1, "rank 1 failed during setup: ...") is None
    assert _time.monotonic() - start < 2.0
    release.set()


def test_every_rank_slow_to_get_its_batch_is_no_stall_when_none_waits_in_a_collective(watched):
    """Issue 37, finding 5: cold storage makes every rank wait 30 s for its first batch. No rank is in a collective,
    so no collective timeout can strike and nobody holds anybody up: the watch must not abort a healthy run. As soon
    as one rank waits in a collective (its beat says it is not fetching), the slowest loader is the stall."""
    import time as _time

    from ddp_utils.robust.heartbeat import Heartbeat
    ctx, _ = watched   # rank 0 of 3
    beat = Heartbeat(ctx, log=lambda *_: None, every=1.0, stall_after=lambda: 20.0)   # not entered: no threads
    now = _time.monotonic()
    beat.progress_at = beat.fetching_since = now - 30   # this rank: no step yet, waiting 30 s for its batch
    beat.seen = {1: ("0|0|29.5", now), 2: ("0|0|30.0", now)}   # fresh beats: both fetching for ~30 s too
    assert beat.stall() is None
    beat.seen[2] = ("0|0|-1.0", now)   # rank 2 got its batch and waits in the all-reduce for the others
    assert beat.stall().startswith("rank 0") and beat.stalled == 0


def test_a_rank_that_lost_the_store_names_the_store_even_when_rank_0s_last_beat_is_older_than_its_last_answer(
        watched):
    """Rank 1 reads the beats every 2 s; rank 0's value may not have changed at the last read, so its beat looks up
    to a beat older than the store's last answer: the silence crosses 15 s first, but the cause is the lost store
    (CI saw rank 1 name rank 0's silence instead)."""
    import time as _time

    from ddp_utils.robust.heartbeat import Heartbeat
    _, aborted = watched
    ctx = distributed.DistContext(rank=1, world_size=3, local_rank=0, device=torch.device("cpu"), backend="gloo")
    beat = Heartbeat(ctx, log=lambda *_: None, every=2.0, silent_after=15.0)   # not entered: no threads
    now = _time.monotonic()
    beat.seen = {0: ("0|9|-1.0", now - 16.0), 2: ("0|9|-1.0", now - 14.5)}
    beat._store_ok = now - 14.0   # the last round that reached the store: 14 s ago, under silent_after
    assert beat.judgement().startswith("another rank stopped answering (rank 0's store gave no answer for"), \
        beat.judgement()
    beat._store_ok = now - 1.0    # the store answers: rank 0's own silence is the cause
    assert beat.judgement().startswith("another rank stopped answering (rank 0's last sign of life: 16 s ago")


def test_a_rank_that_lost_the_store_names_the_store_when_another_peers_beat_looks_oldest(watched):
    """At 16 ranks behind a cut link: rank 2's beat had last changed a beat before the store's last answer, so its
    silence crossed the limit while rank 0's had not; the cause is still the lost store, not rank 2."""
    import time as _time

    from ddp_utils.robust.heartbeat import Heartbeat
    ctx = distributed.DistContext(rank=1, world_size=3, local_rank=0, device=torch.device("cpu"), backend="gloo")
    beat = Heartbeat(ctx, log=lambda *_: None, every=2.0, silent_after=15.0)   # not entered: no threads
    now = _time.monotonic()
    beat.seen = {0: ("0|9|-1.0", now - 14.0), 2: ("0|9|-1.0", now - 16.0)}
    beat._store_ok = now - 14.0
    assert beat.judgement().startswith("another rank stopped answering (rank 0's store gave no answer for"), \
        beat.judgement()
    beat._store_ok = now - 1.0    # the store answers: rank 2 is the one gone
    assert beat.judgement().startswith("another rank stopped answering (rank 2's last sign of life: 16 s ago")


def test_after_a_broken_collective_only_the_quietest_peers_are_named(watched):
    """A killed rank's beat ages without end; on a loaded machine a live peer's can be a beat or two late: the
    rank that died is named, not the late ones (at 16 ranks on 2 cores, rank 9 named ranks 5 and 6 beside 7)."""
    import time as _time

    from ddp_utils.robust.heartbeat import Heartbeat
    ctx = distributed.DistContext(rank=0, world_size=4, local_rank=0, device=torch.device("cpu"), backend="gloo")
    beat = Heartbeat(ctx, log=lambda *_: None, every=2.0, silent_after=15.0)   # not entered: no threads
    beat._store_ok = now = _time.monotonic()
    beat.seen = {1: ("0|9|-1.0", now - 6.0), 2: ("0|9|-1.0", now - 10.0), 3: ("0|9|-1.0", now - 1.0)}
    assert beat.describe() == "rank 2's last sign of life: 10 s ago"
    beat.seen[1] = ("0|9|-1.0", now - 9.0)   # two lost together (a host with two ranks): both named
    assert beat.describe() == "rank 1's last sign of life: 9 s ago; rank 2's last sign of life: 10 s ago"


def test_a_store_wait_that_gets_no_answer_names_rank_0s_host(monkeypatch):
    """A rank behind a cut link, waiting for rank 0 to finish its checkpoint: its paragraph says where rank 0 runs
    (at 16 ranks it named only "rank 0's store", the one survivor's line without the lost host's address)."""
    import threading
    monkeypatch.setattr(peers, "STORE_PATIENCE", 0.2)
    monkeypatch.setattr(peers, "_peers", {0: {"host": "node-a", "addr": "10.0.0.1"}})
    ctx = distributed.DistContext(rank=1, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    never = threading.Event()
    with pytest.raises(peers.PeerLost) as lost:
        peers._ask_store(ctx, "finish saving epoch 1", never.wait)
    never.set()   # the store call's thread ends
    assert "(rank 0's store (on node-a, 10.0.0.1) gave no answer for 0.2 s while this rank waited for finish " \
           "saving epoch 1)" in str(lost.value)


# -- the setup watch's cut on NCCL: its communicators are aborted ---------------------------------------------
def _cut_a_watch():
    from ddp_utils.robust import setup_watch
    watch = setup_watch.SetupWatch(Settings(world_size=2, rank=0, master_port=free_port()), keys=None)
    watch._before = watch._mine = set()
    watch._own = "the watch's own connection"
    watch._cut()
    return watch


def test_the_setup_watch_aborts_nccl_communicators_when_it_cuts(monkeypatch):
    """Emulated NCCL (no GPU here): the cut calls the abort this torch has (compat.abort_path), and keeps the
    watch's own connection for the failure's report."""
    from ddp_utils.robust import compat
    aborted = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: "group")
    monkeypatch.setattr(compat, "abort_path", lambda backend, group=None: ("abort", lambda: aborted.append(group)))
    watch = _cut_a_watch()
    assert aborted == ["group"] and watch.cut and watch.keys == "the watch's own connection"
    watch.__exit__(None, None, None)   # stderr back


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_setup_watch_aborts_a_real_nccl_group(clean_env):
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        dist.barrier()
        watch = _cut_a_watch()
        watch.__exit__(None, None, None)
        with pytest.raises(Exception):   # the aborted communicator refuses further work
            dist.all_reduce(torch.ones(1, device="cuda"))
            torch.cuda.synchronize()
    finally:
        distributed.teardown()


def test_a_peers_last_beat_seen_after_the_break_is_not_taken_for_a_sign_of_life():
    """CI (issue 37, finding 9's early return): rank 1 was SIGKILLed just after it beat; on a busy machine rank 0's
    watch saw that last beat change only after the collective broke, took it for "every peer beat since", and
    reported gloo's raw error as its own instead of naming the lost rank. One change seen is no longer enough."""
    import threading
    import time as _time
    from ddp_utils.robust.heartbeat import Heartbeat
    beat = Heartbeat(distributed.DistContext(0, 2, 0, torch.device("cpu"), "gloo"), log=lambda *_: None,
                     silent_after=60)
    beat.seen, beat._store_ok = {1: ("7", _time.monotonic())}, _time.monotonic() + 60   # the store answers

    def watch(changes):   # the beat thread: rank 1's beat seen to change `changes` times after the break
        for n in range(changes):
            _time.sleep(0.2)
            beat.seen[1] = (str(8 + n), _time.monotonic())
            beat.changes[1] = beat.changes.get(1, 0) + 1
    for changes, early in ((1, False), (2, True)):
        threading.Thread(target=watch, args=(changes,), daemon=True).start()
        start = _time.monotonic()
        assert beat.name_the_lost(timeout=1.5) == ""
        took = _time.monotonic() - start
        assert (took < 1.2) == early, (changes, took)   # alive only once it beat again after the break


# -- "after rank N on the same machine had ended" (robust/devices.py) ---------------------------------------------
def _peer(pid: int, **facts) -> dict:
    from ddp_utils.robust import devices
    return {"machine": devices.machine_id(), "pid_space": devices.pid_space(), "pid": pid, **facts}


def test_a_rank_that_ended_on_this_machine_is_named_also_while_a_zombie():
    """Issue 43, finding 10: a rank that ended but that its launcher has not reaped yet (a zombie) counted as running."""
    import subprocess
    import time as _time
    from ddp_utils.robust import devices
    child = subprocess.Popen(["true"])
    try:
        deadline = _time.monotonic() + 10
        while _time.monotonic() < deadline:   # ended, not reaped: /proc says Z
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            _time.sleep(0.05)
        said = devices.ended_beside({3: _peer(child.pid), 4: _peer(os.getppid())})
        assert said.startswith(", after rank 3 on the same machine had ended"), said
    finally:
        child.wait()


def test_a_pid_from_another_containers_pid_namespace_is_not_looked_up_here():
    """Issue 43, finding 8: containers without --pid=host share the machine's boot id but number their processes
    apart: a rank's PID from there named whatever process has that number here (or none)."""
    from ddp_utils.robust import devices
    import subprocess
    gone = subprocess.Popen(["true"])
    gone.wait()   # a PID that no process has here now
    assert devices.ended_beside({1: _peer(gone.pid)}).startswith(", after rank 1")
    assert devices.ended_beside({1: _peer(gone.pid, pid_space="pid:[1]")}) == ""   # another container's


def test_a_stuck_loaders_worker_processes_are_described_by_their_state_and_wait_channel():
    """Issue 43, finding 10: a worker that took 40 s for its first batch went unexplained; the watch's lines now say
    what each of the rank's child processes is doing (its /proc state and the kernel function it waits in)."""
    import subprocess
    from ddp_utils.robust.heartbeat import child_states
    child = subprocess.Popen(["sleep", "30"])
    try:
        import time as _time
        _time.sleep(0.3)
        said = child_states(os.getpid())
        assert re.search(rf"pid {child.pid} sleeping( in \w+)?(;|$)", said), said
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "zero1", "fsdp"])
def test_after_a_failure_release_group_lets_the_teardown_free_the_process_group(mode):
    """What Job.fail relies on: with the model and optimizer still held (a notebook's traceback holds them), the
    group is freed by the teardown after release_group, on every rank; without it, it is not (the control: DDP's
    reducer, ZeRO's optimizer, FSDP's blocks and their device mesh hold it)."""
    if mode == "fsdp" and compat.fsdp_refusal("cpu", "gloo"):
        pytest.skip(compat.fsdp_refusal("cpu", "gloo"))   # the floor's torch 2.6 runs no FSDP2 on a CPU
    for release in (0, 1):
        port = free_port()
        ranks = run_all([python("-m", "tests.helpers.release_ranks", mode, str(r), "2", str(port), str(release))
                         for r in range(2)], timeout=120, env=base_env())
        assert all(r.returncode == 0 for r in ranks), describe(ranks)
        assert all(f"FREED {bool(release)}" in r.output for r in ranks), describe(ranks)

"""Pre-flight checks, in this process and on loopback only: backend, interface, ports, report."""
from __future__ import annotations

import os
import socket
import time

import pytest
import torch

from ddp_utils.robust import preflight
from ddp_utils.robust.preflight import DistSetupError
from ddp_utils.settings import Settings
from tests.helpers.procs import free_port

QUIET = {"log": lambda *_: None}


def two_rank(**kw) -> Settings:
    return Settings(world_size=2, master_port=free_port(), backend="gloo", workers=0, **kw)


# -- backend ----------------------------------------------------------------------------------
def test_resolve_backend_auto_is_gloo_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert preflight.resolve_backend(Settings()) == "gloo"


def test_resolve_backend_auto_is_nccl_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert preflight.resolve_backend(Settings()) == "nccl"


def test_resolve_backend_refuses_nccl_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DistSetupError, match="backend='nccl' needs a CUDA GPU"):
        preflight.resolve_backend(Settings(backend="nccl"))


def test_resolve_backend_keeps_an_explicit_gloo():
    assert preflight.resolve_backend(Settings(backend="gloo")) == "gloo"


# -- interface --------------------------------------------------------------------------------
def test_choose_interface_for_loopback_is_lo():
    assert preflight.choose_interface("127.0.0.1") == ("lo", "127.0.0.1")


def test_preflight_sets_gloo_and_nccl_socket_ifname(clean_env):
    report = preflight.preflight(two_rank(), **QUIET)
    assert report["interface"] == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"


def test_preflight_keeps_socket_ifname_set_by_the_user(clean_env, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    logs = []
    preflight.preflight(two_rank(), log=logs.append)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7" and os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert any("keeping GLOO_SOCKET_IFNAME=eth7 from the environment" in line for line in logs)


def test_preflight_replaces_socket_ifname_it_set_itself(clean_env, monkeypatch):
    preflight.preflight(two_rank(), **QUIET)
    monkeypatch.setattr(preflight, "choose_interface", lambda addr: ("veth9", "10.0.0.2"))
    preflight.preflight(two_rank(), **QUIET)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "veth9"


def test_socket_ifname_setting_overrides_the_automatic_choice(clean_env):
    others = [name for _, name in socket.if_nameindex() if name != "lo"]
    if not others:
        pytest.skip("this host has only the loopback interface")
    report = preflight.preflight(two_rank(socket_ifname=others[0]), **QUIET)
    assert report["interface"] == os.environ["GLOO_SOCKET_IFNAME"] == others[0]


def test_unknown_socket_ifname_is_refused_listing_the_interfaces(clean_env):
    with pytest.raises(DistSetupError, match="not an interface of this host; it has .*lo"):
        preflight.preflight(two_rank(socket_ifname="nosuch0"), **QUIET)


# -- ports ------------------------------------------------------------------------------------
def test_port_holder_names_the_listening_pid():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        holder = preflight.port_holder(s.getsockname()[1])
    assert holder.startswith(f"pid {os.getpid()} (") and "python" in holder


def test_port_holder_is_none_for_a_free_port():
    assert preflight.port_holder(free_port()) is None


def test_wait_for_master_retries_until_init_timeout_then_explains():
    settings = two_rank(rank=1, init_timeout=1.5)
    start = time.monotonic()
    with pytest.raises(DistSetupError) as e:
        preflight.wait_for_master(settings, **QUIET)
    assert 1.5 <= time.monotonic() - start < 5
    text = str(e.value)
    assert f"127.0.0.1:{settings.master_port}" in text and "Connection refused" in text
    assert "has not started" in text and "--net=host" in text and "security group" in text


def test_a_master_address_that_no_host_answers_is_named_at_the_first_try_with_what_to_compare(monkeypatch):
    import errno

    def unreachable(*_, **__):
        time.sleep(0.05)
        raise OSError(errno.EHOSTUNREACH, "No route to host")
    monkeypatch.setattr(preflight.socket, "create_connection", unreachable)
    said = []
    settings = two_rank(rank=1, init_timeout=2, master_addr="10.0.0.9")
    with pytest.raises(DistSetupError, match="No route to host"):
        preflight.wait_for_master(settings, log=lambda line: said.append((time.monotonic(), line)),
                                  local="10.0.0.2 on eth0")
    first = said[0][1]
    assert f"rank 1: no answer yet from the master at 10.0.0.9:{settings.master_port} (tried from 10.0.0.2 on eth0)" in first
    assert "'No route to host':\n  no machine answers at that address" in first
    assert "rank 0 prints when it starts\n  ('rank 0: listening on ADDRESS:PORT')" in first
    assert "keeps trying until init_timeout\n  (2 s, at " in first
    assert max(len(line) for line in first.splitlines()) < 100   # a notebook wraps longer lines mid-word


def test_a_master_not_started_yet_is_named_within_seconds_as_nothing_listening(monkeypatch):
    monkeypatch.setattr(preflight, "FIRST_NOTE_S", 0.3)
    said = []
    with pytest.raises(DistSetupError):
        preflight.wait_for_master(two_rank(rank=1, init_timeout=1.5), log=said.append)
    assert len(said) == 1 and "'Connection refused':\n  a machine has that address, but nothing listens" in said[0]


def test_torchrun_env_init_skips_the_port_check(clean_env):
    with socket.socket() as s:  # the torchrun agent holds the port
        s.bind(("127.0.0.1", 0))
        s.listen()
        report = preflight.preflight(two_rank(init_method="env").replace(master_port=s.getsockname()[1]),
                                     **QUIET)
    assert "torchrun" in report["port_status"]


# -- report -----------------------------------------------------------------------------------
def test_preflight_reports_network_backend_and_hardware(clean_env):
    report = preflight.preflight(two_rank(), **QUIET)
    assert report["master"].startswith("127.0.0.1:") and report["port_status"] == "free"
    assert report["local_ip"] == "127.0.0.1" and report["backend"] == "gloo"
    assert {"cuda", "gpus", "nccl_version", "shm_bytes", "torch"} <= set(report)


def test_one_process_preflight_touches_no_network(clean_env):
    report = preflight.preflight(Settings(workers=0), **QUIET)
    assert "interface" not in report and "GLOO_SOCKET_IFNAME" not in os.environ


def test_small_dev_shm_warns_about_bus_errors(clean_env, monkeypatch):
    monkeypatch.setattr(preflight, "hardware_report",
                        lambda: {"cuda": False, "gpus": [], "nccl_version": None, "shm_bytes": 64 << 20})
    logs = []
    preflight.preflight(Settings(workers=2), log=logs.append)
    assert any("/dev/shm is only 64 MiB" in line and "--shm-size" in line for line in logs)

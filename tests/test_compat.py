"""Every torch from the floor to the newest: what robust/compat.py finds, the paths it picks, and the places that
state the range. CI runs these on the newest torch and on the floor (tests/floor.sh); the multi-process ones
check that compat's claims hold for the torch they run on."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from packaging.requirements import Requirement

from ddp_utils.robust import compat, rendezvous
from ddp_utils.robust.preflight import DistSetupError
from ddp_utils.settings import Settings
from tests.helpers.procs import REPO, base_env, describe, free_port, python, run_all
from tests.helpers.groups import gpu_only, one_rank_group

NGC_25_01 = "2.6.0a0+ecf3bae40a.nv25.01"   # torch.__version__ in the NGC 25.01 container (the floor)
NGC_24_10 = "2.5.0a0+e000cf0ad9.nv24.10"   # an older NGC release: below the floor


# -- the range, stated alike everywhere --------------------------------------------------------------
def requirement(name: str) -> Requirement:
    lines = [ln.split("#")[0].strip() for ln in Path(REPO, "requirements.txt").read_text().splitlines()]
    return next(Requirement(ln) for ln in lines if ln and Requirement(ln).name == name)


def test_release_reads_ngc_pypi_and_local_build_versions():
    assert compat.release(NGC_25_01) == (2, 6)
    assert compat.release("2.14.1+cu130") == (2, 14)
    assert compat.release("2.10.0") == (2, 10)
    with pytest.raises(ValueError):
        compat.release("nightly")


def test_the_requirement_admits_the_floors_ngc_build_and_refuses_older_ones():
    """`torch>=2.6` would refuse NGC's 2.6.0a0 pre-release, and pip would then try to replace the container's torch."""
    spec = requirement("torch").specifier
    assert spec.contains(NGC_25_01, prereleases=True) and spec.contains("2.6.0") and spec.contains("2.14.1")
    assert not spec.contains(NGC_24_10, prereleases=True) and not spec.contains("2.5.1")
    assert requirement("torchvision").specifier.contains("0.21.0")


def test_the_floor_is_stated_alike_in_the_code_requirements_pyproject_dockerfile_and_readme():
    floor = ".".join(map(str, compat.FLOOR))
    assert f"torch>={floor}.0a0" in Path(REPO, "requirements.txt").read_text()
    assert f"{floor} (the NGC 25.01 container's" in Path(REPO, "pyproject.toml").read_text()
    dockerfile = Path(REPO, "docker", "Dockerfile").read_text()
    assert "ARG NGC_TAG=25.01-py3" in dockerfile and f">= ({floor.replace('.', ', ')})" in dockerfile
    readme = Path(REPO, "README.md").read_text()
    assert f"torch {floor} (NGC 25.01's) to" in readme and "tests/floor.sh" in readme
    assert f"torch=={floor}.0" in Path(REPO, "tests", "floor-constraints.txt").read_text()


def test_below_floor_names_the_version_and_what_to_use_instead():
    assert compat.below_floor(NGC_25_01) is None and compat.below_floor("2.14.1+cu130") is None
    text = compat.below_floor(NGC_24_10)
    assert NGC_24_10 in text and "2.6" in text and "25.01" in text


def _fake_torch_module(tmp_path, version: str) -> Path:
    folder = tmp_path / version
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return folder


@pytest.mark.parametrize("version,passes", [(NGC_25_01, True), ("2.14.1+cu130", True), (NGC_24_10, False)])
def test_the_docker_build_stops_on_an_ngc_release_below_the_floor(tmp_path, version, passes):
    """The Dockerfile's step 0 (its python -c, run as the build would, against a torch reporting ``version``)."""
    from tests.helpers.docker import runs
    check = next(r for r in runs() if "torch.__version__" in r)
    code = re.search(r'python -c "(.*)"$', check).group(1)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**base_env(), "PYTHONPATH": str(_fake_torch_module(tmp_path, version))})
    assert (result.returncode == 0) is passes, result.stderr
    if not passes:
        assert f"torch {version}" in result.stderr and "25.01 or later" in result.stderr


def _fake_dist(site: Path, name: str, version: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def test_pip_in_the_ngc_container_keeps_its_torch_under_the_builds_constraints(tmp_path):
    """Step 2 of docker/Dockerfile, for the torch lines of requirements.txt: in a Python whose torch is NGC 25.01's
    build, pip with the constraints of step 1 finds nothing to install (no index is even asked)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "ngc")], check=True, timeout=60)
    site = next((tmp_path / "ngc" / "lib").glob("python3*/site-packages"))
    versions = {"torch": NGC_25_01, "torchvision": "0.20.0a0+afc54f7"}   # NGC builds both from pre-release sources
    for name, version in versions.items():
        _fake_dist(site, name, version)
    (tmp_path / "constraints.txt").write_text("".join(f"{n}=={v}\n" for n, v in versions.items()))
    (tmp_path / "requirements.txt").write_text(f"{requirement('torch')}\n{requirement('torchvision')}\n")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--isolated", "--python", str(tmp_path / "ngc" / "bin" / "python"), "install",
         "--dry-run", "--no-index", "--report", str(tmp_path / "report.json"), "-c", str(tmp_path / "constraints.txt"),
         "-r", str(tmp_path / "requirements.txt")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((tmp_path / "report.json").read_text())["install"] == []


# -- rank 0's store --------------------------------------------------------------------------------
def _listening_socket() -> tuple[int, int]:
    sock = socket.create_server(("127.0.0.1", 0))
    return sock.getsockname()[1], sock.detach()


def test_the_store_takes_the_kits_socket_on_this_torch(monkeypatch):
    monkeypatch.setattr(compat, "_libuv_takes_a_socket", None)
    port, fd = _listening_socket()
    said = []
    store = compat.master_store("127.0.0.1", port, 1, timedelta(seconds=5), fd, said.append)
    store.set("k", "v")
    assert dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=5)).get("k") == b"v"
    assert said == []   # the release's answer was right: nothing to correct, nothing to say
    assert compat._libuv_takes_a_socket is (compat.release() >= (2, 8))   # what the releases were found to do
    assert ("legacy" in compat.store_path()) is (compat.release() < (2, 8))


class _StoreOf2_6:
    """dist.TCPStore as torch 2.6 and 2.7 answer: the libuv store refuses a listening socket."""
    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs.get("use_libuv", True))
        if kwargs.get("master_listen_fd") is not None and kwargs.get("use_libuv", True):
            raise NotImplementedError("The libuv TCPStore backend does not support initialization with an listen fd.")
        return self.real(*args, **kwargs)


def _two_master_stores_on(monkeypatch, release: tuple[int, int]) -> tuple[list, list]:
    """Two rank-0 stores made on a torch of ``release`` whose libuv store refuses a listening socket: what
    TCPStore was asked for (use_libuv per call) and what the kit said."""
    fake = _StoreOf2_6(dist.TCPStore)
    monkeypatch.setattr(dist, "TCPStore", fake)
    monkeypatch.setattr(compat, "_libuv_takes_a_socket", None)
    monkeypatch.setattr(compat, "release", lambda version=None: release)
    said, stores = [], []
    for _ in range(2):
        port, fd = _listening_socket()
        stores.append(compat.master_store("127.0.0.1", port, 1, timedelta(seconds=5), fd, said.append))
        stores[-1].set("k", "v")
    return fake.calls, said


def test_a_release_known_to_refuse_the_socket_gets_the_legacy_store_without_asking(monkeypatch):
    """torch 2.6 and 2.7: asking the libuv store first would print a C++ error line for nothing."""
    calls, said = _two_master_stores_on(monkeypatch, (2, 6))
    assert calls == [False, False] and said == []
    assert "legacy TCPStore" in compat.store_path() and "before torch 2.8" in compat.store_path()


def test_a_build_that_refuses_the_socket_against_its_release_falls_back_to_the_legacy_store_once(monkeypatch):
    """An NGC 2.8.0a0 snapshot taken before the libuv store learnt to take a socket: found out, said, remembered."""
    calls, said = _two_master_stores_on(monkeypatch, (2, 8))
    assert calls == [True, False, False]          # found out once, then the legacy store straight away
    assert len(said) == 1 and "legacy TCPStore" in said[0]
    assert "legacy" in compat.store_path()


def test_a_store_failing_on_a_free_port_is_not_blamed_on_the_port_and_gives_the_port_back(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated store failure\nC++ noise")
    monkeypatch.setattr(compat, "master_store", broken)
    port = free_port()
    settings = Settings(world_size=2, rank=0, master_addr="127.0.0.1", master_port=port, init_timeout=5, workers=0)
    with pytest.raises(DistSetupError) as err:
        rendezvous.open_store(settings, log=lambda *_: None)
    text = str(err.value)
    assert "although the port is free" in text and "simulated store failure" in text and "held by" not in text
    with socket.create_server(("127.0.0.1", port)):   # the kit's socket was closed: the port is free again
        pass


def test_a_busy_port_is_still_named_with_its_holder(monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        settings = Settings(world_size=2, rank=0, master_addr="127.0.0.1", master_port=port, init_timeout=5, workers=0)
        with pytest.raises(DistSetupError) as err:
            rendezvous.open_store(settings, log=lambda *_: None)
    assert f"could not listen on master_port {port}" in str(err.value) and "held by: pid" in str(err.value)


# -- stopping a hung collective ---------------------------------------------------------------------
class _Backend:
    def __init__(self):
        self.aborted = 0

    def abort(self):
        self.aborted += 1


def test_gloo_is_stopped_by_shutting_its_connections_on_every_torch():
    how, call = compat.abort_path("gloo", object())
    assert call is None and "shutting down gloo's connections" in how


def test_nccl_uses_processgroup_abort_where_this_torch_has_it(monkeypatch):
    class Group(_Backend):
        pass
    monkeypatch.setattr(dist, "ProcessGroup", Group)
    group = Group()
    how, call = compat.abort_path("nccl", group)
    call()
    assert how == "ProcessGroup.abort()" and group.aborted == 1


def test_nccl_on_torch_2_6_uses_the_nccl_backends_own_abort(monkeypatch):
    """torch 2.6 has no ProcessGroup.abort (the watch's abort used to raise an AttributeError that was swallowed)."""
    class Group:   # 2.6's ProcessGroup: no abort, a backend per device
        def __init__(self):
            self.nccl = _Backend()

        def _get_backend(self, device):
            assert device == torch.device("cuda")
            return self.nccl
    monkeypatch.setattr(dist, "ProcessGroup", Group)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _Backend, raising=False)
    group = Group()
    how, call = compat.abort_path("nccl", group)
    call()
    assert "NCCL backend's abort()" in how and group.nccl.aborted == 1


def test_nccl_without_either_abort_falls_back_to_abort_process_group(monkeypatch):
    seen = []
    monkeypatch.setattr(dist, "ProcessGroup", type("Group", (), {}))
    monkeypatch.setattr(dist, "ProcessGroupNCCL", type("NCCL", (), {}), raising=False)
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", seen.append)
    group = dist.ProcessGroup()
    how, call = compat.abort_path("nccl", group)
    call()
    assert how == "_abort_process_group()" and seen == [group]


@gpu_only
def test_the_abort_path_this_torch_takes_on_a_real_nccl_group():
    """The twin of the three above on a GPU: the path compat picks on this torch exists and runs."""
    device = torch.device("cuda", 0)
    with one_rank_group("nccl", device):
        how, call = compat.abort_path("nccl", dist.distributed_c10d._get_default_group())
        call()
    assert how == ("ProcessGroup.abort()" if hasattr(dist.ProcessGroup, "abort") else
                   "the NCCL backend's abort() (torch 2.6 has no ProcessGroup.abort)")


# -- the collective timeout -------------------------------------------------------------------------
def test_gloo_gets_its_collective_timeout_at_init_where_it_cannot_take_a_new_one():
    s = Settings(init_timeout=300, collective_timeout=60)
    assert not compat.timeout_changes_after_init("gloo", "2.6.0") and not compat.timeout_changes_after_init("gloo", "2.8.0")
    assert compat.timeout_changes_after_init("gloo", "2.9.1") is True
    assert compat.timeout_changes_after_init("nccl", "2.6.0") is True
    changes = compat.timeout_changes_after_init("gloo")
    assert compat.timeout_at_init(s, "gloo") == (300 if changes else 60)
    assert compat.timeout_at_init(s.replace(compile=True), "gloo") == 300   # the first step may compile for minutes
    assert compat.timeout_at_init(s, "nccl") == 300
    # A join bound shorter than the collective one is kept too: a rank whose peer failed while joining stops in
    # 3 s, not 60 (on 2.6 a group made with 60 s made it wait out the 60).
    assert compat.timeout_at_init(s.replace(init_timeout=3), "gloo") == 3


def scenario(name, rank, port):
    return python("-m", "tests.helpers.compat_scenarios", name, str(rank), str(port))


def checks(result) -> dict:
    return {k: json.loads(v) for k, v in re.findall(r"^CHECK (\w+)=(.*)$", result.output, re.M)}


@pytest.mark.slow
@pytest.mark.floor
def test_compats_claim_about_gloo_timeouts_holds_for_this_torch():
    """Plain torch, no kit: a gloo group made with 30 s and set to 2 s; rank 1 is 6 s late. If compat says gloo
    takes the new timeout, rank 0's all_reduce fails after ~2 s, else it waits the 6 s and succeeds."""
    port = free_port()
    results = run_all([scenario("gloo_timeout", r, port) for r in range(2)], timeout=90, env=base_env())
    rank0 = checks(results[0])
    assert "failed" in rank0, describe(results)
    assert rank0["failed"] is compat.timeout_changes_after_init("gloo"), describe(results)
    assert (rank0["waited"] < 5) is rank0["failed"], rank0


@pytest.mark.slow
@pytest.mark.floor
def test_the_collective_timeout_a_user_sets_holds_on_every_torch():
    """The kit's setup with collective_timeout=3: a rank 8 s late in a collective ends the other's wait after about
    3 s, on the floor as on the newest (on torch 2.6 gloo kept init_timeout: rank 0 waited the whole 8 s)."""
    port = free_port()
    results = run_all([scenario("kit_timeout", r, port) for r in range(2)], timeout=90, env=base_env())
    rank0 = checks(results[0])
    assert rank0.get("failed") is True and rank0["waited"] < 7, describe(results)


def test_check_prints_the_paths_this_torch_takes(tmp_path, monkeypatch):
    from ddp_utils.tools.check import run_check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # gloo's paths, also on a machine with a GPU
    lines = []
    run_check(Settings(dataset="demo", data_dir=str(tmp_path / "absent"), workers=0), log=lines.append)
    text = "\n".join(lines)
    assert f"torch {torch.__version__}\n  rank 0's store: {compat.store_path()}\n" in text
    assert f"a hung collective is stopped by {compat.abort_path('gloo')[0]}" in text
    assert f"collectives wait: {compat.timeout_path('gloo')}" in text


# -- destroying a group ----------------------------------------------------------------------------
@pytest.mark.parametrize("version,backend,settles", [((2, 6), "gloo", True), ((2, 7), "gloo", True),
                                                     ((2, 14), "gloo", True), ((2, 6), "nccl", False)])
def test_a_gloo_group_gets_a_moment_before_it_is_destroyed_for_its_workers_to_let_go_of_their_tensors(
        monkeypatch, version, backend, settles):
    seen = []
    monkeypatch.setattr(compat, "release", lambda v=None: version)
    monkeypatch.setattr(compat.time, "sleep", lambda s: seen.append(("sleep", s)))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: seen.append("destroy"))
    compat.destroy_process_group(backend)
    assert seen == ([("sleep", compat.SETTLE_S), "destroy"] if settles else ["destroy"])


@pytest.mark.slow
@pytest.mark.floor
def test_setup_and_teardown_again_and_again_never_hang():
    """Fifteen joins and leaves in a row, each right after a collective (the setup cell run again and again)."""
    port = free_port()
    results = run_all([scenario("cycles", r, port) for r in range(2)], timeout=120, env=base_env())
    for r in results:
        assert r.returncode == 0 and checks(r).get("cycles") == 15, describe(results)


def test_an_ngc_pre_release_of_the_release_that_brought_a_change_counts_as_the_release_before():
    """Issue 37: NGC's 2.8.0a0 / 2.9.0a0 are snapshots that may predate their release's changes; the checks take the
    safe side for them (gloo's timeout not trusted to change after init, FSDP refused on CPUs), and final releases,
    later pre-releases and the floor's own 2.6.0a0 are read as before."""
    assert not compat.has((2, 9), "2.9.0a0+5228986c39.nv25.09") and compat.has((2, 9), "2.9.0")
    assert compat.has((2, 9), "2.10.0a0+abc.nv25.11") and not compat.has((2, 9), "2.8.0")
    assert not compat.timeout_changes_after_init("gloo", "2.9.0a0+5228986c39.nv25.09")
    assert compat.timeout_changes_after_init("gloo", "2.9.1") and compat.timeout_changes_after_init("nccl", "2.6.0a0")
    assert compat.fsdp_refusal("cpu", "gloo", "2.7.0a0+7c8ec84dab.nv25.03") is not None
    assert compat.fsdp_refusal("cpu", "gloo", "2.7.1") is None
    assert compat.below_floor(NGC_25_01) is None   # the floor itself is an NGC pre-release

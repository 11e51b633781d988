"""The GPU paths, checked on a CPU: what a GPU node does differently is emulated (what torch.cuda answers,
gloo in place of nccl), and each emulated test has a ``gpu``-marked twin in tests/test_gpu.py or here
that checks the same on a real GPU (skipped, with the reason, where there is none)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from ddp_utils import linkprobe
from ddp_utils.distributed import DistContext
from ddp_utils.model import build_model
from ddp_utils.settings import Settings
from tests.procs import free_port


def gpu_only(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


@contextlib.contextmanager
def one_rank_group(backend="gloo", device=None):
    """A process group of this test process alone (SyncBatchNorm and the probe's collectives need one)."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **({"device_id": device} if device else {}))
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- the link probe with --sync-bn ------------------------------------------------------------------
def test_the_link_probes_copy_of_a_sync_bn_model_starts_no_collective():
    """Rank 0 times its copy alone while the others wait: a SyncBatchNorm in the copy would start
    collectives nobody joins (a hang on GPUs; on a CPU SyncBatchNorm refuses to run, which shows the same)."""
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(build_model("resnet18_cifar", 10))
    settings = Settings(dataset="fake", arch="resnet18_cifar", batch_size=4)
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    with one_rank_group():
        seconds = linkprobe._time_compute(model, settings, ctx, 10, 32, rounds=1)
    assert seconds > 0
    assert isinstance(model.bn1, torch.nn.SyncBatchNorm), "the run's own model must keep its SyncBatchNorm"


def test_the_probes_plain_batchnorm_keeps_the_weights_and_statistics():
    sync = torch.nn.SyncBatchNorm(8)
    with torch.no_grad():
        sync.weight.uniform_()
        sync.running_mean.uniform_()
    local = linkprobe.local_batchnorm(torch.nn.Sequential(sync))[0]
    assert not isinstance(local, torch.nn.SyncBatchNorm)
    assert torch.equal(local.weight, sync.weight) and torch.equal(local.running_mean, sync.running_mean)
    x = torch.randn(4, 8, 5, 5)
    assert torch.allclose(local.eval()(x), sync.eval()(x))


@gpu_only
def test_the_link_probe_runs_with_sync_bn_on_a_gpu():
    device = torch.device("cuda", 0)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(build_model("resnet18_cifar", 10)).to(device)
    settings = Settings(dataset="fake", arch="resnet18_cifar", batch_size=8)
    with one_rank_group("nccl", device):
        assert linkprobe._time_compute(model, settings, DistContext(0, 1, 0, device, "nccl"), 10, 32) > 0

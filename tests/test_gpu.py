"""The GPU suite: what only a CUDA GPU can show. ``python -m pytest -m gpu`` runs it (with
``tests/test_gpu_monitor.py``'s NVML test, the DataParallel test of ``tests/test_time_split.py``
and DALI's mixed decoding in ``tests/test_dali.py``); ``python benchmarks/gpu_peak.py`` then
measures throughput against the hardware's peak. On a machine without a GPU every test here is
skipped, with the reason."""
from __future__ import annotations


import pytest
import torch

from tests.helpers.procs import base_env, free_port
from tests.helpers.runs import train_on_gpu

def gpu_only(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


@gpu_only
def test_the_mode_matrix_on_one_gpu_runs_two_ranks_with_ddp_and_zero_and_says_fsdp_is_not_run(tmp_path):
    """tests/test_mode_matrix.py's round trips on this one GPU, two ranks sharing it over gloo with CUDA tensors (NCCL
    refuses two ranks on one GPU: a rehearsal, as the kit's backend=auto makes it): channels_last, bf16 autocast and
    fp16's scaler as a GPU run takes them, cudnn.benchmark and TF32 on, the two steps before each checkpoint from the
    kit's own loader (pinned memory, copies that do not block). Each round trip says what it built on which device.
    FSDP is not run here: FSDP2 over gloo on CUDA tensors is untried and refused (robust/compat.py), and NCCL needs
    a GPU per rank; docs/gpu.md says so."""
    from ddp_utils.demo_data import prepare_demo
    from ddp_utils.robust import compat
    from tests.helpers import mode_matrix
    from tests.helpers.mode_matrix import phase
    prepare_demo(tmp_path / "demo")
    env = base_env(MATRIX_BACKEND="gloo", MATRIX_DATA=str(tmp_path / "demo"))
    assert "runs over nccl only" in compat.fsdp_refusal("cuda", "gloo")
    phase("save", 2, tmp_path / "matrix", env)
    lines = phase("resume", 2, tmp_path / "matrix", env)
    trips = mode_matrix.round_trips(lines)
    assert len(trips) == 2 * len(mode_matrix.VARIANTS) * 2 and all(r == [0, 1] for r in map(sorted, trips.values()))
    assert not mode_matrix.wrong(lines), "\n".join(mode_matrix.wrong(lines))
    assert not mode_matrix.built_wrong(lines), "\n".join(lines)
    assert all(" built=DDP" in line and "@cuda:0 " in line for line in lines if line.startswith("CHECK")), lines
    assert not [line for line in lines if "-> fsdp@" in line]


@gpu_only
def test_nccl_process_group_with_one_rank_all_reduces_and_trains_a_ddp_step():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        assert t.tolist() == [1.0] * 4
        model = DDP(torch.nn.Linear(8, 2).cuda(), device_ids=[0])
        model(torch.randn(4, 8, device="cuda")).sum().backward()
        assert all(p.grad is not None for p in model.parameters())
    finally:
        dist.destroy_process_group()


@gpu_only
@pytest.mark.parametrize("amp, dtype", [("bf16", "torch.bfloat16"), ("fp16", "torch.float16")])
def test_mixed_precision_trains_with_finite_numbers(tmp_path, amp, dtype):
    if amp == "bf16" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("this GPU has no bf16 (a T4): fp16 + scaler is its AMP")
    output, results = train_on_gpu(tmp_path, "--amp", amp)
    assert f"precision {dtype}" in output
    assert results["loss"] == results["loss"]   # not NaN


@gpu_only
def test_the_fp16_scaler_skips_a_step_whose_gradients_overflowed():
    from ddp_utils.optim import make_scaler
    model = torch.nn.Linear(4, 1).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler(torch.float16, torch.device("cuda"))
    before = model.weight.detach().clone()
    scale = scaler.get_scale()
    loss = model(torch.ones(2, 4, device="cuda")).sum() * float("inf")   # gradients become inf
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(model.weight, before), "the step was not skipped"
    assert scaler.get_scale() < scale, "the scale was not lowered"


@gpu_only
def test_channels_last_on_the_gpu(tmp_path):
    from ddp_utils.model import build_model, prepare_model
    from ddp_utils.optim import to_device
    from ddp_utils.settings import Settings
    from ddp_utils.distributed import DistContext
    settings = Settings(dataset="fake", arch="resnet18", channels_last=True)
    ctx = DistContext(0, 1, 0, torch.device("cuda", 0), None)
    model = prepare_model(build_model("resnet18", 10), settings, ctx)
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    images, _ = to_device(torch.randn(2, 3, 32, 32), torch.zeros(2, dtype=torch.long), settings, ctx.device)
    assert images.is_contiguous(memory_format=torch.channels_last)


@gpu_only
def test_the_memory_loader_keeps_the_images_on_the_gpu(tmp_path):
    from ddp_utils.data import build_loaders
    from ddp_utils.demo_data import prepare_demo
    from ddp_utils.settings import Settings
    prepare_demo(tmp_path / "demo")
    settings = Settings(dataset="demo", data_dir=str(tmp_path / "demo"), loader="memory", batch_size=32)
    data = build_loaders(settings, 0, 1, torch.device("cuda", 0))
    images, labels = next(iter(data.train.epoch(0)))
    assert images.is_cuda and labels.is_cuda and images.shape == (32, 3, 32, 32)


@gpu_only
def test_gpu_use_is_sampled_during_a_real_run(tmp_path):
    _, results = train_on_gpu(tmp_path, "--max-steps-per-epoch", "40")
    assert isinstance(results["gpu_util"], (int, float)) and results["gpu_mem_peak_mb"] > 0


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
                                        ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A10G", 70), ("NVIDIA L4", 121),
                                        ("Tesla T4", 65), ("Some Future GPU", None)])
def test_the_peak_table_matches_the_most_specific_name(name, peak):
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpu_peak import peak_for
    assert peak_for(name) == peak

"""The GPU paths, checked on a CPU: what a GPU node does differently is emulated (what torch.cuda answers,
gloo in place of nccl), and each emulated test has a ``gpu``-marked twin in tests/test_gpu.py or here
that checks the same on a real GPU (skipped, with the reason, where there is none)."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from ddp_utils.speed import linkprobe
from ddp_utils.distributed import DistContext
from ddp_utils.model import build_model
from ddp_utils.settings import Settings
from tests.helpers.procs import free_port
from tests.helpers.groups import gpu_only, one_rank_group
from tests.helpers.runs import run_data


# -- the link probe with --sync-bn ------------------------------------------------------------------
@pytest.mark.slow
def test_the_link_probes_copy_of_a_sync_bn_model_starts_no_collective():
    """Rank 0 times its copy alone while the others wait: a SyncBatchNorm in the copy would start
    collectives nobody joins (a hang on GPUs; on a CPU SyncBatchNorm refuses to run, which shows the same)."""
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(build_model("resnet18_cifar", 10))
    settings = Settings(dataset="fake", arch="resnet18_cifar", batch_size=4)
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    with one_rank_group():
        seconds = linkprobe._time_compute(model, settings, ctx, run_data(10, 32), rounds=1)
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
        assert linkprobe._time_compute(model, settings, DistContext(0, 1, 0, device, "nccl"), run_data(10, 32)) > 0


# -- the ranks agree on a backend before init (devices.py) ------------------------------------------
def two_ranks_with(devices: list, backend: str, amp: str = "auto") -> list:
    from tests.helpers.procs import base_env, python, run_all
    import json
    port = free_port()
    env = base_env(DEVICES=json.dumps(devices), BACKEND=backend, AMP=amp)
    return run_all([python("-m", "tests.helpers.dist_scenarios", "devices", str(r), "2", str(port), "127.0.0.1", "30")
                    for r in range(2)], timeout=90, env=env)


@pytest.mark.slow
def test_a_node_without_a_gpu_is_named_on_every_rank_before_init():
    """A container started without --gpus on node 2: auto meant nccl on rank 0 and gloo on rank 1, and init
    waited out its timeout blaming the network. Now every rank names the node, in seconds, before any backend."""
    from tests.helpers.procs import describe
    results = two_ranks_with(["T4", None], "auto")
    for r in results:
        assert r.returncode == 3 and "CHECK backend" not in r.output, describe(results)
        assert "rank 1 (host " in r.output and "has no usable GPU" in r.output, describe(results)
        assert "--gpus all" in r.output and "Tesla T4" in r.output, describe(results)
        assert float(r.output.split("CHECK seconds_to_error=")[1].split()[0]) < 20


@pytest.mark.slow
def test_two_ranks_on_one_gpu_with_nccl_are_told_before_init():
    from tests.helpers.procs import describe
    results = two_ranks_with(["T4", "T4"], "nccl")
    for r in results:
        assert r.returncode == 3 and "CHECK backend" not in r.output, describe(results)
        assert "ranks 0, 1 (host" in r.output and "all use the same GPU, Tesla T4" in r.output, describe(results)
        assert "duplicate GPU" in r.output and "backend='auto' or 'gloo'" in r.output, describe(results)


@pytest.mark.slow
def test_two_ranks_on_one_gpu_with_auto_rehearse_on_gloo_and_say_why():
    """Both notebooks on one single-GPU VM: gloo can share the GPU, nccl cannot."""
    from tests.helpers.procs import describe
    results = two_ranks_with(["T4", "T4"], "auto")
    for r in results:
        assert r.returncode == 0 and 'CHECK backend="gloo"' in r.output, describe(results)
        assert "a rehearsal on one machine: NCCL cannot share a GPU between ranks" in r.output, describe(results)


@pytest.mark.slow
def test_gloo_asked_for_with_a_cpu_node_trains_and_says_the_cpu_ranks_set_the_pace():
    from tests.helpers.procs import describe
    results = two_ranks_with(["T4", None], "gloo", amp="off")   # gloo asked for: allowed, with a word on the pace
    assert all(r.returncode == 0 and 'CHECK backend="gloo"' in r.output for r in results), describe(results)
    assert "will train on the CPU" in results[0].output
    results = two_ranks_with(["T4", None], "gloo")   # amp=auto: fp16 on the GPU, fp32 on the CPU
    for r in results:
        assert r.returncode == 3 and "gives different precisions" in r.output, describe(results)
        assert "set amp=off on every rank" in r.output, describe(results)


def test_the_agreement_is_one_decision_from_every_ranks_facts():
    from ddp_utils.robust.devices import agree_on_backend

    def facts(rank, gpu, machine="m0"):
        return {"rank": rank, "host": f"node{rank}", "machine": machine, "gpu": gpu, "gpu_name": "Tesla T4",
                "auto": "nccl" if gpu else "gloo"}
    assert agree_on_backend([facts(0, "GPU-a"), facts(1, "GPU-b")], "auto") == ("nccl", "")
    assert agree_on_backend([facts(0, None), facts(1, None)], "auto") == ("gloo", "")
    assert agree_on_backend([facts(1, "GPU-a"), facts(0, "GPU-a")], "auto")[0] == "gloo"


@gpu_only
def test_both_notebooks_on_one_gpu_train_on_gloo(tmp_path):
    """The real rehearsal: two ranks on this machine's one GPU (auto) -> gloo, and the run finishes."""
    if torch.cuda.device_count() != 1:
        pytest.skip("needs a machine with exactly one GPU")
    from tests.helpers.procs import base_env, describe, python, run_all
    port = free_port()
    common = ["--dataset", "fake", "--image-size", "32", "--workers", "0", "--wandb", "disabled", "--epochs", "1",
              "--max-steps-per-epoch", "5", "--batch-size", "16", "--progress", "off", "--world-size", "2",
              "--master-port", str(port)]
    results = run_all([python("-m", "ddp_utils", "train", *common, "--rank", str(r), "--run-dir", str(tmp_path / f"r{r}"))
                       for r in range(2)], timeout=300, env=base_env())
    assert all(r.returncode == 0 for r in results), describe(results)
    assert "every rank uses gloo" in results[0].output and "(gloo, cuda:0)" in results[0].output


# -- amp=auto: from the compute capability ---------------------------------------------------------
def test_amp_auto_gives_fp16_with_the_scaler_on_a_t4(monkeypatch):
    """torch.cuda.is_bf16_supported() says True on a T4 (emulated bf16): the kit must not believe it."""
    from ddp_utils.optim import amp_dtype, make_scaler, precision_name
    from tests.helpers.gpu_emulation import T4, pretend_gpu
    pretend_gpu(monkeypatch.setattr, T4)
    assert torch.cuda.is_bf16_supported()   # the trap, as PyTorch answers on a T4
    device = torch.device("cuda", 0)
    assert amp_dtype(Settings(amp="auto"), device) is torch.float16
    assert precision_name(Settings(amp="auto"), device) == "fp16"
    assert make_scaler(torch.float16, torch.device("cpu")).is_enabled()   # fp16 always comes with the scaler


def test_amp_auto_gives_bf16_from_compute_capability_8(monkeypatch):
    from ddp_utils.optim import amp_dtype
    from tests.helpers.gpu_emulation import A100, pretend_gpu
    pretend_gpu(monkeypatch.setattr, A100)
    assert amp_dtype(Settings(amp="auto"), torch.device("cuda", 0)) is torch.bfloat16


def test_amp_auto_is_off_on_a_cpu_and_explicit_modes_are_kept():
    from ddp_utils.optim import amp_dtype
    cpu = torch.device("cpu")
    assert amp_dtype(Settings(amp="auto"), cpu) is None
    assert amp_dtype(Settings(amp="fp16"), cpu) is torch.float16 and amp_dtype(Settings(amp="off"), cpu) is None


def test_amp_bf16_asked_for_on_a_t4_is_refused_with_what_to_do(monkeypatch):
    from ddp_utils.optim import amp_dtype
    from tests.helpers.gpu_emulation import T4, pretend_gpu
    pretend_gpu(monkeypatch.setattr, T4)
    with pytest.raises(ValueError, match=r"amp=bf16 on Tesla T4 \(compute capability 7\.5\).*amp=fp16"):
        amp_dtype(Settings(amp="bf16"), torch.device("cuda", 0))


@gpu_only
def test_amp_auto_on_this_gpu_follows_its_capability():
    from ddp_utils.optim import amp_dtype
    want = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16
    assert amp_dtype(Settings(amp="auto"), torch.device("cuda", 0)) is want


def test_ranks_whose_gpus_would_pick_different_precisions_are_stopped_before_init():
    """amp=auto on an A100 node and a T4 node: bf16 on one, fp16 + scaler on the other."""
    from ddp_utils.robust.devices import agree_on_precision
    from ddp_utils.robust.preflight import DistSetupError
    a100 = {"rank": 0, "host": "a", "gpu": "GPU-1", "gpu_name": "NVIDIA A100-SXM4-40GB", "precision": "bf16"}
    t4 = {"rank": 1, "host": "b", "gpu": "GPU-2", "gpu_name": "Tesla T4", "precision": "fp16"}
    with pytest.raises(DistSetupError, match=r"amp=auto gives different precisions on the ranks \(bf16 on rank 0 "
                                             r"\(host a\), NVIDIA A100.*fp16 on rank 1 \(host b\), Tesla T4\).*amp=fp16"):
        agree_on_precision([a100, t4], "auto")
    assert agree_on_precision([t4, {**t4, "rank": 0}], "auto") == "fp16"
    with pytest.raises(DistSetupError, match="rank 1 .*amp=bf16 on Tesla T4"):
        agree_on_precision([{**a100}, {**t4, "precision": "error: amp=bf16 on Tesla T4 (compute capability 7.5)"}],
                           "bf16")


# -- resuming across precisions ---------------------------------------------------------------------
@pytest.mark.slow
def test_a_checkpoint_without_fp16_resumes_with_fp16(tmp_path):
    """A bf16 (or CPU) run's checkpoint holds a disabled scaler's empty state; resuming it with fp16 (A100 nodes
    -> T4 nodes) crashed in GradScaler.load_state_dict. Here the real path on a CPU: amp off, then fp16 (the MLP: a
    CPU's fp16 convolutions take seconds a step)."""
    import json
    from tests.helpers.procs import base_env, describe, python, run_all
    run = tmp_path / "run"
    common = ["--dataset", "fake", "--image-size", "32", "--arch", "mlp", "--workers", "0", "--wandb", "disabled",
              "--progress", "off", "--max-steps-per-epoch", "5", "--batch-size", "16", "--run-dir", str(run)]
    first = run_all([python("-m", "ddp_utils", "train", *common, "--epochs", "1", "--amp", "off")], timeout=120,
                    env=base_env())
    assert first[0].returncode == 0, describe(first)
    resumed = run_all([python("-m", "ddp_utils", "train", *common, "--epochs", "2", "--amp", "fp16",
                              "--resume", str(run / "last.pt"))], timeout=120, env=base_env())
    assert resumed[0].returncode == 0, describe(resumed)
    assert "precision torch.float16" in resumed[0].output
    results = json.loads((run / "results.json").read_text())
    assert results["epochs_run"] == 1 and [h["epoch"] for h in results["history"]] == [1, 2]


@gpu_only
def test_a_bf16_checkpoint_resumes_with_fp16_on_a_gpu(tmp_path):
    from tests.helpers.procs import base_env, describe, python, run_all
    first_amp = "bf16" if torch.cuda.get_device_capability() >= (8, 0) else "off"
    run = tmp_path / "run"
    common = ["--dataset", "fake", "--image-size", "64", "--arch", "resnet18", "--workers", "2", "--wandb", "disabled",
              "--progress", "off", "--max-steps-per-epoch", "5", "--batch-size", "32", "--run-dir", str(run)]
    said = {"bf16": "precision torch.bfloat16", "off": "precision fp32", "fp16": "precision torch.float16"}
    for amp, extra in ((first_amp, ["--epochs", "1"]), ("fp16", ["--epochs", "2", "--resume", str(run / "last.pt")])):
        result = run_all([python("-m", "ddp_utils", "train", *common, *extra, "--amp", amp)], timeout=300,
                         env=base_env())
        assert result[0].returncode == 0 and said[amp] in result[0].output, describe(result)
    results = json.loads((run / "results.json").read_text())   # the second run continued the first
    assert results["epochs_run"] == 1 and [h["epoch"] for h in results["history"]] == [1, 2], results
    assert math.isfinite(results["loss"]), results


# -- commtime on a GPU: CUDA events ------------------------------------------------------------------
class FakeEvent:
    """A CUDA event as far as CommTimer uses it: elapsed_time raises unless both events completed, as CUDA does."""
    clock = 0.0

    def __init__(self, enable_timing=True):
        self.done, self.at = False, None

    def record(self, stream=None):
        FakeEvent.clock += 1.0
        self.at = FakeEvent.clock

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True

    def elapsed_time(self, other):
        if not (self.done and other.done):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (other.at - self.at) * 1e3


def test_commtime_waits_for_every_buckets_end_before_reading_gpu_times(monkeypatch):
    """A blocking hook (PowerSGD on one bucket at a time) leaves the last bucket's "done" event pending when the
    step's first "ready" event has completed: take() must wait for the done events, not only the first one."""
    from ddp_utils.speed.commtime import CommTimer
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = CommTimer(torch.device("cuda", 0))
    timer.blocking = True
    first, last = (timer._now(), timer._now()), (timer._now(), timer._now())
    first[0].synchronize()
    first[1].synchronize()                      # the first bucket is finished, the last one still runs
    timer._buckets = [first, last]
    timer.step_done()                           # not finished: nothing read yet, no synchronisation
    assert timer._pending
    waited, in_flight = timer.take()            # the epoch's end: waits, then reads
    assert (waited, in_flight) == (2.0, 2.0)


def test_local_sgds_averages_on_a_gpu_are_timed_by_cuda_events_read_without_a_sync_per_average(monkeypatch):
    """CommTimer.span/end_span (local SGD's weight averages) on a GPU: events, resolved when finished or at take()."""
    from ddp_utils.speed.commtime import CommTimer
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = CommTimer(torch.device("cuda", 0))
    span = timer.span()
    timer.end_span(span)                        # the average is still queued on the GPU: nothing read yet
    assert timer._pending and timer.waited_s == 0.0
    assert timer.take() == (1.0, 1.0)           # the epoch's end: waits, then reads; all of it waited for


# -- the speed a GPU user expects --------------------------------------------------------------------
def test_a_gpu_run_lets_cudnn_pick_its_fastest_convolutions():
    from ddp_utils.optim import use_fast_gpu_kernels
    # Saved and restored by hand: on torch 2.6 allow_tf32 is served by a module __getattr__, which
    # monkeypatch's undo cannot put back (it tries delattr).
    kept = torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32 = False, False
        use_fast_gpu_kernels(torch.device("cpu"))
        assert torch.backends.cudnn.benchmark is False   # a CPU run is left alone
        use_fast_gpu_kernels(torch.device("cuda", 0))
        assert torch.backends.cudnn.benchmark is True and torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32 = kept


def test_prepare_sets_the_fast_kernels_for_the_runs_device(monkeypatch, tmp_path):
    from ddp_utils import job as job_module
    from ddp_utils import model as model_module
    seen = []
    monkeypatch.setattr(model_module, "use_fast_gpu_kernels", seen.append)
    settings = Settings(dataset="fake", image_size=32, workers=0, wandb="disabled", progress="off",
                        run_dir=str(tmp_path / "run"), max_steps_per_epoch=1, batch_size=4, epochs=1)
    with job_module.prepare(settings, log=lambda *_: None) as job:
        assert seen == [job.ctx.device]
    job_module.distributed.teardown()


@gpu_only
def test_cudnn_benchmark_is_on_during_a_gpu_run(tmp_path):
    from ddp_utils import job as job_module
    settings = Settings(dataset="fake", image_size=32, workers=0, wandb="disabled", progress="off",
                        run_dir=str(tmp_path / "run"), max_steps_per_epoch=1, batch_size=4, epochs=1)
    with job_module.prepare(settings, log=lambda *_: None):
        assert torch.backends.cudnn.benchmark
    job_module.distributed.teardown()


# -- DataParallel with bf16 ------------------------------------------------------------------------------
def test_each_dataparallel_replica_computes_in_the_runs_dtype():
    """A replica thread re-enters autocast without the dtype (PyTorch 125186: fp16 by default on CUDA); the kit's
    wrapper enters it with the run's dtype. Emulated on a CPU: a thread in fp16 autocast, the run in bf16."""
    import threading
    from ddp_utils.model import AutocastInReplicas, unwrap
    inner = torch.nn.Linear(4, 2)
    wrapped = AutocastInReplicas(inner, torch.bfloat16, device_type="cpu")
    out = {}

    def replica(name, module):
        with torch.autocast("cpu", dtype=torch.float16):   # what parallel_apply's thread does
            out[name] = module(torch.randn(3, 4)).dtype
    for name, module in (("plain", inner), ("kit", wrapped)):
        thread = threading.Thread(target=replica, args=(name, module))
        thread.start()
        thread.join()
    assert out == {"plain": torch.float16, "kit": torch.bfloat16}
    assert wrapped(torch.randn(3, 4)).dtype == torch.float32   # outside autocast: left alone
    # (last: on a machine with a GPU, DataParallel moves the module onto it)
    assert unwrap(torch.nn.DataParallel(wrapped)) is inner   # checkpoints keep the plain model's keys


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
def test_dataparallel_runs_with_the_devices_the_node_has_and_says_what_it_splits(monkeypatch, gpus):
    """Lab 4 on the homework's one-GPU nodes and on a laptop: parallel=dp is DataParallel there too (a rehearsal:
    torch calls the model itself, nothing is split), recorded as dp; with 2+ GPUs it drives all of them.
    Emulated (tests/helpers/gpu_emulation.py); the one-GPU twin is test_time_split.py's gpu-marked DP test."""
    from tests.helpers.gpu_emulation import T4, pretend_gpu
    from ddp_utils.model import describe_parallel, devices_used, parallel_mode
    if gpus:
        pretend_gpu(monkeypatch.setattr, T4, count=gpus)
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    ctx = DistContext(0, 1, 0, device, None)
    settings = Settings(dataset="fake", parallel="dp", batch_size=64)
    assert parallel_mode(settings, ctx) == "dp" and parallel_mode(settings.replace(parallel="none"), ctx) == "none"
    assert devices_used("dp", ctx) == ([torch.device("cuda", i) for i in range(gpus)] if gpus else [device])
    said = describe_parallel(settings, ctx)
    if gpus >= 2:
        assert said == (f"parallel: DataParallel over {gpus} GPUs in one process; each step splits the batch of 64 "
                        f"into {gpus} parts and gathers the outputs on cuda:0")
    else:
        where = "over 1 GPU" if gpus else "on the CPU (DataParallel splits over GPUs only)"
        assert said.startswith(f"parallel: DataParallel {where} in one process: nothing to split")
        assert "a rehearsal of DP's code path, not of its cost" in said


@gpu_only
def test_dataparallel_with_bf16_runs_bf16_in_every_replica():
    if torch.cuda.device_count() < 2 or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs 2 GPUs with bf16")
    from ddp_utils.model import prepare_model
    settings = Settings(dataset="fake", arch="convnet", parallel="dp", amp="bf16")
    model = prepare_model(build_model("convnet", 10), settings, DistContext(0, 1, 0, torch.device("cuda", 0), None))
    seen = []
    model.module.module[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(torch.randn(8, 3, 32, 32, device="cuda"))
    assert seen and set(seen) == {torch.bfloat16}, seen


# -- gpu-marked twins of the emulated tests above that had none -------------------------------------
@gpu_only
def test_commtime_reads_real_cuda_events_after_the_steps_were_queued():
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddp_utils.speed.commtime import CommTimer
    device = torch.device("cuda", 0)
    with one_rank_group("nccl", device):
        model = DDP(torch.nn.Linear(64, 64).to(device), device_ids=[0])
        timer = CommTimer(device)
        timer.attach(model)
        for _ in range(3):
            model(torch.randn(8, 64, device=device)).sum().backward()
            timer.step_done()
        waited, in_flight = timer.take()
    assert timer.steps == 3 and 0 <= waited <= in_flight < 10


@gpu_only
def test_local_sgd_averages_gpu_tensors_over_nccl_and_times_them():
    from ddp_utils.speed.commtime import CommTimer
    from ddp_utils.speed.localsgd import LocalSGD
    device = torch.device("cuda", 0)
    with one_rank_group("nccl", device):
        model = torch.nn.Linear(64, 64).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        timer = CommTimer(device)
        sgd = LocalSGD(model, optimizer, every=2, warmup_steps=0, timer=timer)
        for _ in range(4):
            model(torch.randn(8, 64, device=device)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            sgd.step_done()
        before = [p.detach().clone() for p in model.parameters()]
        sgd.end_of_epoch()
        sgd.finish()
        waited, _ = timer.take()
    assert sgd.averages == 3 and waited > 0   # after steps 2 and 4, then the momentum
    for p, b in zip(model.parameters(), before):   # one rank: its mean is itself (up to the fp16 difference)
        assert p.device == device and torch.allclose(p, b, atol=1e-3)


@gpu_only
def test_the_scaled_step_tells_a_skipped_fp16_step_on_a_gpu():
    from ddp_utils.optim import ScaledStep, make_scaler
    model = torch.nn.Linear(4, 1).cuda()
    stepper = ScaledStep(torch.optim.SGD(model.parameters(), lr=0.1), make_scaler(torch.float16, torch.device("cuda")))
    stepper.scaler.scale(model(torch.ones(2, 4, device="cuda")).sum() * float("inf")).backward()
    assert stepper() is False and stepper.in_a_row == 1
    stepper.optimizer.zero_grad()
    stepper.scaler.scale(model(torch.ones(2, 4, device="cuda")).sum()).backward()
    assert stepper() is True and stepper.in_a_row == 0 and stepper.skipped == 1


@gpu_only
def test_the_watchs_abort_ends_an_nccl_group():
    """What the watch does on nccl (heartbeat.py -> peers.abort_group): afterwards no collective waits."""
    from ddp_utils.robust import peers
    device = torch.device("cuda", 0)
    with one_rank_group("nccl", device):
        peers.abort_group("test")
        with pytest.raises(Exception):
            t = torch.ones(1, device=device)
            dist.all_reduce(t)
            torch.cuda.synchronize()
    peers._aborted = None


@gpu_only
def test_a_dataparallel_process_samples_every_gpu_with_real_nvml():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from ddp_utils.speed.gpu_monitor import GpuMonitor
    from ddp_utils.model import devices_used
    devices = devices_used("dp", DistContext(0, 1, 0, torch.device("cuda", 0), None))
    with GpuMonitor(devices, interval=3600) as gpu:
        x = [torch.randn(1024, 1024, device=d) for d in devices]
        assert gpu.sample_once()
    assert len(devices) == torch.cuda.device_count() and gpu.summary()["gpu_mem_peak_mb"] > 0
    del x


@gpu_only
def test_a_dataparallel_monitor_keeps_each_real_gpus_figures():
    """The twin of test_gpu_monitor.py's emulated per-device tests: real NVML, every GPU of this node (one too),
    a busy GPU 0 with more memory allocated than the others, as under DataParallel."""
    import time
    from ddp_utils.speed.gpu_monitor import GpuMonitor, describe_per_device
    from ddp_utils.model import devices_used
    devices = devices_used("dp", DistContext(0, 1, 0, torch.device("cuda", 0), None))
    with GpuMonitor(devices, interval=0.05, per_device=True) as gpu:
        x = torch.randn(4096, 4096, device=devices[0])       # 64 MB on GPU 0 only
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            for _ in range(10):
                x = torch.tanh(x @ x)
            torch.cuda.synchronize(devices[0])
    s = gpu.summary()
    n = len(devices)
    assert len(s["gpu_util_per_device"]) == len(s["gpu_mem_peak_mb_per_device"]) == n, s
    assert len(s["torch_mem_peak_mb_per_device"]) == n and s["torch_mem_peak_mb_per_device"][0] >= 64
    assert s["gpu_util_per_device"][0] > 0 and s["gpu_mem_peak_mb_per_device"][0] >= 64
    assert s["gpu_mem_peak_mb"] == max(s["gpu_mem_peak_mb_per_device"])
    assert describe_per_device(s).startswith("per GPU (DataParallel): cuda:0 ")
    del x


@gpu_only
def test_two_launched_processes_share_one_real_gpu_over_gloo(tmp_path, monkeypatch):
    """Lab 4's DDP on a one-GPU homework node: launch(share_gpu=True) starts 2 processes on GPU 0; they agree on
    gloo and train; the run counts one GPU. The emulated twin: test_launch.py's one-GPU plan test."""
    import json
    import os
    from ddp_utils.tools import launch as launch_module
    monkeypatch.setattr(launch_module, "local_gpus", lambda: 1)   # the children see GPU 0 only (below)
    settings = Settings(dataset="fake", image_size=32, arch="convnet", workers=0, wandb="disabled", progress="off",
                        epochs=1, max_steps_per_epoch=3, batch_size=16, init_timeout=60, run_dir=str(tmp_path / "run"))
    lines = []
    results = launch_module.launch(settings, nproc_per_node=2, master_port=free_port(), share_gpu=True,
                                   log_dir=str(tmp_path / "logs"), on_line=lines.append, timeout=300,
                                   environ={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    text = "\n".join(lines)
    assert "all use the same GPU" in text and "(gloo, cuda:0)" in text, text
    assert results["world_size"] == 2 and results["backend"] == "gloo" and results["job_gpus"] == 1
    assert json.loads((tmp_path / "run" / "results.json").read_text())["gpus"] == 1

"""GpuMonitor: the numbers are exactly the samples taken, per phase and per job; no GPU means "no GPU", never a
made-up number; the thread always ends; the torch device is mapped to the right NVML device.

A stub NVML stands in for the driver (CPU only, no sleeping: a long interval keeps the thread quiet and the
test calls ``sample_once`` itself); one test marked ``gpu`` runs the real NVML on a CUDA device.
"""
from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest
import torch

from ddp_utils.speed import gpu_monitor
from ddp_utils.speed.gpu_monitor import MB, GpuMonitor, describe, reduce_summaries

CUDA0 = torch.device("cuda", 0)
QUIET = 3600.0   # an interval the thread never reaches during a test: only sample_once() samples


class StubNvml:
    """A machine of GPUs as NVML sees them: by index and by PCI bus id, each with scripted readings."""

    def __init__(self, util=(50,), used_mb=(1000,), fail_init=None, gpus=1):
        self.util = {i: itertools.cycle(util) for i in range(gpus)}
        self.used_mb = {i: itertools.cycle(used_mb) for i in range(gpus)}
        self.fail_init, self.inits, self.shutdowns, self.lookups = fail_init, 0, 0, []

    def nvmlInit(self):
        if self.fail_init:
            raise self.fail_init
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index):
        self.lookups.append(("index", index))
        return index

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        self.lookups.append(("pci", bus_id))
        return int(bus_id.split(":")[1], 16) - 0x10   # bus 0x10 is GPU 0, 0x11 GPU 1, ...

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=next(self.util[handle]))

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=next(self.used_mb[handle]) * MB)


def no_pci_ids(monkeypatch):
    def unavailable(device):
        raise RuntimeError("no CUDA here")
    monkeypatch.setattr(torch.cuda, "get_device_properties", unavailable)


def pci_ids(monkeypatch, first_visible=0):
    """torch's cuda:i sits on bus 0x10 + its NVML index, which is i + first_visible (CUDA_VISIBLE_DEVICES)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(
        pci_domain_id=0, pci_bus_id=0x10 + first_visible + d.index, pci_device_id=0))


@pytest.fixture(autouse=True)
def stub_machine(monkeypatch, request):
    """The stub tests see the stub's GPUs, also on a machine with real ones; the gpu test sees the real."""
    if not request.node.get_closest_marker("gpu"):
        pci_ids(monkeypatch)
        # the stub's cuda:1 may not exist here, so torch's memory statistics are not read (as on a CPU machine)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_summary_is_exactly_the_mean_and_peaks_of_the_samples_taken():
    nvml = StubNvml(util=[40, 100, 70, 90], used_mb=[3000, 5120, 4000, 4500])
    with GpuMonitor(CUDA0, interval=QUIET, nvml=nvml) as gpu:
        for _ in range(4):
            assert gpu.sample_once()
    s = gpu.summary()
    assert (s["gpu_util"], s["gpu_util_peak"], s["gpu_mem_peak_mb"], s["gpu_samples"]) == (75.0, 100.0, 5120.0, 4)
    assert s["gpu_util_val"] is None
    assert nvml.shutdowns == 1


def test_the_thread_samples_by_itself_every_interval():
    nvml = StubNvml(util=[10, 20, 30])
    with GpuMonitor(CUDA0, interval=0.01, nvml=nvml) as gpu:
        deadline = time.monotonic() + 5
        while len(gpu.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [u for _, u, _ in gpu.samples[:3]] == [10, 20, 30]


def test_phases_keep_training_and_validation_apart():
    gpu = GpuMonitor(CUDA0, interval=QUIET, nvml=StubNvml(util=[80, 90, 30, 20])).start()
    gpu.sample_once(); gpu.sample_once()          # samples start as "train"
    gpu.phase("val")
    gpu.sample_once(); gpu.sample_once()
    gpu.stop()
    s = gpu.summary()
    assert (s["gpu_util"], s["gpu_util_peak"], s["gpu_util_val"], s["gpu_samples"]) == (85.0, 90.0, 25.0, 4)


def test_a_run_shorter_than_the_interval_still_gets_one_sample():
    with GpuMonitor(CUDA0, interval=QUIET, nvml=StubNvml(util=[63], used_mb=[777])) as gpu:
        pass
    s = gpu.summary()
    assert (s["gpu_util"], s["gpu_mem_peak_mb"], s["gpu_samples"]) == (63.0, 777.0, 1)


def test_a_cpu_device_says_no_gpu_and_starts_no_thread():
    nvml = StubNvml()
    with GpuMonitor(torch.device("cpu"), interval=0.01, nvml=nvml) as gpu:
        assert gpu._thread is None
        assert not gpu.sample_once()
    assert nvml.inits == 0
    assert gpu.summary()["gpu_util"] == "no GPU" and gpu.summary()["gpu_samples"] == 0
    assert describe(gpu.summary()) == "GPU use: no GPU (CPU run)"


def test_a_monitor_started_before_cuda_is_initialised_resets_no_peak_and_samples(monkeypatch):
    """On a GPU machine, a monitor started before CUDA's first use: resetting torch's memory peak then raises
    ("Invalid device argument", seen on an H200), and there is no peak to reset yet. Emulated: the twin is the
    gpu-marked real-NVML test below."""
    resets = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: resets.append(device))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 0)
    with GpuMonitor(CUDA0, interval=QUIET, nvml=StubNvml(util=[70])) as gpu:
        assert gpu.sample_once()
    assert resets == [] and gpu.summary()["gpu_util"] == 70
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)   # CUDA in use: this run's peak, from zero
    with GpuMonitor(CUDA0, interval=QUIET, nvml=StubNvml()):
        pass
    assert resets == [CUDA0]


def test_nvml_failing_at_init_says_no_gpu_and_why_without_raising():
    with GpuMonitor(CUDA0, nvml=StubNvml(fail_init=OSError("Driver Not Loaded"))) as gpu:
        assert gpu._thread is None
    s = gpu.summary()
    assert s["gpu_util"] == "no GPU" and s["gpu_mem_peak_mb"] is None and s["gpu_util_peak"] is None
    assert "Driver Not Loaded" in s["gpu_reason"]
    assert "Driver Not Loaded" in describe(s)


def test_the_real_nvml_without_a_driver_says_no_gpu():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    with GpuMonitor(CUDA0) as gpu:
        pass
    assert gpu.summary()["gpu_util"] == "no GPU" and "NVML" in gpu.summary()["gpu_reason"]


def test_a_failed_sample_is_skipped_and_sampling_goes_on():
    nvml = StubNvml(util=[55])
    with GpuMonitor(CUDA0, interval=QUIET, nvml=nvml) as gpu:
        real = nvml.nvmlDeviceGetUtilizationRates
        nvml.nvmlDeviceGetUtilizationRates = lambda h: (_ for _ in ()).throw(RuntimeError("GPU is lost"))
        assert not gpu.sample_once()
        nvml.nvmlDeviceGetUtilizationRates = real
        assert gpu.sample_once()
    assert gpu.summary()["gpu_samples"] == 1


def test_stop_ends_the_thread_at_once():
    gpu = GpuMonitor(CUDA0, interval=QUIET, nvml=StubNvml()).start()
    thread = gpu._thread
    assert thread.is_alive() and thread.daemon
    t0 = time.monotonic()
    gpu.stop()
    assert time.monotonic() - t0 < 1.0 and not thread.is_alive()


def test_an_exception_in_the_block_ends_the_thread_too():
    nvml = StubNvml()
    with pytest.raises(ValueError), GpuMonitor(CUDA0, interval=QUIET, nvml=nvml) as gpu:
        thread = gpu._thread
        raise ValueError("training failed")
    assert not thread.is_alive() and nvml.shutdowns == 1


def test_cuda_visible_devices_is_followed_by_pci_bus_id(monkeypatch):
    """CUDA_VISIBLE_DEVICES=2,3 makes NVML's GPU 3 torch's cuda:1: the numbers must come from GPU 3."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    pci_ids(monkeypatch, first_visible=2)
    nvml = StubNvml(gpus=4)
    nvml.util[1], nvml.util[3] = itertools.cycle([11]), itertools.cycle([33])
    with GpuMonitor(torch.device("cuda", 1), interval=QUIET, nvml=nvml) as gpu:
        gpu.sample_once()
    assert nvml.lookups == [("pci", "00000000:13:00.0")]
    assert gpu.summary()["gpu_util"] == 33.0


def test_without_pci_ids_the_visible_devices_list_maps_the_index(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    no_pci_ids(monkeypatch)
    nvml = StubNvml(gpus=4)
    GpuMonitor(torch.device("cuda", 1), interval=QUIET, nvml=nvml).start().stop()
    assert nvml.lookups == [("index", 3)]


def rank_summary(util, used_mb, val=()):
    gpu = GpuMonitor(CUDA0, interval=QUIET, nvml=StubNvml(util=list(util) + list(val), used_mb=used_mb)).start()
    for _ in util:
        gpu.sample_once()
    gpu.phase("val")
    for _ in val:
        gpu.sample_once()
    gpu.stop()
    return gpu.summary()


def test_reduce_summaries_gives_the_jobs_figures_over_mixed_ranks():
    ranks = [rank_summary([80, 100], [5000], val=[40]),
             rank_summary([60, 60], [6000]),
             GpuMonitor(torch.device("cpu")).start().summary()]
    job = reduce_summaries(ranks)
    assert job["gpu_util"] == 75.0                    # mean of the ranks' means (90 and 60)
    assert job["gpu_util_peak"] == 100.0 and job["gpu_mem_peak_mb"] == 6000.0
    assert job["gpu_util_val"] == 40.0 and job["gpu_samples"] == 5
    assert job["per_rank"] == ranks
    assert "1 of 3 ranks without GPU figures" in describe(job)


def test_reduce_summaries_of_cpu_ranks_is_no_gpu():
    cpu = GpuMonitor(torch.device("cpu")).start().summary()
    job = reduce_summaries([cpu, cpu])
    assert job["gpu_util"] == "no GPU" and job["gpu_mem_peak_mb"] is None
    assert describe(job) == "GPU use: no GPU (CPU run)"


def test_describe_is_one_line_with_the_numbers():
    s = {"gpu_util": 87.2, "gpu_util_peak": 99.0, "gpu_mem_peak_mb": 5120.0, "gpu_samples": 40,
         "gpu_util_val": None, "torch_mem_peak_mb": None, "gpu_reason": ""}
    assert describe(s) == "GPU use: 87 % mean (peak 99 %), memory peak 5120 MB"
    s.update(gpu_util_val=41.0, torch_mem_peak_mb=3900.0)
    assert describe(s) == "GPU use: 87 % mean (peak 99 %), memory peak 5120 MB (PyTorch's own peak 3900 MB); validation 41 %"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_nvml_measures_this_ranks_busy_gpu():
    pynvml = pytest.importorskip("pynvml")
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(4096, 4096, device=device)       # 64 MB
    with GpuMonitor(device, interval=0.05) as gpu:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            for _ in range(10):
                x = torch.tanh(x @ x)
            torch.cuda.synchronize()
        nvml_bus = pynvml.nvmlDeviceGetPciInfo(gpu._handles[0]).busId
    s = gpu.summary()
    assert s["gpu_samples"] >= 5, s
    assert 0 < s["gpu_util_peak"] <= 100 and 0 <= s["gpu_util"] <= 100
    assert s["gpu_mem_peak_mb"] >= 64 and s["torch_mem_peak_mb"] >= 64
    # the NVML device is torch's device: same PCI domain, bus and device numbers
    nvml_bus = nvml_bus.decode() if isinstance(nvml_bus, bytes) else nvml_bus
    assert pci_numbers(nvml_bus) == pci_numbers(gpu_monitor.pci_bus_id(device))


def pci_numbers(bus_id: str) -> list[int]:
    """[domain, bus, device] of "00000000:3B:00.0", whatever the case and the domain's width."""
    return [int(part, 16) for part in bus_id.replace(".", ":").split(":")[:3]]


def test_a_dataparallel_process_reports_every_gpu_it_drives(monkeypatch):
    """--parallel dp: the results say gpus=N, so GPU use is the mean over the N GPUs, memory the fullest GPU's
    (it read cuda:0 alone before)."""
    from ddp_utils.model import devices_used
    from ddp_utils.distributed import DistContext
    from tests.helpers.gpu_emulation import T4, pretend_gpu
    pretend_gpu(monkeypatch.setattr, T4, count=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # no real memory statistics to read here
    pci_ids(monkeypatch)
    devices = devices_used("dp", DistContext(0, 1, 0, CUDA0, None))
    assert devices == [CUDA0, torch.device("cuda", 1)]
    nvml = StubNvml(gpus=2)
    nvml.util = {0: itertools.cycle([90]), 1: itertools.cycle([30])}
    nvml.used_mb = {0: itertools.cycle([5000]), 1: itertools.cycle([3000])}
    with GpuMonitor(devices, interval=QUIET, nvml=nvml) as gpu:
        assert gpu.sample_once()
    s = gpu.summary()
    assert (s["gpu_util"], s["gpu_mem_peak_mb"]) == (60.0, 5000.0)
    assert devices_used("ddp", DistContext(0, 2, 0, CUDA0, "nccl")) == [CUDA0]


def test_a_dataparallel_process_keeps_each_gpus_figures_beside_the_averaged_ones(monkeypatch):
    """Lab 4's "is GPU 0 busier and fuller than GPU 1?": per_device=True keeps each GPU's training mean and
    memory peaks (index i for cuda:i); the averaged keys keep their meaning (mean utilisation, fullest GPU)."""
    from tests.helpers.gpu_emulation import T4, pretend_gpu
    pretend_gpu(monkeypatch.setattr, T4, count=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # torch's own peaks, emulated as well
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: {0: 4800, 1: 2900}[device.index] * MB)
    pci_ids(monkeypatch)
    nvml = StubNvml(gpus=2)
    nvml.util = {0: itertools.cycle([90, 100, 40]), 1: itertools.cycle([50, 30, 20])}   # the third sample: "val"
    nvml.used_mb = {0: itertools.cycle([5000, 6100, 6000]), 1: itertools.cycle([3000, 4200, 4000])}
    with GpuMonitor([CUDA0, torch.device("cuda", 1)], interval=QUIET, nvml=nvml, per_device=True) as gpu:
        gpu.sample_once(); gpu.sample_once()
        gpu.phase("val")
        gpu.sample_once()
    s = gpu.summary()
    assert s["gpu_util_per_device"] == [95.0, 40.0]                # training samples only, like gpu_util
    assert s["gpu_mem_peak_mb_per_device"] == [6100.0, 4200.0]     # every sample, like gpu_mem_peak_mb
    assert s["torch_mem_peak_mb_per_device"] == [4800.0, 2900.0]
    assert (s["gpu_util"], s["gpu_mem_peak_mb"], s["torch_mem_peak_mb"]) == (67.5, 6100.0, 4800.0)
    job = reduce_summaries([s])                                    # one process: its lists go into results.json
    assert job["gpu_util_per_device"] == [95.0, 40.0] and job["gpu_mem_peak_mb_per_device"] == [6100.0, 4200.0]
    assert describe(job).endswith("\n  per GPU (DataParallel): cuda:0 95 %, 6100 MB; cuda:1 40 %, 4200 MB")


def test_only_a_dataparallel_monitor_reports_per_gpu_figures():
    plain = rank_summary([80], [5000])
    assert not any(key in plain for key in gpu_monitor.PER_DEVICE_KEYS)
    assert "\n" not in describe(reduce_summaries([plain]))
    assert not any(key in reduce_summaries([plain, plain]) for key in gpu_monitor.PER_DEVICE_KEYS)


def test_a_dataparallel_monitor_without_nvml_keeps_no_per_gpu_numbers():
    with GpuMonitor([CUDA0, torch.device("cuda", 1)], nvml=StubNvml(fail_init=OSError("Driver Not Loaded")),
                    per_device=True) as gpu:
        pass
    s = reduce_summaries([gpu.summary()])
    assert s["gpu_util_per_device"] is None and s["gpu_mem_peak_mb_per_device"] is None
    assert s["torch_mem_peak_mb_per_device"] is None
    assert describe(s) == "GPU use: no GPU (NVML unavailable: Driver Not Loaded)"
    assert gpu_monitor.describe_per_device(s) == ""


def test_dataparallel_over_one_gpu_has_lists_of_one():
    with GpuMonitor([CUDA0], interval=QUIET, nvml=StubNvml(util=[70], used_mb=[900]), per_device=True) as gpu:
        gpu.sample_once()
    s = gpu.summary()
    assert (s["gpu_util_per_device"], s["gpu_mem_peak_mb_per_device"]) == ([70.0], [900.0])
    assert gpu_monitor.describe_per_device(s) == "per GPU (DataParallel): cuda:0 70 %, 900 MB"

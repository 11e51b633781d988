"""GPU utilisation and memory per rank, sampled in the background, to answer "were the GPUs fully used?".

A daemon thread asks NVML every ``interval`` seconds how busy this rank's GPU is (%) and how much of its
memory is used (MB); each sample is tagged with the current phase ("train" or "val")::

    with GpuMonitor(ctx.device) as gpu:
        gpu.phase("train"); ...            # training steps
        gpu.phase("val"); ...              # evaluation
    print(describe(gpu.summary()))         # GPU use: 87 % mean (peak 99 %), memory peak 5120 MB

NVML reports the whole GPU, so with one rank per GPU (the kit's layout) that is this rank's use. On a CPU
device, or where NVML cannot start (no driver, no ``nvidia-ml-py``), nothing is sampled and the summary
says "no GPU" with the reason: never a made-up number. ``reduce_summaries`` turns every rank's summary
into the job's figures.
"""
from __future__ import annotations

import os
import threading

import torch

NO_GPU = "no GPU"
MB = 2 ** 20


class GpuMonitor:
    """``device``: this rank's device, or a list of GPUs for a process that drives several (DataParallel):
    each sample is then their mean utilisation and the used memory of the fullest one (what limits the
    batch); ``torch_peak_mb`` likewise the largest of their peaks."""

    def __init__(self, device, interval: float = 0.5, nvml=None):
        self.devices = [torch.device(d) for d in (device if isinstance(device, (list, tuple)) else [device])]
        self.device = self.devices[0]
        self.interval = interval
        self.samples: list[tuple[str, float, float]] = []   # (phase, utilisation %, used memory MB)
        self.reason = ""                  # why nothing is sampled; "" while NVML answers
        self.torch_peak_mb: float | None = None
        self._nvml, self._handles, self._phase = nvml, [], "train"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GpuMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()                       # also after an exception in the block: the thread must not outlive it

    def start(self) -> "GpuMonitor":
        if self._thread is not None:      # already running: one thread per monitor
            return self
        if self.device.type != "cuda":
            self.reason = f"{self.device.type.upper()} run"
            return self
        try:
            if self._nvml is None:
                import pynvml             # only here: a CPU run needs no NVML at all
                self._nvml = pynvml
            self._nvml.nvmlInit()
        except Exception as exc:          # noqa: BLE001 - no driver, no library: say so and sample nothing
            self.reason = f"NVML unavailable: {str(exc) or type(exc).__name__}"
            return self
        try:
            self._handles = [nvml_handle(self._nvml, device) for device in self.devices]
        except Exception as exc:          # noqa: BLE001
            self.reason = f"NVML has no handle for {self.device}: {str(exc) or type(exc).__name__}"
            self._nvml.nvmlShutdown()
            return self
        if torch.cuda.is_available() and torch.cuda.is_initialized():   # before CUDA's init there is no peak
            for device in self.devices:                                  # yet, and resetting one raises
                torch.cuda.reset_peak_memory_stats(device)   # this run's peak, not an earlier cell's
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ddp_utils-gpu-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5.0)    # it waits on the event, so it wakes at once unless NVML hangs
        stuck, self._thread = self._thread.is_alive(), None
        if not self.samples:
            self.sample_once()            # a run shorter than the interval still gets a number
        if torch.cuda.is_available():
            self.torch_peak_mb = max(torch.cuda.max_memory_allocated(device) for device in self.devices) / MB
        if not stuck:                     # never pull NVML from under a thread still inside it
            self._nvml.nvmlShutdown()
        self._handles = []

    def phase(self, name: str) -> None:
        """Tag the samples from now on with ``name`` ("train" or "val"); they start as "train"."""
        self._phase = name

    def sample_once(self) -> bool:
        """Take one sample now (the thread calls this every ``interval``; tests call it directly)."""
        if not self._handles:
            return False
        try:
            utils = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            util = sum(utils) / len(utils)
            used = max(self._nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles) / MB
        except Exception as exc:          # noqa: BLE001 - a missed sample is no reason to stop training
            self.reason = f"NVML sample failed: {str(exc) or type(exc).__name__}"
            return False
        self.samples.append((self._phase, float(util), float(used)))
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):   # the first sample after one interval, not the idle start
            self.sample_once()

    def summary(self) -> dict:
        samples = list(self.samples)      # a copy: the thread may still append
        if not samples:
            return {"gpu_util": NO_GPU, "gpu_util_peak": None, "gpu_mem_peak_mb": None, "gpu_samples": 0,
                    "gpu_util_val": None, "torch_mem_peak_mb": self.torch_peak_mb,
                    "gpu_reason": self.reason or "no sample taken yet"}
        train = [u for p, u, _ in samples if p == "train"]
        val = [u for p, u, _ in samples if p == "val"]
        return {"gpu_util": _mean(train), "gpu_util_peak": max(train, default=None),
                "gpu_mem_peak_mb": max(m for _, _, m in samples), "gpu_samples": len(samples),
                "gpu_util_val": _mean(val), "torch_mem_peak_mb": self.torch_peak_mb, "gpu_reason": ""}


def nvml_handle(nvml, device: torch.device):
    """NVML's handle for this torch device. NVML numbers every GPU of the machine, torch only the visible
    ones (CUDA_VISIBLE_DEVICES=2,3 makes GPU 3 "cuda:1"), so the PCI bus id is the safe key."""
    bus_id = pci_bus_id(device)
    if bus_id:
        return nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if all(v.strip().isdigit() for v in visible) and index < len(visible):
        index = int(visible[index])       # older torch without PCI ids: undo the renumbering by hand
    return nvml.nvmlDeviceGetHandleByIndex(index)


def pci_bus_id(device: torch.device) -> str | None:
    """"00000000:3B:00.0" (NVML's format) from torch's device properties, or None when torch cannot tell."""
    try:
        props = torch.cuda.get_device_properties(device)
        bus = props.pci_bus_id
    except Exception:                     # noqa: BLE001 - no CUDA here, or a torch without PCI ids
        return None
    return f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"


def reduce_summaries(summaries: list[dict]) -> dict:
    """The job's figures from every rank's summary: mean of the ranks' means, the highest peaks.
    Ranks without GPU figures are left out of the numbers (and counted in ``describe``)."""
    measured = [s for s in summaries if s["gpu_util"] != NO_GPU]
    if not measured:
        reasons = sorted({s.get("gpu_reason") or NO_GPU for s in summaries})
        return {"gpu_util": NO_GPU, "gpu_util_peak": None, "gpu_mem_peak_mb": None, "gpu_samples": 0,
                "gpu_util_val": None, "torch_mem_peak_mb": _max(s.get("torch_mem_peak_mb") for s in summaries),
                "gpu_reason": "; ".join(reasons), "per_rank": list(summaries)}
    return {"gpu_util": _mean([s["gpu_util"] for s in measured if s["gpu_util"] is not None]),
            "gpu_util_peak": _max(s["gpu_util_peak"] for s in measured),
            "gpu_mem_peak_mb": _max(s["gpu_mem_peak_mb"] for s in measured),
            "gpu_samples": sum(s["gpu_samples"] for s in measured),
            "gpu_util_val": _mean([s["gpu_util_val"] for s in measured if s["gpu_util_val"] is not None]),
            "torch_mem_peak_mb": _max(s.get("torch_mem_peak_mb") for s in summaries),
            "gpu_reason": "", "per_rank": list(summaries)}


def describe(summary: dict) -> str:
    """One console line: "GPU use: 87 % mean (peak 99 %), memory peak 5120 MB" or "GPU use: no GPU (CPU run)"."""
    if summary["gpu_util"] == NO_GPU:
        return f"GPU use: no GPU ({summary.get('gpu_reason') or 'not measured'})"
    util = "no training sample" if summary["gpu_util"] is None else \
        f"{summary['gpu_util']:.0f} % mean (peak {summary['gpu_util_peak']:.0f} %)"
    line = f"GPU use: {util}, memory peak {summary['gpu_mem_peak_mb']:.0f} MB"
    if summary.get("torch_mem_peak_mb") is not None:
        line += f" (PyTorch's own peak {summary['torch_mem_peak_mb']:.0f} MB)"
    if summary.get("gpu_util_val") is not None:
        line += f"; validation {summary['gpu_util_val']:.0f} %"
    ranks = summary.get("per_rank") or []
    blind = sum(s["gpu_util"] == NO_GPU for s in ranks)
    if blind:
        line += f"; {blind} of {len(ranks)} ranks without GPU figures"
    return line


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def _max(values) -> float | None:
    return max((v for v in values if v is not None), default=None)

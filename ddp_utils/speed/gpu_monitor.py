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

A DataParallel process drives every GPU of its node (``per_device=True``): its summary keeps each GPU's
figures beside the averaged ones, index i for cuda:i (``PER_DEVICE_KEYS``), so that "is GPU 0 busier and
fuller than the others?" has an answer in results.json.
"""
from __future__ import annotations

import os
import threading

import torch

from .. import collectives
from ..model import devices_used
from ..observers import Observer, register
from ..robust.devices import gpu_id

NO_GPU = "no GPU"
MB = 2 ** 20
# A DataParallel run's figures per GPU, index i for cuda:i: mean training utilisation (%), NVML's peak of used
# memory (MB: the whole GPU, PyTorch's cache and the CUDA context included) and PyTorch's own peak (MB).
PER_DEVICE_KEYS = ("gpu_util_per_device", "gpu_mem_peak_mb_per_device", "torch_mem_peak_mb_per_device")


class GpuMonitor:
    """``device``: this rank's device, or a list of GPUs for a process that drives several (DataParallel):
    each sample is then their mean utilisation and the used memory of the fullest one (what limits the
    batch); ``torch_peak_mb`` likewise the largest of their peaks. ``per_device=True`` (DataParallel, also
    over one GPU) adds each GPU's own figures to the summary (``PER_DEVICE_KEYS``)."""

    def __init__(self, device, interval: float = 0.5, nvml=None, per_device: bool = False):
        self.devices = [torch.device(d) for d in (device if isinstance(device, (list, tuple)) else [device])]
        self.device = self.devices[0]
        self.interval = interval
        self.per_device = per_device
        self.samples: list[tuple[str, float, float]] = []   # (phase, utilisation %, used memory MB)
        # the same samples GPU by GPU: (phase, utilisation % per device, used memory MB per device)
        self.device_samples: list[tuple[str, tuple[float, ...], tuple[float, ...]]] = []
        self.reason = ""                  # why nothing is sampled; "" while NVML answers
        self.torch_peak_mb: float | None = None
        self.torch_peaks_mb: list[float] | None = None   # per device, in the order of ``devices``
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
            self.torch_peaks_mb = [torch.cuda.max_memory_allocated(device) / MB for device in self.devices]
            self.torch_peak_mb = max(self.torch_peaks_mb)
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
            utils = tuple(float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in self._handles)
            used = tuple(self._nvml.nvmlDeviceGetMemoryInfo(h).used / MB for h in self._handles)
        except Exception as exc:          # noqa: BLE001 - a missed sample is no reason to stop training
            self.reason = f"NVML sample failed: {str(exc) or type(exc).__name__}"
            return False
        phase = self._phase
        self.device_samples.append((phase, utils, used))   # first: samples says how many are complete
        self.samples.append((phase, sum(utils) / len(utils), max(used)))
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):   # the first sample after one interval, not the idle start
            self.sample_once()

    def summary(self) -> dict:
        samples = list(self.samples)      # a copy: the thread may still append
        if not samples:
            return {"gpu_util": NO_GPU, "gpu_util_peak": None, "gpu_mem_peak_mb": None, "gpu_samples": 0,
                    "gpu_util_val": None, "torch_mem_peak_mb": self.torch_peak_mb,
                    "gpu_reason": self.reason or "no sample taken yet", **self._per_device([])}
        train = [u for p, u, _ in samples if p == "train"]
        val = [u for p, u, _ in samples if p == "val"]
        return {"gpu_util": _mean(train), "gpu_util_peak": max(train, default=None),
                "gpu_mem_peak_mb": max(m for _, _, m in samples), "gpu_samples": len(samples),
                "gpu_util_val": _mean(val), "torch_mem_peak_mb": self.torch_peak_mb, "gpu_reason": "",
                **self._per_device(self.device_samples[:len(samples)])}

    def _per_device(self, samples: list) -> dict:
        """``PER_DEVICE_KEYS`` for a DataParallel process (else nothing): one number per GPU, None where
        nothing was measured (no sample: NVML's lists are None; no CUDA statistics: PyTorch's)."""
        if not self.per_device:
            return {}
        n = len(self.devices)
        train = [utils for phase, utils, _ in samples if phase == "train"]
        return {"gpu_util_per_device": [_mean([utils[i] for utils in train]) for i in range(n)] if samples else None,
                "gpu_mem_peak_mb_per_device": [max(used[i] for _, _, used in samples) for i in range(n)]
                if samples else None,
                "torch_mem_peak_mb_per_device": list(self.torch_peaks_mb) if self.torch_peaks_mb else None}


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
    # a DataParallel process (always alone: parallel=dp runs one process) keeps its figures per GPU
    per_device = {k: summaries[0][k] for k in PER_DEVICE_KEYS if k in summaries[0]} if len(summaries) == 1 else {}
    if not measured:
        reasons = sorted({s.get("gpu_reason") or NO_GPU for s in summaries})
        return {"gpu_util": NO_GPU, "gpu_util_peak": None, "gpu_mem_peak_mb": None, "gpu_samples": 0,
                "gpu_util_val": None, "torch_mem_peak_mb": _max(s.get("torch_mem_peak_mb") for s in summaries),
                "gpu_reason": "; ".join(reasons), **per_device, "per_rank": list(summaries)}
    return {"gpu_util": _mean([s["gpu_util"] for s in measured if s["gpu_util"] is not None]),
            "gpu_util_peak": _max(s["gpu_util_peak"] for s in measured),
            "gpu_mem_peak_mb": _max(s["gpu_mem_peak_mb"] for s in measured),
            "gpu_samples": sum(s["gpu_samples"] for s in measured),
            "gpu_util_val": _mean([s["gpu_util_val"] for s in measured if s["gpu_util_val"] is not None]),
            "torch_mem_peak_mb": _max(s.get("torch_mem_peak_mb") for s in summaries),
            "gpu_reason": "", **per_device, "per_rank": list(summaries)}


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
    each = describe_per_device(summary)
    if each:
        line += f";\n  {each}"           # a line of its own: a notebook wraps longer ones mid-word
    return line


def describe_per_device(results: dict) -> str:
    """"per GPU (DataParallel): cuda:0 92 %, 6100 MB; cuda:1 61 %, 4200 MB" from a DataParallel run's
    summary or results.json (``PER_DEVICE_KEYS``); "" for other runs and where no GPU was measured. The MB
    are NVML's (the whole GPU), else PyTorch's own peak."""
    utils, used = results.get("gpu_util_per_device"), results.get("gpu_mem_peak_mb_per_device")
    torch_peaks = results.get("torch_mem_peak_mb_per_device")
    lists = [x for x in (utils, used, torch_peaks) if isinstance(x, list)]
    if not lists:
        return ""
    parts = []
    for i in range(max(len(x) for x in lists)):
        util, mem = _at(utils, i), _at(used, i)
        mem = mem if mem is not None else _at(torch_peaks, i)
        parts.append(f"cuda:{i} " + ", ".join([f"{util:.0f} %" if util is not None else "no utilisation sample",
                                               *([f"{mem:.0f} MB"] if mem is not None else [])]))
    return "per GPU (DataParallel): " + "; ".join(parts)


def _at(values, i: int):
    return values[i] if isinstance(values, list) and i < len(values) and isinstance(values[i], (int, float)) else None


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def _max(values) -> float | None:
    return max((v for v in values if v is not None), default=None)


@register()
class GpuUse(Observer):
    """The run's GPU monitor: started with the run, training and evaluating apart, every rank's summary reduced into
    results.json (and a line of the log); a DataParallel process keeps each of its GPUs' figures."""

    def __init__(self, parallel: str = "none"):
        self.parallel, self.gpu = parallel, None

    @classmethod
    def for_loop(cls, loop, around):
        return cls(loop.meta.get("parallel", "none"))

    def start(self, loop) -> None:
        # dp: every GPU it drives, each GPU's figures kept (is GPU 0 busier and fuller than the others?)
        self.gpu = GpuMonitor(devices_used(self.parallel, loop.ctx), per_device=self.parallel == "dp").start()

    def close(self, loop) -> None:
        if self.gpu is not None:
            self.gpu.stop()   # also after an error: the sampling thread must not outlive the run

    def epoch_start(self, loop) -> None:
        if self.gpu is not None:
            self.gpu.phase("train")

    def epoch_trained(self, loop, stats: dict) -> None:
        if self.gpu is not None:
            self.gpu.phase("val")

    def results(self, loop, results: dict) -> None:
        ctx = loop.ctx
        use = self._summary(loop) if self.gpu is not None else {}
        ranks = use.pop("per_rank", [])
        results.update(use, gpus=len(devices_used(self.parallel, ctx)) if ctx.device.type == "cuda" else 0,
                       job_gpus=job_gpus(self.parallel, ctx))   # this process's GPUs, the job's
        for row, mine in zip(results["per_rank"], ranks):   # one row per rank: its time split and its GPU use
            row.update({key: mine.get(key) for key in ("gpu_util", "gpu_util_peak", "gpu_mem_peak_mb")})

    def _summary(self, loop) -> dict:
        self.gpu.stop()
        summary = reduce_summaries(collectives.gather_objects(self.gpu.summary(), loop.ctx))   # DDP: every sampler
        loop.logger.info(describe(summary))
        if isinstance(summary.get("gpu_util"), (int, float)):
            loop.logger.scalars({"gpu/util_mean": summary["gpu_util"], "gpu/mem_peak_mb": summary["gpu_mem_peak_mb"]
                                 or 0}, loop.step)
        return summary


def job_gpus(parallel: str, ctx) -> int:
    """GPUs the whole job trained on, all ranks together (``gpus`` counts one process's): DataParallel's
    every GPU, one per DDP rank, and a GPU that several ranks share (a rehearsal on gloo, lab 4 on a
    one-GPU node) once. 0 on CPUs."""
    if parallel == "dp":
        return len(devices_used(parallel, ctx)) if ctx.device.type == "cuda" else 0
    mine = gpu_id(ctx.device) if ctx.device.type == "cuda" else None
    return len({g for g in collectives.gather_objects(mine, ctx) if g is not None})   # DDP: every rank's GPU

"""Training throughput on one GPU against the hardware's peak: what "the GPU is the bottleneck" means.

    python benchmarks/gpu_peak.py                         # ResNet-18 and ResNet-50, 224 px, batch 256
    python benchmarks/gpu_peak.py --archs resnet50 --batch-size 128 --steps 50 --out /tmp/trial.json

Synthetic data already on the GPU (no loader: the ceiling a loader can at best reach), the kit's
own step (``train.train_one_epoch``'s maths: autocast in bf16 where the GPU has it, else fp16 +
scaler; channels_last; cudnn.benchmark on, as the kit's train sets it; SGD with momentum), timed over --steps
steps after 5 warm-up steps (recorded as the JSON's steady window). FLOPs per step are counted by PyTorch
(``torch.utils.flop_counter``), so "% of peak" = achieved FLOP/s / the GPU's dense bf16/fp16
tensor-core peak from the table below (its datasheet figure; unknown GPUs print no percentage).

Then the kit itself: ``python -m ddp_utils train`` on the fake ImageNet-sized data (ResNet-18, the same batch),
whose images/s, set beside the ceiling above, says how much the loader and the loop leave on the table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results import Recorder, add_out  # noqa: E402  (benchmarks/results.py)
from ddp_utils.model import build_model  # noqa: E402
from ddp_utils.optim import amp_dtype, autocast, make_scaler  # noqa: E402
from ddp_utils.settings import Settings  # noqa: E402

# Dense (no sparsity) bf16 / fp16 tensor-core peaks, TFLOP/s, from NVIDIA's datasheets.
PEAK_TFLOPS = {"H200": 989, "H100 SXM": 989, "H100 80GB HBM3": 989, "H100 PCIe": 756, "H100 NVL": 835,
               "A100": 312, "L40S": 362, "L4": 121, "A10G": 70, "A10": 125, "T4": 65, "V100": 125}


WARM_UP = 5   # steps before the clock: cuDNN's algorithm search, the allocator settling


def peak_for(name: str) -> float | None:
    for key, value in PEAK_TFLOPS.items():   # most specific names first
        if key in name:
            return value
    return None


def measure(arch: str, batch: int, size: int, steps: int, device: torch.device) -> dict:
    torch.backends.cudnn.benchmark = True   # as the kit's train and student_job.py's ceiling: fixed shapes
    dtype = amp_dtype(Settings(amp="auto"), device)   # the kit's choice: bf16 from capability 8.0, else fp16
    model = build_model(arch, 1000).to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = make_scaler(dtype, device)
    images = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,), device=device)

    def step():
        with autocast(dtype, device):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        step()
    for _ in range(WARM_UP):   # warm-up: cuDNN picks its algorithms
        step()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    return {"arch": arch, "dtype": str(dtype).replace("torch.", ""), "batch": batch, "img_s": batch / seconds,
            "tflops": counter.get_total_flops() / seconds / 1e12,
            "mem_gb": torch.cuda.max_memory_allocated(device) / 1e9}


def kit_run(batch: int, size: int, epochs: int, workers: int) -> dict:
    """The kit's own training on fake data: what the loader, the loop and the logging leave of the ceiling."""
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(dataset="fake", arch="resnet18", image_size=size, batch_size=batch, epochs=epochs,
                            workers=workers, wandb="disabled", progress="off", run_dir=f"{tmp}/run")
        cmd = [sys.executable, "-m", "ddp_utils", "train", *settings.to_argv()]
        done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                              timeout=900)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
            raise SystemExit(f"the kit's run failed (exit {done.returncode}): {' '.join(cmd)}")
        results = json.loads(Path(f"{tmp}/run/results.json").read_text())
    return {"command": " ".join(cmd[1:]).replace(f"{tmp}/run", "RUN"), "images_per_s": results["images_per_s"],
            "data_wait_fraction": results["data_wait_fraction"],
            "time_split": {k: results[k] for k in ("train_time_s", "data_s", "compute_s", "comm_s", "idle_s")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="resnet18,resnet50", help="models (default resnet18,resnet50)")
    parser.add_argument("--batch-size", type=int, default=256, help="images per step (default 256)")
    parser.add_argument("--image-size", type=int, default=224, help="pixels (default 224)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps, after 5 warm-up steps (default 200)")
    parser.add_argument("--kit-epochs", type=int, default=4,
                        help="epochs of the kit's own run on fake data (10 steps each at batch 256; 0: none)")
    parser.add_argument("--workers", type=int, default=8, help="DataLoader workers of the kit's run (default 8)")
    add_out(parser, "gpu_peak")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_peak.py needs a CUDA GPU; this machine has none.")
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    peak = peak_for(name)
    lines = [f"{name}, torch {torch.__version__}, synthetic data on the GPU, channels_last, {args.image_size} px, "
             f"{args.steps} timed steps after {WARM_UP} warm-up steps", "",
             "| model | precision | batch | images/s | TFLOP/s achieved | % of the dense peak | peak memory (GB) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    recorder = Recorder("gpu_peak", args)
    figures = {"gpu": name, "peak_tflops": peak, "models": {}}
    for arch in args.archs.split(","):
        torch.cuda.reset_peak_memory_stats(device)
        m = measure(arch, args.batch_size, args.image_size, args.steps, device)
        m["share_of_peak"] = m["tflops"] / peak if peak else None
        figures["models"][arch] = m
        share = f"{100 * m['share_of_peak']:.0f} % of {peak}" if peak else "unknown peak"
        lines.append(f"| {arch} | {m['dtype']} | {m['batch']} | {m['img_s']:.0f} | {m['tflops']:.0f} | {share} "
                     f"| {m['mem_gb']:.1f} |")
    print("\n".join(lines), flush=True)
    if args.kit_epochs and "resnet18" in figures["models"]:
        kit = kit_run(args.batch_size, args.image_size, args.kit_epochs, args.workers)
        kit["of_ceiling"] = kit["images_per_s"] / figures["models"]["resnet18"]["img_s"]
        figures["kit"] = kit
        lines += ["", f"The kit's own run ({kit['command']}): {kit['images_per_s']:.0f} images/s, "
                      f"{100 * kit['of_ceiling']:.0f} % of ResNet-18's ceiling above; time split "
                      + ", ".join(f"{k} {v:.1f}" for k, v in kit["time_split"].items())]
        print(lines[-1])
    recorder.save(figures, [line for line in lines if line.startswith("|")],
                  notes=[line for line in lines if line and not line.startswith("|")],
                  steady_after_batches=WARM_UP, steady_steps=args.steps)


if __name__ == "__main__":
    main()

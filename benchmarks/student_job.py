"""Benchmark: the student's real job on one GPU, ImageNet JPEGs through the kit, against the GPU's own ceiling.

    python benchmarks/student_job.py                     # on a GPU machine: about 15 minutes with the defaults
    python benchmarks/student_job.py --cores 4,16 --loaders workers,nvjpeg   # under 10 minutes: the lent GPU's
    python benchmarks/student_job.py --images 16 --val-images 4 --steps 2 --batch-size 4 --cores 1 \\
        --ceiling-steps 1 --compile-backend eager        # a CPU trial in well under a minute (not GPU figures)

Every part runs in this one script, in this order, each timed and each recording its error and going on:

  photos      --images training and --val-images validation JPEGs in ImageNet's layout (train/<wnid>/,
              val/<wnid>/) under --data-dir: ImageNet-like files from benchmarks/photos.py (1:1 windows of
              scikit-learn's two real photos with a camera's grain, quality 94-96, ~0.54 bytes a pixel), made by
              several processes; kept if already there, of the same recipe.
  ceiling     ResNet-18 at 224 px on random data already on the device, the kit's step: autocast in bf16 from
              compute capability 8.0 (fp16 with the gradient scaler before), channels_last, SGD with momentum,
              cudnn.benchmark on (as the kit's train sets it): images/s, TFLOP/s and share of the datasheet peak.
  gpu decode  torchvision.io.decode_jpeg(list of JPEG byte tensors, device="cuda") in batches of --batch-size over
              the training folder (files read into memory first): images/s of the decode alone, what a GPU decode
              path could reach; beside it the same decode on one CPU core, one image at a time.
  kit runs    python -m ddp_utils train --dataset imagenet --data-dir <the folder> --arch resnet18 --epochs 1
              --max-steps-per-epoch --steps --batch-size --batch-size --wandb disabled --no-link-probe, one process,
              under taskset -c on the first 4, 8, 16 CPUs (--cores), with --loader workers and --workers = cores - 1
              (one core left to the training process; at least 1), then the same with --loader nvjpeg (the workers
              read the files, nvJPEG decodes and crops on the GPU), then --loader dali where DALI is
              importable (its --workers = DALI's CPU threads, the same count); else one line saying why it was
              skipped. Read from each run folder's results.json: images/s (the kit's figure, first step included,
              and steady = after the batches the loader made ahead, workers x 2 + 1: the window the kit's time
              split records, at least 200 steps with the defaults), the share of the time spent waiting for data, GPU utilisation
              (NVML, mean and peak), and the time split; each also as a share of both ceilings.
  compiled    the ceiling again with torch.compile(model) (--compile-backend, default inductor; last because its
              compilation takes the longest): the ceiling the kit's --compile could reach.

The figures go to benchmarks/results/student_job.json (the Recorder: command, machine, date, commit; the GPU's name
and torch's version among the figures too), rewritten after every part so that a run stopped half way keeps what it
measured ("complete": false). On a machine without a CUDA GPU everything runs on the CPU at the sizes given, the
figures say they are not GPU figures, and the file goes to <data-dir>/student_job-cpu.json unless --out names one.
The exit status is 1 when any part failed (its error is in the file and was printed), 0 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from results import RESULTS, Recorder, add_out  # noqa: E402  (benchmarks/results.py)
from photos import current, make_photos, mark, marked  # noqa: E402  (benchmarks/photos.py: ImageNet-like JPEGs)
from steady import MIN_STEPS, warm_batches  # noqa: E402  (benchmarks/steady.py)
from gpu_peak import peak_for  # noqa: E402  (benchmarks/gpu_peak.py: the datasheet peaks)
from ddp_utils.model import build_model  # noqa: E402
from ddp_utils.optim import amp_dtype, autocast, make_scaler  # noqa: E402
from ddp_utils.settings import Settings  # noqa: E402

ARCH, SIZE = "resnet18", 224
T0 = time.perf_counter()


def say(text: str) -> None:
    print(f"[{time.perf_counter() - T0:5.0f} s] {text}", flush=True)


# -- photos ------------------------------------------------------------------------------------------
def _make_part(job: tuple[str, int, int, int]) -> str:
    root, train, val, seed = job
    return str(make_photos(Path(root), train, val, seed=seed))


def photos(root: Path, train: int, val: int, processes: int) -> dict:
    """ImageNet-layout JPEGs under ``root`` from make_photos, in ``processes`` parts made at once then merged
    (file names get their part's number: each part numbers its files from 0); kept if the counts match."""
    def count(split):
        return len(list(root.glob(f"{split}/*/*.JPEG")))

    if current(root, train, val):
        return {"made": False, "train": train, "val": val, "seconds": 0.0, "files": marked(root)}
    start = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    parts = max(1, min(processes, train // 64 or 1))
    staging = root.with_name(root.name + ".parts")
    shutil.rmtree(staging, ignore_errors=True)
    jobs = [(str(staging / f"p{i}"), train // parts + (i < train % parts), val // parts + (i < val % parts), i)
            for i in range(parts)]
    if parts == 1:
        done = [_make_part(jobs[0])]
    else:   # fork: the children use PIL alone (no CUDA), and find make_photos imported already
        with multiprocessing.get_context("fork").Pool(parts) as pool:
            done = pool.map(_make_part, jobs)
    for i, part in enumerate(done):
        for f in Path(part).glob("*/*/*.JPEG"):
            split, wnid = f.parent.parent.name, f.parent.name
            (root / split / wnid).mkdir(parents=True, exist_ok=True)
            f.rename(root / split / wnid / f"{f.stem}_p{i}.JPEG")
    shutil.rmtree(staging, ignore_errors=True)
    mb = sum(f.stat().st_size for f in root.glob("*/*/*.JPEG")) / 1e6
    files = mark(root, count("train"), count("val"))   # the recipe and the mean size, beside the files
    return {"made": True, "train": count("train"), "val": count("val"), "processes": parts, "megabytes": round(mb, 1),
            "seconds": round(time.perf_counter() - start, 1), "files": files}


# -- the ceiling: data already on the device ---------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ceiling(batch: int, steps: int, device: torch.device, compile_backend: str = "") -> dict:
    """The kit's step on random data on ``device`` (gpu_peak.measure's step, with cudnn.benchmark as the kit's
    train sets it, on a CPU too, and torch.compile when ``compile_backend`` is given)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    dtype = amp_dtype(Settings(amp="auto"), device)   # bf16 from capability 8.0, fp16 + scaler before, none on CPU
    model = build_model(ARCH, 1000).to(device)
    if cuda:   # the kit's --channels-last (ignored on a CPU)
        model = model.to(memory_format=torch.channels_last)
    run = torch.compile(model, backend=compile_backend) if compile_backend else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = make_scaler(dtype, device)
    images = torch.randn(batch, 3, SIZE, SIZE, device=device)
    if cuda:
        images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,), device=device)

    def step():
        with autocast(dtype, device):
            loss = F.cross_entropy(run(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    start = time.perf_counter()
    flops = None
    if compile_backend:
        step()   # compiles
    else:
        from torch.utils.flop_counter import FlopCounterMode
        with FlopCounterMode(display=False) as counter:
            step()
        flops = counter.get_total_flops()
    sync(device)
    first = time.perf_counter() - start
    for _ in range(5 if cuda else 1):   # warm-up: cuDNN times its algorithms, the allocator settles
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    seconds = (time.perf_counter() - start) / steps
    out = {"arch": ARCH, "image_size": SIZE, "batch": batch,
           "dtype": str(dtype).replace("torch.", "") if dtype else "fp32",
           "channels_last": cuda, "cudnn_benchmark": cuda, "compile": compile_backend or None, "steps": steps,
           "img_s": batch / seconds, "step_ms": 1e3 * seconds, "first_step_s": round(first, 2)}
    if flops:
        out["train_gflop_per_image"] = flops / batch / 1e9
    if cuda:
        out["mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    del run, model, optimizer, images
    if cuda:
        torch.cuda.empty_cache()
    return out


def add_peak_share(c: dict, gflop_per_image: float | None, peak: float | None) -> None:
    if gflop_per_image:
        c["tflops"] = c["img_s"] * gflop_per_image / 1e3
        c["share_of_peak"] = c["tflops"] / peak if peak else None


# -- decode alone ------------------------------------------------------------------------------------------
def jpeg_decode(root: Path, batch: int, device: torch.device, passes: int = 3) -> dict:
    """decode_jpeg on the training JPEGs, batched on ``device`` (files in memory first); and one CPU core."""
    from torchvision.io import ImageReadMode, decode_jpeg, read_file
    files = sorted(str(p) for p in (root / "train").glob("*/*.JPEG"))
    data = [read_file(f) for f in files]
    mb = sum(d.numel() for d in data) / 1e6

    def one_pass():
        start = time.perf_counter()
        for i in range(0, len(data), batch):
            decoded = decode_jpeg(data[i:i + batch], mode=ImageReadMode.RGB, device=device)
        sync(device)
        assert decoded[-1].shape[0] == 3
        return len(data) / (time.perf_counter() - start)

    with warnings.catch_warnings():   # torchvision 0.29 deprecates its decoders for TorchCodec's
        warnings.simplefilter("ignore", DeprecationWarning)
        decode_jpeg(data[:batch], mode=ImageReadMode.RGB, device=device)   # warm-up: nvJPEG's handles
        sync(device)
        rates = [one_pass() for _ in range(passes)]
        # beside it: one CPU core, one image at a time (what one --loader workers process decodes at best)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            few = data[:max(1, min(len(data), 512))]
            start = time.perf_counter()
            for d in few:
                decode_jpeg(d, mode=ImageReadMode.RGB)
            cpu_rate = len(few) / (time.perf_counter() - start)
        finally:
            torch.set_num_threads(threads)
    return {"device": str(device), "images": len(data), "batch": batch, "megabytes": round(mb, 1), "passes": passes,
            "img_s": statistics.median(rates), "img_s_passes": rates, "cpu_1core_img_s": cpu_rate,
            "cpu_1core_images": len(few)}


# -- the kit's own runs --------------------------------------------------------------------------------------
def dali_importable() -> str:
    """'' when DALI imports here, else why not."""
    try:
        import nvidia.dali  # noqa: F401
        return ""
    except Exception as e:   # noqa: BLE001 - any failure to import is "no DALI" for this benchmark
        return f"{type(e).__name__}: {e}"


def kit_run(loader: str, cpus: list[int], args, root: Path, runs: Path) -> dict:
    """One ``python -m ddp_utils train`` on ``cpus`` (taskset -c), its results.json's figures."""
    cores = len(cpus)
    workers = max(1, cores - 1)
    run_dir = runs / f"{loader}-{cores}"
    shutil.rmtree(run_dir, ignore_errors=True)
    settings = Settings(dataset="imagenet", data_dir=str(root), arch=ARCH, epochs=1, max_steps_per_epoch=args.steps,
                        batch_size=args.batch_size, loader=loader, workers=workers, wandb="disabled",
                        link_probe=False, progress="off", run_dir=str(run_dir))
    train = ["-m", "ddp_utils", "train", *settings.to_argv(always=("loader",))]
    cpu_list = ",".join(map(str, cpus))
    taskset = shutil.which("taskset")
    argv = ([taskset, "-c", cpu_list] if taskset else []) + [sys.executable, *train]
    shown = f"taskset -c {cpu_list} python {' '.join(train)}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}   # the kit's cores / ranks decides
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    log = runs / f"{loader}-{cores}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as f:   # its own process group: on a timeout it goes with its DataLoader workers
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=None if taskset else (lambda: os.sched_setaffinity(0, cpus)))
        try:
            code = proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            code = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.perf_counter() - start
    out = {"loader": loader, "cores": cores, "cpus": cpu_list, "workers": workers, "command": shown,
           "process_s": round(seconds, 1), "log": str(log)}
    if code != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{shown} " + (f"ran past {args.run_timeout} s" if code is None else f"exited {code}")
                           + f"; its output ends:\n{tail}")
    r = json.loads((run_dir / "results.json").read_text())
    epoch = r["history"][0]["train"] if r.get("history") else {}
    first, count = epoch.get("first_step_s"), epoch.get("count", 0)
    steady = epoch.get("steady_images_per_s")   # after the batches made ahead (the kit's TimeSplit)
    util = r.get("gpu_util")
    out.update({"steps": r["steps"], "images": count, "images_per_s": r["images_per_s"], "steady_images_per_s": steady,
                "data_wait_fraction": r["data_wait_fraction"],
                "gpu_util": util if isinstance(util, (int, float)) else None,
                "gpu_util_peak": r.get("gpu_util_peak"), "gpu_reason": r.get("gpu_reason") or
                (util if isinstance(util, str) else ""), "device": r.get("device_name"), "threads": r.get("threads"),
                "feed": r.get("feed"),   # the kit's feed check on this node: what bound the run, and the workers it needs
                "first_step_s": first, "steady_after_batches": epoch.get("steady_after_batches", warm_batches(workers)),
                "steady_steps": epoch.get("steady_steps", 0),
                "time_split": {k: r.get(k) for k in ("train_time_s", "data_s", "compute_s", "comm_s", "idle_s",
                                                     "startup_s")}})
    if r["steps"] < args.steps:
        out["note"] = (f"{r['steps']} of --steps {args.steps}: the training folder holds {count} images' worth of "
                       f"full batches of {args.batch_size} (raise --images)")
    return out


def add_shares(run: dict, ceilings: dict) -> None:
    for name, c in ceilings.items():
        if c.get("img_s"):
            run[f"of_{name}_ceiling"] = run["images_per_s"] / c["img_s"]
            run[f"steady_of_{name}_ceiling"] = (run["steady_images_per_s"] / c["img_s"]
                                                if run.get("steady_images_per_s") else None)


# -- the table -----------------------------------------------------------------------------------------------
def cores_text(n: int) -> str:
    return f"{n} core" + ("s" if n != 1 else "")


def pc(x) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def num(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def table(f: dict) -> list[str]:
    rows = ["| what | images/s | steady images/s | of the eager ceiling | of the compiled ceiling | data wait | "
            "GPU util (mean / peak) | split: data / compute / idle (s) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, c in f["ceiling"].items():
        if "img_s" in c:
            rows.append(f"| ceiling, {name} ({c['dtype']}, batch {c['batch']}"
                        f"{', ' + pc(c['share_of_peak']) + ' of the peak' if c.get('share_of_peak') else ''}) | "
                        f"{num(c['img_s'])} | - | - | - | - | - | - |")
    for key, r in f["kit"].items():
        if "images_per_s" in r:
            util = "-" if r["gpu_util"] is None else f"{r['gpu_util']:.0f} / {r['gpu_util_peak'] or 0:.0f} %"
            s = r["time_split"]
            rows.append(f"| kit `--loader {r['loader']}`, {cores_text(r['cores'])}, {r['workers']} workers | "
                        f"{num(r['images_per_s'])} | {num(r['steady_images_per_s'])} | "
                        f"{pc(r.get('of_eager_ceiling'))} | {pc(r.get('of_compiled_ceiling'))} | "
                        f"{pc(r['data_wait_fraction'])} | {util} | "
                        f"{s['data_s']:.1f} / {s['compute_s']:.1f} / {s['idle_s']:.1f} |")
        else:
            rows.append(f"| kit {key} | {r.get('skipped') or 'failed (see errors)'} | - | - | - | - | - | - |")
    d = f.get("gpu_decode") or {}
    if "img_s" in d:
        rows.append(f"| `decode_jpeg` alone, batched on {d['device']} ({d['images']} JPEGs) | {num(d['img_s'])} | - | "
                    f"- | - | - | - | - |")
        rows.append(f"| `decode_jpeg` alone, one CPU core | {num(d['cpu_1core_img_s'])} | - | - | - | - | - | - |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data/student-job",
                   help="where the JPEG folder (imagenet/) and the kit's run folders (runs/) go")
    p.add_argument("--images", type=int, default=61440, help="training JPEGs (default 61440: 240 steps of 256)")
    p.add_argument("--val-images", type=int, default=0, help="validation JPEGs; 0 = a tenth of --images (at least 4)")
    p.add_argument("--steps", type=int, default=240,
                   help="--max-steps-per-epoch of each kit run (at most --images / --batch-size steps happen); "
                        f"the steady window is what follows the batches made ahead: {MIN_STEPS} steps or more "
                        "for the pages (15 workers make 31 ahead)")
    p.add_argument("--batch-size", type=int, default=256, help="per step, in the kit's runs and the ceiling")
    p.add_argument("--cores", default="4,8,16", help="CPU counts the kit's runs are pinned to (taskset -c)")
    p.add_argument("--loaders", default="workers,nvjpeg,dali",
                   help="the kit's --loader values to run (dali only where it imports)")
    p.add_argument("--ceiling-steps", type=int, default=30, help="timed steps of each ceiling (after the warm-up)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile's backend for the compiled ceiling (eager: traced but not compiled, for a "
                        "quick CPU trial; none: skip it)")
    p.add_argument("--run-timeout", type=float, default=300, help="seconds each kit run may take (then it is "
                   "stopped and recorded as failed)")
    add_out(p, "student_job")
    args = p.parse_args()
    if args.val_images <= 0:
        args.val_images = max(4, args.images // 10)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    data_dir = Path(args.data_dir)
    if not cuda and args.out == str(RESULTS / "student_job.json"):   # the pages quote GPU figures only
        args.out = str(data_dir / "student_job-cpu.json")
    recorder = Recorder("student_job", args)
    gpu = torch.cuda.get_device_name(device) if cuda else ""
    peak = peak_for(gpu) if cuda else None
    figures = {"gpu": gpu, "torch": torch.__version__, "gpu_figures": cuda,
               "note": "" if cuda else "no CUDA GPU here: every figure is a CPU figure, not a GPU figure",
               "complete": False, "peak_tflops": peak, "photos": {}, "ceiling": {}, "gpu_decode": {}, "kit": {},
               "errors": {}, "part_seconds": {}}
    say(f"{gpu or 'no CUDA GPU: everything runs on the CPU (not GPU figures)'}; torch {torch.__version__}; "
        f"{len(os.sched_getaffinity(0))} CPUs; figures to {args.out}")

    def save(final=False):
        figures["complete"] = final
        if final:
            return recorder.save(figures, table(figures), **window())
        with contextlib.redirect_stdout(io.StringIO()):   # quietly, after every part
            recorder.save(figures, table(figures), **window())

    def window() -> dict:   # the kit runs' steady windows: the most batches made ahead, the fewest steps timed
        runs = [r for r in figures["kit"].values() if "steady_steps" in r]
        return {"steady_after_batches": max((r["steady_after_batches"] for r in runs), default=0),
                "steady_steps": min((r["steady_steps"] for r in runs), default=0)}

    def part(name: str, fn, *a):
        start = time.perf_counter()
        try:
            return fn(*a)
        except Exception as e:   # noqa: BLE001 - every part records its error and the next one runs
            figures["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            say(f"{name} FAILED: {type(e).__name__}: {str(e)[:300]}")
            return None
        finally:
            figures["part_seconds"][name] = round(time.perf_counter() - start, 1)
            save()

    root = data_dir / "imagenet"
    say(f"photos: {args.images} + {args.val_images} ImageNet-like JPEGs of 460-500 px in {root} ...")
    made = part("photos", photos, root, args.images, args.val_images, len(os.sched_getaffinity(0)))
    if made:
        figures["photos"] = {**made, "root": str(root)}
        say(f"photos: {'made' if made['made'] else 'kept'} {made['train']} + {made['val']}"
            + (f" in {made['seconds']} s ({made['megabytes']} MB)" if made["made"] else ""))
    if args.images < args.steps * args.batch_size:
        say(f"note: {args.images} images hold {args.images // args.batch_size} full batches of {args.batch_size}: "
            f"each kit run stops there, before --steps {args.steps}")

    say(f"ceiling, eager: ResNet-18 {SIZE} px, batch {args.batch_size}, {args.ceiling_steps} steps on {device} ...")
    c = part("ceiling eager", ceiling, args.batch_size, args.ceiling_steps, device)
    gflop = None
    if c:
        gflop = c.get("train_gflop_per_image")
        add_peak_share(c, gflop, peak)
        figures["ceiling"]["eager"] = c
        say(f"ceiling, eager: {c['img_s']:,.0f} images/s ({c['dtype']}, {c['step_ms']:.1f} ms a step"
            + (f", {pc(c.get('share_of_peak'))} of {peak} TFLOP/s" if c.get("share_of_peak") else "") + ")")

    say(f"decode_jpeg alone, batched on {device} ...")
    d = part("gpu decode", jpeg_decode, root, args.batch_size, device)
    if d:
        figures["gpu_decode"] = d
        say(f"decode_jpeg on {device}: {d['img_s']:,.0f} images/s; one CPU core: {d['cpu_1core_img_s']:,.0f}")

    cpus_here = sorted(os.sched_getaffinity(0))
    no_dali = dali_importable()
    for loader in [x.strip() for x in args.loaders.split(",") if x.strip()]:
        for cores in [int(x) for x in args.cores.split(",") if x.strip()]:
            key = f"{loader}-{cores}"
            if loader == "dali" and no_dali:
                figures["kit"][key] = {"loader": loader, "cores": cores, "skipped": f"DALI does not import here "
                                       f"({no_dali.splitlines()[0][:200]}): pip install nvidia-dali-cuda120 (or "
                                       f"-cuda130) where the machine can reach PyPI"}
                if cores == int(args.cores.split(",")[0]):
                    say(f"kit --loader dali: skipped, DALI does not import here ({no_dali.splitlines()[0][:120]})")
                continue
            if cores > len(cpus_here):
                figures["kit"][key] = {"loader": loader, "cores": cores,
                                       "skipped": f"this machine lets the script use {len(cpus_here)} CPUs"}
                say(f"kit --loader {loader} on {cores} cores: skipped (only {len(cpus_here)} CPUs here)")
                continue
            say(f"kit --loader {loader} on {cores} cores, {max(1, cores - 1)} workers, {args.steps} steps ...")
            r = part(f"kit {key}", kit_run, loader, cpus_here[:cores], args, root, data_dir / "runs")
            if r:
                figures["kit"][key] = r
                util = "" if r["gpu_util"] is None else f", GPU {r['gpu_util']:.0f} %"
                say(f"kit {key}: {r['images_per_s']:,.0f} images/s ({num(r['steady_images_per_s'])} over "
                    f"{r['steady_steps']} steps after {r['steady_after_batches']} batches), waiting for data {pc(r['data_wait_fraction'])}{util}; {r['process_s']} s in all")
            else:
                figures["kit"][key] = {"loader": loader, "cores": cores}

    if args.compile_backend != "none":
        say(f"ceiling, torch.compile (backend {args.compile_backend}): compiling takes a minute or two ...")
        c = part("ceiling compiled", ceiling, args.batch_size, args.ceiling_steps, device, args.compile_backend)
        if c:
            add_peak_share(c, gflop, peak)
            figures["ceiling"]["compiled"] = c
            say(f"ceiling, compiled: {c['img_s']:,.0f} images/s ({c['step_ms']:.1f} ms a step; compiling and the "
                f"first step {c['first_step_s']} s)")
    for r in figures["kit"].values():
        if "images_per_s" in r:
            add_shares(r, figures["ceiling"])

    rows = table(figures)
    print("\n" + (f"{gpu}, torch {torch.__version__}" if cuda else "CPU ONLY: not GPU figures") + "\n"
          + "\n".join(rows), flush=True)
    for name, error in figures["errors"].items():
        print(f"FAILED {name}: {error.splitlines()[0][:300]}", flush=True)
    save(final=True)
    return 1 if figures["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

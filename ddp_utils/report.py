"""What students hand in: a results table and labelled figures, made from finished run folders.

    python -m ddp_utils report runs/demo/<stamp>-ddp2 runs/demo/<stamp>-single
    python -m ddp_utils compare runs/lab4/*       # single vs DataParallel vs DDP, averaged over seeds

``report`` writes into a new folder ``reports/<YYYYmmdd-HHMMSS>/`` (or the ``--out`` folder)::

    results.md       the table (time, throughput, accuracy, speed-up, scaling efficiency); one
                     sentence per run saying what bound it (data loading, compute, communication
                     or idle time, GPU use); runs that differ only in their seed averaged (mean
                     +- std); single vs DataParallel vs DDP when the runs span several modes; the
                     learning rate and global batch of each run; the hardware; the commands
    curves.png       loss, Acc@1 and the learning rate against images seen, train (solid) and val
                     (dashed), one colour per run (per seed group: the mean, min-max shaded); the
                     lr is the third panel of this picture, not a file of its own
    time.png         where each epoch's training time went, per rank: data wait, compute,
                     communication waited for, idle (stacked bars, in % of the train time)
    throughput.png   global images/s per run, and the speed-up next to the ideal linear one
    .ddp_utils-report.json   the files above with their hashes: a later report into the same
                     folder may replace them, and nothing else (any other file of those names,
                     or one changed since, makes the report stop before writing anything)

The kit's own example pictures in ``images/`` are replaced only with ``--kit-images``; a plain
``--out images/`` is refused.

From a notebook: ``print(results_table(dirs))``, ``print(compare_table(dirs))``,
``plot_curves(dirs)``, ``plot_time_breakdown(dirs)``, ``plot_throughput(dirs)``,
``bottleneck_sentence(load_run(d))``, ``group_runs([load_run(d) for d in dirs])``.

How the numbers are defined:

- *train time* is the time of the training loops only (no validation, no checkpoints), as
  ``fit`` records it in ``results.json``; *speed-up* = baseline train time per epoch / this
  run's train time per epoch. Per epoch, so that a resumed run (whose results time only the
  epochs after the resume) still compares fairly. The baseline is the first 1-rank run unless
  you choose one.
- *scaling efficiency* = speed-up / (ranks / baseline ranks): 100 % means every rank added
  made training proportionally faster (the ideal, linear speed-up); the course's 2 x T4
  homework reached about 1.92x, i.e. 96 %.
- *images/s* is global (all ranks together); per rank = global / ranks.
- *images seen* after a step = step x global batch (all ranks together): runs with different
  global batches (1 rank vs 2) line up on this axis, where they would not on steps.
- *time breakdown* (per rank, summed over the epochs; ``fit`` records them): *data wait*,
  waiting for the next batch; *compute*, the step (forward, backward, optimizer), including
  the gradient all-reduce that overlapped the backward pass; *communication*, the all-reduce
  time the step still waited for after the backward pass; *idle*, the rest of the epoch (log
  points waiting for the other ranks, logging). The four add up to the train time.
  ``comm_total_s`` is all the time an all-reduce was in flight, hidden or not. Runs from
  older kits recorded only data wait and compute (communication inside compute).
- *what bound a run*: the largest of data wait, communication and idle time when it is at
  least 20 % of the train time, else the run is compute-bound.
- *seed groups*: runs whose settings.json are equal except for the seed and where or how the
  run was launched (``GROUP_IGNORED``). Their table gives mean +- sample standard deviation
  (n - 1); in the pictures and that table the speed-up is measured against the mean train
  time per epoch of the baseline's group.
- *parallel mode*: results.json's ``parallel`` (none, dp, ddp); older runs: ddp with more
  than one rank, else none.

Every figure names the hardware and data that made it (``hardware_caption``): a speed-up means
nothing without the machine it was measured on.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import itertools
import json
import math
import shlex
import statistics
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 100  # small PNGs that still read well on a slide or in a README

# The four curves, as (TensorBoard tag, history split, history key); the tags are the course's.
CURVES = (("Loss/train", "train", "loss"), ("Loss/val", "val", "loss"),
          ("acc1/train", "train", "acc1"), ("acc1/val", "val", "acc1"))


# -- reading run folders -------------------------------------------------------------------------
def load_run(run_dir) -> dict:
    """A finished run: its ``results.json`` values plus ``name`` (folder name), ``run_dir`` and
    ``settings`` (the dict in ``settings.json``).

    Raises FileNotFoundError naming the folder when it is missing, is not a run folder, or holds
    a run that has not finished (no ``results.json`` yet), and ValueError for a damaged file.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such folder. Pass run folders made by "
                                f"`python -m ddp_utils train` or `demo`, e.g. runs/demo/<stamp>-ddp2")
    results_path, settings_path = run_dir / "results.json", run_dir / "settings.json"
    if not results_path.exists():
        if settings_path.exists():   # started (settings are written first) but not finished
            raise FileNotFoundError(
                f"{run_dir} is a run that has not finished: it has no results.json yet (written "
                f"after the last epoch). Wait for it to end, or continue it with "
                f"--resume {run_dir / 'last.pt'}")
        raise FileNotFoundError(f"{run_dir} is not a run folder: it has no results.json and no "
                                f"settings.json. Pass the folder a training run wrote, e.g. "
                                f"runs/demo/<stamp>-ddp2")
    if not settings_path.exists():
        raise FileNotFoundError(f"{run_dir} is not a complete run folder: results.json is there "
                                f"but settings.json is missing")
    run = _read_json(results_path)
    run.update(name=run_dir.name, run_dir=run_dir, settings=_read_json(settings_path))
    return run


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); was the run interrupted while writing it?") from None


def run_from_results(results: dict, settings) -> dict:
    """A run as ``load_run`` gives it, from a results dict in memory (what ``fit`` returned): the
    worker notebook, which has no run folder, shows the same table as the main one."""
    run_dir = Path(results.get("run_dir") or settings.run_dir)   # rank 0's folder, which fit() names
    return {**results, "name": run_dir.name, "run_dir": run_dir, "settings": settings.to_dict()}


def _load_all(run_dirs) -> list[dict]:
    if isinstance(run_dirs, (str, Path, dict)):   # one folder (or loaded run) given on its own
        run_dirs = [run_dirs]
    runs = [d if isinstance(d, dict) else load_run(d) for d in run_dirs]
    if not runs:
        raise ValueError("no run folders given: pass at least one, e.g. runs/demo/<stamp>-ddp2")
    return runs


# -- the numbers ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    """One line of the results table (times in seconds, accuracies in %)."""
    name: str
    ranks: int
    global_batch: int
    epochs: int
    wall_time_s: float
    images_per_s: float
    images_per_s_rank: float
    acc1: float
    acc5: float
    speedup: float | None      # None when a run trained nothing (an --evaluate run)
    efficiency: float | None   # speed-up / (ranks / baseline ranks), a fraction (1.0 = linear)


def baseline_index(runs: list[dict], baseline=None) -> int:
    """Index of the baseline run: ``baseline`` (a folder or folder name), else the first 1-rank run,
    else the first run."""
    if baseline is not None:
        wanted = Path(baseline)
        for i, run in enumerate(runs):
            if wanted.name == run["name"] and (len(wanted.parts) == 1 or wanted.resolve() == run["run_dir"].resolve()):
                return i
        raise ValueError(f"baseline {baseline} is not one of the runs given: "
                         f"{', '.join(str(r['run_dir']) for r in runs)}")
    return next((i for i, run in enumerate(runs) if run["world_size"] == 1), 0)


def _seconds_per_epoch(run: dict) -> float | None:
    epochs = run.get("epochs_run", len(run.get("history", [])))
    if not epochs or run.get("train_time_s", 0) <= 0:
        return None
    return run["train_time_s"] / epochs


def scaling_rows(runs: list[dict], baseline=None) -> list[Row]:
    """The table's numbers for already loaded runs (see ``load_run``), in the order given."""
    base = runs[baseline_index(runs, baseline)]
    base_time = _seconds_per_epoch(base)
    rows = []
    for run in runs:
        time = _seconds_per_epoch(run)
        speedup = base_time / time if base_time and time else None
        scale = run["world_size"] / base["world_size"]   # how many times the baseline's ranks
        rows.append(Row(name=run["name"], ranks=run["world_size"], global_batch=run["global_batch_size"],
                        epochs=run["epochs"], wall_time_s=run["wall_time_s"],
                        images_per_s=run["images_per_s"],
                        images_per_s_rank=run["images_per_s"] / run["world_size"],
                        acc1=run["acc1"], acc5=run["acc5"], speedup=speedup,
                        efficiency=speedup / scale if speedup is not None else None))
    return rows


def format_duration(seconds: float) -> str:
    """``h:mm:ss``, rounded to the second: 4487.3 -> ``1:14:47``."""
    s = round(seconds)   # an int
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


# -- the table -----------------------------------------------------------------------------------
def results_table(run_dirs, baseline=None) -> str:
    """The Markdown results table for ``run_dirs`` (one row per run, in the order given), followed
    by notes saying what the baseline is and anything that makes a comparison unfair."""
    runs = _load_all(run_dirs)
    rows = scaling_rows(runs, baseline)
    priced = any(run.get("cost") is not None for run in runs)   # a cost column only when a price was given
    header = ("| run | ranks | global batch | epochs | wall time | train img/s | img/s per rank "
              "| Acc@1 | Acc@5 | speed-up | efficiency |" + (" cost (per epoch) |" if priced else ""))
    lines = [header,
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if priced else "")]
    for r, run in zip(rows, runs):
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else "n/a"
        efficiency = f"{100 * r.efficiency:.0f} %" if r.efficiency is not None else "n/a"
        lines.append(f"| {r.name} | {r.ranks} | {r.global_batch} | {r.epochs} | {format_duration(r.wall_time_s)} "
                     f"| {r.images_per_s:.0f} | {r.images_per_s_rank:.0f} | {r.acc1:.2f} | {r.acc5:.2f} "
                     f"| {speedup} | {efficiency} |" + (f" {format_cost(run)} |" if priced else ""))
    notes = _table_notes(runs, baseline)
    if priced:
        notes.append("Cost: wall time x nodes x the price per node-hour given (--price-per-hour), for all nodes "
                     "together; n/a where no price was given.")
    return "\n".join(lines + [""] + [f"- {note}" for note in notes])


def format_cost(run: dict) -> str:
    """``0.123 (0.015)``: the run's cost and its cost per epoch, or ``n/a`` without a price."""
    if run.get("cost") is None:
        return "n/a"
    per_epoch = f" ({run['cost_per_epoch']:.3f})" if run.get("cost_per_epoch") is not None else ""
    return f"{run['cost']:.3f}{per_epoch}"


def _table_notes(runs: list[dict], baseline) -> list[str]:
    base = runs[baseline_index(runs, baseline)]
    notes = [(f"Speed-up: train time per epoch of the baseline, {base['name']} ({_ranks(base['world_size'])}), "
              f"divided by the run's; train time counts the training loops only (no validation or "
              f"checkpoints). Efficiency = speed-up / (ranks / baseline ranks); 100 % is linear scaling.")]
    if baseline is None and base["world_size"] != 1:
        notes.append("No 1-rank run was given, so the baseline is the first run.")
    base_images = _images_per_epoch(base)
    for run in runs:
        images = _images_per_epoch(run)
        # DDP drops each rank's last partial batch, so a few % fewer images per epoch is expected.
        if base_images and images and abs(images - base_images) > 0.05 * base_images:
            notes.append(f"{run['name']} trained {images:.0f} images per epoch, the baseline "
                         f"{base_images:.0f}: its speed-up compares unequal work.")
        if run.get("stopped_early"):
            notes.append(f"{run['name']} stopped early at epoch {run['stopped_early']} of {run['epochs']}"
                         + (f": {run['stop_reason']}" if run.get("stop_reason") else "") + ".")
        elif run.get("epochs_run", run["epochs"]) < run["epochs"]:
            notes.append(f"{run['name']} was resumed: its times cover only the last "
                         f"{run['epochs_run']} of its {run['epochs']} epochs.")
    return notes


def _images_per_epoch(run: dict) -> float | None:
    counts = [h["train"]["count"] for h in run.get("history", []) if "count" in h.get("train", {})]
    return sum(counts) / len(counts) if counts else None


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


# -- seed groups: runs that differ only in their seed (and where or how they were launched) -----
# settings.json fields that do not change what a run trains, or change it only by chance (seed).
GROUP_IGNORED = ("seed", "run_dir", "rank", "local_rank", "master_addr", "master_port", "progress", "wandb",
                 "wandb_project", "threads", "workers", "log_every", "init_timeout", "collective_timeout",
                 "socket_ifname", "init_method")


def _group_settings(run: dict) -> dict:
    return {k: v for k, v in (run.get("settings") or {}).items() if k not in GROUP_IGNORED}


def group_runs(runs) -> list[list[dict]]:
    """``runs`` (loaded runs or run folders) in groups whose settings.json are equal except for the
    ``GROUP_IGNORED`` fields (the seed, the folder, ports, ...): repeats of one experiment. Groups
    come in the order of their first run, runs in a group in the order given."""
    runs = [run if isinstance(run, dict) else load_run(run) for run in runs]
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(json.dumps(_group_settings(run), sort_keys=True, default=str), []).append(run)
    return list(groups.values())


def _seed(run: dict):
    return run.get("seed", (run.get("settings") or {}).get("seed", "?"))


def _group_label(group: list[dict]) -> str:
    """A run's label, or for several: every name, the ranks and the seeds."""
    if len(group) == 1:
        return _label(group[0])
    return (f"{', '.join(run['name'] for run in group)} ({_ranks(group[0]['world_size'])}, "
            f"{len(group)} runs, seeds {', '.join(str(_seed(run)) for run in group)})")


def _differing_settings(runs: list[dict]) -> list[str]:
    """``key: a / b`` for each settings key (outside GROUP_IGNORED) whose values differ among ``runs``."""
    settings = [_group_settings(run) for run in runs]
    keys = sorted({k for s in settings for k in s})
    return [f"{k}: {' / '.join(dict.fromkeys(str(s.get(k, '-')) for s in settings))}"
            for k in keys if len({json.dumps(s.get(k), default=str) for s in settings}) > 1]


def parallel_mode(run: dict) -> str:
    """``none``, ``dp`` or ``ddp``: results.json's ``parallel``, else ddp with several ranks, else none.
    One process with DDP's name is plain one-process training: none."""
    mode = run.get("parallel") or ("ddp" if run["world_size"] > 1 else "none")
    return "none" if mode == "ddp" and run["world_size"] == 1 else mode


MODE_NAMES = {"none": "single", "dp": "DataParallel", "ddp": "DDP"}


def _gpus(run: dict):
    """GPUs the run trained on: a count results.json gives, else one per rank on a GPU, 0 on CPU;
    None for a DataParallel run that does not say how many it drove."""
    for key in ("gpus", "gpu_count", "num_gpus"):
        for source in (run, run.get("settings") or {}):
            if isinstance(source.get(key), int):
                return source[key]
    if not str(run.get("device", "")).startswith("cuda"):
        return 0
    return None if parallel_mode(run) == "dp" else run["world_size"]


# -- what one run spent its time on --------------------------------------------------------------
# (results key, label, bar colour, colour of a label on the bar)
TIME_PARTS = (("data_s", "data wait", "tab:orange", "black"),
              ("compute_s", "compute (forward, backward, optimizer)", "tab:blue", "white"),
              ("comm_s", "communication waited for", "tab:red", "white"),
              ("idle_s", "idle (log points, other ranks, logging)", "0.78", "black"))
TIME_KEYS = tuple(key for key, *_ in TIME_PARTS)
BOUND_SHARE = 0.2   # a part of the train time this large (other than compute) bounds the run


def _epochs_trained(run: dict) -> int:
    return run.get("epochs_run") or len(run.get("history") or []) or 1


def _has_times(parts) -> bool:
    return bool(parts) and all(isinstance(part, dict) and "compute_s" in part for part in parts)


def _rank_times(run: dict) -> list[dict]:
    """Each rank's ``TIME_KEYS`` seconds over the run: results' ``per_rank`` when it holds them,
    else the sums of the history's per-epoch ``per_rank``; [] when neither has them."""
    if _has_times(run.get("per_rank")):
        return run["per_rank"]
    trained = [h["train"] for h in run.get("history") or []]
    if not trained or not all(_has_times(t.get("per_rank")) for t in trained):
        return []
    return [{"rank": trained[0]["per_rank"][i].get("rank", i), "host": trained[0]["per_rank"][i].get("host"),
             **{key: sum(t["per_rank"][i].get(key) or 0.0 for t in trained) for key in TIME_KEYS}}
            for i in range(min(len(t["per_rank"]) for t in trained))]


def _rank_gpu(run: dict, rank, index: int):
    """Rank ``rank``'s mean GPU use in % from results' ``per_rank``, or None."""
    parts = [part for part in run.get("per_rank") or [] if isinstance(part, dict)]
    part = next((p for p in parts if p.get("rank") == rank), parts[index] if index < len(parts) else {})
    value = part.get("gpu_util")
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def time_breakdown(run: dict) -> list[dict]:
    """Seconds per epoch of data wait, compute, communication waited for and idle time: one dict
    per rank (``rank``, ``host``, the four ``TIME_KEYS``, ``total_s``, ``comm_measured``, ``gpu``:
    the rank's mean GPU use in % or None).

    Per rank from results.json's ``per_rank`` (or the history's) when there, else its top-level
    means over the ranks (one dict, rank None), else, for runs from older kits, the history's data
    and compute time (one dict; the rest of the train time is idle; communication was not
    measured: it is inside compute).
    """
    history = run.get("history") or []
    per_epoch = 1 / (len(history) or _epochs_trained(run))   # the results sum over the history's epochs
    ranks = _rank_times(run)
    if ranks:
        rows = [{"rank": part.get("rank", i), "host": part.get("host"), "comm_measured": True,
                 "gpu": _rank_gpu(run, part.get("rank", i), i),
                 **{key: (part.get(key) or 0.0) * per_epoch for key in TIME_KEYS}}
                for i, part in enumerate(ranks)]
    elif "data_s" in run and "compute_s" in run:
        rows = [{"rank": None, "host": None, "comm_measured": run.get("comm_s") is not None, "gpu": None,
                 **{key: (run.get(key) or 0.0) * per_epoch for key in TIME_KEYS}}]
    else:
        trained = [h["train"] for h in history]
        data = sum(t.get("data_s", 0.0) for t in trained)
        compute = sum(t.get("compute_s", 0.0) for t in trained)
        rest = max(0.0, run.get("train_time_s", 0.0) - data - compute)
        rows = [{"rank": None, "host": None, "comm_measured": False, "gpu": None, "data_s": data * per_epoch,
                 "compute_s": compute * per_epoch, "comm_s": 0.0, "idle_s": rest * per_epoch}]
    for row in rows:
        row["total_s"] = sum(row[key] for key in TIME_KEYS)
    return rows


def time_shares(run: dict) -> dict[str, float]:
    """``{data_s, compute_s, comm_s, idle_s: fraction of the train time}``, the mean over ranks
    (empty when the run trained nothing)."""
    rows = time_breakdown(run)
    total = sum(row["total_s"] for row in rows)
    if total <= 0:
        return {}
    return {key: sum(row[key] for row in rows) / total for key in TIME_KEYS}


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f} %"


def bottleneck_sentence(run: dict, baseline_run: dict | None = None) -> str:
    """One sentence saying what bound ``run`` (a loaded run): data loading, communication, idle
    time or compute, with the measured link, the predicted and measured speed-up (against
    ``baseline_run``, as in the table) and the GPU use where the run recorded them."""
    name = run["name"]
    shares = time_shares(run)
    if not shares:
        return f"{name}: trained nothing (no train time), so nothing bound it."
    kind, share = max((("comm_s", shares["comm_s"]), ("data_s", shares["data_s"]), ("idle_s", shares["idle_s"])),
                      key=lambda item: item[1])
    speed = []
    if run.get("link_gbit_s") is not None:
        speed.append(f"the link measured {run['link_gbit_s']:.3g} Gbit/s")
    predicted = run.get("predicted_speedup")
    time, base_time = _seconds_per_epoch(run), _seconds_per_epoch(baseline_run) if baseline_run else None
    measured = (base_time / time if base_time and time and baseline_run is not run
                and parallel_mode(run) != "none" else None)   # a 1-process run's is the table's noise
    if predicted is not None and measured is not None:
        speed.append(f"predicted speed-up {predicted:.2f}x, measured {measured:.2f}x")
    elif predicted is not None:
        speed.append(f"predicted speed-up {predicted:.2f}x")
    elif measured is not None:
        speed.append(f"measured speed-up {measured:.2f}x")
    comm_total = run.get("comm_total_s")
    if comm_total and run.get("train_time_s") and run["world_size"] > 1:
        hidden = max(0.0, comm_total - (run.get("comm_s") or 0.0))
        speed.append(f"all-reduce in flight {_percent(comm_total / run['train_time_s'])} of the step, "
                     f"{_percent(hidden / comm_total)} of it hidden behind the backward pass")
    if run["world_size"] > 1 and not any(row["comm_measured"] for row in time_breakdown(run)):
        speed.append("communication not measured by this kit version: it is inside compute")
    details = f" ({'; '.join(speed)})" if speed else ""
    if share >= BOUND_SHARE and kind == "comm_s":
        text = f"communication {_percent(share)} of the step{details}: the ranks wait for the gradients"
    elif share >= BOUND_SHARE and kind == "data_s":
        settings = run.get("settings") or {}
        if settings.get("loader") == "memory":
            advice = "the CPU cannot prepare batches fast enough even with --loader memory (more cores per rank help)"
        else:
            now = f" (now {settings['workers']})" if "workers" in settings else ""
            advice = f"raise --workers{now} or use --loader memory"
        text = f"data loading {_percent(share)} of the step{details}: {advice}"
    elif share >= BOUND_SHARE:
        text = (f"idle {_percent(share)} of the step{details}: waiting at log points for a slower rank "
                f"(see time.png) or for logging; a larger --log-every helps the latter")
    else:
        text = f"compute-bound: {_percent(shares['compute_s'])} compute{details}"
    gpu = run.get("gpu_util")
    if isinstance(gpu, (int, float)) and not isinstance(gpu, bool):
        peak = run.get("gpu_util_peak")
        text += f"; GPU use {gpu:.0f} % mean" + (f" (peak {peak:.0f} %)" if isinstance(peak, (int, float)) else "")
    elif gpu is not None:
        text += f"; {gpu}"   # "no GPU"
    return f"{name}: {text}."


# -- mean +- std over seeds: the seed table and single vs DataParallel vs DDP ---------------------
def _step_seconds(run: dict) -> float | None:
    """Mean seconds per training step: results' ``measured_step_s``, else train time / steps, else
    global batch / images per second."""
    if run.get("measured_step_s"):
        return run["measured_step_s"]
    if run.get("steps") and run.get("train_time_s"):
        return run["train_time_s"] / run["steps"]
    if run.get("images_per_s"):
        return run["global_batch_size"] / run["images_per_s"]
    return None


def _mean_epoch_seconds(runs: list[dict]) -> float | None:
    times = [t for t in map(_seconds_per_epoch, runs) if t]
    return statistics.fmean(times) if times else None


def _speedups(runs: list[dict], base_time: float | None) -> list[float]:
    return [base_time / t for t in map(_seconds_per_epoch, runs) if t and base_time]


def mean_std(values) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1) of the numbers in ``values`` (None and strings
    left out); std is None for fewer than two numbers, both None for none."""
    numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not numbers:
        return None, None
    return statistics.fmean(numbers), statistics.stdev(numbers) if len(numbers) > 1 else None


def _pm(values, fmt=lambda v: f"{v:.2f}", unit: str = "") -> str:
    mean, std = mean_std(values)
    if mean is None:
        return "n/a"
    return f"{fmt(mean)}{unit}" if std is None else f"{fmt(mean)} ± {fmt(std)}{unit}"


def _pm_duration(values) -> str:
    mean, std = mean_std(values)
    if mean is None:
        return "n/a"
    return format_duration(mean) if std is None else f"{format_duration(mean)} ± {std:.0f} s"


def _gpu_cell(runs: list[dict]) -> str:
    values = [run.get("gpu_util") for run in runs]
    if any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return _pm(values, lambda v: f"{v:.0f}", " %")
    return "no GPU" if any(isinstance(v, str) for v in values) else "n/a"


def _pm_time(values, std: float | None = None) -> str:
    """Mean (± std) of times in seconds, both in the mean's unit: ``840 ms``, ``12.3 ± 0.4 s``,
    ``1788 ± 18 s``. ``std`` given: the std of the values' source (the values are means)."""
    mean, sample_std = mean_std(values)
    std = sample_std if std is None else std
    if mean is None:
        return "n/a"
    scale, unit = (1000.0, "ms") if mean < 1 else (1.0, "s")
    digits = max(0, 2 - int(math.floor(math.log10(mean * scale)))) if mean > 0 else 0
    text = f"{mean * scale:.{digits}f}"
    return f"{text} {unit}" if not std else f"{text} ± {std * scale:.{digits}f} {unit}"


def _stat_cells(runs: list[dict], base_time: float | None) -> list[str]:
    """wall time, epoch time, batch time, img/s, GPU util, test loss, Acc@1, Acc@5, speed-up."""
    return [_pm_duration([run["wall_time_s"] for run in runs]),
            _pm_time([_seconds_per_epoch(run) for run in runs]),
            _pm_time([_step_seconds(run) for run in runs]),
            _pm([run["images_per_s"] for run in runs], lambda v: f"{v:.0f}"),
            _gpu_cell(runs),
            _pm([run["loss"] for run in runs], lambda v: f"{v:.3f}"),
            _pm([run["acc1"] for run in runs]), _pm([run["acc5"] for run in runs]),
            _pm(_speedups(runs, base_time), unit="x")]


STAT_HEADER = "wall time | epoch time | batch time | img/s | GPU util | test loss | Acc@1 | Acc@5 | speed-up"
STAT_RULE = "---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---:"


def seed_table(run_dirs, baseline=None) -> str:
    """Markdown: one row per seed group (``group_runs``): its runs and seeds, and mean ± std over
    them. Speed-up against the mean train time per epoch of the baseline run's group."""
    runs = _load_all(run_dirs)
    groups = group_runs(runs)
    base = runs[baseline_index(runs, baseline)]
    base_time = _mean_epoch_seconds(next(g for g in groups if any(r is base for r in g)))
    lines = [f"| runs | seeds | ranks | global batch | {STAT_HEADER} |", f"| --- | --- | ---: | ---: | {STAT_RULE} |"]
    for group in groups:
        lines.append(f"| {', '.join(run['name'] for run in group)} | {', '.join(str(_seed(r)) for r in group)} "
                     f"| {group[0]['world_size']} | {group[0]['global_batch_size']} "
                     f"| {' | '.join(_stat_cells(group, base_time))} |")
    return "\n".join(lines + ["", f"- Mean ± sample standard deviation (n - 1) over the runs of a group (runs whose "
                                  f"settings differ only in seed, folder, ports, workers, threads, logging). "
                                  f"Speed-up: mean train time per epoch of {base['name']}'s group divided by each "
                                  f"run's, then averaged. Batch time: seconds per optimizer step."])


def _mode_rows(runs: list[dict]) -> list[tuple[str, int, int | None, list[dict]]]:
    """``(mode, ranks, GPUs, runs)``: the runs by parallel mode (none, dp, ddp) and size, in that order."""
    rows: dict[tuple, list[dict]] = {}
    for run in runs:
        rows.setdefault((parallel_mode(run), run["world_size"], _gpus(run)), []).append(run)
    order = {"none": 0, "dp": 1, "ddp": 2}
    return [(*key, group) for key, group in sorted(rows.items(), key=lambda kv: (order.get(kv[0][0], 3), kv[0][1]))]


def compare_table(run_dirs) -> str:
    """Markdown: single vs DataParallel vs DDP, one row per parallel mode (and number of ranks),
    averaged over its runs (seeds) as mean ± sample std; speed-up against the single row's mean
    train time per epoch (or the first row's when there is no single run). Notes follow."""
    runs = _load_all(run_dirs)
    rows = _mode_rows(runs)
    base_mode, base_ranks, _, base_runs = next((row for row in rows if row[0] == "none"), rows[0])
    base_time = _mean_epoch_seconds(base_runs)
    lines = [f"| method | ranks/GPUs | seeds | {STAT_HEADER} |", f"| --- | ---: | --- | {STAT_RULE} |"]
    notes = [f"Mean ± sample standard deviation (n - 1) over the runs of a row. Speed-up: mean train time per "
             f"epoch of the {MODE_NAMES.get(base_mode, base_mode)} row ({_ranks(base_ranks)}) divided by each "
             f"run's, then averaged. Batch time: seconds per optimizer step. Test loss: on the validation split."]
    for mode, ranks, gpus, members in rows:
        name = MODE_NAMES.get(mode, mode)
        devices = "?" if gpus is None else str(gpus)
        lines.append(f"| {name} | {ranks} / {devices} | {', '.join(str(_seed(r)) for r in members)} "
                     f"| {' | '.join(_stat_cells(members, base_time))} |")
        differ = _differing_settings(members)
        if differ:
            notes.append(f"The {name} row averages runs whose settings differ in more than the seed "
                         f"({'; '.join(differ)}): not repeats of one experiment.")
        if gpus is None:
            notes.append(f"The {name} row's runs do not record how many GPUs DataParallel drove (\"?\").")
    batches = dict.fromkeys(f"{MODE_NAMES.get(m, m)} {'/'.join(dict.fromkeys(str(r['global_batch_size']) for r in g))}"
                            for m, _, _, g in rows)
    if len({r["global_batch_size"] for r in runs}) > 1:
        notes.append(f"Global batch per row: {', '.join(batches)}: the rows took different numbers of steps "
                     f"per epoch and learning rates.")
    return "\n".join(lines + [""] + [f"- {note}" for note in notes])


def lr_notes(runs: list[dict]) -> list[str]:
    """One line per seed group: its global batch, its learning rate and how it got there, its
    schedule in images, and its Acc@1: what the global batch did to accuracy."""
    notes = []
    for group in group_runs(runs):
        run, settings = group[0], group[0].get("settings") or {}
        gb, lr = run["global_batch_size"], run.get("lr")
        if lr is None:
            continue
        per_rank = settings.get("batch_size", gb // max(run["world_size"], 1))
        how = f"{per_rank} per rank x {_ranks(run['world_size'])}"
        if settings.get("scale_lr") and settings.get("lr") is not None and settings.get("lr_reference_batch"):
            scaled = (f"lr {settings['lr']:g} at a batch of {settings['lr_reference_batch']} scaled linearly to "
                      f"{lr:.4g}")
        else:
            scaled = f"lr {lr:.4g} (not scaled with the batch)"
        images = _images_per_epoch(run)
        warmup = settings.get("warmup_epochs")
        if warmup and images:
            schedule = (f"linear warm-up over {_epochs(warmup)} ({_count(warmup * images)} images), then cosine "
                        f"decay to 0 at the last step ({_count(run['epochs'] * images)} images)")
        elif warmup:
            schedule = f"linear warm-up over {_epochs(warmup)}, then cosine decay to 0 at the last step"
        else:
            schedule = "cosine decay to 0 at the last step, no warm-up"
        notes.append(f"{', '.join(r['name'] for r in group)}: global batch {gb} ({how}), {scaled}; "
                     f"{schedule}; Acc@1 {_pm([r['acc1'] for r in group])} %.")
    if len({run["global_batch_size"] for run in runs}) > 1:
        notes.append("A larger global batch takes fewer, larger steps per epoch; with the lr scaled linearly "
                     "the curves against images seen (curves.png) should lie on top of each other: where they "
                     "part, the larger batch cost accuracy.")
    return notes


def _epochs(n: float) -> str:
    return f"{n:g} epoch" if n == 1 else f"{n:g} epochs"


def _count(n: float) -> str:
    """An image count, short: 1.8 M, 450 k, 320."""
    if n >= 1e6:
        return f"{n / 1e6:.3g} M"
    return f"{n / 1e3:.3g} k" if n >= 1e4 else f"{n:.0f}"


# -- labels: no unlabelled pictures --------------------------------------------------------------
def hardware_caption(runs: list[dict]) -> str:
    """One line naming the machine and data behind ``runs`` (values that differ are joined by /).

    ``host`` and ``cpus`` are rank 0's: on several nodes the other nodes are assumed alike.
    """
    # A 1-process run has no process group (backend "none"): name the backend of the DDP runs.
    ddp_runs = [run for run in runs if run.get("backend", "none") != "none"] or runs
    device = _summary(runs, "device_name").replace("cpu", "CPU only")
    cpu = f" ({_summary(runs, 'cpu_name')})" if any("cpu_name" in run for run in runs) else ""
    return (f"Hardware: {device}, {_summary(runs, 'cpus')} CPU cores{cpu}, backend {_summary(ddp_runs, 'backend')}, "
            f"host {_summary(runs, 'host')} (rank 0)  |  Data: {_summary(runs, 'dataset')}, "
            f"model {_summary(runs, 'arch')}  |  ranks per run: {', '.join(str(r['world_size']) for r in runs)}")


def _summary(runs: list[dict], key: str) -> str:
    """The distinct values of ``key`` over ``runs``, in order, joined by " / "."""
    return " / ".join(dict.fromkeys(str(run.get(key, "?")) for run in runs))


def figure_text(fig: Figure) -> str:
    """All the text on a figure (titles, captions, axis labels), one item per line: for checks."""
    texts = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        texts += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
    return "\n".join(t for t in texts if t)


def _new_figure(runs: list[dict], title: str, size: tuple[float, float]):
    """A figure with a title on top and the hardware caption at the bottom, and the panel (a
    subfigure) between them that holds the axes and the legend of the runs.

    The panel keeps the legend above the caption: the constrained layout reserves the bottom
    margin for one of them only when both belong to the same figure. Built as a plain ``Figure``
    on the Agg canvas, not through pyplot: it renders headless (no display, no global backend
    switch) and still shows inline when returned in a notebook.
    """
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=13)
    fig.supxlabel(hardware_caption(runs), fontsize=9, color="0.3")
    return fig, fig.subfigures(1, 1)


def _label(run: dict) -> str:
    return f"{run['name']} ({_ranks(run['world_size'])})"


# -- layout: long run names, labels kept inside the figure and the axes --------------------------
# Run folder names are long (``cinic10-resnet18_cifar-ws2-20261123-101500``): they go into a legend
# below the axes, never into the plots, and nothing may be cut off at the figure's or an axes' edge.
LEGEND_FONTSIZE = 8
MAX_LEGEND_LABEL = 90   # characters per line of a legend entry; longer names wrap


def _wrap(text: str, width: int, sep: str = "  |  ") -> str:
    """``text`` in lines of at most ``width`` characters, broken at ``sep`` where possible, else at
    spaces and hyphens (run names are hyphenated)."""
    import textwrap

    width = max(width, 10)
    lines: list[str] = []
    for part in text.split(sep):
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines += textwrap.wrap(part, width, break_on_hyphens=True) or [""]
    return "\n".join(lines)


def _fit_width(fig: Figure, text, original: str, max_px: float) -> None:
    """Re-wrap a figure-wide text (title, caption) so that it is at most ``max_px`` wide."""
    renderer = fig.canvas.get_renderer()
    for _ in range(4):   # wrapping narrower than the estimate converges in one or two steps
        width = text.get_window_extent(renderer).width
        if width <= max_px:
            return
        longest = max(len(line) for line in text.get_text().splitlines())
        text.set_text(_wrap(original, int(longest * max_px / width) - 2))
        fig.draw_without_rendering()


def _legend_below(fig: Figure, panel, handles: list, labels: list[str]):
    """A legend centred below the axes of ``panel``, in as many columns as fit the figure's width."""
    labels = [_wrap(label, MAX_LEGEND_LABEL, sep="\n") for label in labels]
    legend = None
    for ncols in range(min(len(labels), 4), 0, -1):
        if legend is not None:
            legend.remove()
        legend = panel.legend(handles, labels, loc="outside lower center", ncols=ncols,
                              fontsize=LEGEND_FONTSIZE, frameon=False)
        # Its size does not depend on where it goes: measured before the layout makes room for it.
        if legend.get_window_extent(fig.canvas.get_renderer()).width <= 0.97 * fig.bbox.width:
            break
    return legend


def _finish(fig: Figure) -> Figure:
    """Wrap the title and the hardware caption to the figure's width (after the layout is known)."""
    fig.draw_without_rendering()
    for text in fig.texts:   # the title and the caption
        _fit_width(fig, text, text.get_text(), 0.97 * fig.bbox.width)
    return fig


def _headroom(fig: Figure, ax, labels, pad: float = 0.03) -> None:
    """Raise ``ax``'s top y limit until every text in ``labels`` (anchored on bars, drawn upwards)
    ends at least ``pad`` (a fraction of the axes' height) below the axes' top edge.

    A label is a fixed number of pixels tall however the data is scaled, so the top that fits a
    label of height h above a bar of height b (bottom 0) in an axes H pixels tall is
    b * H / (H (1 - pad) - h).
    """
    for _ in range(3):   # the constrained layout may resize the axes a little: settle it
        fig.draw_without_rendering()
        renderer = fig.canvas.get_renderer()
        height = ax.bbox.height
        bottom, top = ax.get_ylim()
        needed = top
        for label in labels:
            anchor = label.xy[1]   # data y of the bar top the label stands on
            above = label.get_window_extent(renderer).y1 - ax.transData.transform((0, anchor))[1]
            room = height * (1 - pad) - above
            fits = bottom + (anchor - bottom) * height / room if room > 0 else 2 * top
            needed = max(needed, fits)
        if needed <= top * 1.001:
            return
        ax.set_ylim(bottom, needed)


# -- training curves -----------------------------------------------------------------------------
def epoch_curves(run: dict) -> dict[str, tuple[list[float], list[float]]]:
    """``{tag: (epochs, values)}`` for the four CURVES tags; accuracies in %.

    From the per-epoch history in results.json when it covers the whole run; otherwise (no history,
    or a resumed run whose history starts after the resume) from the TensorBoard scalars, where
    training points are window averages every ``log_every`` steps, placed at fractional epochs.
    """
    history = run.get("history") or []
    if history and history[0]["epoch"] == 1:
        return {tag: ([h["epoch"] for h in history], [h[split][key] for h in history])
                for tag, split, key in CURVES}
    return _tensorboard_curves(run["run_dir"])


def _tensorboard_curves(run_dir: Path) -> dict[str, tuple[list[float], list[float]]]:
    from .runlog import read_scalars

    scalars = read_scalars(run_dir)
    val_steps = [step for step, _ in scalars.get("Loss/val", [])]
    if not val_steps:
        return {}
    # Validation is logged once per epoch, at the epoch's last step: that gives steps per epoch.
    steps_per_epoch = val_steps[-1] / len(val_steps)
    return {tag: ([step / steps_per_epoch for step, _ in scalars[tag]], [v for _, v in scalars[tag]])
            for tag, _, _ in CURVES if tag in scalars}


def _run_scalars(run: dict) -> dict[str, list[tuple[int, float]]]:
    """The run's TensorBoard scalars, or {} when it has none (a run folder without ``tb/``)."""
    from .runlog import read_scalars

    run_dir = Path(run["run_dir"])
    return read_scalars(run_dir) if (run_dir / "tb").is_dir() else {}


def _epoch_images(run: dict) -> list[float]:
    """Images seen (all ranks) at the end of each epoch of the history: the running sum of its counts,
    else step x global batch, else epoch x the run's mean images per epoch."""
    history = run.get("history") or []
    trained = [h["train"] for h in history]
    if trained and all("count" in t for t in trained):
        return list(itertools.accumulate(t["count"] for t in trained))
    if trained and all("step" in t for t in trained):
        return [t["step"] * run["global_batch_size"] for t in trained]
    per_epoch = run.get("images_per_s", 0) * run.get("train_time_s", 0) / _epochs_trained(run)
    return [h["epoch"] * per_epoch for h in history]


def image_curves(run: dict, scalars: dict | None = None) -> dict[str, tuple[list[float], list[float]]]:
    """``{tag: (images seen, values)}`` for the four CURVES tags: the x of ``epoch_curves`` in images
    seen, all ranks together, so that runs with different global batches line up.

    Training points from TensorBoard at their steps (step x global batch) when the run logged them;
    else per epoch from the history (end of epoch e: the images of epochs 1..e). Validation from the
    history when it covers the whole run, else from TensorBoard. ``scalars``: the run's TensorBoard
    scalars if already read.
    """
    scalars = _run_scalars(run) if scalars is None else scalars
    gb = run["global_batch_size"]
    history = run.get("history") or []
    curves = {}
    if history and history[0]["epoch"] == 1:
        seen = _epoch_images(run)
        curves = {tag: (seen, [h[split][key] for h in history]) for tag, split, key in CURVES}
    for tag, split, _ in CURVES:
        if scalars.get(tag) and (split == "train" or tag not in curves):
            curves[tag] = ([step * gb for step, _ in scalars[tag]], [v for _, v in scalars[tag]])
    if not curves:   # neither a history nor TensorBoard: the epoch-based fallback, placed per epoch
        per_epoch = run.get("images_per_s", 0) * run.get("train_time_s", 0) / _epochs_trained(run)
        curves = {tag: ([x * per_epoch for x in xs], ys) for tag, (xs, ys) in epoch_curves(run).items()}
    return {tag: curves[tag] for tag, _, _ in CURVES if tag in curves}


def lr_curve(run: dict, scalars: dict | None = None) -> tuple[list[float], list[float]]:
    """``(images seen, lr)``: TensorBoard's ``lr`` at its steps (every step in this kit, every
    log_every steps in older ones), else the history's lr at the end of each epoch, else empty."""
    scalars = _run_scalars(run) if scalars is None else scalars
    if scalars.get("lr"):
        return [step * run["global_batch_size"] for step, _ in scalars["lr"]], [v for _, v in scalars["lr"]]
    history = run.get("history") or []
    if history and history[0]["epoch"] == 1 and all("lr" in h["train"] for h in history):
        return _epoch_images(run), [h["train"]["lr"] for h in history]
    return [], []


def _images_unit(largest: float) -> tuple[float, str]:
    if largest >= 1e6:
        return 1e6, "images seen (millions)"
    if largest >= 1e3:
        return 1e3, "images seen (thousands)"
    return 1.0, "images seen"


def _group_curve(curves: list[tuple[list[float], list[float]]]):
    """Mean, min and max of several runs' curves at the points of the one with the fewest
    (the others interpolated there), as numpy arrays ``(x, mean, low, high)``."""
    import numpy as np

    curves = [(np.asarray(xs, float), np.asarray(ys, float)) for xs, ys in curves if len(xs)]
    x = min(curves, key=lambda c: len(c[0]))[0]
    ys = np.array([np.interp(x, xs, vs) for xs, vs in curves])
    return x, ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0)


def plot_curves(run_dirs) -> Figure:
    """Loss (left), Acc@1 (middle) and learning rate (right) against images seen: train solid, val
    dashed, one colour per run; runs that differ only in their seed (``group_runs``) as their mean
    with the min-max range shaded. The runs' names in a legend below the axes."""
    from matplotlib.lines import Line2D

    runs = _load_all(run_dirs)
    groups = group_runs(runs)
    fig, panel = _new_figure(runs, f"Training curves against images seen: loss, Acc@1 and learning rate "
                                   f"({_summary(runs, 'dataset')} data, {_summary(runs, 'arch')})",
                             (15, 5.2 + 0.15 * len(groups)))   # taller with more runs: the legend grows
    loss_ax, acc_ax, lr_ax = panel.subplots(1, 3)
    scalars = {id(run): _run_scalars(run) for run in runs}
    curves = {id(run): image_curves(run, scalars[id(run)]) for run in runs}
    lrs = {id(run): lr_curve(run, scalars[id(run)]) for run in runs}
    largest = max([max(xs, default=0) for c in curves.values() for xs, _ in c.values()]
                  + [max(xs, default=0) for xs, _ in lrs.values()] + [0])
    scale, xlabel = _images_unit(largest)
    for i, group in enumerate(groups):
        color, label = f"C{i}", _group_label(group)
        for tag, _, _ in CURVES:
            members = [curves[id(run)][tag] for run in group if curves[id(run)].get(tag, ([], []))[0]]
            if not members:
                continue
            ax = loss_ax if tag.startswith("Loss") else acc_ax
            split = tag.split("/")[1]
            style = dict(color=color, linestyle="-" if split == "train" else "--", label=f"{label} {split}",
                         marker="o" if split == "train" else "s", markersize=4)
            if len(members) == 1:
                xs, ys = members[0]
            else:
                xs, ys, low, high = _group_curve(members)
                ax.fill_between(xs / scale, low, high, color=color, alpha=0.2, linewidth=0)
            if len(xs) > 60:   # TensorBoard's many training points: a line, no markers
                style["marker"] = None
            ax.plot([x / scale for x in xs], ys, **style)
        members = [lrs[id(run)] for run in group if lrs[id(run)][0]]
        if members:
            xs, ys = members[0] if len(members) == 1 else _group_curve(members)[:2]
            lr_ax.plot([x / scale for x in xs], ys, color=color, label=f"{label} lr",
                       marker="o" if len(xs) <= 60 else None, markersize=4)
    if not lr_ax.lines:
        lr_ax.text(0.5, 0.5, "no learning rate recorded\nin these runs' files", transform=lr_ax.transAxes,
                   ha="center", va="center", color="0.4")
        lr_ax.set_xticks([])
        lr_ax.set_yticks([])
    for ax, title, unit in ((loss_ax, "loss (cross-entropy)", "loss"), (acc_ax, "top-1 accuracy", "Acc@1 (%)"),
                            (lr_ax, "learning rate, per step", "lr")):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    # One entry per run (its colour), then one per line style, instead of runs x splits entries.
    handles = [Line2D([], [], color=f"C{i}", linewidth=3) for i in range(len(groups))]
    handles += [Line2D([], [], color="0.3", linestyle="-", marker="o", markersize=4),
                Line2D([], [], color="0.3", linestyle="--", marker="s", markersize=4)]
    labels = [_group_label(group) for group in groups] + ["train (solid)", "val (dashed)"]
    if any(len(group) > 1 for group in groups):
        from matplotlib.patches import Patch
        handles.append(Patch(color="0.3", alpha=0.2))
        labels.append("seeds: mean line, min-max shaded")
    _legend_below(fig, panel, handles, labels)
    return _finish(fig)


# -- throughput and speed-up ---------------------------------------------------------------------
def _error_bars(ax, xs, means, stds, horizontal: bool = False) -> None:
    """Black error bars (sample std) where a seed group has one; nothing for single runs."""
    points = [(x, m, s) for x, m, s in zip(xs, means, stds) if s]
    if not points:
        return
    x, m, s = zip(*points)
    if horizontal:
        ax.errorbar(m, x, xerr=s, fmt="none", ecolor="black", capsize=4, linewidth=1.2)
    else:
        ax.errorbar(x, m, yerr=s, fmt="none", ecolor="black", capsize=4, linewidth=1.2)


def plot_throughput(run_dirs, baseline=None) -> Figure:
    """Left: global train images/s per run. Right: speed-up against the baseline, with the ideal
    linear speed-up (ranks / baseline ranks) drawn as a dashed outline behind each bar.

    Runs that differ only in their seed (``group_runs``) share one bar: their mean, with the sample
    standard deviation as an error bar; speed-up then against the baseline group's mean time.
    The bars are numbered (run 1, run 2, ...) and a legend below the axes names the runs, unless
    every run's name fits under its bars."""
    from matplotlib.patches import Patch

    runs = _load_all(run_dirs)
    groups = group_runs(runs)
    base = runs[baseline_index(runs, baseline)]
    base_group = next(g for g in groups if any(r is base for r in g))
    base_time = _mean_epoch_seconds(base_group)
    ips = [mean_std([run["images_per_s"] for run in group]) for group in groups]
    speed = [mean_std(_speedups(group, base_time)) for group in groups]
    ranks = [group[0]["world_size"] for group in groups]
    versus = f"{base['name']} ({_ranks(base['world_size'])})" if len(base_group) == 1 else \
        f"{base['name']} and its seeds (mean of {len(base_group)} runs, {_ranks(base['world_size'])})"
    fig, panel = _new_figure(runs, f"Throughput and speed-up vs {versus}",
                             (max(11.0, 3.0 + 2.0 * len(groups)), 5.2 + 0.15 * len(groups)))   # room per bar
    ips_ax, speed_ax = panel.subplots(1, 2)
    xs = list(range(len(groups)))
    colors = [f"C{i}" for i in xs]

    ips_ax.bar(xs, [m for m, _ in ips], color=colors)
    _error_bars(ips_ax, xs, [m for m, _ in ips], [s for _, s in ips])
    ips_labels = [
        ips_ax.annotate(f"{m:.0f}" + (f" ± {s:.0f}" if s else "") + f"\n{m / n:.0f} per rank",
                        xy=(x, m + (s or 0)), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=LEGEND_FONTSIZE)
        for x, (m, s), n in zip(xs, ips, ranks)]
    ips_ax.set_title("train images/s, all ranks together")
    ips_ax.set_ylabel("images / s")

    ideal = [n / base["world_size"] for n in ranks]
    speed_ax.bar(xs, ideal, fill=False, linestyle="--", edgecolor="0.4", label="ideal (linear) speed-up")
    speed_ax.bar(xs, [m or 0 for m, _ in speed], color=colors, width=0.6, label="measured speed-up")
    _error_bars(speed_ax, xs, [m or 0 for m, _ in speed], [s for _, s in speed])

    def speed_text(m, s, x_ideal):
        if m is None:
            return f"n/a\nideal {x_ideal:g}x"
        return f"{m:.2f}x" + (f" ± {s:.2f}" if s else "") + f"\n{100 * m / x_ideal:.0f} % of {x_ideal:g}x"
    # One label per run above the taller of its two bars (and its error bar): on white, so it reads
    # whatever the bar's height, and never on top of another label when measured equals ideal.
    speed_labels = [
        speed_ax.annotate(speed_text(m, s, x_ideal), xy=(x, max(x_ideal, (m or 0) + (s or 0))), xytext=(0, 2),
                          textcoords="offset points", ha="center", va="bottom", fontsize=LEGEND_FONTSIZE)
        for x, (m, s), x_ideal in zip(xs, speed, ideal)]
    speed_ax.set_title("speed-up vs baseline, in train time per epoch")
    speed_ax.set_ylabel("speed-up (x)")
    # Right of the axes, not on the bars.
    handles, labels = speed_ax.get_legend_handles_labels()
    if any(s for _, s in speed + ips):
        from matplotlib.lines import Line2D
        handles.append(Line2D([], [], color="black", marker="_", markersize=8, linewidth=1.2))
        labels.append("± std over seeds")
    speed_ax.legend(handles, labels, fontsize=LEGEND_FONTSIZE, loc="upper left", bbox_to_anchor=(1.02, 1),
                    borderaxespad=0)

    names = ["\n".join(run["name"] for run in group) for group in groups]
    for ax in (ips_ax, speed_ax):
        ax.set_xticks(xs, [f"{name}\n{_ranks(n)}" for name, n in zip(names, ranks)], fontsize=9)
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    if not _ticks_fit(fig, speed_ax, len(groups)):
        for ax in (ips_ax, speed_ax):
            ax.set_xticks(xs, [f"run {x + 1}\n{_ranks(n)}" for x, n in zip(xs, ranks)], fontsize=9)
        _legend_below(fig, panel, [Patch(color=c) for c in colors],
                      [f"run {x + 1}: {_group_label(group)}" for x, group in zip(xs, groups)])
    _finish(fig)
    _headroom(fig, ips_ax, ips_labels)
    _headroom(fig, speed_ax, speed_labels)
    return fig


def _ticks_fit(fig: Figure, ax, n: int, gap_px: float = 8) -> bool:
    """Whether ``ax``'s x tick labels fit ``n`` to a row without touching, before the layout is
    made (labels too wide for it would make the layout collapse): a text's width does not depend
    on where it goes, and each axes gets at least a third of the figure's width."""
    renderer = fig.canvas.get_renderer()
    widest = max(t.get_window_extent(renderer).width for t in ax.get_xticklabels())
    return widest + gap_px <= fig.bbox.width / 3 / n


# -- where the train time went -------------------------------------------------------------------
def _group_breakdown(group: list[dict]) -> list[dict]:
    """``time_breakdown`` per rank, averaged over a seed group's runs, with ``total_std`` (sample
    std of the total over the runs; None for one run)."""
    tables = [time_breakdown(run) for run in group]
    rows = []
    for i in range(min(map(len, tables))):
        parts = [table[i] for table in tables]
        row = {**parts[0], **{key: statistics.fmean(p[key] for p in parts) for key in (*TIME_KEYS, "total_s")}}
        row["total_std"] = mean_std([p["total_s"] for p in parts])[1]
        row["gpu"] = mean_std([p["gpu"] for p in parts])[0]
        rows.append(row)
    return rows


def plot_time_breakdown(run_dirs) -> Figure:
    """Where each epoch's training time went: one stacked horizontal bar per run and rank (the
    ranks from results.json's ``per_rank``; else one bar, the ranks' mean): data wait, compute,
    communication waited for, idle, in seconds per epoch, each part labelled with its share of
    the train time. Seed groups: the mean bar, the std of its total as an error bar. Runs from
    older kits: data wait and compute from the history (communication counted in compute)."""
    from matplotlib.patches import Patch

    runs = _load_all(run_dirs)
    groups = group_runs(runs)
    bars = []   # (group index, row)
    for g, group in enumerate(groups):
        bars += [(g, row) for row in _group_breakdown(group)]
    measured = all(row["comm_measured"] for _, row in bars)
    fig, panel = _new_figure(runs, "Where the training time went, per rank: data wait, compute, communication, idle",
                             (11, 3.2 + 0.42 * len(bars) + 0.15 * len(groups)))
    ax = panel.subplots(1, 1)
    ys, y = [], 0.0
    for i, (g, _) in enumerate(bars):
        if i and g != bars[i - 1][0]:
            y += 0.5   # a gap between runs
        ys.append(y)
        y += 1
    left = [0.0] * len(bars)
    segments = []   # (bar container, text colour)
    for key, label, color, text_color in TIME_PARTS:
        widths = [row[key] for _, row in bars]
        segments.append((ax.barh(ys, widths, left=left, color=color, height=0.7, label=label), text_color))
        left = [a + b for a, b in zip(left, widths)]
    _error_bars(ax, ys, left, [row["total_std"] for _, row in bars], horizontal=True)
    ax.set_ylim(ys[-1] + 0.75, -0.75)   # the first run on top; as thick a bar for one run as for many
    ax.set_xlim(0, max([row["total_s"] + (row["total_std"] or 0) for _, row in bars] + [1e-9]) * 1.03)
    ax.set_title("seconds per epoch (training loops only); labels: share of the train time")
    note = ("communication overlapped with the backward pass counts as compute;\nall of it, overlapped "
            "or waited for: comm_total_s in results.json and results.md" if measured else
            "runs from older kits measured no communication:\ntheir all-reduce time is inside compute")
    ax.set_xlabel(f"seconds per epoch\n{note}")
    ax.grid(axis="x", alpha=0.3)

    def tick(g, row, short):
        who = f"run {g + 1}" if short else ", ".join(run["name"] for run in groups[g])
        if groups[g][0]["world_size"] == 1:
            rank = ""
        elif row["rank"] is None:
            rank = "mean of ranks"
        else:
            rank = f"rank {row['rank']}" + (f" ({row['host']})" if row.get("host") and not short else "")
        gpu = f", GPU {row['gpu']:.0f} %" if row["gpu"] is not None else ""
        return f"{who}{', ' + rank if rank else ''}\n{_pm_time([row['total_s']], row['total_std'])} per epoch{gpu}"

    ax.set_yticks(ys, [tick(g, row, False) for g, row in bars], fontsize=9)
    legend_handles = [Patch(color=color) for _, _, color, _ in TIME_PARTS]
    legend_labels = [label for _, label, _, _ in TIME_PARTS]
    renderer = fig.canvas.get_renderer()
    if max(t.get_window_extent(renderer).width for t in ax.get_yticklabels()) > 0.3 * fig.bbox.width:
        ax.set_yticks(ys, [tick(g, row, True) for g, row in bars], fontsize=9)
        legend_handles += [Patch(color="none")] * len(groups)
        legend_labels += [f"run {g + 1}: {_group_label(group)}" for g, group in enumerate(groups)]
    _legend_below(fig, panel, legend_handles, legend_labels)
    _finish(fig)
    # A share on each part wide enough to hold it (after the layout: widths in pixels are known).
    fig.draw_without_rendering()
    for container, text_color in segments:
        for (_, row), patch in zip(bars, container.patches):
            if row["total_s"] <= 0 or patch.get_width() <= 0:
                continue
            text = ax.text(patch.get_x() + patch.get_width() / 2, patch.get_y() + patch.get_height() / 2,
                           _percent(patch.get_width() / row["total_s"]), ha="center", va="center",
                           fontsize=LEGEND_FONTSIZE, color=text_color)
            box, bar = text.get_window_extent(renderer), patch.get_window_extent(renderer)
            std = row["total_std"] or 0   # the error bar at the bar's end may cross the last parts' labels
            crossed = std and box.x1 + 3 > ax.transData.transform((row["total_s"] - std, 0))[0]
            if box.width + 6 > bar.width or crossed:
                text.remove()
    return fig


# -- everything at once --------------------------------------------------------------------------
def train_command(settings: dict) -> str:
    """The ``python -m ddp_utils train`` command that reproduces a run (rank 0's), rebuilt from its
    settings.json with ``Settings.to_argv``: the flags that differ from the defaults, and the data."""
    from .settings import Settings

    known = {f.name for f in dataclasses.fields(Settings)}   # a newer kit's extra fields are left out
    argv = Settings.from_dict({k: v for k, v in settings.items() if k in known}).to_argv(
        skip=("rank",), always=("dataset", "data_dir"))
    parts = ["python", "-m", "ddp_utils", "train", *map(shlex.quote, argv)]
    world_size = settings.get("world_size", 1)
    if world_size > 1:
        others = "1" if world_size == 2 else f"1..{world_size - 1}"
        return " ".join(parts + ["--rank", "0"]) + f"   # and the same with --rank {others} on the other rank(s)"
    return " ".join(parts)


# -- where the report goes: a new folder, never over files the report did not write -------------
REPORT_FILES = ("curves.png", "time.png", "throughput.png", "results.md")
MANIFEST = ".ddp_utils-report.json"   # in each report folder: the files written there, and their hashes
REPORTS_DIR = Path("reports")          # the default parent, relative to the current directory
# The kit's own pictures (committed examples made from real runs, described in images/README.md).
KIT_IMAGES = Path(__file__).resolve().parent.parent / "images"


def new_report_dir(parent=REPORTS_DIR, now: datetime.datetime | None = None) -> Path:
    """``parent/<YYYYmmdd-HHMMSS>``, with ``-2``, ``-3``, ... added when that folder exists already."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    folder, n = Path(parent) / stamp, 2
    while folder.exists():
        folder, n = Path(parent) / f"{stamp}-{n}", n + 1
    return folder


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _written_before(out: Path) -> dict[str, str]:
    """``{file name: sha256}`` of the files an earlier report wrote into ``out`` (its manifest)."""
    try:
        files = json.loads((out / MANIFEST).read_text(encoding="utf-8")).get("files", {})
    except (OSError, ValueError, AttributeError):   # no manifest, or not one the report wrote
        return {}
    return files if isinstance(files, dict) else {}


def _is_kit_images(folder: Path) -> bool:
    try:
        return folder.exists() and KIT_IMAGES.exists() and folder.samefile(KIT_IMAGES)
    except OSError:
        return False


def report_dir(out_dir=None, kit_images: bool = False) -> Path:
    """The folder a report goes into, checked before anything is written.

    - no ``out_dir``: a new folder ``reports/<YYYYmmdd-HHMMSS>/`` under the current directory;
    - ``out_dir``: that folder. Files in it named like the report's (``REPORT_FILES``: results.md,
      curves.png, time.png, throughput.png) are replaced only when an earlier report wrote them
      and they are unchanged since (its ``.ddp_utils-report.json`` lists them with their hashes);
      otherwise this raises FileExistsError, and nothing is written. The kit's own ``images/`` folder is always refused;
    - ``kit_images=True``: the kit's ``images/`` folder, whose committed pictures are replaced:
      the one way to regenerate them.
    """
    if kit_images:
        if out_dir is not None and not _is_kit_images(Path(out_dir)):
            raise ValueError(f"choose either --out {out_dir} or --kit-images (which writes to "
                             f"{KIT_IMAGES}), not both")
        if not KIT_IMAGES.is_dir():
            raise FileNotFoundError(
                f"--kit-images writes into the kit's own images/ folder, {KIT_IMAGES}, but there is no "
                f"such folder: this copy of ddp_utils is installed, not a checkout of the kit. "
                f"Use --out DIR to choose a folder, or run without --out for a new {REPORTS_DIR}/<time>/ folder.")
        return KIT_IMAGES
    if out_dir is None:
        return new_report_dir()
    out = Path(out_dir)
    if _is_kit_images(out):
        raise FileExistsError(
            f"{out} is the kit's own images/ folder ({KIT_IMAGES}): its pictures are committed "
            f"examples made from real runs (see images/README.md), and the report would replace "
            f"them, so nothing was written. Run without --out to write to a new {REPORTS_DIR}/<time>/ "
            f"folder, or choose another folder with --out DIR. To regenerate the kit's pictures on "
            f"purpose, pass --kit-images instead of --out.")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a folder, so the report cannot go there and "
                              f"nothing was written. Choose a folder with --out DIR, or run without "
                              f"--out for a new {REPORTS_DIR}/<time>/ folder.")
    present = [name for name in REPORT_FILES if (out / name).exists()]
    ours = _written_before(out)
    foreign = [name for name in present if name not in ours]
    changed = [name for name in present if name in ours and _sha256(out / name) != ours[name]]
    if foreign or changed:
        why = []
        if foreign:
            why.append(f"{', '.join(foreign)} {'was' if len(foreign) == 1 else 'were'} not written by "
                       f"`python -m ddp_utils report` (it lists what it writes in {out / MANIFEST})")
        if changed:
            why.append(f"{', '.join(changed)} {'was' if len(changed) == 1 else 'were'} changed after "
                       f"the report wrote {'it' if len(changed) == 1 else 'them'}")
        raise FileExistsError(
            f"{out} already holds {', '.join(foreign + changed)}, which the report would overwrite: "
            f"{'; '.join(why)}. Nothing was written. Run without --out to write to a new "
            f"{REPORTS_DIR}/<time>/ folder, choose another folder with --out DIR, or move "
            f"{'that file' if len(foreign + changed) == 1 else 'those files'} away first.")
    return out


def report_markdown(run_dirs, baseline=None, report_cmd: str | None = None) -> str:
    """results.md: the table, what bound each run, the seed table (when a group has several runs),
    single vs DataParallel vs DDP (when the runs span several modes), the learning rate and global
    batch, the hardware, the commands behind the runs, and the pictures."""
    runs = _load_all(run_dirs)
    dirs = [run["run_dir"] for run in runs]
    base = runs[baseline_index(runs, baseline)]
    lines = ["# Results", "", results_table(dirs, baseline), "",
             "## What bound each run", "",
             *[f"- {bottleneck_sentence(run, base)}" for run in runs], ""]
    if any(len(group) > 1 for group in group_runs(runs)):
        lines += ["## Seeds: mean ± std over runs that differ only in their seed", "", seed_table(dirs, baseline), ""]
    if len({parallel_mode(run) for run in runs}) > 1:
        lines += ["## Single vs DataParallel vs DDP", "", compare_table(dirs), ""]
    lines += ["## Learning rate and global batch", "", *[f"- {note}" for note in lr_notes(runs)], "",
              f"**{hardware_caption(runs)}**", "",
              "Runs made with (rebuilt from each run's settings.json):", "",
              *[f"    {train_command(run['settings'])}" for run in runs], ""]
    if report_cmd:
        lines += [f"This report: `{report_cmd}`", ""]
    lines += ["![training curves against images seen: loss, Acc@1, learning rate](curves.png)", "",
              "![where the training time went, per rank](time.png)", "",
              "![throughput and speed-up](throughput.png)", ""]
    return "\n".join(lines)


def write_report(run_dirs, out_dir=None, baseline=None, *, kit_images: bool = False) -> list[Path]:
    """Write ``curves.png``, ``time.png``, ``throughput.png`` and ``results.md`` into ``out_dir``
    (default: a new folder ``reports/<YYYYmmdd-HHMMSS>/``); return their paths.

    Nothing is written when a run folder is not a finished run, or when ``out_dir`` holds files
    the report did not write (FileExistsError; see ``report_dir``). The folder's
    ``.ddp_utils-report.json`` lists what was written, so that a later report may replace it.
    ``kit_images=True`` writes into the kit's own ``images/`` folder instead (no list there: its
    pictures are replaced only on this explicit request).
    """
    runs = _load_all(run_dirs)   # fails before anything is written if a folder is not a run
    out = report_dir(out_dir, kit_images)   # fails before anything is written if out holds others' files
    dirs = [run["run_dir"] for run in runs]
    words = ["python -m ddp_utils report", *map(str, dirs)]
    words += ["--kit-images"] if kit_images else ["--out", str(out)]
    words += ["--baseline", str(baseline)] if baseline is not None else []
    report_cmd = " ".join([words[0], *map(shlex.quote, words[1:])])
    contents = {}   # everything made before the first file is written
    for name, fig in (("curves.png", plot_curves(dirs)), ("time.png", plot_time_breakdown(dirs)),
                      ("throughput.png", plot_throughput(dirs, baseline))):
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=DPI)
        contents[name] = buffer.getvalue()
    contents["results.md"] = report_markdown(dirs, baseline, report_cmd).encode("utf-8")

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in REPORT_FILES]
    for path in paths:
        path.write_bytes(contents[path.name])
    if not kit_images:
        manifest = {"written_by": "python -m ddp_utils report", "command": report_cmd,
                    "note": "the report replaces only these files, and only while unchanged",
                    "files": {name: hashlib.sha256(data).hexdigest() for name, data in contents.items()}}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return paths

"""The Markdown tables: time, throughput, accuracy, speed-up; mean +- std over seeds; single vs DP vs DDP."""
from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path


from ...concerns import money
from .runs import MODE_NAMES, _differing_settings, _gpus, _load_all, _ranks, _seed, group_runs, parallel_mode

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
    header = ("| run | ranks | algorithm | global batch | epochs | wall time | train img/s | img/s per rank "
              "| Acc@1 | Acc@5 | speed-up | efficiency |" + (" cost (per epoch) |" if priced else ""))
    lines = [header,
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
             + (" ---: |" if priced else "")]
    for r, run in zip(rows, runs):
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else "n/a"
        efficiency = f"{100 * r.efficiency:.0f} %" if r.efficiency is not None else "n/a"
        lines.append(f"| {r.name} | {r.ranks} | {run_algorithm(run)} | {r.global_batch} | {r.epochs} "
                     f"| {format_duration(r.wall_time_s)} "
                     f"| {r.images_per_s:.0f} | {r.images_per_s_rank:.0f} | {r.acc1:.2f} | {r.acc5:.2f} "
                     f"| {speedup} | {efficiency} |" + (f" {format_cost(run)} |" if priced else ""))
    notes = _table_notes(runs, baseline)
    if priced:
        notes.append("Cost: wall time x nodes x the price per node-hour given (--price-per-hour), for all nodes "
                     "together; n/a where no price was given.")
    return "\n".join(lines + [""] + [f"- {note}" for note in notes])


def run_algorithm(run: dict) -> str:
    """What trained: results.json's ``algorithm`` (runs of older kits: from ``comm``); a DataParallel run,
    one process too, says so."""
    from ...speed.comm import algorithm
    if parallel_mode(run) == "dp":
        return MODE_NAMES["dp"]
    return run.get("algorithm") or algorithm(run.get("comm") or "none", run["world_size"])


def format_cost(run: dict) -> str:
    """``0.123 (0.0154)``: the run's cost and its cost per epoch, or ``n/a`` without a price."""
    if run.get("cost") is None:
        return "n/a"
    per_epoch = f" ({money(run['cost_per_epoch'])})" if run.get("cost_per_epoch") is not None else ""
    return f"{money(run['cost'])}{per_epoch}"


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



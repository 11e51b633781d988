"""What students hand in: a results table and two labelled figures, made from finished run folders.

    python -m ddp_utils report runs/demo/<stamp>-ddp2 runs/demo/<stamp>-single

writes into a new folder ``reports/<YYYYmmdd-HHMMSS>/`` (or the ``--out`` folder)::

    results.md       the table (time, throughput, accuracy, speed-up, scaling efficiency), the
                     hardware, and the commands that made the runs
    curves.png       loss and Acc@1 per epoch, train (solid) and val (dashed), one colour per run
    throughput.png   global images/s per run, and the speed-up next to the ideal linear one
    .ddp_utils-report.json   the files above with their hashes: a later report into the same
                     folder may replace them, and nothing else (any other file of those names,
                     or one changed since, makes the report stop before writing anything)

The kit's own example pictures in ``images/`` are replaced only with ``--kit-images``; a plain
``--out images/`` is refused.

From a notebook: ``print(results_table(dirs))``, ``plot_curves(dirs)``, ``plot_throughput(dirs)``.

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

Every figure names the hardware and data that made it (``hardware_caption``): a speed-up means
nothing without the machine it was measured on.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import json
import shlex
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

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


def _load_all(run_dirs) -> list[dict]:
    if isinstance(run_dirs, (str, Path)):   # one folder given on its own
        run_dirs = [run_dirs]
    runs = [load_run(d) for d in run_dirs]
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
    header = ("| run | ranks | global batch | epochs | wall time | train img/s | img/s per rank "
              "| Acc@1 | Acc@5 | speed-up | efficiency |")
    lines = [header,
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else "n/a"
        efficiency = f"{100 * r.efficiency:.0f} %" if r.efficiency is not None else "n/a"
        lines.append(f"| {r.name} | {r.ranks} | {r.global_batch} | {r.epochs} | {format_duration(r.wall_time_s)} "
                     f"| {r.images_per_s:.0f} | {r.images_per_s_rank:.0f} | {r.acc1:.2f} | {r.acc5:.2f} "
                     f"| {speedup} | {efficiency} |")
    return "\n".join(lines + [""] + [f"- {note}" for note in _table_notes(runs, baseline)])


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
        if run.get("epochs_run", run["epochs"]) < run["epochs"]:
            notes.append(f"{run['name']} was resumed: its times cover only the last "
                         f"{run['epochs_run']} of its {run['epochs']} epochs.")
    return notes


def _images_per_epoch(run: dict) -> float | None:
    counts = [h["train"]["count"] for h in run.get("history", []) if "count" in h.get("train", {})]
    return sum(counts) / len(counts) if counts else None


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


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


def plot_curves(run_dirs) -> Figure:
    """Loss (left) and Acc@1 (right) per epoch: train solid, val dashed, one colour per run; the
    runs' names in a legend below the axes."""
    from matplotlib.lines import Line2D

    runs = _load_all(run_dirs)
    fig, panel = _new_figure(runs, f"Training curves: loss and Acc@1 per epoch "
                                   f"({_summary(runs, 'dataset')} data, {_summary(runs, 'arch')})",
                             (11, 5.2 + 0.15 * len(runs)))   # taller with more runs: the legend grows
    loss_ax, acc_ax = panel.subplots(1, 2)
    for i, run in enumerate(runs):
        color = f"C{i}"
        for tag, (xs, ys) in epoch_curves(run).items():
            ax = loss_ax if tag.startswith("Loss") else acc_ax
            split = tag.split("/")[1]
            ax.plot(xs, ys, color=color, linestyle="-" if split == "train" else "--",
                    marker="o" if split == "train" else "s", markersize=4,
                    label=f"{_label(run)} {split}")
    for ax, title, unit in ((loss_ax, "loss (cross-entropy)", "loss"), (acc_ax, "top-1 accuracy", "Acc@1 (%)")):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.set_ylabel(unit)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    # One entry per run (its colour), then one per line style, instead of runs x splits entries.
    handles = [Line2D([], [], color=f"C{i}", linewidth=3) for i in range(len(runs))]
    handles += [Line2D([], [], color="0.3", linestyle="-", marker="o", markersize=4),
                Line2D([], [], color="0.3", linestyle="--", marker="s", markersize=4)]
    _legend_below(fig, panel, handles, [_label(run) for run in runs] + ["train (solid)", "val (dashed)"])
    return _finish(fig)


# -- throughput and speed-up ---------------------------------------------------------------------
def plot_throughput(run_dirs, baseline=None) -> Figure:
    """Left: global train images/s per run. Right: speed-up against the baseline, with the ideal
    linear speed-up (ranks / baseline ranks) drawn as a dashed outline behind each bar.

    The bars are numbered (run 1, run 2, ...) and a legend below the axes names the runs, unless
    every run's name fits under its bars."""
    from matplotlib.patches import Patch

    runs = _load_all(run_dirs)
    rows = scaling_rows(runs, baseline)
    base = runs[baseline_index(runs, baseline)]
    fig, panel = _new_figure(runs, f"Throughput and speed-up vs {base['name']} ({_ranks(base['world_size'])})",
                             (max(11.0, 3.0 + 2.0 * len(rows)), 5.2 + 0.15 * len(rows)))   # room per bar
    ips_ax, speed_ax = panel.subplots(1, 2)
    xs = list(range(len(rows)))
    colors = [f"C{i}" for i in xs]

    bars = ips_ax.bar(xs, [r.images_per_s for r in rows], color=colors)
    ips_labels = ips_ax.bar_label(bars, fontsize=LEGEND_FONTSIZE, padding=2, labels=[
        f"{r.images_per_s:.0f}\n{r.images_per_s_rank:.0f} per rank" for r in rows])
    ips_ax.set_title("train images/s, all ranks together")
    ips_ax.set_ylabel("images / s")

    ideal = [r.ranks / base["world_size"] for r in rows]
    speed_ax.bar(xs, ideal, fill=False, linestyle="--", edgecolor="0.4", label="ideal (linear) speed-up")
    speed_ax.bar(xs, [r.speedup or 0 for r in rows], color=colors, width=0.6,
                 label="measured speed-up")
    # One label per run above the taller of its two bars: on white, so it reads whatever the bar's
    # height, and never on top of another label when the measured speed-up equals the ideal one.
    speed_labels = [
        speed_ax.annotate(f"{r.speedup:.2f}x\n{100 * r.efficiency:.0f} % of {x_ideal:g}x" if r.speedup is not None
                          else f"n/a\nideal {x_ideal:g}x",
                          xy=(x, max(x_ideal, r.speedup or 0)), xytext=(0, 2), textcoords="offset points",
                          ha="center", va="bottom", fontsize=LEGEND_FONTSIZE)
        for x, r, x_ideal in zip(xs, rows, ideal)]
    speed_ax.set_title("speed-up vs baseline, in train time per epoch")
    speed_ax.set_ylabel("speed-up (x)")
    # Right of the axes, not on the bars.
    speed_ax.legend(fontsize=LEGEND_FONTSIZE, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)

    for ax in (ips_ax, speed_ax):
        ax.set_xticks(xs, [f"{r.name}\n{_ranks(r.ranks)}" for r in rows], fontsize=9)
        ax.set_xlim(-0.6, len(rows) - 0.4)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    if not _ticks_fit(fig, speed_ax, len(rows)):
        for ax in (ips_ax, speed_ax):
            ax.set_xticks(xs, [f"run {x + 1}\n{_ranks(r.ranks)}" for x, r in zip(xs, rows)], fontsize=9)
        _legend_below(fig, panel, [Patch(color=c) for c in colors],
                      [f"run {x + 1}: {_label(run)}" for x, run in zip(xs, runs)])
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
REPORT_FILES = ("curves.png", "throughput.png", "results.md")
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
    - ``out_dir``: that folder. Files in it named like the report's (results.md, curves.png,
      throughput.png) are replaced only when an earlier report wrote them and they are unchanged
      since (its ``.ddp_utils-report.json`` lists them with their hashes); otherwise this raises
      FileExistsError, and nothing is written. The kit's own ``images/`` folder is always refused;
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


def write_report(run_dirs, out_dir=None, baseline=None, *, kit_images: bool = False) -> list[Path]:
    """Write ``curves.png``, ``throughput.png`` and ``results.md`` into ``out_dir`` (default: a new
    folder ``reports/<YYYYmmdd-HHMMSS>/``); return their paths.

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
    text = "\n".join([
        "# Results", "",
        results_table(dirs, baseline), "",
        f"**{hardware_caption(runs)}**", "",
        "Runs made with (rebuilt from each run's settings.json):", "",
        *[f"    {train_command(run['settings'])}" for run in runs], "",
        f"This report: `{report_cmd}`", "",
        "![training curves](curves.png)", "",
        "![throughput and speed-up](throughput.png)", ""])
    contents = {}   # everything made before the first file is written
    for name, fig in (("curves.png", plot_curves(dirs)), ("throughput.png", plot_throughput(dirs, baseline))):
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=DPI)
        contents[name] = buffer.getvalue()
    contents["results.md"] = text.encode("utf-8")

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

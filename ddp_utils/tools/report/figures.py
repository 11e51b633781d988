"""The pictures: training curves, throughput and speed-up, where the train time went."""
from __future__ import annotations

import itertools
import statistics
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .runs import _group_label, _load_all, _ranks, _summary, group_runs, hardware_caption
from .tables import _mean_epoch_seconds, _pm_time, _speedups, baseline_index, mean_std
from .bounds import TIME_KEYS, TIME_PARTS, _epochs_trained, _percent, time_breakdown

DPI = 100  # small PNGs that still read well on a slide or in a README

# The four curves, as (TensorBoard tag, history split, history key); the tags are the course's.
CURVES = (("Loss/train", "train", "loss"), ("Loss/val", "val", "loss"),
          ("acc1/train", "train", "acc1"), ("acc1/val", "val", "acc1"))




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
    fig.suptitle(title, fontsize=13, wrap=True)   # wrap: broken into lines at the figure's edges
    fig.supxlabel(hardware_caption(runs), fontsize=9, color="0.3", wrap=True)
    return fig, fig.subfigures(1, 1)


# -- layout: matplotlib's constrained layout places everything; long texts wrap at the figure's edge ---
# Run folder names are long (``cinic10-resnet18_cifar-ws2-20261123-101500``): they go into a legend
# below the axes, or under the bars when every name is short.
LEGEND_FONTSIZE = 8
SHORT_NAME = 24   # characters: a run's name this short goes under its bar, longer ones into the legend


def _legend_below(panel, handles: list, labels: list[str]):
    """A legend centred below the axes of ``panel`` (the constrained layout makes room for it), in
    as many columns as its longest label leaves room for: one for long run-folder names."""
    longest = max(len(line) for label in labels for line in label.splitlines())
    return panel.legend(handles, labels, loc="outside lower center", ncols=max(1, min(len(labels), 4, 150 // (longest + 8))),
                        fontsize=LEGEND_FONTSIZE, frameon=False)


def _room_above(ax, tops: list[float], share: float = 0.22) -> None:
    """Leave the top ``share`` of ``ax`` free for the labels that stand on the bars (two lines)."""
    ax.set_ylim(0, max(tops + [1e-9]) / (1 - share))


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
    from ...runlog import read_scalars   # here, not at the top: it loads torch and TensorBoard

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
    from ...runlog import read_scalars   # here, not at the top: it loads torch and TensorBoard

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
        _plot_group(group, f"C{i}", (loss_ax, acc_ax, lr_ax), ([curves[id(run)] for run in group],
                                                               [lrs[id(run)] for run in group]), scale)
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
    _curves_legend(panel, groups)
    return fig


def _plot_group(group, color: str, axes, curves_and_lrs, scale: float) -> None:
    """One group of runs (one run, or the seeds of one configuration) on the loss, Acc@1 and lr axes: its mean
    line, with the min-max range shaded where it has several runs."""
    loss_ax, acc_ax, lr_ax = axes
    group_curves, group_lrs = curves_and_lrs
    label = _group_label(group)
    for tag, _, _ in CURVES:
        members = [c[tag] for c in group_curves if c.get(tag, ([], []))[0]]
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
    members = [lr for lr in group_lrs if lr[0]]
    if members:
        xs, ys = members[0] if len(members) == 1 else _group_curve(members)[:2]
        lr_ax.plot([x / scale for x in xs], ys, color=color, label=f"{label} lr",
                   marker="o" if len(xs) <= 60 else None, markersize=4)


def _curves_legend(panel, groups) -> None:
    """One entry per run (its colour), then one per line style, instead of runs x splits entries."""
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=f"C{i}", linewidth=3) for i in range(len(groups))]
    handles += [Line2D([], [], color="0.3", linestyle="-", marker="o", markersize=4),
                Line2D([], [], color="0.3", linestyle="--", marker="s", markersize=4)]
    labels = [_group_label(group) for group in groups] + ["train (solid)", "val (dashed)"]
    if any(len(group) > 1 for group in groups):
        from matplotlib.patches import Patch
        handles.append(Patch(color="0.3", alpha=0.2))
        labels.append("seeds: mean line, min-max shaded")
    _legend_below(panel, handles, labels)


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
    short = all(len(run["name"]) <= SHORT_NAME for group in groups for run in group)   # names under the bars
    who = base["name"] if short else f"run {groups.index(base_group) + 1}"   # long names: in the legend
    versus = f"{who} ({_ranks(base['world_size'])})" if len(base_group) == 1 else \
        f"{who} and its seeds (mean of {len(base_group)} runs, {_ranks(base['world_size'])})"
    fig, panel = _new_figure(runs, f"Throughput and speed-up vs {versus}",
                             (max(11.0, 3.0 + 2.0 * len(groups)), 5.2 + 0.15 * len(groups)))   # room per bar
    ips_ax, speed_ax = panel.subplots(1, 2)
    xs = list(range(len(groups)))
    colors = [f"C{i}" for i in xs]
    ips_labels = _images_per_s_bars(ips_ax, xs, ips, ranks)
    speed_labels = _speed_up_bars(speed_ax, xs, speed, [n / base["world_size"] for n in ranks])
    handles, labels = speed_ax.get_legend_handles_labels()   # right of the axes, not on the bars
    if any(s for _, s in speed + ips):
        from matplotlib.lines import Line2D
        handles.append(Line2D([], [], color="black", marker="_", markersize=8, linewidth=1.2))
        labels.append("± std over seeds")
    speed_ax.legend(handles, labels, fontsize=LEGEND_FONTSIZE, loc="upper left", bbox_to_anchor=(1.02, 1),
                    borderaxespad=0)

    names = ["\n".join(run["name"] for run in group) for group in groups]
    for ax in (ips_ax, speed_ax):
        ticks = names if short else [f"run {x + 1}" for x in xs]
        ax.set_xticks(xs, [f"{tick}\n{_ranks(n)}" for tick, n in zip(ticks, ranks)], fontsize=9)
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.grid(axis="y", alpha=0.3)
    if not short:   # the names in a legend below, numbered like the bars
        _legend_below(panel, [Patch(color=c) for c in colors],
                      [f"run {x + 1}: {_group_label(group)}" for x, group in zip(xs, groups)])
    _room_above(ips_ax, [label.xy[1] for label in ips_labels])
    _room_above(speed_ax, [label.xy[1] for label in speed_labels])
    return fig


def _images_per_s_bars(ax, xs, ips, ranks) -> list:
    """Global train images/s per group (mean, ± std over seeds), each labelled with its per-rank figure."""
    ax.bar(xs, [m for m, _ in ips], color=[f"C{i}" for i in xs])
    _error_bars(ax, xs, [m for m, _ in ips], [s for _, s in ips])
    labels = [ax.annotate(f"{m:.0f}" + (f" ± {s:.0f}" if s else "") + f"\n{m / n:.0f} per rank",
                          xy=(x, m + (s or 0)), xytext=(0, 2), textcoords="offset points",
                          ha="center", va="bottom", fontsize=LEGEND_FONTSIZE)
              for x, (m, s), n in zip(xs, ips, ranks)]
    ax.set_title("train images/s, all ranks together")
    ax.set_ylabel("images / s")
    return labels


def _speed_up_bars(speed_ax, xs, speed, ideal) -> list:
    """The measured speed-up per group in front of its ideal (linear) one, dashed; each labelled."""
    speed_ax.bar(xs, ideal, fill=False, linestyle="--", edgecolor="0.4", label="ideal (linear) speed-up")
    speed_ax.bar(xs, [m or 0 for m, _ in speed], color=[f"C{i}" for i in xs], width=0.6, label="measured speed-up")
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
    return speed_labels


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

    # The runs' names (and hosts) beside their bars when they are short, else numbered bars, names in the legend.
    long_ticks = [_bar_tick(groups[g], g, row, False) for g, row in bars]
    short = max(len(line) for text in long_ticks for line in text.splitlines()) <= 2 * SHORT_NAME
    ax.set_yticks(ys, long_ticks if short else [_bar_tick(groups[g], g, row, True) for g, row in bars], fontsize=9)
    legend_handles = [Patch(color=color) for _, _, color, _ in TIME_PARTS]
    legend_labels = [label for _, label, _, _ in TIME_PARTS]
    if not short:
        legend_handles += [Patch(color="none")] * len(groups)
        legend_labels += [f"run {g + 1}: {_group_label(group)}" for g, group in enumerate(groups)]
    _legend_below(panel, legend_handles, legend_labels)
    _share_labels(ax, bars, segments)
    return fig


def _bar_tick(group: list[dict], g: int, row: dict, short: bool) -> str:
    """The label beside a run's (or rank's) bar: the run, the rank (and its host), its time per epoch, GPU use."""
    who = f"run {g + 1}" if short else ", ".join(run["name"] for run in group)
    if group[0]["world_size"] == 1:
        rank = ""
    elif row["rank"] is None:
        rank = "mean of ranks"
    else:
        rank = f"rank {row['rank']}" + (f" ({row['host']})" if row.get("host") and not short else "")
    gpu = f", GPU {row['gpu']:.0f} %" if row["gpu"] is not None else ""
    return f"{who}{', ' + rank if rank else ''}\n{_pm_time([row['total_s']], row['total_std'])} per epoch{gpu}"


def _share_labels(ax, bars, segments) -> None:
    """Each part's share of the train time on it, where the part is wide enough to hold the label (a 22nd of the
    axis, about 30 pixels) and the error bar at the bar's end does not cross it."""
    span = ax.get_xlim()[1]
    for container, text_color in segments:
        shares = []
        for (_, row), patch in zip(bars, container.patches):
            width, middle = patch.get_width(), patch.get_x() + patch.get_width() / 2
            # a label is about a 22nd of the axis wide: its right half must end before the error bar starts
            crossed = (row["total_std"] or 0) and middle + span / 44 > row["total_s"] - row["total_std"]
            fits = row["total_s"] > 0 and width >= span / 22 and not crossed
            shares.append(_percent(width / row["total_s"]) if fits else "")
        ax.bar_label(container, shares, label_type="center", fontsize=LEGEND_FONTSIZE, color=text_color)

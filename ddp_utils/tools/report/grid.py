"""A grid of short runs that vary one DDP mechanism (``train --grid NAME=V1,V2``, or runs made by hand): one table
and ``grid.png``, each run labelled by the settings that differ.

The step time of each run is split as the epoch lines split it (data wait, compute, communication waited for,
idle), so that what a mechanism changed shows where it changed it: a larger bucket or ``accumulate`` moves time out
of ``comm``, more loader workers out of ``data``. Runs over several world sizes get a scaling-efficiency panel:
images/s per rank against the smallest world size's, where 100 % is linear scaling.
"""
from __future__ import annotations

import json

from matplotlib.figure import Figure

from .bounds import TIME_KEYS, TIME_PARTS, time_shares
from .figures import LEGEND_FONTSIZE, _new_figure
from .runs import _load_all
from .tables import _step_seconds

# Settings that never make a grid: where and how a run was started, and how it logs.
SHORT = {"data_s": "data", "compute_s": "compute", "comm_s": "comm", "idle_s": "idle"}   # the epoch line's words
NOT_VARIED = ("seed", "run_dir", "rank", "local_rank", "master_addr", "master_port", "progress", "wandb",
              "wandb_project", "log_every", "init_timeout", "collective_timeout", "socket_ifname", "init_method",
              "profile_steps", "price_per_hour")


def varied_settings(runs: list[dict]) -> list[str]:
    """The settings whose values differ among ``runs`` (loaded runs), in settings.json's order."""
    settings = [{k: v for k, v in (run.get("settings") or {}).items() if k not in NOT_VARIED} for run in runs]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    return [k for k in keys if len({json.dumps(s.get(k), default=str) for s in settings}) > 1]


def is_grid(runs: list[dict]) -> bool:
    """Worth a grid section: a setting other than the ranks and the parallel mode varies (the homework's DDP vs
    single pair is the results table's job), or three world sizes or more (a scaling curve)."""
    varied = set(varied_settings(runs))
    return len(runs) > 1 and (bool(varied - {"world_size", "parallel"})
                              or len({run["world_size"] for run in runs}) >= 3)


def _value(run: dict, key: str) -> str:
    value = (run.get("settings") or {}).get(key, "-")
    return f"{value:g}" if isinstance(value, float) else str(value)


def _split_ms(run: dict) -> dict[str, float]:
    """The mean step, in ms, split by the time shares (mean over ranks)."""
    step, shares = _step_seconds(run), time_shares(run)
    return {key: 1e3 * step * shares.get(key, 0.0) for key in TIME_KEYS} if step and shares else {}


def efficiencies(runs: list[dict]) -> dict[int, float]:
    """World size -> scaling efficiency in % (images/s per rank against the smallest world size's; the mean over
    the runs of each size)."""
    by_size: dict[int, list[float]] = {}
    for run in runs:
        by_size.setdefault(run["world_size"], []).append(run["images_per_s"] / run["world_size"])
    means = {n: sum(v) / len(v) for n, v in sorted(by_size.items())}
    base = means[min(means)]
    return {n: 100 * per_rank / base for n, per_rank in means.items()}


def grid_table(run_dirs) -> str:
    """Markdown: one row per run, the varied settings first, then images/s, the step and its split, Acc@1."""
    runs = _load_all(run_dirs)
    varied = varied_settings(runs) or ["world_size"]
    head = ["run", *varied, "img/s", "img/s per rank", "step (ms)", *[f"{SHORT[key]} (ms)" for key in TIME_KEYS],
            "Acc@1"]
    lines = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join(["---:"] * (len(head) - 1)) + " |"]
    for run in runs:
        split, step = _split_ms(run), _step_seconds(run)
        lines.append("| " + " | ".join([run["name"], *[_value(run, k) for k in varied], f"{run['images_per_s']:.0f}",
                                        f"{run['images_per_s'] / run['world_size']:.0f}",
                                        f"{1e3 * step:.0f}" if step else "n/a",
                                        *[f"{split[k]:.0f}" if split else "n/a" for k in TIME_KEYS],
                                        f"{run['acc1']:.2f}"]) + " |")
    if len({run["world_size"] for run in runs}) > 1:
        eff = efficiencies(runs)
        lines += ["", "Scaling efficiency (images/s per rank against "
                      f"{min(eff)} rank{'s' if min(eff) > 1 else ''}): "
                  + ", ".join(f"{n} ranks {e:.0f} %" for n, e in eff.items()) + "."]
    return "\n".join(lines)


def plot_grid(run_dirs) -> Figure:
    """Left: each run's mean step, split into data wait, compute, communication waited for and idle (ms), labelled
    by the settings that vary. Right: images/s per run, or with several world sizes the scaling efficiency."""
    runs = _load_all(run_dirs)
    varied = varied_settings(runs) or ["world_size"]
    labels = [", ".join(f"{k}={_value(run, k)}" for k in varied) for run in runs]
    sizes = sorted({run["world_size"] for run in runs})
    fig, panel = _new_figure(runs, f"What changed when {', '.join(varied)} changed", (12.0, 3.2 + 0.45 * len(runs)))
    step_ax, right_ax = panel.subplots(1, 2, width_ratios=[3, 2])
    ys = list(range(len(runs)))[::-1]   # the first run on top
    for key, _, color, _ in TIME_PARTS:
        lefts = [sum(_split_ms(run).get(k, 0.0) for k in TIME_KEYS[:TIME_KEYS.index(key)]) for run in runs]
        step_ax.barh(ys, [_split_ms(run).get(key, 0.0) for run in runs], left=lefts, color=color, label=SHORT[key])
    step_ax.set_yticks(ys, labels, fontsize=LEGEND_FONTSIZE + 1)
    step_ax.set_xlabel("ms per training step (mean over ranks)")
    step_ax.set_title("where each step's time went")
    step_ax.legend(fontsize=LEGEND_FONTSIZE, loc="lower right")
    step_ax.grid(axis="x", alpha=0.3)
    if len(sizes) > 1:
        eff = efficiencies(runs)
        right_ax.plot(list(eff), list(eff.values()), marker="o", label="measured")
        right_ax.axhline(100, color="0.4", linestyle="--", label="linear (100 %)")
        right_ax.set_xticks(sizes)
        right_ax.set_xlabel("ranks")
        right_ax.set_ylabel(f"images/s per rank, % of {sizes[0]} rank{'s' if sizes[0] > 1 else ''}")
        right_ax.set_ylim(0, max(110, max(eff.values()) * 1.1))
        right_ax.set_title("scaling efficiency")
        right_ax.legend(fontsize=LEGEND_FONTSIZE)
    else:
        right_ax.barh(ys, [run["images_per_s"] for run in runs], color="tab:blue")
        right_ax.set_yticks(ys, [""] * len(ys))
        right_ax.set_xlabel("train images/s, all ranks")
        right_ax.set_title("throughput")
    right_ax.grid(alpha=0.3)
    return fig

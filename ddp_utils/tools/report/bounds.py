"""What one run spent its training time on, per rank, and the sentence saying what bound it."""
from __future__ import annotations



from pathlib import Path

from ...speed.gpu_monitor import describe_per_device
from .. import sweep
from .memory import size
from .runs import parallel_mode
from .tables import _seconds_per_epoch

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
    ``baseline_run``, as in the table) and the GPU use where the run recorded them (a DataParallel run's
    GPU by GPU too)."""
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
    each = describe_per_device(run)   # DataParallel: each GPU's use and memory (is GPU 0 busier and fuller?)
    if each:
        text += f"; {each}"
    return f"{name}: {text}."


def beside_probe(run: dict) -> str | None:
    """One line for a multi-rank run: its link probe's bandwidth beside the newest sweep `check` saved next to it
    (``<runs folder>/check/``) for the same number of ranks; None when there is neither."""
    if run.get("world_size", 1) < 2:
        return None
    found = sweep.newest(Path(run["run_dir"]).parent / "check", run["world_size"])
    probe = run.get("link_gbit_s")
    said = [f"{run['name']}: the link probe before training measured {probe:.3g} Gbit/s"] if probe is not None \
        else [f"{run['name']}: no link probe (--no-link-probe, or a kit without one)"]
    if found:
        top = found["rows"][-1]
        said.append(f"`check`'s all-reduce sweep ({found['when']}, {found['backend']}, {Path(found['path']).name}) "
                     f"moved {size(top['bytes'])} in {1e3 * top['seconds']:.1f} ms, busbw "
                     f"{top['busbw_gbit_s']:.3g} Gbit/s (the smallest payload, {size(found['rows'][0]['bytes'])}: "
                     f"{1e3 * found['rows'][0]['seconds']:.2f} ms, the latency)")
    else:
        said.append("no `check` sweep for this many ranks beside the run folder (run `python -m ddp_utils check` "
                    "on every node before training)")
    return "; ".join(said) + "."

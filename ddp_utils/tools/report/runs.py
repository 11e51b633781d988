"""Reading finished run folders, and grouping runs that differ only in their seed."""
from __future__ import annotations

import json
from pathlib import Path



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
            go_on = (f"continue it with --resume {run_dir / 'last.pt'}" if (run_dir / "last.pt").exists() else
                     "start it again: no epoch finished, so it has no checkpoint to continue from")
            raise FileNotFoundError(
                f"{run_dir} is a run that has not finished: it has no results.json yet (written "
                f"after the last epoch). Wait for it to end, or {go_on}")
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




def _label(run: dict) -> str:
    return f"{run['name']} ({_ranks(run['world_size'])})"


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"




# -- mean +- std over seeds: the seed table and single vs DataParallel vs DDP ---------------------


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
    """``none``, ``dp``, ``ddp``, ``zero1`` or ``fsdp``: results.json's ``parallel``, else ddp with several ranks,
    else none.
    One process with DDP's name is plain one-process training: none."""
    mode = run.get("parallel") or ("ddp" if run["world_size"] > 1 else "none")
    return "none" if mode == "ddp" and run["world_size"] == 1 else mode


MODE_NAMES = {"none": "single", "dp": "DataParallel", "ddp": "DDP", "zero1": "ZeRO-1", "fsdp": "FSDP"}


def _gpus(run: dict):
    """GPUs the run trained on: results.json's ``job_gpus`` (all ranks together; a GPU that two ranks shared
    counts once), else a count it gives, else one per rank on a GPU, 0 on CPU; None for a DataParallel run
    that does not say how many it drove."""
    if isinstance(run.get("job_gpus"), int):
        return run["job_gpus"]
    if parallel_mode(run) == "ddp" and isinstance(run.get("gpus"), int):
        return run["gpus"] * run["world_size"]   # older kits: ``gpus`` counted one process's
    for key in ("gpus", "gpu_count", "num_gpus"):
        for source in (run, run.get("settings") or {}):
            if isinstance(source.get(key), int):
                return source[key]
    if not str(run.get("device", "")).startswith("cuda"):
        return 0
    return None if parallel_mode(run) == "dp" else run["world_size"]




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



"""Where a report goes and what it holds: results.md, curves.png, time.png, throughput.png."""
from __future__ import annotations

import dataclasses
import datetime
import io
import shlex
from pathlib import Path


from ...robust.files import folder_refusal
from .runs import _load_all, group_runs, hardware_caption, parallel_mode
from .tables import baseline_index, compare_table, lr_notes, results_table, seed_table
from .bounds import beside_probe, bottleneck_sentence
from .memory import memory_table, shows_memory
from .figures import DPI, plot_curves, plot_throughput, plot_time_breakdown
from .grid import grid_table, is_grid, plot_grid


# -- everything at once --------------------------------------------------------------------------
def train_command(settings: dict) -> str:
    """The ``python -m ddp_utils train`` command that reproduces a run (rank 0's), rebuilt from its
    settings.json with ``Settings.to_argv``: the flags that differ from the defaults, and the data."""
    from ...settings import Settings   # here, not at the top: `report` itself needs no torch

    known = {f.name for f in dataclasses.fields(Settings)}   # a newer kit's extra fields are left out
    argv = Settings.from_dict({k: v for k, v in settings.items() if k in known}).to_argv(
        skip=("rank",), always=("dataset", "data_dir"))
    parts = ["python", "-m", "ddp_utils", "train", *map(shlex.quote, argv)]
    world_size = settings.get("world_size", 1)
    if world_size > 1:
        others = "1" if world_size == 2 else f"1..{world_size - 1}"
        return " ".join(parts + ["--rank", "0"]) + f"   # and the same with --rank {others} on the other rank(s)"
    return " ".join(parts)


# -- where the report goes: always a new folder, or an empty one you name -----------------------
REPORT_FILES = ("curves.png", "time.png", "throughput.png", "results.md")
REPORTS_DIR = Path("reports")          # the default parent, relative to the current directory
# The kit's own pictures (committed examples made from real runs, described in images/README.md).
KIT_IMAGES = Path(__file__).resolve().parents[3] / "images"


def new_report_dir(parent=REPORTS_DIR, now: datetime.datetime | None = None) -> Path:
    """``parent/<YYYYmmdd-HHMMSS>``, with ``-2``, ``-3``, ... added when that folder exists already."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    folder, n = Path(parent) / stamp, 2
    while folder.exists():
        folder, n = Path(parent) / f"{stamp}-{n}", n + 1
    return folder


def _is_kit_images(folder: Path) -> bool:
    try:
        return folder.exists() and KIT_IMAGES.exists() and folder.samefile(KIT_IMAGES)
    except OSError:
        return False


def report_dir(out_dir=None, kit_images: bool = False) -> Path:
    """The folder a report goes into, checked before anything is written.

    - no ``out_dir``: a new folder ``reports/<YYYYmmdd-HHMMSS>/`` under the current directory;
    - ``out_dir``: that folder, if it does not exist yet or is empty; a folder with anything in it
      is refused (FileExistsError) and nothing is written, so a report never replaces a file,
      least of all a student's own answers. The kit's own ``images/`` folder is always refused;
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
        return _writable(new_report_dir(), "the report folder (a new one under reports/)")
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
    if out.exists() and any(out.iterdir()):
        held = sorted(p.name for p in out.iterdir())
        raise FileExistsError(
            f"{out} already holds {', '.join(held[:5])}{' ...' if len(held) > 5 else ''}: --out takes a new or "
            f"an empty folder, so that a report never replaces a file (your answers, or an earlier report "
            f"you handed in). Nothing was written. Run without --out to write to a new "
            f"{REPORTS_DIR}/<time>/ folder, or choose a new folder with --out DIR.")
    return _writable(out, "the report folder (--out)")


def _writable(folder: Path, what: str) -> Path:
    """``folder``, or ValueError naming why it cannot be written (before the table or a figure is made)."""
    refusal = folder_refusal(folder, what)
    if refusal:
        raise ValueError(refusal.replace("start again", "run the report again") + " Nothing was written.")
    return folder


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
    link = [line for line in map(beside_probe, runs) if line]
    if link:
        lines += ["## The link between the ranks", "", *[f"- {line}" for line in link], ""]
    if any(len(group) > 1 for group in group_runs(runs)):
        lines += ["## Seeds: mean ± std over runs that differ only in their seed", "", seed_table(dirs, baseline), ""]
    if is_grid(runs):   # train --grid, or runs that vary one mechanism: where each step's time went
        lines += ["## What changed when a setting changed", "", grid_table(dirs), "", "![each run's step split into "
                  "data wait, compute, communication and idle; throughput or scaling efficiency](grid.png)", ""]
    if len({parallel_mode(run) for run in runs}) > 1:
        lines += ["## Single vs DataParallel vs DDP", "", compare_table(dirs), ""]
    if shows_memory(runs):
        lines += ["## Memory per rank: DDP, ZeRO-1, FSDP", "", memory_table(runs), ""]
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

    Nothing is written when a run folder is not a finished run, or when ``out_dir`` is not new or
    empty (FileExistsError; see ``report_dir``). ``kit_images=True`` writes into the kit's own
    ``images/`` folder instead: its pictures are replaced only on this explicit request.
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
                      ("throughput.png", plot_throughput(dirs, baseline)),
                      *([("grid.png", plot_grid(dirs))] if is_grid(runs) else [])):
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=DPI)
        contents[name] = buffer.getvalue()
    contents["results.md"] = report_markdown(dirs, baseline, report_cmd).encode("utf-8")

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in (*REPORT_FILES, "grid.png") if name in contents]
    for path in paths:
        path.write_bytes(contents[path.name])
    return paths

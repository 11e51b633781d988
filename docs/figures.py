"""The benchmarks' figures in the pages, pasted from the files the benchmarks write.

Every benchmark writes ``benchmarks/results/NAME.json`` (its command, the machine, how busy the machine
was, the date and commit, its table and figures: ``benchmarks/results.py``). The tables and the sentences
with figures in docs/benchmarks.md, docs/faults.md and the README sit between cog markers that call
the functions below, so a page quotes only what a file says, with the machine beside it::

    python benchmarks/data_loading.py       # writes benchmarks/results/data_loading.json
    python docs/quotes.py pages             # pastes it (and every quoted output) into the pages

``tests/test_figures.py`` fails while a page and a results file disagree, and when a results file lacks
its command or machine.
"""
from __future__ import annotations

import itertools
import json
import re
import statistics
import string
import textwrap
from pathlib import Path

from docs.quotes import WIDTH, _out   # the pages' line width, and cog's output

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def bench(name: str) -> dict:
    """The results file of one benchmark run."""
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def machine_of(name: str) -> str:
    """'an idle 2-core AMD EPYC VM (23.5 GiB, no GPU), torch 2.14.1, 2026-11-25': where a file's figures come from
    (and, where the file breaks a rule of RULES, what it lacks: ``caveat``)."""
    r = bench(name)
    m = r["machine"]
    others = r["other_processes_cores"]
    busy = "an idle" if others < 0.2 else f"a busy (other processes used {others:.1f} cores meanwhile)"
    return f"{busy} {hardware(m)}, torch {m['torch']}, {r['date']}{caveat(name)}"


# The rules a quoted figure's file keeps (issue 58), or its quote says which it breaks (``caveat``).
MIN_REPETITIONS = 3   # rounds or seeds, each figure then a median or mean with its spread
MIN_STEPS = 200       # steps a timed figure's window holds at least (benchmarks/steady.py's MIN_STEPS)


def repetitions(r: dict) -> int | None:
    """How many times a file's figures were taken: its rounds, or its seeds; None where it records neither."""
    args = r.get("args", {})
    if args.get("rounds") is not None:
        return int(args["rounds"])
    if args.get("seeds"):   # "1,2,3" or "301-316"
        return sum(int(b) - int(a) + 1 if b else 1 for a, _, b in (s.partition("-") for s in str(args["seeds"]).split(",")))
    return None


def window(r: dict) -> int | None:
    """The steps a file's timed figures are taken over: its steady window (benchmarks/steady.py), or the steps per
    round its command timed; None for whole-run figures (a training run's accuracy and time, a fault's delay)."""
    if r.get("steady_steps") is not None:
        return int(r["steady_steps"])
    steps = r.get("args", {}).get("steps")
    return int(steps) if steps is not None else None


def lacks(name: str) -> list[str]:
    """The rules benchmarks/results/NAME.json breaks: a clean commit, MIN_REPETITIONS repetitions (where it records
    them), a timed window of at least MIN_STEPS steps (where it times one), a calibration figure taken in the same
    run."""
    r, out = bench(name), []
    if r["commit"].endswith("+changes"):
        out.append("uncommitted code")
    reps = repetitions(r)
    if reps is not None and reps < MIN_REPETITIONS:
        out.append(f"{reps} round{'s' * (reps != 1)}")
    steps = window(r)
    if steps is not None and steps < MIN_STEPS:
        out.append(f"a window of {steps} steps")
    if "calibration" not in r:
        out.append("no calibration")
    return out


# Files kept as the record of a decision whose code is gone, so that no re-run can take them again: why, for the quote.
RECORDS = {"comm_hooks-powersgd": "its `auto` rows are an `auto` that could send PowerSGD, which the kit no longer has"}


def caveat(name: str) -> str:
    """'' for a file that keeps the rules; else '; to re-run: uncommitted code, 1 round, no calibration', appended
    to the machine a quote names (tests/test_figures.py holds every quote of such a file to it); a RECORDS file says
    why it is not re-run instead."""
    missing = lacks(name)
    if missing and name in RECORDS:
        return f"; a record, not re-run ({RECORDS[name]}): {', '.join(missing)}"
    return f"; to re-run: {', '.join(missing)}" if missing else ""


def cpu(m: dict) -> str:
    """'Intel Xeon Processor' for 'Intel(R) Xeon(R) Processor': the CPU's name without its marks."""
    return re.sub(r"\((R|TM)\)", "", m["cpu"], flags=re.I)


def hardware(m: dict) -> str:
    """'2-core AMD EPYC VM (24 GiB, no GPU)' from a results file's machine."""
    return (f"{m['cores']}-core {cpu(m)} {'VM' if m.get('virtual') else 'machine'} "
            f"({m['memory_gib']:.0f} GiB, {m['gpu'] or 'no GPU'})")


def sitting(name: str) -> tuple[str, str]:
    """(what ran it, the day) of benchmarks/results/NAME.json: ('NVIDIA H200', '2026-11-27') or ('2-core AMD EPYC',
    '2026-11-25'), as ``where`` and ``machine_of`` name them."""
    r = bench(name)
    m = r["machine"]
    gpu = re.sub(r"^\d+ x ", "", m["gpu"] or "")   # '1 x NVIDIA H200': the pages say 'an NVIDIA H200'
    return (gpu or f"{m['cores']}-core {cpu(m)}", r["date"])


# figures.py functions that read a results file by a name of their own, not one the page's block spells out
READS = {"run_on_a_gpu": ("student_job", "gpu_peak"), "auto_against_none": ("comm_hooks-auto",),
         "path_table": ("data_prep",), "budgets": ("data_prep",), "budget_sentence": ("data_prep",),
         "data_plan": ("data_prep",), "data_steps": ("data_prep",)}


def files_read(code: str) -> set[str]:
    """The results files a cog block's code reads: the names it spells out, and those its functions read."""
    names = {n for n in re.findall(r"[\"']([\w.-]+)[\"']", code) if (RESULTS / f"{n}.json").exists()}
    return names | {n for fn, ns in READS.items() if re.search(rf"\bfigures\.{fn}\(", code) for n in ns}


def unsaid_sittings(names: set[str], text: str) -> list[str]:
    """Files of different sittings set side by side in one passage (a cog block's output) must each be placed: where
    two ran on different machines, the passage names both machines; where one machine ran them on different days,
    it names both days (the issue-58 rule: runs of different days are not compared as if they were one sitting).
    Returns what is missing (empty when nothing is)."""
    flat = " ".join(text.split())
    missing = []
    for a, b in itertools.combinations(sorted(names), 2):
        (ma, da), (mb, db) = sitting(a), sitting(b)
        need = [ma, mb] if ma != mb else [da, db] if da != db else []
        missing += [f"{a} and {b} ({ma}, {da} / {mb}, {db}): the passage does not say {w!r}"
                    for w in dict.fromkeys(need) if w not in flat]
    return missing


class _Figures(string.Formatter):
    """``{f[ratio][single_node]:.2f}``: a figure of the file; ``{command}``, ``{machine}``, ``{where}``,
    ``{args[rounds]}``; ``{x:pm0}`` a {mean, std} pair as 'mean +- std' with 0 decimals; ``{x:pc}`` a share as '8 %'."""

    def format_field(self, value, spec):
        if spec == "pc":          # a share as the pages write it: '8 %'
            return f"{100 * value:.0f} %"
        if spec.startswith(("pm", "+pm")):   # "+pm2": a signed mean (a difference)
            sign, digits = ("+" if spec[0] == "+" else ""), int(spec.lstrip("+")[2:] or 0)
            return f"{value['mean']:{sign}.{digits}f} +- {value['std']:.{digits}f}"
        return super().format_field(value, spec)


def where(name: str) -> str:
    """'a 2-core AMD EPYC VM': the machine in a few words (the README's), the whole of it being on the linked page,
    and the file's ``caveat``."""
    m = bench(name)["machine"]
    return (f"a {m['cores']}-core {cpu(m)} {'VM' if m.get('virtual') else 'machine'}"
            + (f", {m['gpu']}" if m["gpu"] else "") + caveat(name))


def fill(name: str, template: str, **more) -> str:
    r = bench(name)
    return _Figures().format(template, f=r["figures"], command=f"`{r['command']}`", machine=machine_of(name),
                             where=where(name), args=r["args"], **more)


def say(name: str, template: str, hang: int = 0, **more) -> None:
    """Cog: a paragraph with the figures of benchmarks/results/NAME.json filled in, wrapped as the pages are
    (``hang``: the indent of the lines after the first, 2 in a list item)."""
    _paragraph(fill(name, template, **more), hang)


def rerun_pending(name: str, lacks: str) -> str:
    """'' when benchmarks/results/NAME.json was measured from a clean commit over a steady window of MIN_STEPS
    steps; else a sentence saying its figures are not yet re-run and what they lack (``lacks``). GPU files wait for
    the next lent GPU (tests/test_figures.py lets a page quote one only beside these words)."""
    r = bench(name)
    if r.get("steady_steps", 0) >= MIN_STEPS and not r["commit"].endswith("+changes"):
        return ""
    return (f"These figures ({r['date']}, commit {r['commit']}) are not yet re-run with the timing that holds: "
            f"{lacks}; the next lent GPU re-runs them (`{r['command'].split(' --out')[0]}`).")


def run_on_a_gpu() -> None:
    """Cog: the README's GPU bullet: the gpu suite's card and its ceiling on data on the GPU, then the student's
    job from JPEG files (benchmarks/results/student_job.json) as shares of its own card's ceiling."""
    shares = {loader: " / ".join(f"{{f[kit][{loader}-{c}][steady_of_eager_ceiling]:pc}}" for c in (4, 8, 16))
              for loader in ("workers", "nvjpeg")}
    workers = " / ".join(f"{{f[kit][workers-{c}][steady_of_eager_ceiling]:pc}}" for c in (4, 8))
    jpeg = fill("student_job", "on an {f[gpu]}, from JPEG files, `--loader workers` gets " + workers
                + " of its ceiling on 4 / 8 cores (16's is its prefetch), `--loader nvjpeg` "
                + shares["nvjpeg"] + " on 4 / 8 / 16"
                + " ([figures](docs/benchmarks.md#the-students-job-on-one-gpu)).")
    pending = (" These GPU figures are not yet re-run over a steady window of 200 steps." if
               rerun_pending("student_job", "-") or rerun_pending("gpu_peak", "-") else "")
    say("gpu_peak", "* **Run on a GPU**: the `gpu`-marked tests pass on an {f[gpu]}, where the kit's step trains "
        "ResNet-18 at {f[models][resnet18][img_s]:.0f} img/s on data on the GPU "
        "([figures](docs/benchmarks.md#one-gpu-against-its-peak)); {jpeg}{pending}", hang=2, jpeg=jpeg,
        pending=pending)


def _paragraph(text: str, hang: int = 0) -> None:
    _out(textwrap.fill(" ".join(text.split()), WIDTH, subsequent_indent=" " * hang, break_on_hyphens=False,
                       break_long_words=False))


def table(name: str, rows: list[str] | None = None, apart: bool = False) -> None:
    """Cog: the benchmark's own Markdown table, or ``rows`` (templates) filled with its figures (``apart``: with a
    blank line before and after, between two paragraphs)."""
    text = "\n".join(fill(name, row) for row in rows) if rows else "\n".join(bench(name)["table"])
    _out(f"\n{text}\n" if apart else text)


# -- sentences whose words depend on the figures ------------------------------------------------------
def faster(ratio: float, than: str = "one rank") -> str:
    """'faster than one rank' / 'slower than one rank' / 'as fast as one rank'."""
    if abs(ratio - 1) < 0.03:
        return f"about as fast as {than}"
    return f"{'faster' if ratio > 1 else 'slower'} than {than}"


def chose(name: str, key: str) -> str:
    """What ``--comm auto`` chose in the runs of ``key``: '`localsgd`', or '`fp16` in some runs and `localsgd` in
    the others' where the seeds' probes fell on either side of a threshold."""
    found = [f"`{c}`" for c in bench(name)["figures"][key]["chose"]]
    return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} in some runs and {found[-1]} in the others"


def auto_against_none(name: str = "comm_hooks-auto", link: str = "1gbit") -> dict:
    """``comm=auto`` against ``none`` on one link, seed by seed: ``diff`` (Acc@1 points, auto minus none, a seed
    each), ``speed_ok`` (auto at SPEED_MARK or more of the unshaped link's images/s), ``acc_ok`` (the mean paired
    difference at least ACC_MARK points)."""
    f = bench(name)["figures"]
    auto, none = f[f"{link}/auto"], f[f"{link}/none"]
    diff = [a - n for a, n in zip(auto["acc1"]["values"], none["acc1"]["values"])]
    return {"diff": diff, "speed_ok": auto["of_unshaped"]["mean"] >= SPEED_MARK,
            "acc_ok": sum(diff) / len(diff) >= ACC_MARK}


# Issue 36's marks for compressed gradients over 1 Gbit: at least this share of the unshaped link's images/s, and a
# paired Acc@1 difference to exact DDP of at least this many points (with a paired loss difference whose 90 %
# interval includes 0)
SPEED_MARK, ACC_MARK = 0.90, -0.5


def interval90(values: list[float]) -> tuple[float, float]:
    """The 90 % t-interval of the mean of ``values`` (two or more)."""
    import statistics

    from scipy import stats
    half = stats.t.ppf(0.95, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return statistics.mean(values) - half, statistics.mean(values) + half


def variants_against_none(name: str, link: str = "1gbit") -> list[dict]:
    """Each compressed run of ``link`` against exact DDP on it, seed by seed: ``key``, ``speed`` (of the unshaped
    link's images/s), ``acc`` (paired Acc@1 points), ``loss`` (paired validation loss) and its 90 % interval,
    ``speed_ok``, ``acc_ok`` (both of issue 36's marks: ``acc_ok`` needs the loss interval to include 0 too)."""
    out = []
    for key, row in bench(name)["figures"].items():
        if not key.startswith(f"{link}/") or key == f"{link}/none" or "acc1_vs_none" not in row:
            continue
        low, high = interval90(row["val_loss_vs_none"]["values"])
        out.append({"key": key.split("/", 1)[1], "speed": row["of_unshaped"]["mean"],
                    "acc": row["acc1_vs_none"]["mean"], "acc_std": row["acc1_vs_none"]["std"],
                    "loss": row["val_loss_vs_none"]["mean"], "loss_low": low, "loss_high": high,
                    "speed_ok": row["of_unshaped"]["mean"] >= SPEED_MARK,
                    "acc_ok": row["acc1_vs_none"]["mean"] >= ACC_MARK and low <= 0 <= high})
    return out


def variants_verdict(name: str, link: str = "1gbit") -> str:
    """A sentence per compressed run: its speed and paired differences, and which of issue 36's marks it meets."""
    parts = []
    for v in variants_against_none(name, link):
        marks = {(True, True): "both marks met", (True, False): f"{SPEED_MARK:.2f}x met, the accuracy mark missed",
                 (False, True): f"accuracy kept, {SPEED_MARK:.2f}x missed"}.get((v["speed_ok"], v["acc_ok"]),
                                                                                  "both marks missed")
        parts.append(f"`{v['key']}` {v['speed']:.2f}x the unshaped link, Acc@1 {v['acc']:+.2f} +- {v['acc_std']:.2f} "
                     f"points against `none`, validation loss {v['loss']:+.3f} (90 % interval {v['loss_low']:+.3f} "
                     f"to {v['loss_high']:+.3f}): {marks}")
    return "; ".join(parts)


# Issue 46's non-inferiority marks for compressed gradients, judged on seeds never used to choose a setting: the mean
# paired Acc@1 difference and the lower end of its 90 % interval, the upper end of the paired validation loss's,
# and the share of the unshaped link's images/s
NONINFERIOR = {"acc_mean": -0.5, "acc_low": -1.0, "loss_high": 0.03, "speed": 0.90}


def noninferiority(names: str | list[str], key: str, link: str = "1gbit") -> dict:
    """``key`` (e.g. 'powersgd') against exact DDP on ``link``, seed by seed, over the seeds of one results file or
    of several (a study run in parts: each seed's runs are side by side in one file, so its paired figures hold):
    the four figures NONINFERIOR marks, whether each is met (``ok``: a dict), the number of seeds, and ``verdict``."""
    acc, loss, speed = [], [], []
    for name in [names] if isinstance(names, str) else names:
        row = bench(name)["figures"][f"{link}/{key}"]
        acc += row["acc1_vs_none"]["values"]
        loss += row["val_loss_vs_none"]["values"]
        speed += row["of_unshaped"]["values"]
    acc_low, _ = interval90(acc)
    _, loss_high = interval90(loss)
    got = {"acc_mean": sum(acc) / len(acc), "acc_low": acc_low, "loss_high": loss_high,
           "speed": sum(speed) / len(speed)}
    ok = {k: (got[k] <= mark if k == "loss_high" else got[k] >= mark) for k, mark in NONINFERIOR.items()}
    missed = [k for k, met in ok.items() if not met]
    words = {"acc_mean": "the mean Acc@1 difference", "acc_low": "its 90 % lower bound",
             "loss_high": "the validation loss's upper bound", "speed": f"{NONINFERIOR['speed']:.2f}x"}
    verdict = ("non-inferior on every mark" if not missed else
               "not shown non-inferior: " + ", ".join(words[k] for k in missed) + " missed")
    return {**got, "ok": ok, "seeds": len(acc), "verdict": verdict, "acc_sd": statistics.stdev(acc),
            "seeds_needed": seeds_needed(statistics.mean(acc), statistics.stdev(acc), NONINFERIOR["acc_low"])}


def seeds_needed(mean: float, sd: float, mark: float) -> int | None:
    """How many seeds a study needs for its 90 % lower bound to reach ``mark`` if its paired differences keep this
    ``mean`` and ``sd`` (a study's power, for the pages); None when the mean itself is under the mark."""
    from scipy import stats
    if mean <= mark:
        return None
    n = 2
    while stats.t.ppf(0.95, n - 1) * sd / n ** 0.5 > mean - mark:
        n += 1
    return n


def best_variant(name: str, meets: str, link: str = "1gbit") -> str:
    """Among the compressed runs that meet issue 36's ``meets`` mark ("acc" or "speed"), the fastest (for "acc") or
    the most accurate (for "speed"), in words; "none" when no run meets it."""
    found = [v for v in variants_against_none(name, link) if v[f"{meets}_ok"]]
    if not found:
        return "none of these runs"
    v = max(found, key=lambda v: v["speed"] if meets == "acc" else v["acc"])
    return f"`{v['key']}` ({v['speed']:.2f}x, {v['acc']:+.2f} points)"


def releases(template: str) -> None:
    """Cog: ``template`` with the probes of every benchmarks/results/torch_releases-*.json (one per torch release):
    {releases} '2.6.0, 2.7.1, ...', {hung} '2 of 3 on 2.6.0, 2.7.1; 0 of 3 on ...', {agrees}, {machine} (the
    hardware, and the releases probed beside other load)."""
    runs = sorted((bench(p.stem) for p in RESULTS.glob("torch_releases-*.json")),
                  key=lambda r: tuple(int(x) for x in re.findall(r"\d+", r["figures"]["release"])[:3]))
    by_count: dict[str, list[str]] = {}
    for r in runs:
        f = r["figures"]
        by_count.setdefault(f"{f['destroy_hung']} of {f['destroy_runs']}", []).append(f["release"])
    hung = "; ".join(f"{count} on {', '.join(found)}" for count, found in by_count.items())
    wrong = [r["figures"]["release"] for r in runs if not r["figures"]["compat_agrees"]]
    agrees = "it did on each" if not wrong else f"it did not on {', '.join(wrong)}"
    machines = {hardware(r["machine"]) for r in runs}
    busy = [f"{r['figures']['release']} ({r['other_processes_cores']:.1f})" for r in runs
            if r["other_processes_cores"] >= 0.2]
    machine = "a " + " / a ".join(sorted(machines)) + (f"; other processes used cores (in brackets) beside "
                                                      f"{', '.join(busy)}" if busy else "")
    text = template.format(releases=", ".join(r["figures"]["release"] for r in runs), hung=hung, agrees=agrees,
                           machine=machine)
    _paragraph(text)


# -- the walkthrough's data steps: lab/data.md's time plan ------------------------------------------------
GP3_MB_S = 125           # a gp3 volume's default throughput (MB/s): what a node's disk writes at most
IMAGENET_GB, SUBSET_GB = 147, 14
DOWNLOAD_H = 0.75        # Kaggle's 155 GB zip: 0.5-1 h, an estimate (its speed varies), the middle taken
BUILD_H = 0.25           # docker/run.sh --build: NGC's ~20 GB image, 10-20 min, an estimate


def data_steps() -> dict[str, dict[str, float]]:
    """Minutes of each data step for ImageNet and for the 100-class subset: the rates benchmarks/data_prep.py
    measured, scaled to the files; a write bounded by a gp3 volume's throughput where that is slower."""
    f = bench("data_prep")["figures"]
    # the subset's route (lab/data.md, g4dn.xlarge) unpacks its classes (about 128,000 files, 14 GB) and all of val
    # (50,000, 6.4 GB), sorts all of val, links the subset, and checks and copies the subset (a tenth of ImageNet)
    unpacked = {"imagenet": (1.0, IMAGENET_GB), "subset": ((128_000 + 50_000) / 1_331_167, SUBSET_GB + 6.4)}
    kept = {"imagenet": (1.0, IMAGENET_GB), "subset": (0.1, SUBSET_GB)}
    def no_faster_than_gp3(minutes: float, gb: float) -> float:
        return max(minutes, gb * 1000 / GP3_MB_S / 60)
    out = {}
    for kind in ("imagenet", "subset"):
        (share_in, gb_in), (share, gb) = unpacked[kind], kept[kind]
        steps = out[kind] = {
            "unpack": no_faster_than_gp3(f["unzip"]["imagenet_minutes"] * share_in, gb_in),
            "sort val": f["sort val"]["imagenet_minutes"],   # all 50,000 validation images, on either route
            "subset": f["subset (hard links)"]["imagenet_minutes"] if kind == "subset" else 0.0,
            "check": f["check (list every file)"]["imagenet_minutes"] * share,
            "copy": no_faster_than_gp3(f["copy (tar to tar)"]["imagenet_minutes"] * share, gb),
        }
        node1 = DOWNLOAD_H + BUILD_H + sum(steps.values()) / 60
        node2 = BUILD_H + (steps["copy"] + steps["check"]) / 60
        steps["node-hours"] = node1 + node2
    return out


PATH_ROWS = [   # lab/README.md's path table: (you have, price a node-hour, data set, the rest of the row's cells)
    ("2 x g4dn.2xlarge ($0.752 per hour; T4, 8 vCPUs): the course's", 0.752, "imagenet",
     "(a) ImageNet from Kaggle | steps 0-10 | 6 | `/data/imagenet`",
     "4.9 h, $3.68 (with `WORKERS = 2`; 6 is faster) | 1 h\\*, $0.75\\* | 1-10 and 12; 11, 13, 14 optional"),
    ("2 x g4dn.xlarge ($0.526 per hour; T4, 4 vCPUs)", 0.526, "subset",
     "the 100-class subset from the zip ([data.md](data.md#on-a-g4dnxlarge-the-subset-straight-from-the-zip)) | "
     "steps 0-10, that section for step 2 (a) | 3 | `/data/imagenet-100`",
     "0.5 h\\*, $0.26\\* | 0.5 h\\*, $0.26\\* | as above"),
    ("2 x g5.2xlarge (about $1.20 per hour; A10G, 8 vCPUs)", 1.20, "imagenet",
     "(a) ImageNet from Kaggle | steps 0-10 | 6 | `/data/imagenet`",
     "2 h\\*, $2.40\\* | 1 h\\*, $1.20\\* | as above"),
    ("2 A10 nodes elsewhere (e.g. $0.75 per hour; 30 vCPUs, one local disk)", 0.75, "imagenet",
     "(a), onto the local disk | [nodes.md](nodes.md#a10-nodes-off-aws) for step 1 | 24 | `/data/imagenet`",
     "1.5 h\\*, $1.13\\* | 1 h\\*, $0.75\\* | as above"),
]


def path_table() -> None:
    """Cog: lab/README.md's path table, whose *data* column is lab/data.md's node-hours (data_steps: one source)
    and each row's dollars those hours times its price."""
    steps = data_steps()
    rows = ["| you have | data (step 2) | read | `WORKERS` | `DATA_DIR` | data | runs | questions | questions to answer |",
            "| --- | --- | --- | ---: | --- | --- | --- | --- | --- |"]
    for have, price, kind, middle, rest in PATH_ROWS:
        hours = round(steps[kind]["node-hours"], 1)
        rows.append(f"| {have} | {middle} | {hours:.1f} h\\*, ${hours * price:.2f}\\* | {rest} |")
    rows.append("| a laptop, no GPU | the bundled `demo` digits | step 0, then questions 12-14 | 0 | `../data/demo` | "
                "none, $0 | minutes, $0 | your own time, $0 | 12, 13, 14 (1-10 need the nodes) |")
    _out("\n".join(rows))


DISK_DOLLARS_A_DAY = 300 * 0.08 / 30   # a node's 300 GB gp3 root volume at $0.08 per GB and month
BUDGET_DAYS = 7                        # the disks of both nodes for a week: the homework's usual span


def budgets() -> dict[str, int]:
    """Each AWS row's budget (step 1's ``nodes.py budget --dollars``): the row's dollars (data, runs, questions)
    plus both disks for BUDGET_DAYS, rounded up to the next $5."""
    steps, out = data_steps(), {}
    for have, price, kind, _middle, rest in PATH_ROWS:
        if "elsewhere" in have:
            continue   # not AWS: the provider's own alarms
        row = round(steps[kind]["node-hours"], 1) * price + sum(float(d) for d in re.findall(r"\$(\d+\.\d+)", rest))
        total = row + 2 * DISK_DOLLARS_A_DAY * BUDGET_DAYS
        out[re.search(r"g\w+\.\w+", have).group()] = int(-(-total // 5) * 5)
    return out


def budget_sentence() -> None:
    """Cog: the sentence under step 1's budget command, one amount per AWS row."""
    amounts = ", ".join(f"{kind} ${dollars}" for kind, dollars in budgets().items())
    _out(textwrap.fill(
        f"`BUDGET`: your row's dollars plus both disks for a week (${2 * DISK_DOLLARS_A_DAY * BUDGET_DAYS:.2f}), "
        f"rounded up: {amounts}. AWS e-mails you at 80 % of it and when it forecasts more.", WIDTH))


def data_plan() -> None:
    """Cog: lab/data.md's table of the data steps, per data set, with the node-hours they add up to."""
    s = data_steps()
    def minutes(kind: str, step: str) -> str:
        m = s[kind][step]
        return f"{m:.0f} min" if m >= 1 else "under 1 min"
    rows = ["| step | on | ImageNet (g4dn.2xlarge, g5.2xlarge, A10 elsewhere) | the subset (g4dn.xlarge) | how it is known |",
            "| --- | --- | ---: | ---: | --- |",
            "| download Kaggle's zip (155 GB) | node 1 | 0.5-1 h\\* | 0.5-1 h\\* | an estimate: Kaggle's speed varies |",
            f"| unpack (`unzip`) | node 1 | {minutes('imagenet', 'unpack')} | {minutes('subset', 'unpack')} | "
            f"the rate above, or {GP3_MB_S} MB/s of gp3 where slower |",
            f"| sort val | node 1 | {minutes('imagenet', 'sort val')} | {minutes('subset', 'sort val')} | the rate above |",
            f"| make the subset (hard links) | node 1 | - | {minutes('subset', 'subset')} | the rate above |",
            "| `docker/run.sh --build` (NGC's image, about 20 GB) | each node | 10-20 min\\* | 10-20 min\\* | "
            "an estimate |",
            f"| the kit's check (lists every file) | each node | {minutes('imagenet', 'check')} | "
            f"{minutes('subset', 'check')} | the rate above |",
            f"| copy to node 2 (`tar \\| ssh`) | both | {minutes('imagenet', 'copy')} | {minutes('subset', 'copy')} | "
            f"the rate above, or {GP3_MB_S} MB/s of gp3 where slower |",
            f"| **node-hours in all** | | **{s['imagenet']['node-hours']:.1f} h\\*** | "
            f"**{s['subset']['node-hours']:.1f} h\\*** | the download and the build taken at their middle |"]
    _out("\n".join(rows))

"""The kit's output that the pages quote, recorded from real runs and pasted by one command.

Every ```text block of README.md, docs/*.md, lab/*.md and notebooks/lesson.md that shows what the
kit prints sits between cog markers (HTML comments, so GitHub renders only the fence)::

    <!-- [[[cog quote("demo") ]]] -->
    ```text
    ...
    ```
    <!-- [[[end]]] -->

and the figures the prose takes from the same run (speed-up, per-step ms, final Acc@1) are generated the
same way. The lines come from ``docs/output/NAME.txt``, written by a real run of the command in RUNS.

**After changing a line the kit prints**, re-record and re-paste (on an otherwise idle machine: the
pages name it and quote its timings)::

    python docs/quotes.py record            # all of RUNS (a few minutes on 2 cores); or: record check docker
    python docs/quotes.py pages             # = cog -r -p "from docs.quotes import *; from docs import figures"
                                            #   README.md docs/*.md lab/*.md notebooks/lesson.md
    python docs/quotes.py check             # only says whether a page is out of date (cog --check)

**After changing only the epoch line's or the results table's format**, one command, on any machine: nothing
is run, those lines are rendered again from the records each recording keeps (docs/output/NAME.facts.json,
see docs/facts.py), so the pages keep the idle recording's figures::

    python docs/quotes.py reformat          # then pastes the pages
    python -m pytest tests/test_quotes.py   # pages in sync; the slow tier re-runs the commands

A new quoted block: add its command to RUNS (or a view of a recorded one to QUOTES), record it, put the
markers in the page, run ``pages``. A block this machine cannot produce (a GPU node's) stays hand-written
after an ``<!-- illustrative: ... -->`` comment; the fast tests then require each of its lines to have the
shape of a line in docs/output/ or be listed in tests/test_quotes.py's GPU_ONLY.

``tests/test_quotes.py`` fails while a page and ``docs/output/`` disagree (fast tier), and while a
command prints lines other than the recorded ones, digits, paths and ports aside (slow tier).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import string
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / "docs" / "output"
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")),
         *sorted(f"lab/{p.name}" for p in (REPO / "lab").glob("*.md")),
         "notebooks/lesson.md"]


# -- what is run -----------------------------------------------------------------------------------
@dataclass
class Run:
    """One or more processes started together (``{tmp}`` a fresh folder, ``{port}`` a free port).

    ``procs`` maps each recorded output's NAME to its argv; ``shown`` is the path/port the pages show
    in place of each temporary one. ``cwd`` is relative to the repository; ``{tmp}`` allowed."""
    procs: dict[str, list[str]]
    cwd: str = "."
    env: dict[str, str | None] = field(default_factory=dict)   # None: unset
    shown: dict[str, str] = field(default_factory=dict)
    stagger: float = 1.0        # seconds between starting the processes (rank 0 listens first)
    timeout: float = 600
    before: list[list[str]] = field(default_factory=list)   # run first, to completion, not recorded
    drop: str = ""              # a regex: lines that are not the kit's (a library's warning), left out
    action: Callable[[dict, str], None] | None = None   # done to the running processes (procs by NAME, tmp)
    returncode: int = 0         # what every process must exit with
    compare: Callable[[list[str]], list[str]] = lambda lines: lines   # the lines the slow tests compare


WIDTH = 115     # the pages' prose lines
PY = "python"   # replaced by sys.executable when run
LAUNCH = ["--nproc-per-node", "2", "--master-port", "{port}", "--dataset", "fake", "--image-size", "32", "--workers", "0",
          "--wandb", "disabled", "--batch-size", "8", "--max-steps-per-epoch", "2", "--no-link-probe"]
RUNS: dict[str, Run] = {
    # step 0 of the walkthrough, README's table, the link probe of docs/time-split.md
    "demo": Run({"demo": [PY, "-m", "ddp_utils", "demo", "--run-dir", "{tmp}/runs/demo"]},
                shown={"{tmp}/": ""}),
    # step 8: the report of the demo's two runs (run after "demo", in the same {tmp})
    "report": Run({"report": [PY, "-m", "ddp_utils", "report", "{tmp}/runs/demo/*-ddp2", "{tmp}/runs/demo/*-single"]},
                  cwd="{tmp}", shown={"{tmp}/": ""}),
    # step 5: both ranks' checks on loopback
    "check": Run({f"check-rank{r}": [PY, "-m", "ddp_utils", "check", "--master-addr", "127.0.0.1", "--master-port",
                                     "{port}", "--world-size", "2", "--rank", str(r)] for r in (0, 1)},
                 shown={"{port}": "29611"}, timeout=120),
    # step 6: main.ipynb and worker.ipynb cell by cell on the demo data, as a student runs them
    "notebooks": Run({f"notebook-{nb}": [PY, "-m", "tests.helpers.run_cells", f"notebooks/{nb}.ipynb",
                                         '{"EPOCHS": 1, "MAX_STEPS": 3, "WORKERS": 0, "BACKEND": "gloo", '
                                         '"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": {port}, "INIT_TIMEOUT": 120, '
                                         '"WANDB_MODE": "disabled", "TENSORBOARD": false, "RUN_DIR": "{tmp}/runs/ddp"}',
                                         "{}", "notebooks"] for nb in ("main", "worker")},
                     env={"OMP_NUM_THREADS": None}, shown={"{tmp}/": "../", "{port}": "29677"},
                     drop=r"MissingIDFieldWarning|^  _validate\(", stagger=3.0, timeout=300),
    # question 9: a resume on one machine (a 1-epoch run first, then 2 epochs from its last.pt)
    "resume": Run({"resume": [PY, "-m", "ddp_utils", "launch", *LAUNCH, "--run-dir", "{tmp}/rs", "--epochs", "2",
                              "--resume", "{tmp}/rs/last.pt"]},
                  before=[[PY, "-m", "ddp_utils", "launch", *LAUNCH, "--run-dir", "{tmp}/rs", "--epochs", "1"]],
                  shown={"{tmp}/": "", "{tmp}": ".", "{port}": "29691"}, timeout=300),
    # docs/commands.md: launch when the out-of-memory killer takes rank 1 (we kill -9 it once last.pt is written)
    "launch-kill": Run({"launch-kill": [PY, "-m", "ddp_utils", "launch", *LAUNCH, "--run-dir", "{tmp}/oom",
                                        "--epochs", "50"]},
                       action=lambda procs, tmp: _kill_rank1(procs["launch-kill"], Path(tmp, "oom", "last.pt")),
                       shown={"{tmp}/": "", "{port}": "29612"}, returncode=2, timeout=300,
                       compare=lambda lines: _from(lines, "error: rank 1 failed")[:2]),
    # (the rest depends on how far the ranks got when the kill came, and whether rank 0 stopped by itself)
    # step 3: the docker command
    "docker": Run({"docker": ["docker/run.sh", "--print"]}, env={"DATA": "/tmp"},
                  shown={str(REPO): "/home/ubuntu/ddp-kit"}, timeout=30),
}


def _from(lines: list[str], start: str) -> list[str]:
    return lines[next(i for i, line in enumerate(lines) if line.startswith(start)):]


def _kill_rank1(launcher: subprocess.Popen, checkpoint: Path) -> None:
    """SIGKILL the launcher's rank 1 (a process of the torchrun it started) once the first checkpoint exists."""
    deadline = time.monotonic() + 240
    while not checkpoint.exists():
        if time.monotonic() > deadline or launcher.poll() is not None:
            raise RuntimeError(f"no {checkpoint} in time")
        time.sleep(0.2)
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    for pid, ppid in parents.items():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if parents.get(ppid) == launcher.pid and b"RANK=1" in environ:   # launcher -> torchrun -> rank 1
            os.kill(pid, 9)
            return
    raise RuntimeError("the launcher's rank 1 was not found")


# Phrases the kit prints only sometimes, for the shape comparison of the slow tests (a recorded run and
# a fresh one may differ in them without a printed line having changed).
VARIABLE = [
    (re.compile(r" \(\d+ ms for one rank alone: these ranks share a machine\)"), ""),   # linkprobe.describe
    (re.compile(r"(?<=: )[\w-]+-bound(?=:)"), "BOUND"),                                # the report's bottleneck
    (re.compile(r"ddp_utils-launch-[\w-]+"), "ddp_utils-launch-LOGS"),                 # launch's temporary log folder
]


def _expand(text: str, tmp: str, port: int) -> str:
    return text.replace("{tmp}", tmp).replace("{port}", str(port))


def execute(name: str, tmp: str, wrap=None, extra_env: dict | None = None) -> dict[str, str]:
    """Run RUNS[name] for real in ``tmp``; every process's output, temporary paths shown as the pages do.
    ``wrap(argv, env)``: how each process is started (the tests fork them from their fork server, tests/helpers/zygote.py);
    ``extra_env``: variables the tests add (torchrun's PYTHON_EXEC)."""
    wrap = wrap or (lambda argv, env: argv)
    import glob
    import socket
    run = RUNS[name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "WANDB_API_KEY",
                        "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env.update(WANDB_SILENT="true", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")   # as the tests run the kit
    env.update(extra_env or {})
    for k, v in run.env.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    cwd = REPO / _expand(run.cwd, tmp, port)
    def argv_of(argv: list[str]) -> list[str]:
        args = []
        for a in argv:
            a = sys.executable if a == PY else _expand(a, tmp, port)
            args += sorted(glob.glob(a)) if "*" in a else [a]
        return args

    for argv in run.before:
        first = subprocess.run(wrap(argv_of(argv), env), cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=run.timeout)
        if first.returncode != 0:
            raise RuntimeError(f"{argv} exited {first.returncode}:\n{first.stdout}")
    procs = {}
    try:
        for i, (proc, argv) in enumerate(run.procs.items()):
            if i:
                time.sleep(run.stagger)
            args = argv_of(argv)
            if not run.action:   # an action finds its processes by their parents: those stay unwrapped
                args = wrap(args, env)
            procs[proc] = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True, start_new_session=True)
        deadline = time.monotonic() + run.timeout
        if run.action:
            run.action(procs, tmp)
        outs = {proc: p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for proc, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    for proc, p in procs.items():
        if p.returncode != run.returncode:
            raise RuntimeError(f"{proc} exited {p.returncode}:\n{outs[proc]}")
    return {proc: shown(run, out, tmp, port) for proc, out in outs.items()}


def shown(run: Run, text: str, tmp: str, port: int) -> str:
    for temporary, page in run.shown.items():
        text = text.replace(_expand(temporary, tmp, port), page)
    return "".join(line.rstrip() + "\n" for line in text.splitlines() if not (run.drop and re.search(run.drop, line)))


def command(name: str) -> str:
    """The command as the pages show it (temporary paths replaced)."""
    run = RUNS[name]
    lines = []
    for argv in run.procs.values():
        words = [a if a == PY else shown(run, _expand(a, "{tmp}", "{port}"), "{tmp}", "{port}").strip()
                 for a in argv]
        lines.append(" ".join(shlex.quote(w) if "*" not in w else w for w in words))
    env = " ".join(f"{k}={v}" for k, v in run.env.items() if v is not None)
    return " & ".join(f"{env} {line}".strip() for line in lines)


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}"


def record(names: list[str]) -> None:
    """Run RUNS' commands for real and write docs/output/NAME.txt (the demo's runs feed the report)."""
    OUTPUT.mkdir(exist_ok=True)
    if os.getloadavg()[0] > 0.5:
        print(f"warning: this machine is busy (load {os.getloadavg()[0]:.1f}); the pages quote these timings, "
              "and the demo's speed-up shows the load", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="ddp-quotes-") as tmp:
        for name in RUNS if not names else names:
            if name == "report" and not Path(tmp, "runs", "demo").is_dir():
                execute("demo", tmp)   # the report needs the demo's runs
            print(f"recording {name}: {command(name)}", flush=True)
            for proc, out in execute(name, tmp).items():
                head = (f"# {command(name)} | machine: {machine()} | "
                        f"{datetime.datetime.now().strftime('%Y-%m-%d')}\n")
                (OUTPUT / f"{proc}.txt").write_text(head + out, encoding="utf-8")
                keep_facts(proc, out.splitlines(), RUNS[name], tmp)
            if name == "report":
                kit_images(tmp)


def kit_images(tmp: str) -> None:
    """images/: the report's pictures and results.md of the same two demo runs the pages quote, so that images/ and
    the pages show one run's numbers (``report --kit-images``, run in the recording's folder: the paths it names are
    the pages' ``runs/demo/...``)."""
    import glob
    runs = [os.path.relpath(p, tmp) for pattern in ("*-ddp2", "*-single")
            for p in sorted(glob.glob(f"{tmp}/runs/demo/{pattern}"))]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "ddp_utils", "report", *runs, "--kit-images"], cwd=tmp, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"report --kit-images exited {out.returncode}:\n{out.stdout}")
    print(f"images/: {len(runs)} demo runs' report", flush=True)


def keep_facts(proc: str, lines: list[str], run: Run, tmp: str) -> None:
    """docs/output/PROC.facts.json: the records PROC's epoch lines and results table were printed from, and
    where they sit (docs/facts.py); temporary paths in them shown as the pages show them."""
    from docs import facts
    text = json.dumps(facts.runs_in(Path(tmp)))
    for temporary, page in run.shown.items():
        if "{port}" not in temporary:
            text = text.replace(_expand(temporary, tmp, 0), page)
    runs = json.loads(text.replace(tmp, "."))
    blocks = facts.find(lines, runs)
    used = {key for b in blocks for key in ([b["epoch"][0]] if "epoch" in b else b["table"])}
    path = OUTPUT / f"{proc}.facts.json"
    if blocks:
        path.write_text(json.dumps({"runs": {k: runs[k] for k in sorted(used)}, "blocks": blocks}, indent=1,
                                   sort_keys=True) + "\n", encoding="utf-8")
    else:
        path.unlink(missing_ok=True)


def reformat(procs: list[str]) -> list[str]:
    """Render each recorded output's epoch lines and results table again from its facts with the current code
    (nothing is run: the figures stay those of the recording); the outputs that changed."""
    from docs import facts
    changed = []
    for path in sorted(OUTPUT.glob("*.facts.json")):
        proc = path.name[:-len(".facts.json")]
        if procs and proc not in procs:
            continue
        head, lines = recorded(proc)
        new, kept = facts.reformat(lines, json.loads(path.read_text(encoding="utf-8")))
        if new != lines:
            changed.append(proc)
            (OUTPUT / f"{proc}.txt").write_text("\n".join([head, *new]) + "\n", encoding="utf-8")
            path.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return changed


def recorded(proc: str) -> tuple[str, list[str]]:
    """(the header comment, the output's lines) of docs/output/PROC.txt."""
    head, *lines = (OUTPUT / f"{proc}.txt").read_text(encoding="utf-8").splitlines()
    return head, lines


def shape(line: str) -> str:
    """A line with what differs between runs masked: every run of digits, the phrases of VARIABLE, and the width of
    the padding between a table's columns (a time of 10 ms takes a column one space more than one of 9 ms)."""
    for pattern, repl in VARIABLE:
        line = pattern.sub(repl, line)
    return re.sub(r"(?<=\S) {2,}", " ", re.sub(r"\d+", "#", line))


# -- how the pages show it ------------------------------------------------------------------------
def shorten_epochs(lines: list[str]) -> list[str]:
    """Keep epochs 1 to 3 and the last (each an `epoch` line and its indented lines); the others become `...`."""
    out, skipping = [], False
    for line in lines:
        m = re.match(r"epoch (\d+)/(\d+):", line)
        if m:
            was, skipping = skipping, 3 < int(m.group(1)) < int(m.group(2))
            if skipping and not was:
                out.append("...")
        elif not line.startswith("  "):
            skipping = False
        if not skipping:
            out.append(line)
    return out


def table(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("|")]


def _block(lines: list[str], start: str) -> list[str]:
    """The first line starting with ``start`` and the indented lines after it."""
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    end = next((i for i in range(first + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return lines[first:end]


def link_probe(lines: list[str]) -> list[str]:
    """The link probe's lines."""
    return _block(lines, "link probe:")


# NAME -> (recorded output, how the page shortens it)
QUOTES: dict[str, tuple[str, Callable[[list[str]], list[str]]]] = {
    "demo": ("demo", shorten_epochs),
    "demo-table": ("demo", table),
    "link-probe": ("demo", link_probe),
    "per-step": ("demo", lambda lines: _block(lines, "per step:")),
    "report": ("report", lambda lines: lines),
    "check-rank0": ("check-rank0", lambda lines: lines),
    "check-rank1": ("check-rank1", lambda lines: lines),
    "docker": ("docker", lambda lines: lines),
    "launch-kill": ("launch-kill", lambda lines: _from(lines, "error: rank 1 failed")),
    "resume": ("resume", lambda lines: [line for line in lines if re.match(r"rank 0: joined|=== resumed|resumed from", line)]),
}


def lines_of(name: str) -> list[str]:
    proc, view = QUOTES[name]
    return view(recorded(proc)[1])


def _out(text: str) -> None:
    import cog  # only while cog runs
    cog.outl(text)


def quote(name: str, intro: str = "", indent: int = 0) -> None:
    """Cog: the ```text block of QUOTES[name], after ``intro`` (a sentence; {where} names the machine);
    ``indent``: in a list item."""
    head = [textwrap.fill(intro.format(where=where(QUOTES[name][0]), **demo_figures()), WIDTH,
                          break_on_hyphens=False)] if intro else []
    _out("\n".join((" " * indent + line).rstrip() for line in [*head, "```text", *lines_of(name), "```"]))


def where(proc: str = "demo") -> str:
    """The machine and date the recorded output comes from, from its header line."""
    head, _ = recorded(proc)
    m = re.search(r"machine: (.*?), (\d+) cores, torch (\S+?)(?:, load ([\d.]+))? \| (\S+)", head)
    busy = f", load {m.group(4)}" if m.group(4) else ""
    return f"{m.group(2)}-core {m.group(1)} machine, torch {m.group(3)}{busy}, {m.group(5)}"


def table_rows(lines: list[str]) -> list[dict[str, str]]:
    """The rows of the first Markdown table in ``lines``, each a dict keyed by the header's column names (a page
    that read a column by position quoted another column once the table gained one: "Acc@1 145 %")."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table(lines)]
    header = rows[0]
    return [dict(zip(header, row, strict=True)) for row in rows[2:] if len(row) == len(header)]


def demo_figures() -> dict[str, str]:
    """The figures the prose takes from the recorded demo: speed-up, probe, per-step ms, batch, Acc@1."""
    lines = recorded("demo")[1]
    text = "\n".join(lines)
    ddp, single = table_rows(lines)[:2]
    probe = " ".join(line.strip() for line in link_probe(lines))
    compute = re.search(r"one step's compute (\d+) ms", probe).group(1)
    alone = re.search(r"\((\d+) ms for one rank alone", probe)
    batches = re.findall(r"global batch (\d+) = ", text)
    lrs = re.findall(r"lr [\d.]+ x \d+/\d+ = ([\d.]+)", text)
    return {"speedup": ddp["speed-up"], "predicted": re.search(r"about ([\d.]+x) one rank", probe).group(1),
            "share": re.search(r"up to (\d+ %) of a step", probe).group(1), "compute": compute,
            "alone": alone.group(1) if alone else "", "batch_ddp": batches[0], "batch_single": batches[1],
            "lr_ddp_line": re.search(r"lr [\d.]+ x \d+/\d+ = [\d.]+", text).group(0), "lr_single": lrs[1],
            "run_ddp": ddp["run"], "run_single": single["run"], "acc_ddp": ddp["Acc@1"], "acc_single": single["Acc@1"],
            "wall_ddp": ddp["wall time"], "wall_single": single["wall time"]}


def say(template: str, proc: str = "demo") -> None:
    """Cog: ``template`` with {speedup}, {predicted}, ... of demo_figures() and {where} filled in."""
    _out(textwrap.fill(template.format(where=where(proc), **demo_figures()), WIDTH))


def step0() -> None:
    """Cog: the lessons the walkthrough's step 0 draws from the recorded demo, with its figures."""
    f = demo_figures()
    lines = recorded("demo")[1]
    data = re.search(r"time: data (\d+%)", "\n".join(lines)).group(1)
    cores = re.search(r", (\d+) cores,", recorded("demo")[0]).group(1)
    slower = (f"each slower than one alone ({f['compute']} ms against {f['alone']} ms a step)" if f["alone"] else
              "often each slower than one alone (the probe prints both step times when they differ by over 10 %; "
              "in this run they did not)")
    end = (f"both runs end at {f['acc_ddp']} %" if f["acc_ddp"] == f["acc_single"] else
           f"the runs end at {f['acc_ddp']} % (DDP) and {f['acc_single']} % (single)")
    speed, batch = f"""Two lessons are already in this output (recorded on a {where()}). **Speed:** this machine has {cores} CPU
cores, and the demo gives every process one thread, so each rank had a core of its own, as each cloud node has its
own GPU, and the single run stands for one node: {f['speedup']}, not 2x. The link probe predicted {f['predicted']}
before training: the all-reduce is small here ({f['share']} of a step), but two processes computing at once on one
machine are {slower}, and each rank also decodes its own PNGs (`time: data {data}`). Run it while something else
loads the cores and DDP can even be slower than one process: DDP only helps when every rank gets its own device.""", f"""**Batch and learning rate:** both runs use the demo preset's recipe (lr 0.8 for a global batch of 256, half an
epoch of warm-up). DDP's global batch is twice as big ({f['batch_ddp']} against {f['batch_single']}), so it took
half as many optimizer steps per epoch, and the kit doubled its learning rate (`{f['lr_ddp_line']}` against
`{f['lr_single']}`). The bigger steps can make its early epochs unstable (look at its validation loss in the
first epochs: the BatchNorm running statistics lag behind the fast-moving weights), but it caught up: {end}.
You will meet both questions again on ImageNet."""
    keep = f": {f['speedup']}, not 2x"   # one phrase, never broken across lines (tests/test_lab.py looks for it)
    speed = " ".join(speed.split()).replace(keep, keep.replace(" ", "\ue000"))
    _out("\n".join(textwrap.fill(" ".join(text.split()), WIDTH).replace("\ue000", " ") for text in (speed, batch)))


def cell_output(proc: str) -> dict[int, list[str]]:
    """A notebook's recorded output by cell: tests/run_cells prints `CELL n: ok` after each cell's output."""
    cells, current = {}, []
    for line in recorded(proc)[1]:
        m = re.fullmatch(r"CELL (\d+): ok", line)
        if m:
            cells[int(m.group(1))], current = current, []
        else:
            current.append(line)
    return cells


class _Cells(string.Formatter):
    """``{m7_start-up}``: main.ipynb's cell 7, its first output line that starts with `start-up`, in backticks;
    ``{m7_epoch+1}`` the line after the first that starts with `epoch`; ``{w6_resume}`` worker.ipynb's (a line
    named by its start stays right when the cell prints a line more before it, where an index would not);
    ``{m7_link:cut}`` only up to the first `: ` (then `...`), ``{m7_rank:cut2}`` up to the second."""
    def __init__(self):
        self.out = {"m": cell_output("notebook-main"), "w": cell_output("notebook-worker")}

    def get_value(self, key, args, kwargs):
        nb, cell, start, after = re.fullmatch(r"([mw])(\d+)_([\w -]+?)(?:\+(\d+))?", key).groups()
        lines = [text.strip() for text in self.out[nb][int(cell)]]
        first = next(i for i, text in enumerate(lines) if text.startswith(start))   # StopIteration if none does
        return lines[first + int(after or 0)]

    def format_field(self, value, spec):
        if spec.startswith("cut"):   # cut, cut2: keep up to the first (second) ": "
            end = -1
            for _ in range(int(spec[3:] or 1)):
                end = value.index(": ", end + 1)
            value = value[:end + 2] + "..."
        return "`" + value.replace("|", "\\|") + "`"


# Step 6 of the walkthrough: (cell, what it prints, what it means), from the recorded notebooks.
CELLS = [
    ("Settings", "{m2_global} then {m2_global+1}", "the global batch, the lr really used, the rest of the recipe"),
    ("1. Join the process group", "{m3_rank 0+2} (before it: the interface chosen, rank 0 listening)",
     "both ranks are in, and their settings agree"),
    ("2. The data", "{m4_CPU+1} then {m4_this}",
     "each rank's share of the data: half the steps `single.ipynb` takes (`MAX_STEPS = 3` cuts both to 3 here)"),
    ("3. The model", "{m5_parallel}", "DDP copied rank 0's weights to rank 1"),
    ("4. The run folder", "{m6_Run:cut}, then the layer table (rank 1: {w6_resume:cut})",
     "rank 0 writes the run folder, rank 1 nothing"),
    ("5. Train", "a progress bar, then {m7_epoch} and {m7_epoch+1} (before: the watch and the link probe; after: "
     "{m7_start-up:cut} and {m7_per:cut})", "global metrics, throughput, where the time went"),
    ("Results", "{m8_global}, then a key a line: {m8_global+1}, {m8_global+2} ... (rank 1: the same)",
     "**the same accuracy and loss on both ranks**"),
]


def cells() -> None:
    """Cog: step 6's table of what each cell of main.ipynb prints."""
    fmt = _Cells()
    intro = textwrap.fill(f"What each cell prints. Real output on a {where('notebook-main')} (both notebooks on the "
                          "demo data, `EPOCHS = 1`, `MAX_STEPS = 3`, `WORKERS = 0`), rank 0 unless marked:", WIDTH)
    rows = [intro, "", "| cell | rank 0 (main.ipynb) | what it means |", "| --- | --- | --- |"]
    rows += [f"| {cell} | {fmt.format(printed)} | {meaning} |" for cell, printed, meaning in CELLS]
    rows.append("| results table and curves, TensorBoard, teardown | the table, the curves, the time split and what "
                "bound the run; TensorBoard (rank 0) | |")
    _out("\n".join(rows))


def recipes() -> None:
    """Cog: docs/commands.md's table of every preset's recipe and loaders, made from ddp_utils/presets.py."""
    from ddp_utils.loaders import recipe_table
    _out(recipe_table())


def pages(check: bool = False) -> int:
    from cogapp import Cog
    argv = ["cog", "--check" if check else "-r", "-p", "from docs.quotes import *; from docs import figures",
            *PAGES]
    if check:
        argv.insert(2, "--diff")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return Cog().main(argv)
    finally:
        os.chdir(cwd)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    what, *rest = sys.argv[1:] or ["-h"]
    if what == "record":
        record(rest)
    elif what == "reformat":
        for proc in reformat(rest):
            print(f"reformatted docs/output/{proc}.txt")
        sys.exit(pages())
    elif what == "pages":
        sys.exit(pages())
    elif what == "check":
        sys.exit(pages(check=True))
    else:
        print(__doc__.split("\n\n**After")[0] + "\n\nusage: python docs/quotes.py record [NAME ...] | reformat [NAME ...] | pages | check")

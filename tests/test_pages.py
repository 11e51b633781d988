"""Every page of the kit against the code: links and anchors, --flags and their defaults, parameter lists, prices.

The pages are the front-page README, docs/*.md, the walkthrough (lab/README.md), notebooks/lesson.md and
the notebooks' markdown cells and parameter comments. Each test reads files only (no process, no training):
the command-line flags come from ``ddp_utils``'s own argparse parser and from the ``add_argument`` calls of
the benchmark and lab scripts, read without running them.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers.notebook_cells import parameters
from tests.helpers.pages import MD_PAGES, NOTEBOOK_PAGES, PRICE, ROOT, notebook_text, pages, quoted_prices, rel

MAIN, SINGLE = ROOT / "notebooks" / "main.ipynb", ROOT / "notebooks" / "single.ipynb"

FENCE = re.compile(r"^\s*```[^\n]*\n.*?^\s*```[^\n]*$", re.M | re.S)


def test_the_pages_are_all_there():
    assert len(MD_PAGES) >= 9 and all(page.is_file() for page in MD_PAGES)
    assert len(NOTEBOOK_PAGES) == 8


# -- (1) every relative link and #anchor resolves ----------------------------------------------------
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def without_code(text: str) -> str:
    """The text without fenced blocks and inline code spans (a link written as code is not a link)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: its text (links as their text) lowercased, every character other than a
    letter, a digit, a space, ``-`` or ``_`` dropped, spaces turned into ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, with GitHub's ``-1``, ``-2`` ... for repeated ones."""
    seen: dict[str, int] = {}
    found = set()
    for match in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", FENCE.sub("", text), re.M):
        slug = github_anchor(match.group(1))
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_github_anchor_is_githubs():
    assert github_anchor("A slow link: local SGD and `comm=auto`") == "a-slow-link-local-sgd-and-commauto"
    assert github_anchor("5. Check both nodes: `python -m ddp_utils check`") == \
        "5-check-both-nodes-python--m-ddp_utils-check"
    assert github_anchor("7. Monitor: GPUs, TensorBoard, Weights & Biases") == "7-monitor-gpus-tensorboard-weights--biases"
    assert anchors("# Title\n## Part\n```\n# not a heading\n```\n## Part\n") == {"title", "part", "part-1"}


def broken_links(page: Path, text: str) -> list[str]:
    broken = []
    for target in LINK.findall(without_code(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{rel(page)}: {target} (no such file)")
        elif anchor:
            heads = anchors(file.read_text(encoding="utf-8") if file.suffix == ".md" else notebook_text(file))
            if anchor not in heads:
                broken.append(f"{rel(page)}: {target} (no heading of {rel(file)} has that anchor)")
    return broken


def test_every_relative_link_and_anchor_of_every_page_resolves():
    broken = [b for page, text in pages().items() for b in broken_links(page, text)]
    assert broken == [], "\n".join(broken)


# -- (2) every --flag a page names exists ---------------------------------------------------------------
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")   # --batch-size, --no-scale-lr, --net (of --net=host)

# Other programs' flags the pages use (not the kit's: not checked against its parsers).
EXTERNAL = {
    "docker": (r"\bdocker\b", {"--gpus", "--net", "--ipc", "--shm-size", "--rm", "--ulimit", "--build-arg"}),
    "tensorboard": (r"\btensorboard\b", {"--logdir", "--port", "--bind_all"}),
    "torchrun": (r"torchrun|torch\.distributed\.run", None),   # its own parser's flags (torchrun_flags)
    "pytest": (r"\bpytest\b", {"--basetemp"}),
    "papermill": (r"\bpapermill\b", {"--cwd"}),
    "pip": (r"\bpip install\b", {"--index-url"}),
    "nvidia-smi": (r"nvidia-smi", {"--query-gpu", "--format"}),
    "aws": (r"\baws (?:ec2|ssm)\b", {"--group-name", "--group-names", "--name", "--description", "--vpc-id",
                                     "--group-id", "--protocol", "--port",
                             "--cidr", "--source-group", "--strategy", "--image-id", "--instance-type", "--count",
                             "--key-name", "--security-group-ids", "--placement", "--block-device-mappings",
                             "--filters", "--query", "--output"}),
    "gcloud": (r"\bgcloud compute\b", {"--network", "--allow", "--source-tags", "--target-tags", "--tags"}),
    "rsync": (r"\brsync\b", {"--exclude"}),
    "wsl": (r"\bwsl\b", {"--install"}),
    "nvidia-ctk": (r"\bnvidia-ctk\b", {"--runtime"}),
}


def external(name: str) -> set[str]:
    """The flags of another program the pages name."""
    flags = EXTERNAL[name][1]
    return torchrun_flags() if flags is None else flags


def torchrun_flags() -> set[str]:
    """torchrun's flags, from torch's own parser."""
    from torch.distributed.run import get_args_parser
    return {flag for action in get_args_parser()._actions for flag in action.option_strings}


def kit_flags() -> dict[str, set[str]]:
    """``{subcommand: its option strings}`` of ``python -m ddp_utils``, from the parser itself."""
    from ddp_utils.tools.cli import build_parser

    parser = build_parser()
    [sub] = [a for a in parser._actions if a.choices and isinstance(a.choices, dict)]
    return {name: {s for action in p._actions for s in action.option_strings if s.startswith("--")}
            for name, p in sub.choices.items()}


def script_flags(path: Path) -> set[str]:
    """The ``--flags`` a script's argparse accepts, read from its ``add_argument`` calls (it is not run)."""
    flags = {"--help"}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "add_out":   # benchmarks/results.py's
            flags.add("--out")
    return flags


def scripts() -> dict[str, set[str]]:
    """``{path as written on a page: its flags}`` for the benchmarks, the lab's scripts (and its part (e), bench.py)
    and docker/run.sh."""
    found = {rel(p): script_flags(p) for p in [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "lab" / "scripts").glob("*.py"),
                                               ROOT / "lab" / "build_ddp" / "bench.py"]}
    usage = (ROOT / "docker" / "run.sh").read_text(encoding="utf-8").split("USAGE")[1]
    found["docker/run.sh"] = set(FLAG.findall(usage))
    return found


def test_the_flag_readers_find_the_flags():
    kit = kit_flags()
    assert {"train", "launch", "check", "demo", "report", "compare"} <= set(kit)
    assert {"--batch-size", "--no-link-probe", "--resume", "--seeds"} <= kit["train"]
    assert {"--rounds", "--steps"} <= scripts()["benchmarks/powersgd_cost.py"]
    assert {"--build", "--print"} <= scripts()["docker/run.sh"]
    assert {"--hosts", "--rate", "--ranks", "--max-mib"} <= scripts()["lab/build_ddp/bench.py"]


def test_every_flag_a_page_names_exists():
    known = set().union(*kit_flags().values(), *scripts().values(), *(external(name) for name in EXTERNAL))
    unknown = sorted({f"{rel(page)}: {flag}" for page, text in pages().items() for flag in FLAG.findall(text)
                      if flag not in known})
    assert unknown == [], "flags that no ddp_utils command, script or named program has:\n" + "\n".join(unknown)


def commands(text: str) -> list[str]:
    """Code-block lines (``\\``-continued lines joined) and inline code spans of a page."""
    blocks = re.findall(r"^\s*```[^\n]*\n(.*?)^\s*```", text, re.M | re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return lines + re.findall(r"`([^`\n]+)`", FENCE.sub("", text))


def test_kit_commands_on_every_page_use_only_their_own_flags():
    """``python -m ddp_utils check ... --flag`` (or a benchmark, a lab script, docker/run.sh): the flag must be
    that command's, or belong to another program named on the same line (torchrun, docker ...)."""
    kit, own = kit_flags(), scripts()
    wrong, checked = [], 0
    for page, text in pages().items():
        for command in commands(text):
            owners = [kit[name] for name in re.findall(r"ddp_utils (\w+)", command) if name in kit]
            owners += [flags for path, flags in own.items() if path in command]
            if not owners:
                continue
            checked += 1
            allowed = set().union(*owners, *(external(name) for name, (pattern, _) in EXTERNAL.items()
                                             if re.search(pattern, command)))
            wrong += [f"{rel(page)}: {flag} in: {command}" for flag in FLAG.findall(command) if flag not in allowed]
    assert checked >= 40   # the pages are full of commands; finding few means the parsing broke
    assert wrong == [], "\n".join(wrong)


# -- (3) every list of parameters to keep equal names them all -------------------------------------------
# RANK is the one parameter main.ipynb and worker.ipynb hold differently, by design. The kit's settings agreement
# (collectives.agree: settings.MUST_AGREE, the backend, the data) refuses a mismatch in what decides the
# training; the other parameters are not compared, but either only rank 0 reads them (RUN_DIR, RESUME,
# WANDB_MODE, PRICE_PER_HOUR, TENSORBOARD) or they set one rank's own pace (WORKERS, LOADER, THREADS,
# INIT_TIMEOUT), so a difference there is silently ignored or slows one node: the pages ask for every one
# equal (tests/test_notebooks.py keeps the committed notebooks so). single.ipynb holds WORLD_SIZE and PARALLEL
# of its own (and no DDP parameter).
DIFFER_ON_THE_NODES = {"RANK"}
SINGLE_OWN = {"WORLD_SIZE", "PARALLEL"}
SAME = re.compile(r"\b(same|identical|equal|match|matching)\b", re.I)
PARAM = re.compile(r"`([A-Z][A-Z0-9_]+)(?:\s*=[^`]*)?`")
SERIES = re.compile(r"`[A-Z][A-Z0-9_]+`(?:(?:,| and|, and)\s+`[A-Z][A-Z0-9_]+`){2,}")   # `A`, `B` and `C`


def units(text: str) -> list[str]:
    """Paragraphs (blank-line separated, fenced blocks kept whole), with each table row and list item apart."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        if block.lstrip().startswith("```"):
            out.append(block)
            continue
        out += re.split(r"\n(?=\s*(?:\||[*-] |\d+\. ))", block)
    return out


def parameter_lists(text: str) -> list[tuple[str, set[str]]]:
    """``(kind, parameters named)`` of every list of parameters to keep equal: a series of three or more of the
    notebooks' parameters (```A`, `B` and `C```) in a paragraph that says to keep them equal (same, identical,
    equal, match), or a python block of parameter assignments after such a paragraph. kind: "single" when it
    compares single.ipynb, else "nodes"."""
    names = set(parameters(MAIN)) | set(parameters(SINGLE))
    found, previous = [], ""
    for unit in units(text):
        if unit.lstrip().startswith("```python"):
            assigned = set(re.findall(r"^([A-Z][A-Z0-9_]+) = ", unit, re.M)) & names
            if len(assigned) >= 3 and SAME.search(previous):
                found.append(("single" if "single" in previous else "nodes", assigned))
        else:
            for series in SERIES.findall(unit):
                named = set(PARAM.findall(series)) & names
                if len(named) >= 3 and SAME.search(unit):
                    found.append(("single" if "single" in unit else "nodes", named))
        previous = unit
    return found


def test_parameter_lists_are_found():
    assert parameter_lists("Keep `DATASET`, `EPOCHS` and `LR` the same.\n\nOther `A`, `B`, `C`.") == \
        [("nodes", {"DATASET", "EPOCHS", "LR"})]
    lab = parameter_lists((ROOT / "lab" / "README.md").read_text(encoding="utf-8"))
    assert {kind for kind, _ in lab} == {"nodes", "single"}   # step 6's parameter cell, step 8's baseline


def test_every_list_of_parameters_to_keep_equal_names_every_parameter():
    expected = {"nodes": set(parameters(MAIN)) - DIFFER_ON_THE_NODES, "single": set(parameters(SINGLE)) - SINGLE_OWN}
    short = [f"{rel(page)}: a list of parameters to keep equal ({kind}) leaves out {sorted(expected[kind] - named)}"
             for page, text in pages().items() for kind, named in parameter_lists(text)
             if not expected[kind] <= named]
    assert short == [], "\n".join(short)


def same_price(a: str, b: str) -> bool:
    """Equal to the precision of the less precise quote ("about $0.75" and 0.752 agree)."""
    digits = min(len(a.split(".")[1]), len(b.split(".")[1]))
    return round(float(a), digits) == round(float(b), digits)


def course_instance() -> str:
    """The instance type of the walkthrough's default row ("the course's": its reference run and parameter cell)."""
    from tests.helpers.page_commands import path_rows
    [kind] = [row["TYPE"] for row in path_rows() if "the course's" in row["you have"]]
    return kind


def test_quoted_prices_are_found():
    assert quoted_prices("a g4dn.2xlarge costs about $0.75 per hour and a g5.2xlarge about $1.20.") == \
        [("g4dn.2xlarge", "0.75"), ("g5.2xlarge", "1.20")]
    assert quoted_prices("GPU nodes: e.g. 0.752 (AWS g4dn.2xlarge, USD)") == [("g4dn.2xlarge", "0.752")]
    assert same_price("0.75", "0.752") and not same_price("0.526", "0.752")


def test_an_instance_type_has_one_price_wherever_it_is_quoted():
    seen: dict[str, tuple[str, str]] = {}
    clash = []
    for page, text in pages().items():
        for kind, price in quoted_prices(text):
            if kind in seen and not same_price(seen[kind][1], price):
                clash.append(f"{kind}: {seen[kind][0]} says {seen[kind][1]}, {rel(page)} says {price}")
            seen.setdefault(kind, (rel(page), price))
    assert course_instance() in seen, f"no page gives the price of {course_instance()}, the course's instance"
    assert clash == [], "\n".join(clash)


def test_every_price_per_hour_example_is_the_course_instances():
    """The notebooks' PRICE_PER_HOUR comment and every parameter cell a page shows name the instance the
    walkthrough provisions, at the price the pages give it."""
    kind = course_instance()
    price = next(p for page_text in pages().values() for k, p in quoted_prices(page_text) if k == kind)
    lines = [(rel(page), line) for page, text in pages().items() for line in text.splitlines()
             if line.startswith("PRICE_PER_HOUR")]
    assert len(lines) >= 4   # main, worker, single and the walkthrough's parameter cell
    wrong = [f"{where}: {line}" for where, line in lines
             if kind not in line or not all(same_price(p, price) for p in PRICE.findall(line))]
    assert wrong == [], f"the course's nodes are {kind} at {price} per hour:\n" + "\n".join(wrong)


def test_costs_quoted_at_a_price_per_node_hour_use_the_course_instances_price():
    """The walkthrough's reference row: cost = wall time x nodes x the price of the nodes it ran on."""
    text = (ROOT / "lab" / "README.md").read_text(encoding="utf-8")
    price = next(p for k, p in quoted_prices(text) if k == course_instance())
    rows = [row for row in text.splitlines() if re.search(r"per node-hour", row) and row.startswith("|")]
    assert rows, "the reference row of the homework table gives its cost"
    for row in rows:
        [at] = re.findall(r"at (\d+\.\d+) per node-hour", row)
        assert same_price(at, price), f"{row}\nthe reference ran on {course_instance()}, {price} per hour"
        walls = re.findall(r"\*(\d+):(\d\d):(\d\d) / (\d+):(\d\d):(\d\d)\*", row)
        costs = re.findall(r"\*(\d+\.\d\d) / (\d+\.\d\d) \(at", row)
        assert walls and costs, row
        h = [int(a) + int(b) / 60 + int(c) / 3600 for a, b, c in (walls[0][:3], walls[0][3:])]
        assert [round(h[0] * 2 * float(at), 2), round(h[1] * 1 * float(at), 2)] == [float(c) for c in costs[0]], row


# -- (5) the defaults a flag table quotes are the Settings' defaults -------------------------------------
def quoted_defaults(text: str) -> list[tuple[str, str]]:
    """(flag, quoted default) from the rows of a `| flag | default | meaning |` table: one default per flag
    (``--rank``, ``--world-size`` | ``0, 1``); rows whose default is a word (recipe, -) are not literals."""
    out = []
    tables = re.findall(r"^\| flag \| default \|.*\n((?:\|.*\n?)+)", text, re.M)
    for row in re.findall(r"^\| ((?:`--[\w-]+`(?:, )?)+) \| ([^|]+) \|", "\n".join(tables), re.M):
        flags = re.findall(r"`(--[\w-]+)`", row[0])
        values = [v.strip().strip("`") for v in row[1].split(",")]
        if len(values) == len(flags):
            out += list(zip(flags, values))
    return out


def test_every_default_a_flag_table_quotes_is_the_kits():
    from dataclasses import fields

    from ddp_utils.settings import Settings
    defaults = {"--" + f.name.replace("_", "-"): f.default for f in fields(Settings)}
    checked, wrong = 0, []
    for page, text in pages().items():
        for flag, quoted in quoted_defaults(text):
            if flag not in defaults or quoted in ("recipe", "-", "") or "<" in quoted:   # a word, not a value
                continue
            real = defaults[flag]
            if isinstance(real, bool):
                said = {"on": True, "off": False}.get(quoted)
            elif isinstance(real, float):
                said = float(quoted) if re.fullmatch(r"[\d.]+", quoted) else quoted
            else:
                said = int(quoted) if isinstance(real, int) and quoted.isdigit() else quoted
            checked += 1
            if said != real:
                wrong.append(f"{rel(page)}: {flag} quoted as {quoted!r}, the default is {real!r}")
    assert checked >= 15, checked
    assert wrong == [], "\n".join(wrong)


# -- (9) every `python -m ddp_utils ...` line of a shell block runs as typed -----------------------------------
BASH = re.compile(r"^( *)```bash\n(.*?)^\1```$", re.M | re.S)


def kit_commands() -> list[tuple[str, str]]:
    """(page, command) for every `python -m ddp_utils ...` line of the pages' ```bash blocks, joined over `\\`
    continuations, without its trailing comment; lines with `...` (elided flags) are left out."""
    found = []
    for page in MD_PAGES:
        for m in BASH.finditer(page.read_text(encoding="utf-8")):
            text = re.sub(r"\\\n\s*", " ", m.group(2))
            for line in text.splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith("python -m ddp_utils") and "..." not in line:
                    found.append((rel(page), line))
    return found


def test_every_kit_command_on_a_page_parses_and_its_settings_are_valid():
    """A literal reader types these lines: each must parse with the kit's own parser, and a train/launch/check
    line's settings must pass validation (the same check train runs first)."""
    import shlex
    from ddp_utils import settings as settings_module
    from ddp_utils.tools.cli import build_parser
    commands = kit_commands()
    assert len(commands) >= 10, commands
    bad = []
    from tests.helpers.page_commands import ROW_WORDS, path_rows, typed
    node_rows = [row for row in path_rows() if row["WORKERS"] != "0"]
    for page, line in commands:
        words = shlex.split(line)[3:]
        # a row's words (DATA_DIR, WORKERS, PRICE): the line as each node row types it
        each_row = any(ROW_WORDS.search(word) for word in words)
        for argv in {tuple(typed(words, row)) for row in node_rows} if each_row else {tuple(words)}:
            try:
                args = build_parser().parse_args(list(argv))
            except SystemExit:
                bad.append(f"{page}: does not parse: {shlex.join(argv)}")
                continue
            if args.command in ("train", "launch", "check"):
                problems = settings_module.from_args(args, environ={}).problems()
                if problems:
                    bad.append(f"{page}: {shlex.join(argv)}: {problems}")
    assert not bad, "\n".join(bad)

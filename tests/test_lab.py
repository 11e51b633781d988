"""The lab: the homework walkthrough (lab/README.md) and the CINIC-10 lab notebooks (lab/lab*.ipynb).

Structure tests read the committed files. The README tests keep the walkthrough honest: every
troubleshooting row the course needs is there and the error texts it quotes are still the kit's (its
links and ``--flags`` are checked with every other page's in tests/test_pages.py). The execution tests run
every lab notebook with papermill on the bundled demo data with tiny settings, all at once, under a
hard time bound (lab 5 starts two ranks of its own on localhost).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tests.helpers.notebook_cells import code, markdown, parameter_cells, parameters, read
from tests.helpers.pages import kit_pages
from tests.helpers.procs import REPO, base_env, describe, free_port, run_all

LAB = Path(REPO) / "lab"
README = LAB / "README.md"
NOTEBOOKS = ["lab1_amp.ipynb", "lab2_tensorboard.ipynb", "lab3_wandb.ipynb", "lab4_dataparallel.ipynb",
             "lab5_ddp_two_nodes.ipynb"]   # the course's lab order
TIME_BOUND = 300   # seconds for all five notebooks started together (kernels, torch imports, training)


# -- helpers ----------------------------------------------------------------------------------
# The walkthrough's reference pages: what a student reaches from it when something differs or goes wrong.
PAGES = [LAB / name for name in ("nodes.md", "data.md", "troubleshooting.md", "labs.md")]
TROUBLESHOOTING = LAB / "troubleshooting.md"


def readme() -> str:
    """The walkthrough with its reference pages (a fact it states may sit on either)."""
    return "\n\n".join(page.read_text(encoding="utf-8") for page in [README, *PAGES])


def walkthrough() -> str:
    """lab/README.md alone: the path a student follows."""
    return README.read_text(encoding="utf-8")


def section(text: str, heading_start: str) -> str:
    """The text of the ``## <heading_start>...`` section, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(heading_start)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no section starting with '## {heading_start}'"
    return match.group(1)


# -- the notebooks: structure -----------------------------------------------------------------
def test_the_five_lab_notebooks_are_there_in_the_courses_order():
    assert sorted(p.name for p in LAB.glob("lab*.ipynb")) == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_valid_nbformat(name):
    nbformat.validate(read(LAB / name))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_has_exactly_one_parameters_cell(name):
    assert len(parameter_cells(read(LAB / name))) == 1


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(name):
    for cell in read(LAB / name).cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_code_cell_is_valid_ipython(name):
    from IPython.core.inputtransformer2 import TransformerManager

    for cell in read(LAB / name).cells:
        if cell.cell_type == "code":
            compile(TransformerManager().transform_cell(cell.source), name, "exec")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_defaults_run_on_a_laptop_and_comments_say_what_to_use_on_the_gpu(name):
    values = parameters(LAB / name)
    assert values["DATASET"] == "demo" and values["DATA_DIR"] == "../data/demo"
    [cell] = parameter_cells(read(LAB / name))
    assert '"cinic10"' in cell.source and '"/data/cinic10"' in cell.source
    for line in cell.source.splitlines():
        if re.match(r"[A-Z_]+ = ", line):
            assert "#" in line, f"parameter without a comment: {line}"
            # papermill cannot read a parameter line whose comment holds '=' ("unknown parameter")
            assert "=" not in line.split("#", 1)[1], f"'=' in the comment: {line}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_no_notebook_asks_for_or_holds_a_wandb_key(name):
    source = code(LAB / name)
    assert "wandb.login(" not in source and "getpass" not in source
    assert not re.search(r"WANDB_API_KEY\s*=", source)


def test_wandb_lab_is_offline_by_default():
    assert parameters(LAB / "lab3_wandb.ipynb")["WANDB_MODE"] == "offline"
    for name in NOTEBOOKS:
        mode = parameters(LAB / name).get("WANDB_MODE", "disabled")
        assert mode in ("offline", "disabled"), (name, mode)


def test_dataparallel_lab_compares_the_three_modes_with_the_devices_the_node_has():
    source = code(LAB / "lab4_dataparallel.ipynb")
    assert 'parallel="dp"' in source and 'parallel="none"' in source
    assert "DataParallel(" not in source   # prepare wraps the model, as on the command line (--parallel dp)
    assert "node_modes()" in source and "share_gpu=modes.share_gpu" in source   # 1 GPU: DDP's ranks share it
    assert "launch(" in source and "compare_table(run_dirs)" in source
    text = markdown(LAB / "lab4_dataparallel.ipynb")
    assert "DistributedDataParallel" in text
    # the homework's nodes have one GPU: the lab says what it shows there, and that the 2+ GPU node is optional
    assert "g4dn.2xlarge" in text and "g4dn.12xlarge" in text and "4 x T4" in text and "48 vCPUs" in text
    assert "$3.91 per hour" in text and "quota of 48, more\nthan the 16 that step 1" in text and "optional" in text
    assert "16 vCPUs" in readme()   # what step 1 asks for, quoted above


def test_lab4_answers_come_from_the_saved_results_keys_the_kit_writes():
    """Every results.json key lab 4's questions name is one the kit writes (gpu_monitor, train, runlog)."""
    import ddp_utils
    text = markdown(LAB / "lab4_dataparallel.ipynb")
    questions = text.split("## Questions", 1)[1]
    named = set(re.findall(r"`results\.json: ([^`]+)`", questions.replace("\n", " ")))
    keys = {k.strip() for group in named for k in group.split(",")}
    assert {"gpu_util_per_device", "gpu_mem_peak_mb_per_device", "torch_mem_peak_mb_per_device"} <= keys
    source = "\n".join(p.read_text() for p in Path(ddp_utils.__file__).parent.rglob("*.py"))
    for key in keys:
        assert f'"{key}"' in source, f"lab 4 asks for results.json: {key}, which the kit does not write"


def test_two_node_lab_points_to_the_homework_notebooks():
    text = markdown(LAB / "lab5_ddp_two_nodes.ipynb")
    assert "notebooks/main.ipynb" in text and "notebooks/worker.ipynb" in text
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "BACKEND", "RUN_DIR", "WANDB_MODE"):
        assert name in parameters(LAB / "lab5_ddp_two_nodes.ipynb"), name


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_labs_build_their_runs_with_prepare_like_the_notebooks_and_the_command_line(name):
    """One way to start a run: the labs call prepare() (or run_job, which calls it), never assemble one by hand."""
    source = code(LAB / name)
    assert "prepare(" in source or "run_job(" in source, name
    for hand_made in ("DistContext(", "make_logger("):
        assert hand_made not in source, f"{name} assembles a run by hand ({hand_made})"
    assert "OMP_NUM_THREADS" not in source, "threads come from the kit (threads.py), the same for every entry point"


def test_lab5_builds_its_command_lines_from_the_same_settings_as_its_notebook_run():
    source = code(LAB / "lab5_ddp_two_nodes.ipynb")
    assert ".to_argv(skip=(\"rank\",))" in source and '"--rank", str(rank)' in source


# -- the walkthrough --------------------------------------------------------------------------
def test_walkthrough_has_the_numbered_steps_in_order():
    headings = re.findall(r"^## (\d+)\. ", walkthrough(), re.M)
    assert headings == [str(i) for i in range(11)], headings


# Every pain point of the course (the users guide), and the one term a student would search the troubleshooting
# table for: the row may be reworded freely, as long as it names that term.
PAIN_POINTS = {
    "wrong master IP / blocked port / security group: a hang": "security group",
    "wrong network interface": "GLOO_SOCKET_IFNAME",
    "further random ports": "random ports",
    "port held after a kernel restart": "EADDRINUSE",
    "init cell run twice": "teardown()",
    "set_epoch forgotten": "set_epoch",
    "validation with DistributedSampler": "DistributedSampler",
    "rank-0-only validation through DDP": "deadlock",
    "every rank writes": "NullLogger",
    "W&B login prompt": "prompt",
    "Bus error in Docker": "/dev/shm",
    "datasets defined in the notebook": "pickle",
    "one notebook edited, the other not": "disagree on settings",
    "worker dies mid-run": "--resume",
    "wrong normalisation / no centre crop / lr not scaled": "CenterCrop",
    "W&B key pasted into a notebook": "WANDB_API_KEY",
}


@pytest.mark.parametrize("pain", PAIN_POINTS)
def test_troubleshooting_covers_every_pain_point(pain):
    """In the full table of lab/troubleshooting.md, and in a line of the walkthrough's step 10."""
    rows = [line for line in TROUBLESHOOTING.read_text(encoding="utf-8").splitlines() if line.startswith("| ")]
    assert any(PAIN_POINTS[pain].lower() in row.lower() for row in rows), f"no troubleshooting row names {pain!r}"
    short = [line for line in section(walkthrough(), "10.").splitlines() if line.startswith("| ")]
    assert any(PAIN_POINTS[pain].lower() in row.lower() for row in short), f"step 10 has no line for {pain!r}"


def test_troubleshooting_is_a_symptom_cause_fix_table():
    table = TROUBLESHOOTING.read_text(encoding="utf-8")
    assert "| symptom | cause | fix |" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert len(rows) - 1 >= len(PAIN_POINTS)
    assert all(line.count(" | ") >= 2 for line in rows)


# The kit's error texts that the README quotes: when a message changes, the README must follow.
QUOTED_KIT_TEXTS = [
    "cannot reach the master at",
    "is not one of its addresses",
    "is already in use by",
    "The port is never switched silently",
    "NCCL and Gloo open further random ports between the nodes, so allow all TCP between them",
    "the ranks disagree on",
    "or they would silently train different things",
    "needs an API key and none is set up on this node",
    "DataLoader workers may die with 'Bus error'",
    "Iterate over loader.epoch(epoch), not the loader itself",
    "already holds a run",
    "has no class folders",
    "using interface",
    "but not each other on other ports",
    "Gloo and NCCL connect every rank to the others on further random ports",
    "continuing at epoch",
]


def kit_source() -> str:
    """Every ddp_utils module, with adjacent string literals joined (messages span several lines)."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((Path(REPO) / "ddp_utils").rglob("*.py")))
    return re.sub(r"\"\s*\n\s*f?\"", "", text)


@pytest.mark.parametrize("quoted", QUOTED_KIT_TEXTS)
def test_quoted_error_texts_are_still_the_kits(quoted):
    assert quoted in readme(), f"README no longer quotes: {quoted}"
    assert quoted in kit_source(), f"the kit no longer says: {quoted} (update lab/README.md)"


# -- quoted tables, timeouts and times: the two READMEs must agree with each other and the kit ------
TABLE_ROW = re.compile(r"^\| (\d{8}-\d{6}-\w+) \|.*\|$", re.M)   # a results-table row of a real run


def quoted_rows(text: str) -> dict[str, set[str]]:
    rows: dict[str, set[str]] = {}
    for match in TABLE_ROW.finditer(text):
        rows.setdefault(match.group(1), set()).add(match.group(0))
    return rows


def test_every_quoted_results_row_is_the_same_wherever_it_is_quoted():
    """The same run quoted twice (step 0, step 8, README, images/results.md) must show the same numbers."""
    texts = {"lab/README.md": readme(), "README.md and docs/": kit_pages(),
             "images/results.md": (Path(REPO) / "images" / "results.md").read_text()}
    seen: dict[str, tuple[str, str]] = {}
    for where, text in texts.items():
        for run, rows in quoted_rows(text).items():
            assert len(rows) == 1, f"{where} quotes {run} with different numbers: {rows}"
            row = next(iter(rows))
            if run in seen:
                assert seen[run][1] == row, f"{run}: {seen[run][0]} says\n{seen[run][1]}\n{where} says\n{row}"
            seen[run] = (where, row)


def test_the_walkthrough_quotes_one_demo_run_and_its_speed_up_in_the_prose():
    """Step 0 and step 8 show the same demo runs, and the prose's speed-up is the table's."""
    runs = quoted_rows(readme())
    ddp = [r for r in runs if r.endswith("-ddp2")]
    assert len(ddp) == 1, f"the walkthrough quotes several demo runs: {sorted(runs)}"
    speedup = next(iter(runs[ddp[0]])).split("|")[-3].strip()     # e.g. 1.74x
    assert f": {speedup}, not 2x" in section(readme(), "0."), speedup
    assert ddp[0] in section(readme(), "8."), "step 8 should show the report of step 0's runs"


def test_quoted_timeouts_are_the_kits_defaults():
    from ddp_utils.settings import Settings
    default = Settings().init_timeout
    text = readme()
    for waited in re.findall(r"waiting up to (\d+) s for the checks", text):
        assert float(waited) == default, f"check output quotes {waited} s, the default is {default:g} s"
    for said in re.findall(r"INIT_TIMEOUT`?,? \(?(\d+)(?: s)?\)?", text) + re.findall(r"init_timeout`?\)? ?\((\d+)", text):
        assert float(said) == default, said
    for nb in ("main", "worker"):
        assert parameters(Path(REPO) / "notebooks" / f"{nb}.ipynb")["INIT_TIMEOUT"] == default


def test_the_imagenet_epoch_time_is_quoted_the_same_everywhere():
    sources = [readme(), kit_pages()] + [
        code(Path(REPO) / "notebooks" / f"{nb}.ipynb") for nb in ("main", "worker", "single")]
    minutes = {m for text in sources for m in re.findall(r"ImageNet epoch[^.]*?about (\d+) min", text)}
    assert len(minutes) == 1, f"one ImageNet epoch on 2 x T4 is quoted as {sorted(minutes)} minutes"


def test_the_jupyter_line_quoted_in_step_4_is_what_start_jupyter_prints():
    script = (Path(REPO) / "docker" / "start-jupyter.sh").read_text()
    echoed = re.search(r'echo "(JupyterLab listens on .*)"', script).group(1)
    expected = echoed.replace("${ip}", "127.0.0.1").replace("${port}", "8888")
    assert expected in section(readme(), "4."), expected


def test_demo_output_in_the_walkthrough_matches_the_demos_current_settings():
    """Step 0 quotes `python -m ddp_utils demo`: when its batch, lr or epochs change, re-run and re-quote it."""
    from ddp_utils.tools import demo
    from ddp_utils.settings import describe_batch

    step0 = section(readme(), "0.")
    for world_size in (2, 1):
        line = describe_batch(demo.DEMO.replace(world_size=world_size))
        assert line in step0, f"step 0 should show: {line}"
    assert f"epoch {demo.DEMO.epochs}/{demo.DEMO.epochs}:" in step0


def test_files_the_walkthrough_names_exist():
    for path in set(re.findall(r"\b((?:lab|notebooks|docker|ddp_utils)/[\w./-]+\.(?:py|ipynb|sh|md))\b", readme())):
        assert (Path(REPO) / path).is_file(), path


# -- the walkthrough's shell lines, as a student types them -----------------------------------------
def bash_lines(text: str) -> list[tuple[int, str]]:
    """(offset in the text, command) of every ```bash block line, ``\\``-continued lines joined, comments cut off."""
    found = []
    for block in re.finditer(r"^ *```bash\n(.*?)^ *```", text, re.M | re.S):
        offset, start, pending = block.start(1), None, ""
        for raw in block.group(1).splitlines(keepends=True):
            start = offset if start is None else start
            offset += len(raw)
            if raw.rstrip("\n").endswith("\\"):
                pending += raw.rstrip("\n")[:-1] + " "
                continue
            command = re.sub(r"(^|\s)#.*", "", pending + raw).strip()
            if command:
                found.append((start, command))
            start, pending = None, ""
    return found


def typed(text: str) -> list[tuple[int, str]]:
    """What a student copies into a shell: the bash lines, and the inline code spans of the prose."""
    prose = re.sub(r"^ *```.*?^ *```", lambda m: " " * len(m.group(0)), text, flags=re.M | re.S)
    return bash_lines(text) + [(m.start(), m.group(1)) for m in re.finditer(r"`([^`\n]+)`", prose)]


NODE = re.compile(r"\b(\w+)@(NODE[12]_(PUBLIC|PRIVATE)_IP)\b")
KEY = re.compile(r"-i (?:~|\$HOME)/\.ssh/KEY\.pem\b")


def test_every_ssh_scp_or_rsync_to_a_node_names_the_user_and_the_key_or_uses_the_forwarded_agent():
    text = readme()
    agent = [text.find("ssh-add ~/.ssh/KEY.pem"), text.find("ssh -A ubuntu@NODE1_PUBLIC_IP")]
    assert min(agent) >= 0, "the walkthrough sets up agent forwarding (ssh-add, then ssh -A) before node-to-node copies"
    checked = 0
    for where, command in typed(text):
        if not re.search(r"\b(ssh|scp|rsync)\b", command) or "ssh-add" in command:
            continue
        for user, target, kind in NODE.findall(command):
            checked += 1
            assert user == "ubuntu", f"log in as ubuntu (the Ubuntu AMIs' user): {command}"
            if kind == "PUBLIC":   # from the laptop: the key, or the agent that ssh-add filled
                assert KEY.search(command) or (command.startswith("ssh -A ") and where > min(agent)), \
                    f"a laptop command without -i ~/.ssh/KEY.pem: {command}"
            else:                  # node to node: only the laptop's agent, forwarded by ssh -A, holds the key
                assert where > max(agent), f"{command} comes before ssh-add / ssh -A are shown"
    assert checked >= 10, checked


def test_no_command_starts_docker_run_sh_with_plain_sudo():
    """sudo resets the environment: WANDB_API_KEY and the interface variables would not reach the container."""
    wrong = [c for _, c in typed(readme()) if re.search(r"\bsudo\s+(?!-E\b)(?:\S+\s+)*?(?:\S*/)?run\.sh\b", c)]
    assert wrong == [], wrong
    assert "sudo usermod -aG docker" in readme()


def test_bash_blocks_hold_no_angle_bracket_placeholders():
    """`git clone <url>` is a shell redirection, not a placeholder: placeholders are CAPITALS (NODE1_PUBLIC_IP)."""
    wrong = [c for _, c in bash_lines(readme()) if re.search(r"<[A-Za-z][^>]*>", c)]
    assert wrong == [], wrong


def test_no_page_calls_the_cinic10_labs_lab_9():
    texts = {"lab/README.md": readme(), **{nb: markdown(LAB / nb) + code(LAB / nb) for nb in NOTEBOOKS},
             **{f"notebooks/{nb}.ipynb": code(Path(REPO) / "notebooks" / f"{nb}.ipynb")
                for nb in ("main", "worker", "single")}}
    assert [name for name, text in texts.items() if re.search(r"\blab 9\b", text, re.I)] == []
    # the labs are "labs 1-5", on their own page, which the walkthrough links
    assert "# The CINIC-10 lab notebooks (labs 1-5)" in readme() and "(labs 1-5) have a page of their own: [labs.md](labs.md)" in walkthrough()


def test_every_lab_script_the_walkthrough_runs_exists_and_its_help_runs_without_the_container():
    """The scripts run on the node's own python3 before the container exists (step 2): --help must start there."""
    named = sorted(set(re.findall(r"lab/scripts/(\w+\.py)", readme())))
    assert "make_imagenet_subset.py" in named and "sort_imagenet_val.py" in named, named
    for name in named:
        result = subprocess.run([sys.executable, str(LAB / "scripts" / name), "--help"], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0 and "usage:" in result.stdout, (name, result.stderr[-500:])
    for _, command in bash_lines(readme()):
        if "lab/scripts/" in command:
            assert command.startswith(("python3 ", "sudo python3 ")), \
                f"the node has python3, not python, outside the container: {command}"


def table(text: str, header: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose header line starts with ``header``, as {column: cell}."""
    start = text.index(header)
    lines = text[start:].split("\n\n", 1)[0].splitlines()
    names = [c.strip() for c in lines[0].strip("|").split(" | ")]
    return [dict(zip(names, (c.strip() for c in line.strip().strip("|").split(" | ")))) for line in lines[2:]]


def test_the_node_table_fits_each_node_type():
    """Step 1: no more loader workers than a node's vCPUs leave free, and ImageNet only where an archive fits on
    the local NVMe disk (the 155 GB Kaggle zip, or the 145 GB of tars)."""
    step1 = (LAB / "nodes.md").read_text(encoding="utf-8")   # step 1's reference page: what each node can do
    nodes = {row["type"]: row for row in table(step1, "| type | GPU | vCPUs |")}
    assert {"g4dn.xlarge", "g4dn.2xlarge", "g5.2xlarge"} <= set(nodes)
    rows = table(step1, "| node | data (step 2) |")
    for row in rows:
        node = nodes[row["node"]]
        vcpus, nvme = int(node["vCPUs"]), int(node["local NVMe (instance store)"].split()[0])
        workers = re.match(r"(\d+|-)", row["`WORKERS`"]).group(1)
        assert workers == "-" or int(workers) <= vcpus - 1, row
        if row["data (step 2)"] == "ImageNet":
            assert ("not supported" in row["disk: how much, and where"]) == (nvme < 145), row
    assert {(row["node"], row["data (step 2)"]) for row in rows} >= \
        {(n, d) for n in nodes for d in ("ImageNet", "the 100-class subset", "CINIC-10")}


def test_the_walkthrough_says_a_stop_erases_the_local_nvme_disk():
    text = readme()
    assert "stopped nodes keep their disks" not in text
    start = text.index("**Stop the nodes whenever you pause**")   # the walkthrough's cost paragraph
    cost = text[start:text.index("\n---", start)]
    assert "instance store" in cost and "erased at" in cost and "survives the stop" in cost
    assert "erased whenever the node stops" in (LAB / "nodes.md").read_text(encoding="utf-8")


# -- the notebooks, executed ------------------------------------------------------------------
QUICK = {"EPOCHS": 1, "MAX_STEPS": 2, "WORKERS": 0}


def papermill(name: str, out: Path, params: dict) -> list[str]:
    """What "Run All" in Jupyter amounts to, from the lab/ folder."""
    return [sys.executable, "-m", "tests.helpers.run_notebook", str(LAB / name), str(out), json.dumps(params), str(LAB)]


def printed(executed: Path) -> str:
    nb = read(executed)
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")


def errors(executed: Path) -> list[str]:
    nb = read(executed)
    return [f"{o.ename}: {o.evalue}" for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """All five notebooks run at once on the demo data; returns (tmp, {name: (result, output notebook)})."""
    from ddp_utils.demo_data import prepare_demo

    tmp = tmp_path_factory.mktemp("lab")
    data = str(prepare_demo(tmp / "demo"))   # once, before five kernels would race to write it
    runs = tmp / "runs"
    params = {
        "lab1_amp.ipynb": {**QUICK, "BATCH_SIZE": 32, "BIG_BATCH": 64, "RUN_ROOT": str(runs / "lab1")},
        "lab2_tensorboard.ipynb": {**QUICK, "LOG_EVERY": 1, "TENSORBOARD": False, "RUN_ROOT": str(runs / "lab2")},
        "lab3_wandb.ipynb": {**QUICK, "WANDB_MODE": "offline", "RUN_DIR": str(runs / "lab3")},
        "lab4_dataparallel.ipynb": {**QUICK, "RUN_ROOT": str(runs / "lab4")},
        "lab5_ddp_two_nodes.ipynb": {**QUICK, "MASTER_PORT": free_port(), "INIT_TIMEOUT": 120,
                                     "RUN_DIR": str(runs / "lab5")},
    }
    outs = {name: tmp / name.replace(".ipynb", ".out.ipynb") for name in params}
    wandb_home = tmp / "wandb-home"   # W&B's own config and cache stay out of the user's home
    env = base_env(WANDB_CONFIG_DIR=wandb_home / "config", WANDB_CACHE_DIR=wandb_home / "cache",
                   WANDB_DATA_DIR=wandb_home / "data")
    results = run_all([papermill(name, outs[name], {**p, "DATA_DIR": data}) for name, p in params.items()],
                      timeout=TIME_BOUND, env=env)
    return runs, {name: (result, outs[name]) for name, result in zip(params, results)}


def finished(executed, name: str) -> str:
    """What the executed notebook printed, after checking that it ran to the end without errors."""
    result, out = executed[1][name]
    assert result.returncode == 0, describe([result])
    assert not errors(out), errors(out)
    return printed(out)


@pytest.mark.slow
@pytest.mark.timeout(TIME_BOUND + 60)
def test_lab1_compares_fp32_amp_and_a_bigger_batch(executed):
    text = finished(executed, "lab1_amp.ipynb")
    assert "| run | ranks | algorithm | global batch |" in text
    for run in ("fp32", "amp-auto", "amp-auto-batch64"):
        assert f"| {run} | 1 | one process |" in text, run
        assert (executed[0] / "lab1" / run / "results.json").is_file(), run
    assert "global batch 64 = 64 per rank x 1 rank(s); lr 0.8 x 64/256 = 0.2" in text   # the recipe's lr, scaled
    import torch
    if not torch.cuda.is_available():
        assert "No GPU here: the memory probe needs CUDA" in text


@pytest.mark.slow
@pytest.mark.timeout(TIME_BOUND + 60)
def test_lab2_reads_back_the_courses_tensorboard_tags(executed):
    text = finished(executed, "lab2_tensorboard.ipynb")
    tags = next(line for line in text.splitlines() if line.startswith("tags: "))
    for tag in ("Loss/train", "acc1/train", "acc5/train", "Loss/val", "acc1/val", "acc5/val", "lr"):
        assert tag in tags, tag
    for lr in ("0.1", "0.4"):
        assert list((executed[0] / "lab2" / f"lr{lr}" / "tb").glob("events.out.tfevents.*")), lr


@pytest.mark.slow
@pytest.mark.timeout(TIME_BOUND + 60)
def test_lab3_logs_wandb_offline_without_a_key(executed):
    text = finished(executed, "lab3_wandb.ipynb")
    assert "a W&B key is set up on this machine: False" in text
    assert "W&B will run: offline" in text
    assert list((executed[0] / "lab3" / "wandb").glob("offline-run-*"))
    assert "upload with: wandb sync" in text


@pytest.mark.slow
@pytest.mark.timeout(TIME_BOUND + 60)
def test_lab4_compares_single_dataparallel_and_ddp_with_the_devices_it_has(executed):
    """On this machine (a CPU here; one GPU on a homework node): all three runs, the DP run recorded as dp."""
    import torch

    from ddp_utils.tools.node_modes import node_modes
    modes = node_modes()
    text = finished(executed, "lab4_dataparallel.ipynb")
    assert modes.describe().splitlines()[0] in text and "model: DataParallel" in text
    dp, ddp = f"dataparallel-{modes.label}", f"ddp-{modes.ddp_ranks}ranks-{modes.label}"
    for run, ranks in (("single", 1), (dp, 1), (ddp, modes.ddp_ranks)):
        assert f"| {run} | {ranks} |" in text, run
    results = json.loads((executed[0] / "lab4" / dp / "results.json").read_text())
    assert results["parallel"] == "dp" and results["job_gpus"] == torch.cuda.device_count()
    assert f"| DataParallel | 1 / {modes.gpus} |" in text and f"| DDP | {modes.ddp_ranks} / {modes.gpus} |" in text
    if modes.gpus:
        assert f"- {dp}: " in text and "per GPU (DataParallel): cuda:0 " in text
    assert "python -m ddp_utils report " in text


class _Job:
    """What the lab's train() uses of prepare()'s job, without training (the emulated runs below)."""

    def __init__(self, settings, trained):
        self.settings, self.model = settings, type("DataParallel" if settings.parallel == "dp" else "Sequential",
                                                   (), {})()
        trained.append(settings)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("gpus", [0, 1, 4])
def test_lab4_asks_for_the_runs_this_nodes_gpus_allow(monkeypatch, tmp_path, capsys, gpus):
    """The notebook's cells, run here with the GPUs emulated (tests/helpers/gpu_emulation.py) and the training left out:
    on the homework's one-GPU node DP runs over that GPU with BATCH_SIZE and DDP as 2 processes sharing it; on a
    4-GPU node DP splits 4 x BATCH_SIZE and DDP runs 4 processes; on a laptop 2 CPU processes. (The real runs:
    the executed notebook above, on this machine's devices, and test_gpu_paths.py's gpu-marked twins.)"""
    import ddp_utils.job
    import ddp_utils.train
    import ddp_utils.tools.launch
    import ddp_utils.tools.report as report
    from tests.helpers.gpu_emulation import T4, pretend_gpu
    if gpus:
        pretend_gpu(monkeypatch.setattr, T4, count=gpus)
    else:
        monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    trained, launched = [], []
    monkeypatch.setattr(ddp_utils.job, "prepare", lambda settings: _Job(settings, trained))
    monkeypatch.setattr(ddp_utils.train, "fit", lambda job: {})
    monkeypatch.setattr(ddp_utils.tools.launch, "launch", lambda settings, **kw: launched.append((settings, kw)))
    for name in ("results_table", "compare_table", "bottleneck_sentence", "load_run"):
        monkeypatch.setattr(report, name, lambda *a, **kw: "")
    monkeypatch.chdir(LAB)
    namespace = {"__name__": "__main__"}
    cells = [c.source for c in read(LAB / "lab4_dataparallel.ipynb").cells if c.cell_type == "code"]
    exec(cells[0] + f"\nRUN_ROOT = {str(tmp_path / 'lab4')!r}", namespace)   # the parameters, as papermill sets them
    for cell in cells[1:]:
        exec(cell, namespace)
    out = capsys.readouterr().out
    batch = parameters(LAB / "lab4_dataparallel.ipynb")["BATCH_SIZE"]
    assert [(s.parallel, s.batch_size) for s in trained] == [("none", batch), ("dp", batch * max(gpus, 1))]
    [(ddp, how)] = launched
    ranks = max(gpus, 2)
    assert how["nproc_per_node"] == ranks and how["share_gpu"] is (gpus == 1)
    assert ddp.parallel == "ddp" and ddp.batch_size == batch
    label = {0: "cpu", 1: "1gpu", 4: "4gpus"}[gpus]
    assert ddp.run_dir.endswith(f"ddp-{ranks}ranks-{label}") and trained[1].run_dir.endswith(f"dataparallel-{label}")
    first = {0: "No GPU: a rehearsal on the CPU", 1: "1 GPU (Tesla T4), as on the homework's nodes: a rehearsal",
             4: "4 GPUs (Tesla T4): the comparison as meant."}[gpus]
    assert out.startswith(first), out
    if gpus == 1:
        assert "2 processes sharing the GPU over gloo" in out and "nothing to split" in out
        assert "GPU 0 vs the others need a node with 2+ GPUs" in " ".join(out.split())


@pytest.mark.slow
@pytest.mark.timeout(TIME_BOUND + 60)
def test_lab5_rehearses_two_ranks_on_localhost(executed):
    text = finished(executed, "lab5_ddp_two_nodes.ipynb")
    assert "node 1$ python -m ddp_utils train" in text and "--rank 1" in text
    assert "as rank 0 of 2 (gloo, cpu)" in text
    results = json.loads((executed[0] / "lab5" / "results.json").read_text())
    assert results["world_size"] == 2 and results["global_batch_size"] == 2 * 64
    assert "| lab5 | 2 |" in text


def test_the_walkthrough_embeds_every_picture_its_questions_ask_about():
    asked = set(re.findall(r"`(\w+\.png)`", section(readme(), "9.")))
    embedded = set(re.findall(r"!\[[^\]]*\]\(\.\./images/(\w+\.png)\)", readme()))
    assert asked and asked <= embedded, f"asked about but not shown: {sorted(asked - embedded)}"
    assert all((Path(REPO) / "images" / name).is_file() for name in embedded)

"""Issue 45: one path per student through lab/README.md, with one default data set, its hours and its dollars.

The walkthrough is a path, the reference material lives in linked pages (lab/nodes.md, data.md,
troubleshooting.md, labs.md). These tests read the files only: the path table near the top and its sums, the word
budget, the table rows a student reads, the commands that find what a placeholder used to stand for, and every
number the pages state for the default data set against that data set's sizes.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.page_commands import path_rows, typed
from tests.helpers.procs import REPO

ROOT = Path(REPO)
LAB = ROOT / "lab"
README = LAB / "README.md"
PAGES = [README, *(LAB / name for name in ("nodes.md", "data.md", "troubleshooting.md", "labs.md"))]
FENCE = re.compile(r"^ *```.*?^ *```", re.M | re.S)

# The default data set (step 2's route (a)): ImageNet-2012's training and validation images.
TRAIN, VAL = 1_281_167, 50_000
# The walkthrough's runs: batch 500 per GPU, 2 nodes (DDP) or 1 (single).
BATCH, NODES = 500, 2
KINDS = ["g4dn.2xlarge", "g4dn.xlarge", "g5.2xlarge", "A10 nodes elsewhere", "laptop"]


def text(page: Path = README) -> str:
    return page.read_text(encoding="utf-8")


def prose(page: Path = README) -> str:
    """A page's words outside code blocks and HTML comments (cog markers)."""
    return re.sub(r"<!--.*?-->", "", FENCE.sub("", text(page)), flags=re.S)


def path_table() -> list[dict[str, str]]:
    """The path table's rows by column (tests/helpers/page_commands.py reads it, with each row's values)."""
    return path_rows()


def price(kind: str) -> float:
    """The on-demand price per hour the pages give an instance type ("a g4dn.xlarge costs $0.526 per hour")."""
    from tests.helpers.pages import pages, quoted_prices
    return float(next(p for t in pages().values() for k, p in quoted_prices(t) if k == kind))


# -- the path -----------------------------------------------------------------------------------------------
def test_the_path_table_is_in_the_first_80_lines_with_a_row_for_each_kind_of_student():
    lines = text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| you have |"))
    rows = path_table()
    assert start + 2 + len(rows) <= 80, "the path table must end within the walkthrough's first 80 lines"
    for kind in KINDS:
        assert sum(kind in row["you have"] for row in rows) == 1, f"no single row for {kind}"
    for row in rows:
        for column in ("data (step 2)", "read", "`WORKERS`", "`DATA_DIR`", "data", "runs", "questions",
                       "questions to answer"):
            assert row[column], (row["you have"], column)
        assert re.fullmatch(r"\d+", row["`WORKERS`"]), f"one WORKERS per row: {row['`WORKERS`']}"
        if "laptop" not in row["you have"]:
            assert all(re.search(r"\d h", row[stage]) for stage in ("data", "runs", "questions")), row
        assert all("$" in row[stage] for stage in ("data", "runs", "questions")), f"each stage's dollars: {row}"


def test_each_rows_dollars_are_its_node_hours_at_its_instances_price():
    """`3.5 h, $2.63`: the hours are node-hours, the dollars those hours at the price the pages give the type."""
    checked = 0
    for row in path_table():
        kind = next((k for k in ("g4dn.2xlarge", "g4dn.xlarge", "g5.2xlarge") if k in row["you have"]), None)
        if kind is None:
            continue
        for stage in ("data", "runs", "questions"):
            m = re.match(r"([\d.]+) h\\?\*?, \$([\d.]+)", row[stage])
            assert m, (kind, stage, row[stage])
            assert abs(float(m.group(1)) * price(kind) - float(m.group(2))) < 0.006, (kind, stage, row[stage])
            checked += 1
    assert checked == 9


def test_the_walkthrough_is_at_most_8000_words_outside_code_and_its_table_rows_are_short():
    words = len(prose().split())
    assert words <= 8000, f"lab/README.md has {words} words outside code blocks (8,000 at most: move reference " \
                          f"material to lab/nodes.md, data.md or troubleshooting.md)"
    long = [line[:80] for line in text().splitlines() if line.startswith("|") and len(line) > 400]
    assert long == [], f"table rows over 400 characters (symptom -> fix, with a link for the rest): {long}"


def test_step_10_is_symptom_to_fix_with_a_link_to_every_other_symptom():
    step = text().split("## 10. Troubleshooting", 1)[1]
    rows = [line for line in step.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert rows[0] == "| symptom | fix |" and len(rows) > 10
    assert "(troubleshooting.md)" in step
    full = [line for line in text(LAB / "troubleshooting.md").splitlines() if line.startswith("| ")]
    assert len(full) > len(rows), "lab/troubleshooting.md holds every symptom"


# -- no placeholder typed as real -------------------------------------------------------------------------
PLACEHOLDER_IDS = re.compile(r"\b(?:ami|vpc|sg|subnet)-0123456789abcdef0?\b|\bami-[0-9a-f]{8,17}\b")


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_page_types_a_made_up_aws_id_as_real(page):
    found = PLACEHOLDER_IDS.findall(text(page))
    assert found == [], f"{page.name}: {found} (look the id up with an aws command instead)"


def test_the_ami_the_vpc_and_the_security_group_are_found_by_commands_a_student_runs():
    blocks = "\n".join(FENCE.findall(text()))
    # the AMI and the security group of a launch: looked up by lab/scripts/nodes.py (tests/test_nodes.py runs it)
    assert re.search(r"python3 lab/scripts/nodes.py launch node1 --type \S+ --key KEY", blocks)
    nodes = (Path(REPO) / "lab" / "scripts" / "nodes.py").read_text()
    assert re.search(r'AMI_PARAMETER = "/aws/service/deeplearning/ami/x86_64/\S+/latest/ami-id"', nodes)
    assert '"ssm", "get-parameter", "--name", AMI_PARAMETER' in nodes
    assert '"ec2", "describe-security-groups", "--group-names", GROUP' in nodes and 'GROUP = "ddp-course"' in nodes
    assert re.search(r"VPC=\$\(aws ec2 describe-vpcs --filters Name=is-default,Values=true", blocks)
    assert re.search(r'SG=\$\(aws ec2 create-security-group --group-name ddp-course .*--vpc-id "\$VPC" --query '
                     r'GroupId', blocks)
    assert "aws configure" in blocks and "mkdir -p ~/.ssh && aws ec2 create-key-pair --key-name KEY" in blocks


# -- the default data set's numbers ---------------------------------------------------------------------
def test_every_step_count_and_time_follows_the_default_data_sets_sizes():
    t = re.sub(r"\s+", " ", text())
    ddp_steps, single_steps = TRAIN // (BATCH * NODES), TRAIN // BATCH
    assert f"per epoch DDP takes {ddp_steps} optimizer steps, the single run {single_steps}" in t
    illustrative = text()
    assert f"{TRAIN} training and {VAL} validation images" in illustrative
    assert f"this process: {ddp_steps} steps of {BATCH} images per epoch" in illustrative
    assert f"train {TRAIN} images / 1000 classes, val {VAL} images" in illustrative
    assert f"{TRAIN:,} training and {VAL:,} validation images" in t           # the path table's default
    # 2 x T4 at 300 images/s per GPU: an epoch's minutes (step 6); one T4: the single run's hours (step 8)
    minutes = round(TRAIN / (300 * NODES) / 60)
    assert f"takes about {minutes} minutes" in t
    hours = 2 * TRAIN / 300 / 3600
    assert abs(hours - float(re.search(r"about ([\d.]+) hours on a T4 with ImageNet", t).group(1))) < 0.2
    # question 3: the gradients all-reduced per epoch, and the step time at 300 images/s
    gb = 46.8e6 * ddp_steps / 1e9
    assert f"{round(gb)} GB per epoch" in t and f"about {BATCH / 300:.1f} s for {BATCH} images" in t


def test_the_reference_rows_are_the_default_data_set_on_the_course_nodes():
    """The measured run the pages quote is full ImageNet on 2 x g4dn.2xlarge: the path table's default row."""
    t = text()
    assert "on ImageNet, 2 epochs, batch 500 per GPU" in re.sub(r"\s+", " ", t)
    row = next(r for r in path_table() if "g4dn.2xlarge" in r["you have"])
    assert row["data (step 2)"].startswith("(a) ImageNet") and row["`DATA_DIR`"] == "`/data/imagenet`"
    walls = [(1, 14, 47), (2, 24, 0)]   # the reference DDP and single runs
    node_hours = sum((h + m / 60 + s / 3600) * n for (h, m, s), n in zip(walls, (NODES, 1)))
    assert row["runs"].startswith(f"{node_hours:.1f} h"), (row["runs"], node_hours)


def test_one_workers_per_row_and_the_parameter_block_is_the_default_rows():
    rows = {next(k for k in KINDS if k in r["you have"]): int(r["`WORKERS`"]) for r in path_table()}
    block = re.search(r"^WORKERS = (\d+) ", text(), re.M)
    assert block and int(block.group(1)) == rows["g4dn.2xlarge"]
    nodes = text(LAB / "nodes.md")
    for kind, data in (("g4dn.2xlarge", "ImageNet"), ("g4dn.xlarge", "the 100-class subset"), ("g5.2xlarge", "ImageNet")):
        row = next(line for line in nodes.splitlines() if line.startswith(f"| {kind} | {data} |"))
        assert row.split(" | ")[3].strip() == str(rows[kind]), (kind, row[:120])


# -- the findings ---------------------------------------------------------------------------------------
def test_the_report_folder_holds_iperf3s_output_before_it_is_fetched():
    step8 = text().split("## 8. ", 1)[1].split("## 9. ", 1)[0]
    lines = [line for block in FENCE.findall(step8) for line in block.splitlines()]
    copy = next(i for i, line in enumerate(lines) if re.match(r"cp ~/ddp-kit/runs/iperf3.txt ~/ddp-kit/reports/", line))
    fetch = next(i for i, line in enumerate(lines) if line.startswith("scp -r") and "reports/" in line)
    assert copy < fetch
    assert "iperf3 -c NODE2_PRIVATE_IP" in text() and "tee ~/ddp-kit/runs/iperf3.txt" in text()


def test_the_resume_of_question_9_keeps_the_price_of_the_run():
    price_line = re.search(r"^PRICE_PER_HOUR = ([\d.]+)", text(), re.M).group(1)
    resumes = [line.strip() for line in text().splitlines()
               if line.strip().startswith("python -m ddp_utils train") and "--resume" in line]
    assert len(resumes) == 2
    assert all("--price-per-hour PRICE" in line for line in resumes), resumes   # each row's own, typed in
    default = next(r for r in path_rows() if r["TYPE"] == "g4dn.2xlarge")
    assert all(f"--price-per-hour {default['PRICE']}" in " ".join(typed(line.split(), default)) for line in resumes)
    assert price_line == default["PRICE"]   # the parameter cell shows the default row's price


# -- walked literally, row by row (issue 57) --------------------------------------------------------------
ROW_FLAGS = {"--data-dir": "DATA_DIR", "--workers": "WORKERS", "--price-per-hour": "PRICE", "--type": "TYPE",
             "--dollars": "BUDGET"}


def steps() -> dict[int, str]:
    """lab/README.md's numbered steps: {number: the section's text, HTML comments dropped}."""
    parts = re.split(r"^## (\d+)\. ", re.sub(r"<!--.*?-->", "", text(), flags=re.S), flags=re.M)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_command_a_row_runs_carries_that_rows_data_dir_workers_and_price():
    """Steps 1-10 are every node row's: a command there with a literal data folder, worker count, price, type or
    budget fails as typed on some row. Each says the row's word instead, and each row has a value for it."""
    literal = []
    for number, body in steps().items():
        if number == 0:
            continue   # the laptop's rehearsal: the demo data, its own values
        for block in FENCE.findall(body):
            if block.lstrip().startswith("```text"):
                continue   # output, not a command
            for line in block.splitlines():
                for flag, word in ROW_FLAGS.items():
                    for value in re.findall(rf"{flag}[ =](\S+)", line.split("#")[0]):
                        if value != word:
                            literal.append(f"step {number}: {flag} {value}: {line.strip()[:100]}")
    assert literal == [], "\n".join(literal)
    rows = [r for r in path_rows() if r["WORKERS"] != "0"]   # the node rows (the laptop's: step 0 only)
    assert len(rows) == 4
    for row in rows:
        assert row["DATA_DIR"].startswith("/data/") and int(row["WORKERS"]) > 0 and float(row["PRICE"]) > 0
        assert bool(row["TYPE"]) == bool(row["BUDGET"]), row   # every AWS row has its budget
    # the parameter cell is the default row's, and each value the rows differ in says so
    cell = re.search(r"^```python\nMASTER_ADDR = .*?^```", text(), re.M | re.S).group()
    for name in ("DATA_DIR", "WORKERS", "PRICE_PER_HOUR"):
        line = next(line for line in cell.splitlines() if line.startswith(f"{name} = "))
        assert "your row's" in line, line


# A figure that holds only for full ImageNet (1000 classes, 1,281,167 images) and the phrase that must come with it.
FULL_IMAGENET_FIGURES = ["1281", "1,281", "2562", "46.8 MB", "60 GB", "94 MB", "93,625,805", "69.8 %", "1.7 s",
                         "11,689,512"]


def test_no_question_quotes_a_full_imagenet_figure_to_the_subset_row():
    """The g4dn.xlarge row answers questions 1-10 on the 100-class subset (about 128 steps, 45 MB of gradients):
    a full-ImageNet figure in a question is labelled as such, and the question names where the student's own is."""
    subset = next(r for r in path_rows() if r["TYPE"] == "g4dn.xlarge")
    assert subset["questions to answer"] == "as above" and subset["DATA_DIR"] == "/data/imagenet-100"
    questions = re.sub(r"\s+", " ", steps()[9])
    unlabelled = [f"{figure}: ...{questions[max(0, m.start() - 120):m.end() + 20]}"
                  for figure in FULL_IMAGENET_FIGURES for m in re.finditer(re.escape(figure), questions)
                  if "full ImageNet" not in questions[max(0, m.start() - 250):m.end() + 30]]
    assert unlabelled == [], "\n".join(unlabelled)
    for own in ("`measured_step_s`", "`probe.grad_mb`", "`steps` / `epochs_run`", "`probe.compute_alone_s`"):
        assert own in questions, own


def test_no_step_refers_to_a_later_steps_result():
    """A step may point ahead ("step 8 copies the file"), never depend on a later step's result ("once the
    container runs (step 3)", "step 5's check says READY"); a question never needs a later question's."""
    ahead = []
    for number, body in steps().items():
        prose_only = re.sub(r"\s+", " ", FENCE.sub("", body))
        for m in re.finditer(r"\bsteps? (\d+)'s\b|\b(?:once|after|until)\b[^.;:]{0,80}?\(?step (\d+)\b", prose_only, re.I):
            later = int(m.group(1) or m.group(2))
            if later > number:
                ahead.append(f"step {number} -> step {later}: ...{prose_only[max(0, m.start() - 60):m.end() + 40]}")
    questions = re.split(r"^(\d+)\. \*\*", steps()[9], flags=re.M)
    for i in range(1, len(questions), 2):
        number = int(questions[i])
        for m in re.finditer(r"\bquestion (\d+)'s\b", questions[i + 1]):
            if int(m.group(1)) > number:
                ahead.append(f"question {number} -> question {m.group(1)}'s")
    assert ahead == [], "\n".join(ahead)


def test_the_hand_in_lists_every_file_it_asks_for():
    hand_in = re.sub(r"\s+", " ", text().split("**What you hand in:**", 1)[1].split("\n\n", 1)[0])
    for item in ("results table of step 8", "step 9's questions", "reports/<YYYYmmdd-HHMMSS>/", "iperf3.txt",
                 "lab/build_ddp/student.py", "pytest-log.txt", "runs/build_ddp_bench/"):
        assert item in hand_in, item


def test_the_front_readmes_five_steps_copy_the_kit_use_the_lab_parameters_and_free_the_gpu():
    five = text(ROOT / "README.md").split("## Two nodes in five steps", 1)[1].split("\n## ", 1)[0]
    assert "rsync" in five and "ddp-kit" in five                           # the copy to the nodes
    assert "lab/README.md#6-run-the-notebooks" in five and "batch 500" in five
    assert "Shut down `main.ipynb`'s kernel" in five


def test_macos_is_said_to_be_untested_wherever_it_is_named():
    for page in (ROOT / "README.md", README):
        for line in text(page).splitlines():
            if "macOS" in line:
                window = text(page)[max(0, text(page).index(line) - 200):text(page).index(line) + 300]
                assert "not tested" in window, f"{page.name}: {line}"


def test_the_path_tables_data_hours_are_the_sum_of_the_data_plan():
    """lab/data.md's plan adds each data step's minutes (measured rates, scaled; estimates where marked): the path
    table's *data* column is that sum, to the half hour."""
    from docs import figures
    steps = figures.data_steps()
    for kind, data in (("g4dn.2xlarge", "imagenet"), ("g5.2xlarge", "imagenet"), ("A10 nodes elsewhere", "imagenet"),
                       ("g4dn.xlarge", "subset")):
        row = next(r for r in path_table() if kind in r["you have"])
        hours = float(re.match(r"([\d.]+) h", row["data"]).group(1))
        assert abs(hours - steps[data]["node-hours"]) <= 0.25, (kind, row["data"], round(steps[data]["node-hours"], 2))


def test_the_kit_images_show_the_recorded_demo_the_pages_quote():
    """images/results.md is the report of the two demo runs docs/output/ recorded: the same rows, today's columns."""
    from docs import quotes

    def rows(lines):
        start = next(i for i, line in enumerate(lines) if line.startswith("| run |"))
        return [line for line in lines[start:] if line.startswith("|")][:4]
    assert rows((ROOT / "images" / "results.md").read_text(encoding="utf-8").splitlines()) == \
        rows(quotes.recorded("report")[1])

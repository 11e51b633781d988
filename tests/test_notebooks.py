"""The notebooks as students run them: main.ipynb and worker.ipynb side by side, single.ipynb alone.

Structure tests read the committed files. Execution tests run every notebook with papermill in its
own process (one kernel per rank, as on two nodes), started at the same time under a hard time
bound, with small settings injected through the ``parameters`` cell. RANK and WORLD_SIZE are never
injected: each notebook runs with its own, so a wrong RANK in a notebook fails the tests.
"""
from __future__ import annotations

import ast
import difflib
import json
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import netns
from tests.helpers.notebook_cells import code_cells, parameter_cells, parameters, read
from tests.helpers.procs import REPO, Result, base_env, describe, free_port, run_all
from tests.helpers.notebook_cells import DDP, MAIN, NOTEBOOKS, QUICK, SINGLE, WORKER

TAG = "# DDP:"
REQUIRED = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "DATASET", "DATA_DIR", "EPOCHS",
            "BATCH_SIZE", "RUN_DIR", "WANDB_MODE")
SINGLE_ONLY_CHANGES = 2   # code lines single.ipynb adds to main without its `# DDP:` lines: WORLD_SIZE, PARALLEL

COLLECTIVE_S = 15  # the collective timeout of the notebooks run at a student's pace (the kit's is 60 s)
TIME_BOUND = 240  # seconds for a group of notebooks started together (kernels + torch imports + training)
METRICS = ("acc1", "acc5", "loss", "val_images", "world_size", "global_batch_size")


# -- helpers ----------------------------------------------------------------------------------
def papermill(notebook: Path, out: Path, params: dict) -> list[str]:
    """The command a student's Jupyter would amount to: run every cell, in the notebooks folder."""
    return [sys.executable, "-m", "tests.helpers.run_notebook", str(notebook), str(out), json.dumps(params), str(NOTEBOOKS)]


def printed(executed: Path) -> str:
    """Everything the executed notebook's cells printed (stream outputs), in order."""
    nb = read(executed)
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")


def displayed(executed: Path, mime: str) -> list[str]:
    """The ``mime`` parts of everything the executed notebook's cells displayed (tables, figures)."""
    nb = read(executed)
    return [o["data"][mime] for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") in ("display_data", "execute_result") and mime in o.get("data", {})]


def global_results(executed: Path) -> dict:
    """The JSON the results cell prints after ``global results: `` (one key a line)."""
    parts = printed(executed).split("global results: ")
    assert len(parts) == 2, f"{executed.name} printed 'global results' {len(parts) - 1} times"
    return json.JSONDecoder().raw_decode(parts[1])[0]


def assert_finished(results: list[Result]) -> None:
    assert all(r.returncode == 0 for r in results), describe(results)


def assert_same_global_metrics(main_out: Path, worker_out: Path, run_dir: Path) -> dict:
    rank0, rank1 = global_results(main_out), global_results(worker_out)
    saved = json.loads((run_dir / "results.json").read_text())
    for key in METRICS:
        assert rank0[key] == rank1[key] == saved[key], (key, rank0[key], rank1[key], saved[key])
    assert rank0["world_size"] == 2 and rank0["global_batch_size"] == 2 * QUICK["BATCH_SIZE"]
    return rank0


# -- structure: the committed files -----------------------------------------------------------
def test_main_and_worker_differ_only_in_the_rank_line():
    main, worker = MAIN.read_text().splitlines(), WORKER.read_text().splitlines()
    changed = [line for line in difflib.unified_diff(main, worker, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(changed) == 2 and all('"RANK = ' in line for line in changed), "\n".join(changed)


def test_rank_is_0_in_main_and_1_in_worker_with_two_processes():
    assert (parameters(MAIN)["RANK"], parameters(WORKER)["RANK"]) == (0, 1)
    assert parameters(MAIN)["WORLD_SIZE"] == parameters(WORKER)["WORLD_SIZE"] == 2
    assert parameters(SINGLE)["WORLD_SIZE"] == 1


@pytest.mark.parametrize("path", [MAIN, WORKER, SINGLE], ids=lambda p: p.name)
def test_exactly_one_parameters_cell_holding_the_documented_parameters(path):
    nb = read(path)
    assert len(parameter_cells(nb)) == 1
    names = set(parameters(path))
    required = set(REQUIRED) if path != SINGLE else set(REQUIRED) - {"MASTER_ADDR", "MASTER_PORT", "RANK"}
    assert required <= names, f"missing: {sorted(required - names)}"


def test_parameter_comments_say_what_to_use_on_the_gpu_nodes():
    [cell] = parameter_cells(read(MAIN))
    for must in ("private ip", '"imagenet"', '"/data/imagenet"', '"resnet18"', "500", '"nccl"', '"auto"'):
        assert must in cell.source.lower(), must
    for line in cell.source.splitlines():
        if re.match(r"[A-Z_]+ = ", line):
            assert "#" in line, f"parameter without a comment: {line}"


@pytest.mark.parametrize("path", [MAIN, WORKER, SINGLE], ids=lambda p: p.name)
def test_committed_without_outputs(path):
    for cell in read(path).cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.parametrize("path", [MAIN, WORKER, SINGLE], ids=lambda p: p.name)
def test_every_code_cell_is_valid_ipython(path):
    from IPython.core.inputtransformer2 import TransformerManager

    for source in code_cells(read(path)):
        compile(TransformerManager().transform_cell(source), path.name, "exec")


def test_ddp_tags_mark_main_and_are_absent_from_single():
    main, single = "\n".join(code_cells(read(MAIN))), "\n".join(code_cells(read(SINGLE)))
    for ddp_call in ("init_process_group", "DistributedSampler", "DistributedDataParallel", "all_reduce",
                     "teardown()", "rank=RANK", "MASTER_ADDR = ", "WORLD_SIZE = ", "PARALLEL = "):
        line = next(line for line in main.splitlines() if ddp_call in line)
        assert TAG in line, line
    assert TAG not in single and "DDP:" not in single


ESSENTIALS = ("init_process_group", "DistributedSampler", "set_epoch", "DistributedDataParallel", "all_reduce")


@pytest.mark.parametrize("essential", ESSENTIALS)
def test_main_names_each_ddp_essential_in_a_code_cell(essential):
    """A student finds every step DDP adds in the cells, not only inside the package."""
    assert any(essential in source for source in code_cells(read(MAIN))), essential


# The notebook's steps: each one a visible call; prepare() (for the command line, labs and benchmarks)
# and run_job make the same calls in the same order.
STEPS = ("setup", "build_data", "prepare_model", "build_model", "open_run", "fit", "teardown")


def calls(tree) -> list[tuple[str, list[str]]]:
    """``(function name, names of its positional arguments)`` of the STEPS calls in ``tree``, in source order."""
    found = []
    for node in ast.walk(tree):
        name = getattr(node.func, "id", getattr(node.func, "attr", None)) if isinstance(node, ast.Call) else None
        if name in STEPS:   # setup(...) or distributed.teardown(...)
            args = [a.id if isinstance(a, ast.Name) else ast.unparse(a) for a in node.args]
            found.append((node.lineno, node.col_offset, name, args))
    return [(name, args) for *_, name, args in sorted(found)]


def notebook_calls(path) -> list[tuple[str, list[str]]]:
    from IPython.core.inputtransformer2 import TransformerManager
    return [call for source in code_cells(read(path))
            for call in calls(ast.parse(TransformerManager().transform_cell(source)))]


def prepare_calls() -> list[tuple[str, list[str]]]:
    import inspect

    from ddp_utils import job
    return (calls(ast.parse(inspect.getsource(job.prepare).strip())) +
            [c for c in calls(ast.parse(inspect.getsource(job.run_job).strip())) if c[0] in ("fit", "teardown")])


@pytest.mark.parametrize("path", [MAIN, WORKER, SINGLE], ids=lambda p: p.name)
def test_notebook_cells_make_the_same_calls_in_the_same_order_as_prepare(path):
    """The notebooks show the steps; prepare() is their one-call form. Same functions, same order, and the
    notebook passes the same leading arguments (prepare adds its log and the evaluate flag)."""
    mine, theirs = notebook_calls(path), prepare_calls()
    if path == SINGLE:   # one process: no process group to leave
        theirs = [c for c in theirs if c[0] != "teardown"]
    assert [name for name, _ in mine] == [name for name, _ in theirs], (mine, theirs)
    for (name, args), (_, prepared) in zip(mine, theirs):
        assert prepared[:len(args)] == args, (name, args, prepared)


def test_the_steps_inside_prepare_are_tagged_too():
    """Read from the command line's side, prepare's DDP steps stay marked for students."""
    import inspect

    from ddp_utils import job
    source = inspect.getsource(job.prepare)
    for ddp_call in ("setup(", "build_data(", "prepare_model(", "open_run("):
        line = next(line for line in source.splitlines() if ddp_call in line)
        assert TAG in line, line


@pytest.mark.parametrize("module, function, essential", [
    ("distributed", "_init_process_group", "dist.init_process_group("),
    ("loaders", "train_sampler", "DistributedSampler("),
    ("loaders", "TrainLoader._shuffle", "set_epoch("),
    ("model", "wrap_ddp", "DDP(model"),
    ("metrics", "Meter.reduced", "all_reduce_sum("),
    ("collectives", "all_reduce_sum", "dist.all_reduce("),
    ("runlog", "make_logger", "NullLogger()"),
    ("distributed", "teardown", "destroy_process_group("),
])
def test_the_lesson_page_points_at_the_code_that_does_each_step(module, function, essential):
    """notebooks/lesson.md names ddp_utils/<module>.py and <function> for each step; that code does it."""
    import importlib
    import inspect

    lesson = (NOTEBOOKS / "lesson.md").read_text()
    assert f"ddp_utils/{module}.py" in lesson and f"`{function}`" in lesson, (module, function)
    obj = importlib.import_module(f"ddp_utils.{module}")
    for part in function.split("."):
        obj = getattr(obj, part)
    assert essential in inspect.getsource(obj), (function, essential)


@pytest.mark.parametrize("path", [MAIN, SINGLE], ids=lambda p: p.name)
def test_notebook_parameters_use_the_recipe_and_show_the_lr_convention(path):
    params = parameters(path)
    for name in ("ARCH", "EPOCHS", "BATCH_SIZE", "LR", "WARMUP_EPOCHS"):
        assert params[name] is None, f"{name} should default to the preset's recipe"
    assert params["SCALE_LR"] is True
    [cell] = parameter_cells(read(path))
    assert "global batch of 256" in cell.source


@pytest.mark.parametrize("path", [MAIN, WORKER, SINGLE], ids=lambda p: p.name)
def test_resume_none_and_data_dir_none_get_the_kits_sentence_not_a_type_error(path, monkeypatch):
    """Issue 55: `RESUME = None` failed in the settings cell's own os.path.dirname, `DATA_DIR = None` in pathlib."""
    monkeypatch.chdir(NOTEBOOKS)
    params, settings_cell = code_cells(read(path))[:2]
    scope = {}
    exec(params + "\nRESUME = None", scope)
    exec(settings_cell, scope)   # the import and Settings cell: RESUME = None is "start a new run"
    assert scope["settings"].run_dir.startswith("../runs/")
    exec("DATA_DIR = None", scope)
    with pytest.raises(ValueError, match=re.escape("data_dir=None: must be text (a name, or a path in quotes)")):
        exec(settings_cell, scope)


def test_single_is_main_without_its_ddp_lines():
    """The lesson is a diff: drop main's `# DDP:` lines and single.ipynb is left, except for its own values of
    WORLD_SIZE and PARALLEL (main's lines for both are tagged)."""
    def lines(nb, drop_tagged):
        return [line.strip() for source in code_cells(nb) for line in source.splitlines()
                if line.strip() and not (drop_tagged and TAG in line)]
    diff = [line for line in difflib.ndiff(lines(read(MAIN), True), lines(read(SINGLE), False))
            if line[:2] in ("- ", "+ ")]
    added = [line for line in diff if line.startswith("+ ")]
    assert not [line for line in diff if line.startswith("- ")], "\n".join(diff)
    assert len(added) == SINGLE_ONLY_CHANGES, "\n".join(diff)
    assert any(line.startswith("+ WORLD_SIZE = 1") for line in added), "\n".join(diff)
    assert any(line.startswith('+ PARALLEL = "none"') for line in added), "\n".join(diff)


# -- execution on one machine: main + worker on loopback, single beside them -------------------
def headless_commands() -> dict[str, tuple[Path, Path, dict]]:
    """The papermill commands docs/commands.md gives, by notebook name: (notebook, --cwd, its -p parameters)."""
    import shlex

    from papermill.cli import _resolve_type   # how papermill's CLI reads a -p value ("False" -> False)
    page = (Path(REPO) / "docs" / "commands.md").read_text()
    out = {}
    for line in re.findall(r"^papermill .*$", page, re.M):
        words = shlex.split(line)
        cwd = Path(REPO) / words[words.index("--cwd") + 1]
        params = {words[i + 1]: _resolve_type(words[i + 2]) for i, w in enumerate(words) if w == "-p"}
        out[Path(words[1]).stem] = (Path(REPO) / words[1], cwd, params)
    return out


@pytest.fixture(scope="module")
def on_loopback(tmp_path_factory):
    """main, worker and single started together, as docs/commands.md's headless commands start them (their
    notebook, --cwd and parameters) with small settings on top; the notebooks build the demo data themselves."""
    tmp = tmp_path_factory.mktemp("notebooks")
    data = str(tmp / "demo")  # absent: both ranks and single write it at once (prepare_demo is race-safe)
    documented = headless_commands()
    ddp = {**DDP, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(), "DATA_DIR": data,
           "RUN_DIR": str(tmp / "runs" / "ddp")}
    single = {**QUICK, "DATA_DIR": data, "RUN_DIR": str(tmp / "runs" / "single")}
    outs = {name: tmp / f"{name}.out.ipynb" for name in ("main", "worker", "single")}
    commands = []
    for name, ours in (("main", ddp), ("worker", ddp), ("single", single)):
        notebook, cwd, params = documented[name]
        params = {**params, **ours}   # the page's, with this machine's address and the small settings
        commands.append([sys.executable, "-m", "tests.helpers.run_notebook", str(notebook), str(outs[name]),
                         json.dumps(params), str(cwd)])
    results = run_all(commands, timeout=TIME_BOUND, env=base_env())
    return tmp, outs, results


def test_the_headless_commands_run_each_notebook_in_its_folder_without_tensorboard():
    documented = headless_commands()
    assert set(documented) == {"main", "worker", "single"}
    for name, (notebook, cwd, params) in documented.items():
        assert notebook == {"main": MAIN, "worker": WORKER, "single": SINGLE}[name] and cwd == NOTEBOOKS
        assert params["TENSORBOARD"] is False and "RANK" not in params and "WORLD_SIZE" not in params
    assert documented["main"][2] == documented["worker"][2]   # the same parameters on both nodes


@pytest.mark.slow
def test_papermill_s_own_command_line_runs_the_baseline_notebook_as_documented(tmp_path):
    """The real `papermill` CLI with docs/commands.md's single.ipynb command (one kernel: no port race)."""
    import shlex
    line = re.search(r"^papermill notebooks/single.ipynb .*$", (Path(REPO) / "docs" / "commands.md").read_text(),
                     re.M).group(0)
    words = shlex.split(line)
    words[2] = str(tmp_path / "single-out.ipynb")
    quick = {**QUICK, "DATA_DIR": str(tmp_path / "demo"), "RUN_DIR": str(tmp_path / "runs" / "single")}
    extra = [w for key, value in quick.items() for w in ("-p", key, str(value))]
    [result] = run_all([[sys.executable, "-m", *words, *extra]], timeout=TIME_BOUND, env=base_env())
    assert result.returncode == 0, describe([result])
    assert "global results" in printed(tmp_path / "single-out.ipynb")
    assert (tmp_path / "runs" / "single" / "results.json").exists()


@pytest.mark.slow
def test_main_and_worker_run_at_the_same_time_and_both_finish(on_loopback):
    _, outs, results = on_loopback
    assert_finished(results[:2])
    assert "model: DistributedDataParallel" in printed(outs["main"])
    assert "model: DistributedDataParallel" in printed(outs["worker"])


@pytest.mark.slow
def test_both_ranks_print_the_same_global_metrics_as_results_json(on_loopback):
    tmp, outs, results = on_loopback
    assert_finished(results[:2])
    assert_same_global_metrics(outs["main"], outs["worker"], tmp / "runs" / "ddp")


@pytest.mark.slow
def test_the_worker_notebook_shows_progress_and_the_same_epoch_lines_during_training(on_loopback):
    _, outs, results = on_loopback
    assert_finished(results[:2])
    def epoch_lines(out):
        return re.findall(r"^epoch \d+/\d+: train loss.*\n  .*$", printed(out), re.M)   # with its 2nd line
    assert epoch_lines(outs["worker"]) and epoch_lines(outs["worker"]) == epoch_lines(outs["main"])
    nb = read(outs["worker"])
    widgets = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
               or "rank 1 epoch" in o.get("data", {}).get("text/plain", "") + o.get("text", "")]
    assert widgets, "no progress bar in the worker's notebook"


@pytest.mark.slow
def test_the_join_cell_names_the_interface_it_chose(on_loopback):
    _, outs, results = on_loopback
    assert_finished(results[:2])
    for rank, name in enumerate(("main", "worker")):
        assert f"rank {rank}: using interface lo (127.0.0.1) to reach master 127.0.0.1:" in printed(outs[name])


@pytest.mark.slow
def test_rank_0_shows_the_results_table_and_the_curves_from_its_run_folder(on_loopback):
    _, outs, results = on_loopback
    assert_finished(results)
    for name in ("main", "single"):
        [table, bound] = displayed(outs[name], "text/markdown")
        assert table.startswith("| run | ranks |") and "Acc@1" in table
        assert len(displayed(outs[name], "image/png")) == 2, "the curves and time-split figures are not shown inline"
        assert re.search(r"(compute-bound|bound by|communication|data loading).*(no GPU|GPU use)", bound), \
            "no sentence on what bound the run"
    # the worker wrote no run folder, but ends with the same table (the results are global)
    assert displayed(outs["worker"], "text/markdown") == displayed(outs["main"], "text/markdown")[:1]
    assert displayed(outs["worker"], "image/png") == []


@pytest.mark.slow
def test_only_rank_0_writes_one_run_folder_with_one_tensorboard_event_file(on_loopback):
    tmp, _, results = on_loopback
    assert_finished(results[:2])
    run_dir = tmp / "runs" / "ddp"
    assert len(list(run_dir.rglob("events.out.tfevents.*"))) == 1
    for name in ("settings.json", "results.json", "log.txt", "last.pt"):
        assert (run_dir / name).is_file(), name
    assert sorted(p.name for p in (tmp / "runs").iterdir()) == ["ddp", "single"]


@pytest.mark.slow
def test_single_runs_one_process_and_evaluates_the_same_validation_images(on_loopback):
    tmp, outs, results = on_loopback
    assert_finished(results[2:])
    single = global_results(outs["single"])
    assert single["world_size"] == 1 and single["global_batch_size"] == QUICK["BATCH_SIZE"]
    assert "model: Sequential" in printed(outs["single"])
    assert len(list((tmp / "runs" / "single").rglob("events.out.tfevents.*"))) == 1
    assert_finished(results[:2])
    assert single["val_images"] == global_results(outs["main"])["val_images"]  # each image once in DDP too


# -- execution across two hosts: network namespaces -------------------------------------------
@pytest.fixture
def two_hosts():
    with netns.two_hosts_or_skip("10.213.1") as hosts:
        yield hosts


@pytest.mark.slow
@pytest.mark.floor
def test_main_and_worker_train_across_two_hosts_given_only_master_addr(two_hosts, tmp_path):
    """Nothing but MASTER_ADDR points at host 1: the notebooks must pick the veth interface themselves.

    COMM, set the same in both notebooks as the lab's slow-link advice says, reaches DDP."""
    hosts = two_hosts
    port = free_port()
    ddp = {**DDP, "MASTER_ADDR": hosts.addrs[0], "MASTER_PORT": port, "DATA_DIR": str(tmp_path / "demo"),
           "RUN_DIR": str(tmp_path / "runs" / "ddp"), "COMM": "fp16"}
    outs = [tmp_path / "main.out.ipynb", tmp_path / "worker.out.ipynb"]
    results = run_all([papermill(MAIN, outs[0], ddp), papermill(WORKER, outs[1], ddp)], timeout=TIME_BOUND,
                      env=base_env(), prefix=[hosts.exec_prefix(0), hosts.exec_prefix(1)])
    assert_finished(results)
    assert_same_global_metrics(outs[0], outs[1], tmp_path / "runs" / "ddp")
    for rank, out in enumerate(outs):
        assert (f"rank {rank}: using interface {hosts.veths[rank]} ({hosts.addrs[rank]}) to reach master "
                f"{hosts.addrs[0]}:{port}") in printed(out)
    assert len(list((tmp_path / "runs").rglob("events.out.tfevents.*"))) == 1
    assert json.loads((tmp_path / "runs" / "ddp" / "results.json").read_text())["comm"] == "fp16"
    assert "gradient communication: fp16 (--comm fp16)" in printed(outs[0])


# -- at a student's pace: one cell at a time, reading between cells ----------------------------
@pytest.mark.slow
def test_main_and_worker_run_cell_by_cell_with_pauses_and_both_finish(tmp_path):
    """Two notebooks stepped through cell by cell: main reads 20 s before its model cell, the worker 10 s before
    its run cell, 25 s before its Train cell (longer than a collective may wait, COLLECTIVE_S, and than the
    watch's 15 s without a beat) and then 5 s and 15 s before its results and teardown cells, after main has left
    the process group. Every cell that needs the other rank waits for it; nothing counts the late rank as lost.
    The collective timeout is COLLECTIVE_S, not the kit's 60 s, set after the Settings cell as a student could
    (``settings.replace``; settings.json shows it): the pauses outlast it as 60 s ones would the kit's, 35 s sooner."""
    params = {**DDP, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(), "DATA_DIR": str(tmp_path / "demo"),
              "RUN_DIR": str(tmp_path / "runs" / "ddp"), "EPOCHS": 2, "INIT_TIMEOUT": 300}   # the notebooks' default
    pauses = {MAIN: {"prepare_model(": 20},   # then main runs on to its teardown cell while the worker still reads:
              WORKER: {"open_run(": 10, "fit(job)": 25, "results_table(": 5, "teardown()": 15}}
    after = {"print(describe_batch(settings))": f"settings = settings.replace(collective_timeout={COLLECTIVE_S})"}
    results = run_all([[sys.executable, "-m", "tests.helpers.run_cells", str(nb), json.dumps(params), json.dumps(pauses[nb]),
                        str(NOTEBOOKS), json.dumps(after)] for nb in (MAIN, WORKER)], timeout=TIME_BOUND + 90,
                      env=base_env())
    assert_finished(results)
    out = [r.output for r in results]
    assert "PAUSE 25 s" in out[1] and "PAUSE 20 s" in out[0] and "PAUSE 15 s" in out[1]
    assert json.loads((tmp_path / "runs" / "ddp" / "settings.json").read_text())["collective_timeout"] == COLLECTIVE_S
    assert "stopped answering" not in out[0] + out[1]
    lines = [re.findall(r"^epoch \d+/\d+: train loss.*$", o, re.M) for o in out]
    assert len(lines[0]) == 2 and lines[0] == lines[1]   # one run: the same global epoch lines on both ranks

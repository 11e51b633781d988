"""The package's shape as a reader meets it: four layers, one job per module said up front, no import
circles, no module over 600 lines, and the lesson core never importing the tools."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers.procs import REPO

PACKAGE = Path(REPO) / "ddp_utils"
LAYERS = ("robust", "speed", "tools")   # subpackages; the modules directly in ddp_utils/ are the lesson core
MAX_LINES = 600


def _name(path: Path) -> str:
    """ddp_utils/robust/heartbeat.py -> 'robust.heartbeat'; ddp_utils/train.py -> 'train'."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


FILES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if p.name not in ("__init__.py", "__main__.py")}
MODULES = sorted(FILES)


def layer_of(module: str) -> str:
    return module.split(".")[0] if module.split(".")[0] in LAYERS else "core"


def imports_of(module: str) -> set[str]:
    """The ddp_utils modules that ``module`` imports, at the top or inside functions."""
    package = module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(FILES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            if node.level - 1 > len(package):
                continue
            stem = base + (node.module.split(".") if node.module else [])
            found.add(".".join(stem))
            found.update(".".join(stem + [alias.name]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddp_utils."):
            stem = node.module.split(".")[1:]
            found.add(".".join(stem))
            found.update(".".join(stem + [alias.name]) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("ddp_utils."))
    return found & set(MODULES)


def test_the_modules_are_found_in_every_layer():
    """Guards the tests below: they see the modules of every layer (not an empty list)."""
    assert {layer_of(m) for m in MODULES} == {"core", *LAYERS}
    assert "robust.heartbeat" in imports_of("watch") and "robust.peers" in imports_of("robust.heartbeat")


def test_the_training_loop_reads_top_to_bottom_and_names_no_optional_feature():
    """Issue 44: fit was a hub (a 115-line _fit of 13 parameters, a 121-line train_one_epoch of 15, calling the
    watch, the profiler, local SGD and the rest by name). Each function of train.py is short with few parameters,
    and everything optional reaches the loop through the observer interface (observers.py) alone."""
    tree = ast.parse(FILES["train"].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            params = len(node.args.args) + len(node.args.kwonlyargs)
            assert node.end_lineno - node.lineno + 1 <= 60 and params <= 6, (node.name, params)
    layers = {layer_of(m) for m in imports_of("train")}
    assert "speed" not in layers, imports_of("train")   # the options reach it as observers alone
    identifiers = {getattr(node, field) for node in ast.walk(tree) for field in ("id", "attr", "name", "arg")
                   if isinstance(getattr(node, field, None), str)}
    for word in ("heartbeat", "profiler", "sgd", "powersgd", "gpu", "patience", "cost", "held", "probe", "memory"):
        assert not {i for i in identifiers if word in i.lower().split("_")}, f"train.py names {word}"


def test_no_code_outside_presets_branches_on_a_preset_or_lists_their_names():
    """Issue 44: adding CIFAR-100 meant four lists of preset names besides presets.py, and forgetting the memory
    loader's was silent. Only presets.py may name the presets in code (docstrings and messages aside)."""
    from ddp_utils.presets import PRESETS
    for module, path in FILES.items():
        if module == "presets":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            about_data = isinstance(node, ast.Compare) and re.search(r"dataset|preset|\.name\b", ast.unparse(node))
            if about_data or isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                names = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in PRESETS]
                assert not names, f"{module}.py line {node.lineno} names the preset(s) {names} in code"


def test_the_import_graph_has_no_cycle():
    graph = {m: imports_of(m) for m in MODULES}
    state: dict[str, str] = {}

    def visit(module, path):
        state[module] = "open"
        for nxt in sorted(graph[module]):
            if state.get(nxt) == "open":
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = "done"

    for module in MODULES:
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", [m for m in MODULES if layer_of(m) != "tools"])
def test_only_tools_import_tools(module):
    """The lesson core (and robust/, speed/) never import the command line, demo, launch or report."""
    assert not {m for m in imports_of(module) if layer_of(m) == "tools"}, module


def test_lower_layers_never_import_the_run_assembly():
    """datasets, memdata and distributed are the lesson's building blocks: they know nothing of a run."""
    for module in ("settings", "presets", "datasets", "speed.memdata", "distributed", "robust.rendezvous",
                   "robust.files"):
        assert not imports_of(module) & {"job", "train", "tools.cli", "runlog", "data"}, module


@pytest.mark.parametrize("module", MODULES)
def test_no_module_is_over_600_lines(module):
    lines = len(FILES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module}: {lines} lines; split it by job"


@pytest.mark.parametrize("module", MODULES + list(LAYERS))
def test_every_module_opens_with_a_comment_saying_its_one_job(module):
    path = PACKAGE / module / "__init__.py" if module in LAYERS else FILES[module]
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and len(doc.splitlines()[0]) > 20, f"{path} needs an opening docstring"


def test_the_readme_file_tree_lists_every_module_under_its_layer():
    readme = (Path(REPO) / "README.md").read_text()
    for layer in LAYERS:
        assert re.search(rf"^  {layer}/\s+\S", readme, re.M), f"README file tree lacks {layer}/"
    for module in MODULES:
        *folders, stem = module.split(".")
        indent = "  " * (len(folders) + 1)   # ddp_utils/ at the left margin, each folder two spaces in
        assert re.search(rf"^{indent}{stem}\.py\s+\S", readme, re.M), f"README file tree lacks {module}.py"

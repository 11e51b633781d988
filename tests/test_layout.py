"""The package's shape as a reader meets it: four layers and short functions (held by linters, run here as CI runs
them), one job per module said up front, no module over 600 lines, the loop naming no option."""
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


def test_the_layers_and_the_size_limits_hold(tmp_path):
    """Issue 54: the layers (.importlinter: tools/ on speed/ on the core on robust/, no import circles, no test
    module importing another) and the limits (at most 6 parameters a function: pyproject.toml's ruff; at most 60
    lines: .flake8) are the linters' job; here they run as .ci/run runs them, so the suite alone sees a break."""
    import os
    import subprocess
    import sys
    bin_dir = Path(sys.executable).parent
    for command in (["lint-imports"], ["ruff", "check", "ddp_utils"], ["flake8", "ddp_utils"]):
        done = subprocess.run([str(bin_dir / command[0]), *command[1:]], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "RUFF_CACHE_DIR": str(tmp_path / "ruff")})
        assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"


def _linted_copy(tmp_path: Path, breaks: dict[str, str]) -> dict[str, str]:
    """A copy of the package with `breaks` appended to the named modules; each linter's complaint, by command."""
    import os
    import shutil
    import subprocess
    import sys
    for item in ("ddp_utils", "tests", ".importlinter", "pyproject.toml", ".flake8"):
        source = Path(REPO) / item
        (shutil.copytree(source, tmp_path / item, ignore=shutil.ignore_patterns("__pycache__"))
         if source.is_dir() else shutil.copy(source, tmp_path / item))
    for module, code in breaks.items():
        with open(tmp_path / "ddp_utils" / module, "a") as handle:
            handle.write(code)
    bin_dir, said = Path(sys.executable).parent, {}
    for command in (["lint-imports", "--no-cache"], ["ruff", "check", "--no-cache", "ddp_utils"],
                    ["flake8", "ddp_utils"]):
        done = subprocess.run([str(bin_dir / command[0]), *command[1:]], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
        said[command[0]] = "" if done.returncode == 0 else done.stdout + done.stderr
    return said


def test_the_linters_refuse_a_core_module_importing_speed_and_a_long_or_wide_function(tmp_path):
    """The contracts bite: the core reaching up into speed/ (even inside a function), a seventh parameter and a
    sixty-first line are each refused, naming the place; without them the layers would be a wish."""
    long_body = "".join(f"    x{i} = {i}\n" for i in range(61))
    said = _linted_copy(tmp_path, {
        "train.py": "\n\ndef _reach_up():\n    from ddp_utils.speed import localsgd\n    return localsgd\n",
        "metrics.py": "\n\ndef _wide(a, b, c, d, e, f, g):\n    return a\n",
        "summary.py": f"\n\ndef _long():\n{long_body}    return 0\n"})
    assert "ddp_utils.train -> ddp_utils.speed.localsgd" in said["lint-imports"], said["lint-imports"][-2000:]
    assert "Contracts: 3 kept, 1 broken" in said["lint-imports"]
    assert "metrics.py" in said["ruff"] and "PLR0913" in said["ruff"], said["ruff"][-2000:]
    assert "summary.py" in said["flake8"] and "Function too long" in said["flake8"], said["flake8"][-2000:]


def test_the_training_loop_reads_top_to_bottom_and_names_no_optional_feature():
    """Issue 44: fit was a hub, calling the watch, the profiler, local SGD and the rest by name. Everything optional
    reaches the loop through the observer interface (observers.py) alone: train.py names none of it."""
    tree = ast.parse(FILES["train"].read_text())
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

"""The lab's data scripts (lab/scripts/, not a package), imported as modules."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.helpers.procs import REPO


SCRIPTS = Path(REPO) / "lab" / "scripts"


def load(name: str):
    """Import lab/scripts/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # importable by name, as pool workers started by a server process need
    if str(SCRIPTS) not in sys.path:
        sys.path.append(str(SCRIPTS))
    spec.loader.exec_module(module)
    return module

"""The newest leg's torch against its reviewed constraints: ``python tests/helpers/newest_torch.py`` (what .ci/run runs after the
README's test install) prints the versions and exits 1 with what to do where they differ from
tests/newest-constraints.txt, so CI never tests a torch nobody reviewed, nor says it tested one it did not."""
from __future__ import annotations

import re
import sys
from pathlib import Path

CONSTRAINTS = Path(__file__).resolve().parents[1] / "newest-constraints.txt"


def pinned(text: str | None = None) -> dict[str, str]:
    """``{"torch": "2.14.1", "torchvision": "0.29.1"}`` from the constraints file."""
    text = CONSTRAINTS.read_text(encoding="utf-8") if text is None else text
    return dict(re.findall(r"^(torch|torchvision)==(\S+)\s*$", text, re.M))


def mismatch(installed: dict[str, str], wanted: dict[str, str]) -> str | None:
    """None when every pinned package is installed at its version (a local tag such as +cu130 aside), else why not."""
    wrong = [f"{name} {installed.get(name) or 'missing'} (pinned {version})" for name, version in wanted.items()
             if (installed.get(name) or "").split("+")[0] != version]
    if not wrong:
        return None
    return (f"The newest leg runs {', '.join(wrong)}: pip resolved another release than tests/newest-constraints.txt "
            f"names. Install with the README's Tests line (pip install -c tests/newest-constraints.txt ...); if a newer "
            f"torch is out, run the whole suite on it first, then raise the constraints and the README's \"today\".")


def main() -> int:
    import torch
    import torchvision
    installed = {"torch": torch.__version__, "torchvision": torchvision.__version__}
    print(f"== newest leg: torch {installed['torch']}, torchvision {installed['torchvision']} "
          f"(tests/newest-constraints.txt: {', '.join(f'{k} {v}' for k, v in pinned().items())})", flush=True)
    problem = mismatch(installed, pinned())
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The README's shell blocks, as a reader types them: ``python tests/helpers/readme_blocks.py quick-start`` prints the bash
block under the heading "Quick start" (``tests`` the one under "Tests"). .ci/run runs the quick start's exactly as
printed, so the block a student types first is the block CI proves; tests/test_cli.py checks the Tests block's
commands are the ones CI runs."""
from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def block(heading: str, text: str | None = None) -> str:
    """The first ```bash block after the ``## <heading>`` line (``heading`` as words: quick-start = Quick start)."""
    text = README.read_text(encoding="utf-8") if text is None else text
    title = heading.replace("-", " ")
    section = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S | re.I)
    if not section:
        raise SystemExit(f"README.md has no '## {title}' section")
    code = re.search(r"^```bash\n(.*?)^```$", section.group(1), re.M | re.S)
    if not code:
        raise SystemExit(f"README.md's '## {title}' section has no ```bash block")
    return code.group(1)


def commands(heading: str, text: str | None = None) -> list[str]:
    """The block's commands without their comments."""
    return [line.split("  #")[0].strip() for line in block(heading, text).splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


if __name__ == "__main__":
    sys.stdout.write(block(sys.argv[1] if len(sys.argv) > 1 else "quick-start"))

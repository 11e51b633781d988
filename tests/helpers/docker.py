"""The container recipe as instructions: docker/Dockerfile's lines, continuation lines joined."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.procs import REPO


DOCKERFILE = Path(REPO) / "docker" / "Dockerfile"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """The Dockerfile as (INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    result, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue   # comments, also those between continuation lines
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            keyword, _, rest = current.strip().partition(" ")
            result.append((keyword.upper(), rest.strip()))
        current = ""
    return result


def runs() -> list[str]:
    return [args for keyword, args in instructions() if keyword == "RUN"]

#!/usr/bin/env bash
# The kit on the oldest torch it supports (the floor: NGC 25.01's torch 2.6, tests/floor-constraints.txt).
# Makes a venv of its own (or reuses it while the requirements are unchanged), installs the requirements
# under the floor's constraints, and runs the fast tier plus the multi-process tests whose path depends
# on torch's release (marked `floor`). Extra arguments go to pytest.
#   tests/floor.sh                       # FLOOR_VENV=DIR picks the venv's folder
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${FLOOR_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ddp-kit/venv-torch-floor}"
# What the venv was made from: when any of these files changes, pip brings it up to date.
wanted="$(cat tests/floor-constraints.txt requirements.txt requirements-dev.txt | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
fi
if [[ "$(cat "$venv/.ddp-kit-requirements" 2>/dev/null)" != "$wanted" ]]; then
    echo "floor.sh: installing the requirements under tests/floor-constraints.txt into $venv" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        -c tests/floor-constraints.txt -r requirements-dev.txt
    echo "$wanted" > "$venv/.ddp-kit-requirements"
fi

want="$(sed -n 's/^torch==//p' tests/floor-constraints.txt)"
have="$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
if [[ "$have" != "$want" ]]; then
    echo "floor.sh: $venv has torch $have, not the floor's $want; delete that folder and run again" >&2
    exit 1
fi
echo "floor.sh: torch $have in $venv" >&2
# The kit is not installed into this venv: it is imported from this checkout, as the container does (PYTHONPATH).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The venv's own tools (shellcheck, hadolint from their wheels) first on the PATH, as an activated venv has them:
# the tests find them there, not in whatever venv the caller happens to have active.
export PATH="$venv/bin:$PATH"
exec "$venv/bin/python" -m pytest -n 2 -m "floor or not slow" "$@"   # -n 2: both cores (pytest-xdist)

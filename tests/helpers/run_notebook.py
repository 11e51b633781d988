"""Run one notebook as papermill's CLI does, with its kernel on Unix sockets instead of TCP ports.

``python -m tests.helpers.run_notebook NOTEBOOK OUT PARAMS_JSON CWD`` is ``papermill NOTEBOOK OUT -y PARAMS_JSON --cwd CWD
-k python3 --log-output``. Why not the CLI: jupyter_client picks five free TCP ports, closes them and lets the kernel
bind them a moment later. With five kernels and their gloo connections starting at once, another process can take
one in between, and the kernel dies ("Address already in use ... Kernel died before replying to kernel_info"; CI
hit it). Socket files in a private folder cannot be taken by anyone else.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import papermill
from jupyter_client.manager import AsyncKernelManager

from tests.helpers import zygote


def main(notebook: str, out: str, params: str, cwd: str) -> None:
    with tempfile.TemporaryDirectory(prefix="kernel-") as sockets:
        km = AsyncKernelManager(kernel_name="python3", transport="ipc", ip=str(Path(sockets) / "k"))
        zygote.kernel_from_fork_server(km)
        papermill.execute_notebook(notebook, out, parameters=json.loads(params), kernel_name="python3",
                                   cwd=cwd, log_output=True, progress_bar=False, km=km)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Run one notebook as a student does: cell by cell, reading between cells.

``python -m tests.helpers.run_cells NOTEBOOK PARAMS_JSON PAUSES_JSON CWD [AFTER_JSON]``

Executes the code cells one at a time in a fresh kernel started in CWD, with PARAMS_JSON's values set right
after the ``parameters`` cell (as papermill injects them). PAUSES_JSON maps a piece of a cell's code (e.g.
``"fit(job)"``) to the seconds to wait before running that cell; AFTER_JSON a piece of a cell's code to code run
as a cell of its own right after that cell (a student's line, say ``settings = settings.replace(...)``). Prints
each cell's output as it comes, ``CELL n: ok`` after each cell, and exits 1 at the first cell that raises (its
error printed). Kernels talk over Unix sockets, for the reason tests/helpers/run_notebook.py gives.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from jupyter_client.manager import KernelManager

from tests.helpers import zygote
from tests.helpers.notebook_cells import read


def _show(msg) -> None:
    content = msg["content"]
    if msg["msg_type"] == "stream":
        print(content["text"], end="", flush=True)
    elif msg["msg_type"] in ("execute_result", "display_data"):
        print(content["data"].get("text/plain", ""), flush=True)
    elif msg["msg_type"] == "error":
        print("\n".join(content["traceback"]), flush=True)


def main(notebook: str, params: str, pauses: str, cwd: str, after: str = "{}") -> int:
    values, waits, added = json.loads(params), json.loads(pauses), json.loads(after)
    cells = []
    for cell in read(notebook).cells:
        if cell.cell_type != "code":
            continue
        cells.append(cell.source)
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            cells.append("\n".join(f"{name} = {value!r}" for name, value in values.items()))
        cells += [code for piece, code in added.items() if piece in cell.source]
    with tempfile.TemporaryDirectory(prefix="kernel-") as sockets:
        km = KernelManager(kernel_name="python3", transport="ipc", ip=str(Path(sockets) / "k"))
        zygote.kernel_from_fork_server(km)
        km.start_kernel(cwd=cwd)
        client = km.client()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=60)
            for n, source in enumerate(cells):
                pause = sum(seconds for piece, seconds in waits.items() if piece in source)
                if pause:
                    print(f"PAUSE {pause} s before cell {n}", flush=True)
                    time.sleep(pause)
                reply = client.execute_interactive(source, output_hook=_show, timeout=600)
                if reply["content"]["status"] != "ok":
                    print(f"CELL {n}: {reply['content'].get('ename')}", flush=True)
                    return 1
                print(f"CELL {n}: ok", flush=True)
        finally:
            client.stop_channels()
            km.shutdown_kernel(now=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

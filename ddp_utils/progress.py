"""Progress of an epoch: a live bar on a terminal or in Jupyter, plain lines when output is piped.

Every rank shows its own bar (labelled with its rank: its own steps, and its own data wait at each
log point); the lines (log points with ``steps``, and the epoch lines) hold the global, reduced
numbers, the same on every rank.

A bar redraws itself with ``\\r`` several times a second: right in a terminal or a notebook, hundreds
of garbage frames per epoch in a log file or CI output. So the ``progress`` setting's ``auto`` shows a
bar only where one can be drawn, and piped output gets the epoch lines alone; ``steps`` adds one line
per log point (every ``log_every`` steps), ``bar`` forces the bar, ``off`` shows neither.
"""
from __future__ import annotations

import sys


def interactive() -> bool:
    """True in a terminal or a Jupyter kernel, where a progress bar can redraw itself."""
    if "ipykernel" in sys.modules:
        try:
            from IPython import get_ipython
            if get_ipython() is not None and "IPKernelApp" in get_ipython().config:
                return True
        except ImportError:
            pass
    return sys.stderr.isatty()


class Progress:
    """One epoch's progress on this rank: ``update()`` per step, ``log_point(...)`` per log point."""

    def __init__(self, mode: str, total: int, desc: str, show: bool, print_line=print, rank: int | None = None):
        self.show_bar = show and (mode == "bar" or (mode == "auto" and interactive()))
        self.show_lines = show and mode == "steps"
        self.desc, self.total, self.print_line = desc, total, print_line
        self.bar = None
        self.data_wait = 0.0
        if self.show_bar:
            from tqdm.auto import tqdm   # a widget in Jupyter, text on a terminal
            from tqdm.notebook import tqdm as widget
            label = desc if rank is None else f"rank {rank} {desc}"   # whose steps these are
            # A bar of one length on every line: a widget keeps its own width (filling the row, it shrank
            # when the numbers after it appeared); on a terminal the bar has a fixed number of characters.
            # No it/s and no percentage (the epoch lines give img/s): short enough to sit beside the bar.
            numbers = "{n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
            bar = "{bar}" if issubclass(tqdm, widget) else "|{bar:24}|"
            self.bar = tqdm(total=total, desc=label, leave=True, bar_format="{desc}: " + bar + " " + numbers)
            row = getattr(self.bar, "container", None)   # the widget's row: label, bar, numbers
            if row is not None:   # in a narrow output the numbers go below the bar instead of squeezing it
                row.layout.flex_flow = "row wrap"
                row.children[1].layout.flex = "0 0 auto"

    def update(self, data_wait: float = 0.0) -> None:
        """One step done; ``data_wait``: this rank's share of the epoch so far spent waiting for data."""
        self.data_wait = data_wait
        if self.bar is not None:
            self.bar.update(1)

    def log_point(self, step_in_epoch: int, loss: float, acc1: float, lr: float) -> None:
        if self.bar is not None:
            # In the epoch line's order (set_postfix would sort the names).
            self.bar.set_postfix_str(f"loss={loss:.3f}, acc1={acc1:.1f}, data={100 * self.data_wait:.0f}%")
        if self.show_lines:
            self.print_line(f"{self.desc} step {step_in_epoch}/{self.total}: loss {loss:.4f} "
                            f"acc1 {acc1:.2f} lr {lr:.4g}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

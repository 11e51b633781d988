"""The progress bar a rank shows: one length on every line, and its numbers in the epoch line's order.

In Jupyter the bar is a widget (the browser test, test_jupyterlab.py, measures it on the page); on a
terminal it is text redrawn with ``\\r``, which these tests read frame by frame.
"""
from __future__ import annotations

import re

from ddp_utils.progress import Progress


def frames(err: str) -> list[str]:
    """Every state of the text bar, as the terminal drew it."""
    return [f.strip() for f in err.split("\r") if "|" in f]


def test_the_text_bar_keeps_its_length_when_the_numbers_after_it_appear(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")   # a terminal's width: a bar filling it shrank as text was added
    progress = Progress("bar", total=6, desc="epoch 1/2", show=True, rank=1)
    for step in range(1, 7):
        progress.update(data_wait=0.07)
        if step % 3 == 0:
            progress.log_point(step, loss=1.2345 / step, acc1=100.0 * step / 6, lr=0.1)
    progress.close()
    shown = frames(capsys.readouterr().err)
    assert any("loss=" in f for f in shown) and any("loss=" not in f for f in shown), shown
    bars = {len(f.split("|")[1]) for f in shown}
    assert bars == {24}, shown
    assert all(f.startswith("rank 1 epoch 1/2:") for f in shown), shown


def test_the_numbers_after_the_bar_keep_the_epoch_lines_order(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    progress = Progress("bar", total=4, desc="epoch 1/1", show=True)
    progress.update(data_wait=0.07)
    progress.log_point(1, loss=2.3456, acc1=9.5, lr=0.1)
    progress.update(data_wait=0.125)
    progress.log_point(2, loss=0.4321, acc1=87.5, lr=0.1)
    progress.close()
    postfixes = [re.search(r"loss=.*?%", f).group(0) for f in frames(capsys.readouterr().err) if "loss=" in f]
    assert postfixes[0] == "loss=2.346, acc1=9.5, data=7%"   # loss first, as in the epoch line
    assert postfixes[-1] == "loss=0.432, acc1=87.5, data=12%"


def test_piped_output_gets_no_bar_unless_asked(capsys):
    progress = Progress("auto", total=3, desc="epoch 1/1", show=True)   # pytest's output is no terminal
    progress.update()
    progress.close()
    assert capsys.readouterr().err == ""

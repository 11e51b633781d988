"""The benchmarks' figures in the pages, pasted from the files the benchmarks write.

Every benchmark writes ``benchmarks/results/NAME.json`` (its command, the machine, how busy the machine
was, the date and commit, its table and figures: ``benchmarks/results.py``). The tables and the sentences
with figures in docs/benchmarks.md, docs/faults.md and the README sit between cog markers that call
the functions below, so a page quotes only what a file says, with the machine beside it::

    python benchmarks/data_loading.py       # writes benchmarks/results/data_loading.json
    python docs/quotes.py pages             # pastes it (and every quoted output) into the pages

``tests/test_figures.py`` fails while a page and a results file disagree, and when a results file lacks
its command or machine.
"""
from __future__ import annotations

import json
import re
import string
import textwrap
from pathlib import Path

from docs.quotes import WIDTH, _out   # the pages' line width, and cog's output

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def bench(name: str) -> dict:
    """The results file of one benchmark run."""
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def machine_of(name: str) -> str:
    """'an idle 2-core AMD EPYC VM (23.5 GiB, no GPU), torch 2.14.1, 2026-11-25': where a file's figures come from."""
    r = bench(name)
    m = r["machine"]
    others = r["other_processes_cores"]
    busy = "an idle" if others < 0.2 else f"a busy (other processes used {others:.1f} cores meanwhile)"
    return f"{busy} {hardware(m)}, torch {m['torch']}, {r['date']}"


def cpu(m: dict) -> str:
    """'Intel Xeon Processor' for 'Intel(R) Xeon(R) Processor': the CPU's name without its marks."""
    return re.sub(r"\((R|TM)\)", "", m["cpu"], flags=re.I)


def hardware(m: dict) -> str:
    """'2-core AMD EPYC VM (24 GiB, no GPU)' from a results file's machine."""
    return (f"{m['cores']}-core {cpu(m)} {'VM' if m.get('virtual') else 'machine'} "
            f"({m['memory_gib']:.0f} GiB, {m['gpu'] or 'no GPU'})")


class _Figures(string.Formatter):
    """``{f[ratio][single_node]:.2f}``: a figure of the file; ``{command}``, ``{machine}``, ``{where}``,
    ``{args[rounds]}``; ``{x:pm0}`` a {mean, std} pair as 'mean +- std' with 0 decimals; ``{x:pc}`` a share as '8 %'."""

    def format_field(self, value, spec):
        if spec == "pc":          # a share as the pages write it: '8 %'
            return f"{100 * value:.0f} %"
        if spec.startswith("pm"):
            digits = int(spec[2:] or 0)
            return f"{value['mean']:.{digits}f} +- {value['std']:.{digits}f}"
        return super().format_field(value, spec)


def where(name: str) -> str:
    """'a 2-core AMD EPYC VM': the machine in a few words (the README's), the whole of it being on the linked page."""
    m = bench(name)["machine"]
    return f"a {m['cores']}-core {cpu(m)} {'VM' if m.get('virtual') else 'machine'}" + (f", {m['gpu']}" if m["gpu"]
                                                                                           else "")


def fill(name: str, template: str, **more) -> str:
    r = bench(name)
    return _Figures().format(template, f=r["figures"], command=f"`{r['command']}`", machine=machine_of(name),
                             where=where(name), args=r["args"], **more)


def say(name: str, template: str, hang: int = 0, **more) -> None:
    """Cog: a paragraph with the figures of benchmarks/results/NAME.json filled in, wrapped as the pages are
    (``hang``: the indent of the lines after the first, 2 in a list item)."""
    _paragraph(fill(name, template, **more), hang)


def _paragraph(text: str, hang: int = 0) -> None:
    _out(textwrap.fill(" ".join(text.split()), WIDTH, subsequent_indent=" " * hang, break_on_hyphens=False,
                       break_long_words=False))


def table(name: str, rows: list[str] | None = None, apart: bool = False) -> None:
    """Cog: the benchmark's own Markdown table, or ``rows`` (templates) filled with its figures (``apart``: with a
    blank line before and after, between two paragraphs)."""
    text = "\n".join(fill(name, row) for row in rows) if rows else "\n".join(bench(name)["table"])
    _out(f"\n{text}\n" if apart else text)


# -- sentences whose words depend on the figures ------------------------------------------------------
def faster(ratio: float, than: str = "one rank") -> str:
    """'faster than one rank' / 'slower than one rank' / 'as fast as one rank'."""
    if abs(ratio - 1) < 0.03:
        return f"about as fast as {than}"
    return f"{'faster' if ratio > 1 else 'slower'} than {than}"


def chose(name: str, key: str) -> str:
    """What ``--comm auto`` chose in the runs of ``key``: '`localsgd`', or '`fp16` in some runs and `localsgd` in
    the others' where the seeds' probes fell on either side of a threshold."""
    found = [f"`{c}`" for c in bench(name)["figures"][key]["chose"]]
    return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} in some runs and {found[-1]} in the others"


def auto_against_none(name: str = "comm_hooks-auto", link: str = "1gbit") -> dict:
    """``comm=auto`` against ``none`` on one link, seed by seed: ``diff`` (Acc@1 points, auto minus none, a seed
    each), ``speed_ok`` (auto at 0.95 or more of the unshaped link's images/s), ``acc_ok`` (mean gap within 1 point)."""
    f = bench(name)["figures"]
    auto, none = f[f"{link}/auto"], f[f"{link}/none"]
    diff = [a - n for a, n in zip(auto["acc1"]["values"], none["acc1"]["values"])]
    return {"diff": diff, "speed_ok": auto["of_unshaped"]["mean"] >= 0.95,
            "acc_ok": abs(sum(diff) / len(diff)) <= 1.0}


def releases(template: str) -> None:
    """Cog: ``template`` with the probes of every benchmarks/results/torch_releases-*.json (one per torch release):
    {releases} '2.6.0, 2.7.1, ...', {hung} '2 of 3 on 2.6.0, 2.7.1; 0 of 3 on ...', {agrees}, {machine} (the
    hardware, and the releases probed beside other load)."""
    runs = sorted((bench(p.stem) for p in RESULTS.glob("torch_releases-*.json")),
                  key=lambda r: tuple(int(x) for x in re.findall(r"\d+", r["figures"]["release"])[:3]))
    by_count: dict[str, list[str]] = {}
    for r in runs:
        f = r["figures"]
        by_count.setdefault(f"{f['destroy_hung']} of {f['destroy_runs']}", []).append(f["release"])
    hung = "; ".join(f"{count} on {', '.join(found)}" for count, found in by_count.items())
    wrong = [r["figures"]["release"] for r in runs if not r["figures"]["compat_agrees"]]
    agrees = "it did on each" if not wrong else f"it did not on {', '.join(wrong)}"
    machines = {hardware(r["machine"]) for r in runs}
    busy = [f"{r['figures']['release']} ({r['other_processes_cores']:.1f})" for r in runs
            if r["other_processes_cores"] >= 0.2]
    machine = "a " + " / a ".join(sorted(machines)) + (f"; other processes used cores (in brackets) beside "
                                                      f"{', '.join(busy)}" if busy else "")
    text = template.format(releases=", ".join(r["figures"]["release"] for r in runs), hung=hung, agrees=agrees,
                           machine=machine)
    _paragraph(text)

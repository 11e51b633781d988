"""Memory per rank, measured against the ZeRO formula: DDP, ZeRO-1 and FSDP side by side (results.json's ``memory``)."""
from __future__ import annotations

from .runs import MODE_NAMES, parallel_mode

PARTS = (("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer state"))


def size(n) -> str:
    """``282 KB``, ``44.7 MB``, ``1.20 GB``: bytes with three significant digits (1 KB = 1000 bytes)."""
    if not isinstance(n, (int, float)):
        return str(n)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{n:.0f} B"


def shows_memory(runs: list[dict]) -> bool:
    """Whether a report gets the memory table: some run sharded (ZeRO-1, FSDP) and recorded its memory."""
    return any(parallel_mode(run) in ("zero1", "fsdp") and run.get("memory") for run in runs)


def fullest(run: dict, key: str) -> int:
    """The largest of the ranks' measured bytes for ``key``: what must fit on every rank."""
    return max(row[key] for row in run["memory"]["per_rank"])


def _against(run: dict, ddp: dict | None, key: str) -> str:
    if ddp is None or run is ddp or not fullest(ddp, key):
        return ""
    return f", {fullest(run, key) / fullest(ddp, key):.2f}x DDP"


def memory_table(runs: list[dict]) -> str:
    """Markdown: one row per run that recorded its memory: mode, ranks, each part's bytes on the fullest rank,
    measured (predicted by the formula) and against the DDP run of as many ranks, FSDP's working copy, the
    allocator's peak and the time per step; notes with the formula follow."""
    runs = [run for run in runs if run.get("memory")]
    ddp = {run["world_size"]: run for run in runs if parallel_mode(run) == "ddp"}
    lines = ["| run | mode | ranks | " + " | ".join(name for _, name in PARTS)
             + " | FSDP working copy | peak | step time |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:
        memory, mode = run["memory"], parallel_mode(run)
        base = ddp.get(run["world_size"])
        cells = [f"{size(fullest(run, key))} ({size(memory['predicted'][key])}){_against(run, base, key)}"
                 for key, _ in PARTS]
        copy = size(memory["predicted"]["working_copy_bytes"]) if mode == "fsdp" else "-"
        step = f"{1e3 * run['measured_step_s']:.0f} ms" if run.get("measured_step_s") else "-"
        lines.append(f"| {run['name']} | {MODE_NAMES.get(mode, mode)} | {run['world_size']} | {' | '.join(cells)} "
                     f"| {copy} | {size(memory['peak_bytes'])} | {step} |")
    first = runs[0]["memory"]
    notes = [f"Each part: the fullest rank's bytes, summed over its own tensors (an FSDP parameter counts its local "
             f"shard), at the end of training; in brackets the ZeRO paper's prediction with P = "
             f"{first['params']:,} fp32 parameters, K = {first['k']} bytes of optimizer state per parameter "
             f"(SGD's momentum; Adam's would be 8) and N ranks: DDP 4P + 4P + KP, ZeRO-1 4P + 4P + KP/N, FSDP "
             f"(4P + 4P + KP)/N plus the working copy 4B of its largest unit of B parameters, all-gathered while "
             f"that unit computes (predicted only: it is freed after). x DDP: against the DDP run with as many ranks "
             f"(docs/zero-fsdp.md).",
             "Peak: torch.cuda.max_memory_allocated on a GPU (everything together: the parts above, the activations "
             "and the working copies); a CPU keeps no such figure. Step time: train time per optimizer step."]
    return "\n".join(lines + [""] + [f"- {note}" for note in notes])

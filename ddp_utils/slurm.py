"""SLURM: the master host from ``SLURM_JOB_NODELIST`` (``node[01-04]`` -> ``node01``) for ``Settings.from_env``.

``srun`` starts one task per GPU and tells each its place in ``SLURM_PROCID`` (rank), ``SLURM_NTASKS``
(world size) and ``SLURM_LOCALID`` (GPU index on its node); ``Settings.from_env`` reads those when
torchrun's ``RANK`` is absent. The master is ``MASTER_ADDR`` if set, else the first host of the job's
node list: ``scontrol show hostnames`` expands it where SLURM is installed; elsewhere (tests, a login
node without SLURM's tools) ``expand_nodelist`` parses the compressed forms SLURM writes:
``node[01-04,07]``, ``a,b``, ``gpu[1-2]-ib,login1``. Plain data and the standard library, no torch.
"""
from __future__ import annotations

import re
import shutil
import subprocess


def first_host(nodelist: str) -> str:
    """The first host name of a SLURM node list: where rank 0 runs (tasks are placed in node order)."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=10)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.SubprocessError):
            pass   # fall back to parsing it ourselves
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} names no host; set MASTER_ADDR to rank 0's node")
    return hosts[0]


def expand_nodelist(nodelist: str) -> list[str]:
    """``"node[01-03],login1"`` -> ``["node01", "node02", "node03", "login1"]`` (zero padding kept)."""
    return [host for part in _split_top_level(nodelist.strip()) for host in _expand_one(part)]


def _split_top_level(text: str) -> list[str]:
    """Split on the commas that are not inside brackets: ``a[1,2],b`` -> ``["a[1,2]", "b"]``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(name: str) -> list[str]:
    """One host expression, possibly with several bracket groups (``rack[1-2]-n[01-02]``)."""
    match = re.search(r"\[([^\]]*)\]", name)
    if not match:
        return [name]
    head, tail = name[:match.start()], name[match.end():]
    out = []
    for item in match.group(1).split(","):
        low, _, high = item.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"cannot read the SLURM node list entry {name!r}; set MASTER_ADDR to rank 0's node")
        for n in range(int(low), int(high or low) + 1):
            out += [f"{head}{n:0{len(low)}d}{rest}" for rest in _expand_one(tail)]
    return out

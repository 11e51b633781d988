"""Single vs DataParallel vs DDP on one node, with the devices it has (lab 4).

The comparison is made for a node with 2+ GPUs, but the homework's nodes have one GPU each (a T4 on a
g4dn.2xlarge, an A10G on a g5.2xlarge) and a laptop has none. On every node the same three runs are made,
and ``NodeModes.describe()`` says plainly what each can show there::

    GPUs      DataParallel                               DDP (processes on this node)
    0 (CPU)   nothing to split: torch calls the model    2 processes over gloo, sharing the CPU cores
    1         nothing to split: torch calls the model    2 processes sharing the GPU over gloo
              (DP's code path, not its cost)             (NCCL cannot share one GPU between ranks)
    2+        every GPU: replicate, scatter, gather      one process per GPU over nccl
              at every step

``node_modes()`` reads the node; the lab notebook trains ``parallel="none"`` and ``parallel="dp"`` in its
kernel and DDP with ``launch(settings, nproc_per_node=modes.ddp_ranks, share_gpu=modes.share_gpu)``.
"""
from __future__ import annotations

import dataclasses
import textwrap

import torch


@dataclasses.dataclass(frozen=True)
class NodeModes:
    """What lab 4 runs on a node with ``gpus`` GPUs (named ``gpu_name``)."""
    gpus: int
    gpu_name: str = ""

    @property
    def label(self) -> str:
        """For run folder names: ``cpu``, ``1gpu``, ``4gpus``."""
        return "cpu" if not self.gpus else f"{self.gpus}gpu" + ("s" if self.gpus > 1 else "")

    @property
    def splits(self) -> bool:
        """Whether DataParallel splits each batch here (2+ GPUs); else torch calls the model itself."""
        return self.gpus >= 2

    @property
    def ddp_ranks(self) -> int:
        """DDP's processes on this node: one per GPU, and at least 2 (sharing the GPU or the CPU)."""
        return max(self.gpus, 2)

    @property
    def share_gpu(self) -> bool:
        """Whether DDP's processes share one GPU (``launch(share_gpu=True)``; they agree on gloo)."""
        return self.gpus == 1

    def describe(self) -> str:
        """A few lines: the devices, and what each of the three runs does and can show on them."""
        if self.gpus >= 2:
            head = f"{self.gpus} GPUs ({self.gpu_name}): the comparison as meant."
            dp = (f"DataParallel over all {self.gpus} GPUs from one process: each step copies the weights from "
                  f"GPU 0 to the others, splits the batch and gathers the outputs on GPU 0")
            ddp = f"DDP with {self.gpus} processes, one per GPU, over nccl"
        elif self.gpus == 1:
            head = (f"1 GPU ({self.gpu_name}), as on the homework's nodes: a rehearsal. The questions on GPU 0 vs "
                    f"the others need a node with 2+ GPUs.")
            dp = ("DataParallel over 1 GPU: nothing to split, torch calls the model itself: DP's code path, not "
                  "its cost (replicating and gathering need 2+ GPUs)")
            ddp = ("DDP with 2 processes sharing the GPU over gloo (NCCL cannot share one GPU between ranks): "
                   "DDP's start-up and all-reduce, not its speed-up (the two take turns on one GPU)")
        else:
            head = "No GPU: a rehearsal on the CPU (a laptop). The questions on GPU use need a GPU node."
            dp = ("DataParallel on the CPU: nothing to split (DataParallel splits over GPUs only), torch calls "
                  "the model itself")
            ddp = "DDP with 2 processes over gloo, sharing the CPU cores"
        single = "single: one process" + (" on GPU 0" if self.gpus else " on the CPU")
        # lines under 100 characters: a notebook wraps longer ones mid-word
        lines = textwrap.wrap(head, 100)
        for i, run in enumerate((single, dp, ddp), 1):
            lines += textwrap.wrap(run, 100, initial_indent=f"  {i}. ", subsequent_indent="     ")
        return "\n".join(lines)


def node_modes(gpus: int | None = None) -> NodeModes:
    """This node's ``NodeModes``, from the GPUs PyTorch sees (``gpus`` given: that many, for a plan)."""
    if gpus is None:
        gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0) if gpus and torch.cuda.is_available() else ""
    return NodeModes(gpus, name)

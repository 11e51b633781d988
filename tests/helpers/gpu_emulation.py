"""What a GPU node's PyTorch answers, for tests on a CPU: ``pretend_gpu(monkeypatch-like setter, ...)``.

Only the questions the kit asks are answered (is there a GPU, how many, which one, its name and compute
capability, whether it has bf16); nothing runs on it, so a test must stop before a tensor would go there.
"""
from __future__ import annotations

import types

import torch

T4 = {"name": "Tesla T4", "capability": (7, 5), "uuid": "GPU-t4-0000"}
A100 = {"name": "NVIDIA A100-SXM4-40GB", "capability": (8, 0), "uuid": "GPU-a100-0000"}


def pretend_gpu(setattr_, gpu: dict, count: int = 1) -> None:
    """Make torch.cuda answer as on a node with ``count`` GPUs like ``gpu`` (T4, A100 or your own dict).

    ``setattr_`` is ``monkeypatch.setattr`` in a test, or plain ``setattr`` in a scenario process."""
    props = types.SimpleNamespace(name=gpu["name"], major=gpu["capability"][0], minor=gpu["capability"][1],
                                  uuid=gpu["uuid"], pci_bus_id=0, total_memory=16 << 30)
    cuda = torch.cuda
    setattr_(cuda, "is_available", lambda: True)
    setattr_(cuda, "device_count", lambda: count)
    setattr_(cuda, "set_device", lambda device: None)
    setattr_(cuda, "current_device", lambda: 0)
    setattr_(cuda, "get_device_name", lambda device=None: gpu["name"])
    setattr_(cuda, "get_device_capability", lambda device=None: tuple(gpu["capability"]))
    setattr_(cuda, "get_device_properties", lambda device=None: props)
    # torch's own answer on a T4 is True, by emulation: the trap the kit must not fall into
    setattr_(cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation or gpu["capability"] >= (8, 0))

"""A layer-by-layer model summary, like the ``torchsummary`` / Keras tables students know.

    print(model_summary(model, (3, 32, 32)))      # input_shape without the batch dimension

    Layer (type)            Output shape       Params
    =================================================
    conv1 (Conv2d)          [2, 16, 32, 32]       448
    ...

It runs one forward pass on a dummy batch of 2 zeros (no random numbers are drawn, so the
training RNG is untouched) with forward hooks on the layers, in eval mode and without gradients.
DDP, DataParallel and torch.compile wrappers are unwrapped first, so the pass runs on the plain
module on this rank alone: no collective, no deadlock when only rank 0 calls it. An FSDP model's forward
all-gathers its weights (a collective): the table comes from a meta-device copy taken before sharding
(its mode's ``blueprint``, parallel.py), shapes without data.
"""
from __future__ import annotations

import torch
from torch import nn

from . import parallel
from .model import unwrap


def model_summary(model: nn.Module, input_shape: tuple) -> str:
    """A table of every layer's output shape and parameter count, then the totals.

    ``input_shape`` is one sample's shape, e.g. ``(3, 224, 224)``; a batch of 2 is fed.
    A row is written per call of each leaf module (a module without children) and of each module
    that owns parameters itself (a ViT's class token); a module called twice gets two rows, with
    its parameters counted on the first only, so the column adds up to the total.
    """
    net = unwrap(model)
    model = parallel.of_state(net).blueprint(net)   # FSDP: its meta-device copy (the real one's forward all-gathers)
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    dummy = torch.zeros(2, *input_shape, device=device, dtype=dtype)
    rows = _layer_rows(model, dummy)

    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    size_mb = sum(p.numel() * p.element_size() for p in params) / 2**20
    not_called = total - sum(n for _, _, n in rows)

    header = ("Layer (type)", "Output shape", "Params")
    lines = [(layer, shape, f"{n:,}") for layer, shape, n in rows]
    w1 = max(len(r[0]) for r in [header, *lines])
    w2 = max(len(r[1]) for r in [header, *lines])
    w3 = max(len(r[2]) for r in [header, *lines])
    width = w1 + w2 + w3 + 4

    def fmt(row):
        return f"{row[0]:<{w1}}  {row[1]:<{w2}}  {row[2]:>{w3}}"

    out = [fmt(header), "=" * width, *map(fmt, lines), "=" * width,
           f"Input: {list(dummy.shape)} (a dummy batch of 2, {dtype}, on {device})",
           f"Total params: {total:,}",
           f"Trainable params: {trainable:,}",
           f"Non-trainable params: {total - trainable:,}",
           f"Params size (MB): {size_mb:.2f}"]
    if not_called:
        out.append(f"Params of modules not called in this forward pass: {not_called:,}")
    return "\n".join(out) + "\n"


def _layer_rows(model: nn.Module, dummy: torch.Tensor) -> list[tuple[str, str, int]]:
    """``(layer, output shape, parameters)`` of each call of a leaf module (or one that owns parameters) in a
    forward of ``dummy``, in eval mode (BatchNorm must not learn from a dummy batch), every module's mode put back."""
    rows = []          # (layer, output shape, parameters)
    counted = set()    # ids of parameters already in a row (shared layers, tied weights)

    def record(name):
        def hook(module, inputs, output):
            new = [p for p in module.parameters(recurse=False) if id(p) not in counted]
            counted.update(id(p) for p in new)
            rows.append((f"{name or 'model'} ({type(module).__name__})", _shape(output),
                         sum(p.numel() for p in new)))
        return hook

    hooks = [module.register_forward_hook(record(name)) for name, module in model.named_modules()
             if _is_leaf(module) or _owns_parameters(module)]
    modes = {module: module.training for module in model.modules()}
    try:
        model.eval()  # BatchNorm must not update its running statistics on a dummy batch
        with torch.no_grad():
            model(dummy)
    finally:
        for hook in hooks:
            hook.remove()
        for module, training in modes.items():  # restore each one: some may be frozen on purpose
            module.training = training
    return rows


def _is_leaf(module: nn.Module) -> bool:
    return next(module.children(), None) is None


def _owns_parameters(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def _shape(output) -> str:
    """``[2, 64, 16, 16]`` for a tensor; shapes joined for tuples, lists and dicts."""
    if isinstance(output, torch.Tensor):
        return str(list(output.shape))
    if isinstance(output, (tuple, list)):
        return ", ".join(_shape(o) for o in output)
    if isinstance(output, dict):
        return ", ".join(f"{k}: {_shape(v)}" for k, v in output.items())
    return type(output).__name__

"""The kit's own small models (the registry, architectures.py, names them with their facts)."""
from __future__ import annotations

from torch import nn


def _conv_block(c_in: int, c_out: int, norm: str) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                         nn.BatchNorm2d(c_out) if norm == "bn" else nn.GroupNorm(8, c_out),
                         nn.ReLU(inplace=True))


def convnet(num_classes: int, width: int = 32, norm: str = "bn") -> nn.Sequential:
    """A small CNN for 32x32 images that trains in seconds on a CPU. Input (N, 3, H, W) -> (N, classes).

    norm="bn": BatchNorm, whose statistics are per rank under DDP (sync_bn makes them global on GPUs).
    norm="gn": GroupNorm normalises each image on its own, so 2 ranks x batch b compute exactly what
    1 process x batch 2b does (the tests use it to check DDP's gradient averaging); it trains slower.
    """
    w = width
    return nn.Sequential(
        _conv_block(3, w, norm), _conv_block(w, w, norm), nn.MaxPool2d(2),              # 32 -> 16 px
        _conv_block(w, 2 * w, norm), _conv_block(2 * w, 2 * w, norm), nn.MaxPool2d(2),  # 16 -> 8 px
        _conv_block(2 * w, 4 * w, norm),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, num_classes))


def mlp(num_classes: int, width: int = 2048) -> nn.Sequential:
    """A wide MLP on the flattened image: many gradient bytes per FLOP (2048 wide: 10.5 M parameters, 42 MB of fp32
    gradients with 10 classes, 12.5 M and 50 MB with 1000, for 21-25 MFLOP a forward pass). Communication is then a
    real share of a DDP step even on a CPU: the lab's part (e) measures its all-reduces with it. Input (N, 3, H, W),
    any size (pooled to 32 x 32 first) -> (N, classes)."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(32), nn.Flatten(), nn.Linear(3 * 32 * 32, width), nn.ReLU(inplace=True),
                         nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, num_classes))


def resnet18_cifar(num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 with the usual small-image stem: 3x3 stride-1 conv, no max-pool."""
    import torchvision
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model

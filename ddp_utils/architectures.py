"""The model registry: each architecture's facts in one place.

Besides its layers, the kit needs to know of a model the image sizes it takes, the parameters that get no weight
decay, its FSDP units and the optimizer it trains with when that is not the data set recipe's (a ViT: AdamW, with
that optimizer's lr and weight decay). ``build_model`` (model.py), the settings' check (settings.py), the optimizer
(optim.py) and FSDP (speed/sharding.py) ask here. Adding a model is one entry in ``ARCHITECTURES``
(tests/test_registry.py adds a small ViT that way); any other torchvision classifier works by its name, its sizes
found by a forward pass on the meta device (shapes only, no memory, no compute).
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:   # torch is imported where a model is built: settings.py reads this registry without it
    from torch import nn

TRIED_SIZES = (16, 32, 64, 96, 128, 160, 224, 299)   # the sizes a torchvision model is tried at, to name those it takes


def _any_size(size: int) -> bool:
    return size >= 1


@dataclass(frozen=True)
class Architecture:
    """One model's facts. ``build(num_classes, image_size)``: a fresh model for images of that side."""
    build: Callable[[int, int], nn.Module]
    about: str = ""                                       # for --arch's help
    takes: Callable[[int], bool] = _any_size              # whether it takes images of this side
    sizes: str | Callable[[], str] = "any size"           # what ``takes`` accepts, in words (or made when asked)
    default_size: int = 224                               # the side it is built for when none is given
    no_decay: tuple[str, ...] = ()                        # parameter names without weight decay, besides 1-D ones
    units: Callable[[nn.Module], list[nn.Module]] | None = None   # its FSDP units; None: sharding's default
    optimizer: str | None = None                          # sgd or adamw, where the recipe's would not train it
    lr: float | None = None                               # that optimizer's lr at 256 images
    weight_decay: float | None = None                     # and weight decay

    def refusal(self, name: str, size: int) -> str | None:
        """None where it takes ``size`` px images; else what is wrong and what to do."""
        if self.takes(size):
            return None
        sizes = self.sizes() if callable(self.sizes) else self.sizes
        return (f"arch={name!r} cannot take {size} px images: it takes {sizes}. Pick an image_size it takes "
                f"(--image-size) or another arch")


def _kit_model(builder: str) -> Callable[[int, int], nn.Module]:
    def build(num_classes: int, image_size: int) -> nn.Module:
        from . import nets
        return getattr(nets, builder)(num_classes)
    return build


def _convnet_gn(num_classes: int, image_size: int) -> nn.Module:
    from .nets import convnet
    return convnet(num_classes, norm="gn")


def vision_transformer(patch: int, layers: int, heads: int, hidden: int, mlp: int, about: str = "") -> Architecture:
    """A torchvision VisionTransformer entry: built for the run's image size (a multiple of ``patch``), AdamW,
    no weight decay on its position embedding and class token, each encoder block an FSDP unit."""
    def build(num_classes: int, image_size: int) -> nn.Module:
        from torchvision.models import VisionTransformer
        return VisionTransformer(image_size=image_size, patch_size=patch, num_layers=layers, num_heads=heads,
                                 hidden_dim=hidden, mlp_dim=mlp, num_classes=num_classes)
    return Architecture(build, about=about, takes=lambda size: size >= patch and size % patch == 0,
                        sizes=f"multiples of its patch, {patch} px", default_size=224,
                        no_decay=("class_token", "encoder.pos_embedding"),
                        units=lambda net: list(net.encoder.layers), optimizer="adamw", lr=1e-3, weight_decay=0.05)


ARCHITECTURES: dict[str, Architecture] = {
    "convnet": Architecture(_kit_model("convnet"), "small, fast on CPU", default_size=32),
    "convnet_gn": Architecture(_convnet_gn, "convnet with GroupNorm", default_size=32),
    "resnet18_cifar": Architecture(_kit_model("resnet18_cifar"), "ResNet-18 with the 32 px stem", default_size=32),
    "mlp": Architecture(_kit_model("mlp"), "wide: many gradient bytes per FLOP, the lab's part e", default_size=32),
    # torchvision's ViT-B/16 (86 M parameters); "vit_b_16" through get_model would be built for 224 px only
    "vit_b_16": vision_transformer(16, 12, 12, 768, 3072, "ViT-B/16, AdamW"),
}


def architecture(name: str) -> Architecture:
    """The registry's entry, or one for a torchvision classifier of that name. ValueError for an unknown name."""
    if name in ARCHITECTURES:
        return ARCHITECTURES[name]
    return _torchvision(name)


@functools.lru_cache(maxsize=None)
def _torchvision(name: str) -> Architecture:
    import torchvision
    if name not in torchvision.models.list_models(module=torchvision.models):
        raise ValueError(f"Unknown arch {name!r}. Use {', '.join(ARCHITECTURES)} or a torchvision classifier such as "
                         f"resnet18, resnet50 (torchvision.models.list_models()).")

    def build(num_classes: int, image_size: int) -> nn.Module:
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    takes = functools.partial(_forward_takes, name)

    def sizes() -> str:   # asked only to explain a refusal: a forward pass per size tried
        tried = [size for size in TRIED_SIZES if takes(size)]
        return f"{', '.join(map(str, tried))} px of those tried" if tried else f"none of {TRIED_SIZES} px"
    return Architecture(build, takes=takes, sizes=sizes)


@functools.lru_cache(maxsize=None)
def _forward_takes(name: str, size: int) -> bool:
    """Whether torchvision's ``name`` runs a forward pass on a ``size`` px image (on the meta device: shapes only)."""
    import torch
    import torchvision
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")   # inception's "default weight initialization will change"
            net = torchvision.models.get_model(name, weights=None, num_classes=10).eval()
            net(torch.empty(2, 3, size, size))
    except NotImplementedError:   # an operation without a meta kernel: not known to fail, so allowed
        return True
    except (RuntimeError, ValueError, AssertionError, IndexError):
        return False
    return True

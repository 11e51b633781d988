"""The data set presets: each one's folders, statistics, transforms and default training recipe.

Plain data, no torch: ``settings.py`` reads the recipes to fill in what a user leaves out, and
``datasets.py`` builds the transforms and folder checks from the rest.

A recipe is what makes ``python -m ddp_utils train --dataset NAME`` learn with no other flag: the
model, the batch per rank, the number of epochs, the warm-up and the learning rate. The lr is always
given at ``LR_REFERENCE_BATCH`` images (Goyal et al.'s convention) and scaled linearly to the real
global batch (``scale_lr``), so the same recipe works on one GPU and on two nodes. Any flag overrides
its part of the recipe.
"""
from __future__ import annotations

from dataclasses import dataclass

LR_REFERENCE_BATCH = 256   # the global batch at which every lr in this kit is given


@dataclass(frozen=True)
class Recipe:
    """Defaults that train well on a preset; lr at LR_REFERENCE_BATCH, batch per rank."""
    arch: str
    batch_size: int
    epochs: int
    lr: float
    warmup_epochs: float


@dataclass(frozen=True)
class Preset:
    """Everything that belongs to one data set: folders, statistics and the kind of transforms.

    ``mean`` and ``std`` are per RGB channel, for pixels scaled to 0..1. ``image_size`` is the
    default training crop in pixels. ``num_classes`` None means "count the class folders".
    ``crop`` picks the transforms: "resized" (ImageNet style), "padded" (CIFAR/CINIC style) or
    "none". ``layout`` is the folder layout, as shown in error messages.
    """
    name: str
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None
    image_size: int
    num_classes: int | None
    train_split: str
    val_split: str
    test_split: str | None
    recipe: Recipe
    crop: str = "resized"
    hflip: bool = True
    folders: bool = True  # False: generated in memory, no data_dir needed
    layout: str = ""


CINIC10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck"]

PRESETS: dict[str, Preset] = {
    # The course homework: ResNet-18 from scratch, 1-2 epochs. 0.1 at 256 with a short warm-up is
    # Goyal et al.'s recipe; batch 256 per GPU fits a 16 GB T4 with AMP.
    "imagenet": Preset(
        "imagenet", mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), image_size=224,
        num_classes=None, train_split="train", val_split="val", test_split=None, crop="resized",
        recipe=Recipe(arch="resnet18", batch_size=256, epochs=2, lr=0.1, warmup_epochs=0.2),
        layout="DATA_DIR/train/<wnid>/*.JPEG and DATA_DIR/val/<wnid>/*.JPEG "
               "(e.g. train/n01440764/n01440764_10026.JPEG). The 50,000 ImageNet validation images "
               "ship in one flat folder: sort them into the same <wnid> class folders as train/ "
               "with lab/scripts/sort_imagenet_val.py before training"),
    # The CINIC-10 labs (lab/): ResNet-18 with the 32 px stem; CIFAR's usual 0.1 at batch 128, i.e. 0.2 at 256.
    "cinic10": Preset(
        "cinic10", mean=(0.47889522, 0.47227842, 0.43047404),
        std=(0.24205776, 0.23828046, 0.25874835), image_size=32, num_classes=10,
        train_split="train", val_split="valid", test_split="test", crop="padded",
        recipe=Recipe(arch="resnet18_cifar", batch_size=128, epochs=10, lr=0.2, warmup_epochs=1.0),
        layout="DATA_DIR/train/<class>/*.png, DATA_DIR/valid/<class>/*.png and DATA_DIR/test/<class>/*.png, "
               "32x32 RGB, with the ten class folders " + ", ".join(CINIC10_CLASSES) +
               " (unpack CINIC-10.tar.gz into DATA_DIR)"),
    # Handwritten digits: a mirrored digit is not the same digit, so no horizontal flip.
    # mean/std are None here: datasets.load_preset reads them from DATA_DIR/demo.json.
    # The recipe reaches >= 95 % Acc@1 in about a minute on a CPU, with 1 rank and with 2.
    "demo": Preset(
        "demo", mean=None, std=None, image_size=32, num_classes=10,
        train_split="train", val_split="valid", test_split="test", crop="padded", hflip=False,
        recipe=Recipe(arch="convnet", batch_size=32, epochs=8, lr=0.8, warmup_epochs=0.5),
        layout="DATA_DIR/{train,valid,test}/<digit>/*.png plus DATA_DIR/demo.json, written by "
               "ddp_utils.demo_data.prepare_demo(DATA_DIR) (build_data does it when DATA_DIR does not exist)"),
    # Random pixels, deterministic per index: measures speed and tests the plumbing, learns nothing
    # (so its recipe is only small and quick; pass --arch resnet18 to time a real model).
    "fake": Preset(
        "fake", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), image_size=224, num_classes=1000,
        train_split="train", val_split="val", test_split=None, crop="none", hflip=False,
        recipe=Recipe(arch="convnet", batch_size=64, epochs=2, lr=0.1, warmup_epochs=0.0),
        folders=False),
}

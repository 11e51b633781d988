"""The data set presets: each one is the only owner of its data set's facts.

Its folders and layout, statistics, transforms, default training recipe, and which loaders do not suit it, and why
(``not_for``: names of the table of loaders, loaders.py, checked against it when ddp_utils is imported). Plain data,
no torch: ``settings.py`` reads the recipes to fill in what a user leaves out and its help texts from here;
``datasets.py`` builds the transforms and folder checks, ``data.py`` asks ``loader_refusal`` before building a
loader, and loaders.py makes docs/commands.md's table (``recipe_table()``). Adding a data set is one entry here
(tests/test_registry.py adds CIFAR-100 that way).

A recipe is what makes ``python -m ddp_utils train --dataset NAME`` learn with no other flag: the
model, the batch per rank, the number of epochs, the warm-up, the learning rate, the optimizer and its weight decay.
The lr is always given at ``LR_REFERENCE_BATCH`` images (Goyal et al.'s convention) and scaled linearly to the real
global batch (``scale_lr``), so the same recipe works on one GPU and on two nodes. Any flag overrides its part of
the recipe; a model whose registry entry pairs it with another optimizer (a ViT with AdamW, ``architectures.py``)
brings that optimizer's lr and weight decay.
"""
from __future__ import annotations

from dataclasses import dataclass, field

LR_REFERENCE_BATCH = 256   # the global batch at which every lr in this kit is given


@dataclass(frozen=True)
class Recipe:
    """Defaults that train well on a preset; lr at LR_REFERENCE_BATCH, batch per rank."""
    arch: str
    batch_size: int
    epochs: int
    lr: float
    warmup_epochs: float
    optimizer: str = "sgd"        # sgd (with momentum) or adamw
    weight_decay: float = 1e-4    # not applied to norm layers, biases and a registry entry's exceptions


@dataclass(frozen=True)
class Preset:
    """Everything that belongs to one data set: folders, statistics and the kind of transforms.

    ``mean`` and ``std`` are per RGB channel, for pixels scaled to 0..1. ``image_size`` is the
    default training crop in pixels. ``num_classes`` None means "count the class folders".
    ``crop`` picks the transforms: "resized" (ImageNet style), "padded" (CIFAR/CINIC style) or
    "none". ``layout`` is the folder layout, as shown in error messages. ``not_for``: each loader that does not
    suit the data set, with why not and what to use instead (said when it is asked for). ``made_here``: the kit
    writes the data into DATA_DIR the first time (demo_data.py), with its statistics (``mean`` None until read).
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
    not_for: dict[str, str] = field(default_factory=dict)
    made_here: bool = False


CINIC10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck"]

# the small-image presets' PNGs: decoded once into memory beats decoding them again on a GPU every epoch
_SMALL_PNGS = {"dali": "its 32 px PNGs are best decoded once: use loader='memory' (--loader memory)",
               "nvjpeg": "its 32 px PNGs are best decoded once: use loader='memory' (--loader memory)"}
_MADE_ON_THE_FLY = ("the fake preset makes its images on the fly, so there is nothing to decode: use "
                    "loader='workers' (--loader workers)")

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
               "with lab/scripts/sort_imagenet_val.py before training",
        not_for={"memory": "ImageNet does not fit in memory (its 1.28 million training images are about 190 GB as "
                           "uint8 at 224 px): use loader='workers' (--loader workers)"}),
    # The CINIC-10 labs (lab/): ResNet-18 with the 32 px stem; CIFAR's usual 0.1 at batch 128, i.e. 0.2 at 256.
    "cinic10": Preset(
        "cinic10", mean=(0.47889522, 0.47227842, 0.43047404),
        std=(0.24205776, 0.23828046, 0.25874835), image_size=32, num_classes=10,
        train_split="train", val_split="valid", test_split="test", crop="padded",
        recipe=Recipe(arch="resnet18_cifar", batch_size=128, epochs=10, lr=0.2, warmup_epochs=1.0),
        layout="DATA_DIR/train/<class>/*.png, DATA_DIR/valid/<class>/*.png and DATA_DIR/test/<class>/*.png, "
               "32x32 RGB, with the ten class folders " + ", ".join(CINIC10_CLASSES) +
               " (unpack CINIC-10.tar.gz into DATA_DIR)",
        not_for=_SMALL_PNGS),
    # Handwritten digits: a mirrored digit is not the same digit, so no horizontal flip.
    # mean/std are None here: datasets.load_preset reads them from DATA_DIR/demo.json.
    # The recipe reaches >= 95 % Acc@1 in about a minute on a CPU, with 1 rank and with 2.
    "demo": Preset(
        "demo", mean=None, std=None, image_size=32, num_classes=10,
        train_split="train", val_split="valid", test_split="test", crop="padded", hflip=False,
        recipe=Recipe(arch="convnet", batch_size=32, epochs=8, lr=0.8, warmup_epochs=0.5),
        layout="DATA_DIR/{train,valid,test}/<digit>/*.png plus DATA_DIR/demo.json, written by "
               "ddp_utils.demo_data.prepare_demo(DATA_DIR) (build_data does it when DATA_DIR does not exist)",
        not_for=_SMALL_PNGS, made_here=True),
    # Random pixels, deterministic per index: measures speed and tests the plumbing, learns nothing
    # (so its recipe is only small and quick; pass --arch resnet18 to time a real model).
    "fake": Preset(
        "fake", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), image_size=224, num_classes=1000,
        train_split="train", val_split="val", test_split=None, crop="none", hflip=False,
        recipe=Recipe(arch="convnet", batch_size=64, epochs=2, lr=0.1, warmup_epochs=0.0),
        folders=False, not_for={loader: _MADE_ON_THE_FLY for loader in ("memory", "dali", "nvjpeg")}),
}


def suited(loader: str) -> list[str]:
    """The presets that ``loader`` suits."""
    return [name for name, preset in PRESETS.items() if loader not in preset.not_for]


def loader_refusal(dataset: str, loader: str) -> str | None:
    """None where ``loader`` suits ``dataset``; else the sentence that says why not and what to use."""
    why = PRESETS[dataset].not_for.get(loader)
    if why is None:
        return None
    return f"loader='{loader}' is for {', '.join(suited(loader))} only, not dataset={dataset!r}: {why}."


def default_of(field_name: str) -> str:
    """A help text's "the preset's" part: each value and the presets that have it, e.g. "224 imagenet, fake;
    32 cinic10, demo"."""
    by_value: dict = {}
    for name, preset in PRESETS.items():
        by_value.setdefault(getattr(preset, field_name), []).append(name)
    return "; ".join(f"{value} {', '.join(names)}" for value, names in by_value.items())



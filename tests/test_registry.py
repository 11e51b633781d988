"""Each data set's facts in its preset, each model's in the registry (issue 44, parts 3 and 4).

The three changes a TA makes are one entry each: a data set (CIFAR-100 here: a folder preset with its recipe) is
added to ``presets.PRESETS`` and a model (a small ViT) to ``architectures.ARCHITECTURES``, in this test only, and a
run trains with them without any other module knowing their names.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from ddp_utils import architectures, loaders, presets
from ddp_utils.architectures import ARCHITECTURES, architecture, vision_transformer
from ddp_utils.datasets import DataError
from ddp_utils.presets import PRESETS, Preset, Recipe
from ddp_utils.settings import Settings

CIFAR100_CLASSES = [f"class{i:02d}" for i in range(100)]

CIFAR100 = Preset(
    "cifar100", mean=(0.507, 0.487, 0.441), std=(0.267, 0.256, 0.276), image_size=32, num_classes=100,
    train_split="train", val_split="test", test_split=None, crop="padded",
    recipe=Recipe(arch="resnet18_cifar", batch_size=128, epochs=30, lr=0.2, warmup_epochs=1.0, weight_decay=5e-4),
    layout="DATA_DIR/train/<class>/*.png and DATA_DIR/test/<class>/*.png, 32x32 RGB, 100 classes",
    not_for={loader: "its 32 px PNGs are best decoded once: use loader='memory'" for loader in ("dali", "nvjpeg")})

VIT_TINY = vision_transformer(patch=8, layers=2, heads=2, hidden=32, mlp=64, about="a tiny ViT (tests)")


@pytest.fixture
def added(monkeypatch):
    """CIFAR-100 and the tiny ViT, added as a TA would: one entry each."""
    monkeypatch.setitem(PRESETS, "cifar100", CIFAR100)
    monkeypatch.setitem(ARCHITECTURES, "vit_tiny", VIT_TINY)


def cifar100_folder(root, per_class: int = 1):
    """CIFAR-100's layout as image folders: train/<class>/*.png and test/<class>/*.png, 32x32 RGB."""
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 2 * per_class), ("test", per_class)):
        for label, name in enumerate(CIFAR100_CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8)
                Image.fromarray(pixels.numpy()).save(folder / f"{label}_{i}.png")
    return root


@pytest.mark.slow
def test_a_data_set_and_a_model_added_by_one_entry_each_train_a_step(added, tmp_path):
    from ddp_utils.job import prepare
    from ddp_utils.train import fit
    data_dir = cifar100_folder(tmp_path / "cifar100")
    settings = Settings(dataset="cifar100", data_dir=str(data_dir), arch="vit_tiny", epochs=1, batch_size=8,
                        max_steps_per_epoch=1, workers=0, wandb="disabled", progress="off", loader="auto",
                        run_dir=str(tmp_path / "run"), link_probe=False)
    assert (settings.optimizer, settings.lr, settings.weight_decay) == ("adamw", 1e-3, 0.05)   # the ViT's pairing
    assert settings.epochs == 1 and Settings(dataset="cifar100", data_dir=str(data_dir)).weight_decay == 5e-4
    with prepare(settings, log=lambda *_: None) as job:
        assert job.data.num_classes == 100 and job.data.train_size == 200
        results = fit(job)
    assert results["steps"] == 1 and results["epochs_run"] == 1 and results["val_images"] == 100
    assert results["arch"] == "vit_tiny" and results["dataset"] == "cifar100" and 0.0 <= results["acc1"] <= 100.0


def test_a_preset_owns_its_loaders_and_the_help_and_docs_follow_it(added):
    from ddp_utils.data import loader_for
    from ddp_utils.speed.dali import check_dali_dataset
    from ddp_utils.speed.memdata import check_memory_dataset
    from ddp_utils.tools.cli import build_parser
    assert loader_for(Settings(dataset="cifar100", loader="auto")) == "memory"   # it fits in memory: nothing listed
    check_memory_dataset("cifar100")
    with pytest.raises(DataError, match="loader='dali' is for imagenet only, not dataset='cifar100': its 32 px"):
        check_dali_dataset("cifar100")
    assert "cifar100" in presets.suited("memory") and "cifar100" not in presets.suited("nvjpeg")
    args = build_parser().parse_args(["train", "--dataset", "cifar100", "--data-dir", "x"])   # a choice at once
    assert args.dataset == "cifar100"
    assert "| `cifar100` | `resnet18_cifar` | 128 | 30 | 0.2 | 1 | sgd | 0.0005 | memory, workers |" in \
        loaders.recipe_table()
    assert "test cifar100" in presets.default_of("val_split")


def test_the_docs_recipe_table_and_the_help_texts_are_made_from_the_presets():
    """Removing a data set from the docs by hand, or forgetting a new one there, fails here (not only the pages)."""
    from pathlib import Path

    from ddp_utils.settings import Settings as S
    from tests.helpers.procs import REPO
    page = (Path(REPO) / "docs" / "commands.md").read_text()
    assert loaders.recipe_table() in page
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(S)}
    for name in PRESETS:
        assert name in helps["dataset"] and name in helps["image_size"] and name in helps["val_split"]
    for name in ARCHITECTURES:
        assert name in helps["arch"]


def test_the_layout_hint_names_every_preset_whose_folders_are_there(tmp_path, added, monkeypatch):
    """Issue 54: the hint named the first preset that fit; Food-101 and CIFAR-100 share train/ and test/, so which
    one it named was a coin toss. Every preset that fits is named."""
    from ddp_utils.datasets import _layout_hint
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
    assert "use dataset='cifar100' (train/, test/)" in _layout_hint(tmp_path, PRESETS["imagenet"])
    monkeypatch.setitem(PRESETS, "food101", dataclasses.replace(CIFAR100, name="food101", image_size=224))
    both = _layout_hint(tmp_path, PRESETS["imagenet"])
    assert "dataset='cifar100' (train/, test/) or dataset='food101' (train/, test/)" in both, both
    (tmp_path / "val").mkdir()
    assert "dataset='imagenet' (train/, val/)" in _layout_hint(tmp_path, PRESETS["cinic10"])


def test_a_model_that_cannot_take_the_data_sets_image_size_is_refused_at_the_settings_with_the_sizes_it_takes():
    """vit_b_16 on a 32 px preset was accepted and failed at its first forward; inception_v3 likewise."""
    with pytest.raises(ValueError, match=r"arch='vit_b_16' cannot take 40 px images: it takes multiples of its "
                                         r"patch, 16 px"):
        Settings(dataset="cinic10", arch="vit_b_16", image_size=40)
    with pytest.raises(ValueError, match=r"arch='inception_v3' cannot take 32 px images: it takes 96, .* px of "
                                         r"those tried"):
        Settings(dataset="cinic10", arch="inception_v3")
    with pytest.raises(ValueError, match="Unknown arch 'resnet19'"):
        Settings(arch="resnet19")
    assert Settings(dataset="cinic10", arch="vit_b_16").optimizer == "adamw"   # built for 32 px: it takes it
    assert Settings(dataset="cinic10", arch="vit_b_16", optimizer="sgd").lr == 0.2   # a flag beats the pairing


def test_a_vits_position_embedding_and_class_token_get_no_weight_decay(added):
    from ddp_utils.model import build_model
    from ddp_utils.optim import build_optimizer
    settings = Settings(dataset="cinic10", arch="vit_tiny")
    model = build_model("vit_tiny", 10, seed=0, image_size=32)
    optimizer = build_optimizer(model, settings)
    assert isinstance(optimizer, torch.optim.AdamW)
    decayed, free = (group["params"] for group in optimizer.param_groups)
    assert optimizer.param_groups[0]["weight_decay"] == 0.05 and optimizer.param_groups[1]["weight_decay"] == 0.0
    ids = {id(p) for p in free}
    assert id(model.class_token) in ids and id(model.encoder.pos_embedding) in ids
    assert all(p.ndim > 1 for p in decayed) and len(decayed) + len(free) == len(list(model.parameters()))
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)   # built for the size it is given


def test_fsdp_makes_each_encoder_block_of_a_vit_a_unit(added, monkeypatch):
    """The default rule (children with layers of their own) made the whole ViT encoder one unit: all-gathered
    whole for its forward, so FSDP saved nothing of its memory. The registry names the blocks."""
    from ddp_utils.robust import compat
    from ddp_utils.speed import sharding
    if compat.fsdp_refusal("cpu", "gloo"):
        pytest.skip(compat.fsdp_refusal("cpu", "gloo"))   # the floor's torch 2.6 runs no FSDP2 on a CPU
    from ddp_utils.distributed import DistContext
    from ddp_utils.model import build_model
    from tests.helpers.procs import free_port
    model = build_model("vit_tiny", 10, seed=0, image_size=32)
    assert [type(b).__name__ for b in sharding.blocks(model)] == ["Encoder", "Sequential"]   # the default rule
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        sharded = sharding.shard_model(model, DistContext(0, 1, 0, torch.device("cpu"), "gloo"),
                                       architecture("vit_tiny").units)
        from torchvision.models.vision_transformer import EncoderBlock
        units = sharding.blocks(sharded)
        assert len(units) == 2 and all(isinstance(b, EncoderBlock) for b in units)
        assert len(sharding.units(sharded)) == 3   # two blocks and the root
    finally:
        torch.distributed.destroy_process_group()


def test_any_torchvision_classifier_is_found_by_name_and_sized_on_the_meta_device():
    entry = architecture("resnet18")
    assert entry.takes(224) and entry.refusal("resnet18", 224) is None
    assert architectures.architecture("resnet18") is entry   # asked once

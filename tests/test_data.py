"""ddp_utils.data: presets, folder checks, per-rank samplers and loaders, the demo set.

Small folders in the exact layouts of ImageNet (JPEG, wnid folders) and CINIC-10 (PNG, ten class
names) are written into tmp_path; every image is one solid colour so normalisation is checkable.
"""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from ddp_utils import datasets as data_mod
from ddp_utils import loaders
from ddp_utils.data import build_loaders
from ddp_utils.datasets import (PRESETS, DataError, ImageFolderDataset, check_data, eval_transform, load_preset,
                                train_transform)
from ddp_utils.loaders import Data, EpochLoader, EvalShardSampler
from ddp_utils.demo_data import DEMO_CLASSES, DEMO_JSON, prepare_demo, read_demo_info
from ddp_utils.settings import Settings
from tests.helpers import procs
from tests.helpers.folders import CINIC, WNIDS, make_cinic, make_imagenet, solid
from tests.helpers.loading import failed_after_one_batch, released


def settings(path="", dataset="cinic10", **kw) -> Settings:
    return Settings(**{"dataset": dataset, "data_dir": str(path), "workers": 0, "batch_size": 2, **kw})


@pytest.fixture
def imagenet(tmp_path):
    return make_imagenet(tmp_path / "imagenet")


@pytest.fixture
def cinic(tmp_path):
    return make_cinic(tmp_path / "cinic10")


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The demo set, written by check_data because the folder does not exist yet."""
    root = tmp_path_factory.mktemp("demo_parent") / "demo"
    summary = check_data(settings(root, "demo"))
    assert summary["splits"]["train"] == {"images": 1078, "classes": 10}
    return root


def read_png(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image)


def normalize_of(transform: T.Compose) -> T.Normalize:
    return next(t for t in transform.transforms if isinstance(t, T.Normalize))


def train_indices(loader: EpochLoader, epoch: int) -> list[int]:
    loader.sampler.set_epoch(epoch)
    return list(loader.sampler)


# ---------------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_train_shards_are_disjoint_equal_and_cover_all_but_the_remainder(cinic, demo_dir, world_size):
    for path, dataset in ((cinic, "cinic10"), (demo_dir, "demo")):  # 20 and 1078 train images
        shards = [train_indices(build_loaders(settings(path, dataset), r, world_size).train, epoch=3)
                  for r in range(world_size)]
        n = len(ImageFolderDataset(path / "train"))
        assert all(len(s) == n // world_size for s in shards)          # same steps on every rank
        union = [i for s in shards for i in s]
        assert len(set(union)) == len(union) == world_size * (n // world_size)  # disjoint, no padding


def test_train_order_changes_with_epoch_and_repeats_with_the_same_seed(demo_dir):
    a = build_loaders(settings(demo_dir, "demo"), 0, 2).train
    b = build_loaders(settings(demo_dir, "demo"), 0, 2).train
    c = build_loaders(settings(demo_dir, "demo", seed=1), 0, 2).train
    assert train_indices(a, 0) != train_indices(a, 1)
    assert train_indices(a, 1) == train_indices(b, 1)
    assert train_indices(a, 1) != train_indices(c, 1)


def test_epoch_loader_calls_set_epoch_itself():
    s = settings(dataset="fake", image_size=8, batch_size=4, max_steps_per_epoch=3)
    a, b = build_loaders(s, 0, 1).train, build_loaders(s, 0, 1).train
    labels = lambda loader, e: torch.cat([y for _, y in loader.epoch(e)]).tolist()  # noqa: E731
    assert labels(a, 0) == labels(b, 0)
    assert labels(a, 1) == labels(b, 1)
    assert labels(a, 0) != labels(a, 1)
    assert labels(a, 0) == labels(b, 0)  # going back to epoch 0 gives epoch 0's order again


def test_epoch_loader_respects_max_steps_per_epoch():
    full = build_loaders(settings(dataset="fake", image_size=8, batch_size=64), 0, 8).train
    assert len(full) == 2560 // 8 // 64 == 5
    capped = build_loaders(settings(dataset="fake", image_size=8, batch_size=64, max_steps_per_epoch=2), 0, 8).train
    assert len(capped) == 2
    assert len(list(capped.epoch(0))) == 2
    assert len(list(full.epoch(0))) == 5


def test_epoch_loader_cannot_be_iterated_without_an_epoch():
    loader = build_loaders(settings(dataset="fake", image_size=8), 0, 1).train
    with pytest.raises(TypeError, match="epoch"):
        iter(loader)


@pytest.mark.parametrize("n", [1, 7, 10, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_eval_shard_sampler_covers_every_index_exactly_once(n, world_size):
    shards = [list(EvalShardSampler(n, r, world_size)) for r in range(world_size)]
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert [len(EvalShardSampler(list(range(n)), r, world_size)) for r in range(world_size)] == list(map(len, shards))


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_val_loaders_see_every_image_once_across_ranks(cinic, world_size):
    batches = [build_loaders(settings(cinic, batch_size=3), r, world_size).val for r in range(world_size)]
    assert sum(len(x) for loader in batches for x, _ in loader) == 20  # last batches may be short
    assert all(not loader.drop_last for loader in batches)


# ---------------------------------------------------------------------------------------------
# Presets and loading
# ---------------------------------------------------------------------------------------------
def test_imagenet_preset_loads_its_folders(imagenet):
    data = build_loaders(settings(imagenet, "imagenet"), 0, 1)
    assert (data.classes, data.num_classes, data.train_size, data.val_size) == (WNIDS, 3, 9, 6)
    x, y = next(data.train.epoch(0))
    assert x.shape == (2, 3, 224, 224) and x.dtype == torch.float32 and y.dtype == torch.int64
    x, _ = next(iter(data.val))
    assert x.shape == (2, 3, 224, 224)
    mean, std = data.preset.mean, data.preset.std   # applied per batch after the workers (fastjpeg.py)
    assert list(mean) == [0.485, 0.456, 0.406] and list(std) == [0.229, 0.224, 0.225]
    # val images are solid (120, 60, 200): check the statistics really apply (JPEG is lossy: 2 % slack)
    expected = (torch.tensor([120, 60, 200]) / 255 - torch.tensor(mean)) / torch.tensor(std)
    assert torch.allclose(x.mean(dim=(0, 2, 3)), expected, atol=0.1)


def test_imagenet_transforms_crop_224_and_resize_256():
    preset = PRESETS["imagenet"]
    kinds = [type(t) for t in train_transform(preset).transforms]
    assert kinds[:2] == [T.RandomResizedCrop, T.RandomHorizontalFlip]
    resize, crop = eval_transform(preset).transforms[:2]
    assert (resize.size, crop.size) == (256, (224, 224))
    assert eval_transform(preset, 160).transforms[0].size == round(160 * 256 / 224)


def test_cinic10_preset_loads_its_folders_with_cinic_statistics(cinic):
    data = build_loaders(settings(cinic), 0, 1)
    assert data.classes == CINIC and data.num_classes == 10
    assert (data.train_size, data.val_size, data.image_size) == (20, 20, 32)
    x, _ = next(data.train.epoch(0))
    assert x.shape == (2, 3, 32, 32)
    norm = normalize_of(data.val.dataset.transform)
    assert list(norm.mean) == [0.47889522, 0.47227842, 0.43047404]
    assert list(norm.std) == [0.24205776, 0.23828046, 0.25874835]
    x, y = data.val.dataset[0]  # airplane: solid (0, 100, 250), PNG is lossless
    expected = (torch.tensor([0, 100, 250]) / 255 - torch.tensor(norm.mean)) / torch.tensor(norm.std)
    assert torch.allclose(x, expected[:, None, None].expand(3, 32, 32), atol=1e-5) and y == 0
    kinds = [type(t) for t in data.train.dataset.transform.transforms]
    assert kinds == [T.RandomCrop, T.RandomHorizontalFlip, T.ToTensor, T.Normalize]
    assert data.train.dataset.transform.transforms[0].padding == 4


def test_val_split_setting_picks_another_split(cinic):
    shutil.rmtree(cinic / "test" / "cat")
    (cinic / "test" / "cat").mkdir()
    solid(cinic / "test" / "cat" / "one.png", (32, 32), (0, 0, 0))
    data = build_loaders(settings(cinic, val_split="test"), 0, 1)
    assert (data.val_split, data.val_size) == ("test", 19)


def test_fake_preset_shapes_and_sizes():
    data = build_loaders(settings(dataset="fake", batch_size=4), 0, 1)
    assert (data.train_size, data.val_size, data.num_classes, data.image_size) == (2560, 512, 1000, 224)
    x, y = next(data.train.epoch(0))
    assert x.shape == (4, 3, 224, 224) and y.shape == (4,)
    small = build_loaders(settings(dataset="fake", image_size=16, batch_size=4), 0, 1)
    assert next(iter(small.val))[0].shape == (4, 3, 16, 16)
    assert torch.equal(small.val.dataset[5][0], small.val.dataset[5][0])  # deterministic per index
    assert not torch.equal(small.val.dataset[0][0], small.train.dataset[0][0])


def test_datasets_pickle_for_spawned_workers(imagenet, cinic, demo_dir):
    for s in (settings(imagenet, "imagenet"), settings(cinic), settings(demo_dir, "demo"),
              settings(dataset="fake", image_size=8)):
        data = build_loaders(s, 0, 1)
        for dataset in (data.train.dataset, data.val.dataset):
            copy = pickle.loads(pickle.dumps(dataset))
            assert len(copy) == len(dataset)
        assert torch.equal(pickle.loads(pickle.dumps(data.val.dataset))[0][0], data.val.dataset[0][0])


def test_loader_with_worker_processes(cinic):
    data = build_loaders(settings(cinic, workers=1, batch_size=4), 1, 2)
    # train workers restart each epoch so they can be reseeded per epoch (see the next test)
    assert not data.train.loader.persistent_workers and data.val.persistent_workers
    assert not data.train.loader.pin_memory
    assert [x.shape for x, _ in data.train.epoch(0)] == [(4, 3, 32, 32)] * 2
    assert sum(len(y) for _, y in data.val) == 10


def test_an_epochs_augmented_batches_do_not_depend_on_the_epochs_before_it(cinic):
    """What resume relies on: epoch 1 of a run that skipped epoch 0 sees the same random crops."""
    straight = build_loaders(settings(cinic, workers=1, batch_size=4), 0, 1)
    list(straight.train.epoch(0))
    after_epoch_0 = [x for x, _ in straight.train.epoch(1)]
    resumed = [x for x, _ in build_loaders(settings(cinic, workers=1, batch_size=4), 0, 1).train.epoch(1)]
    assert all(torch.equal(a, b) for a, b in zip(after_epoch_0, resumed)) and len(resumed) == len(after_epoch_0)


class _Draws:
    """A transform that returns the random numbers it draws instead of an image: what a crop would use."""

    def __call__(self, image):
        return torch.rand(3, 2, 2, dtype=torch.float64)   # 2**53 values: no collision by chance


def _augmentation_draws(demo_dir, monkeypatch, workers: int, rank: int, epoch: int) -> torch.Tensor:
    monkeypatch.setattr(data_mod, "train_transform", lambda preset, size: _Draws())
    from ddp_utils import data as build_mod
    monkeypatch.setattr(build_mod, "train_transform", lambda preset, size: _Draws())
    loader = build_loaders(settings(demo_dir, "demo", workers=workers, batch_size=16, max_steps_per_epoch=4),
                        rank, 2).train
    torch.manual_seed(0)   # what prepare() does on every rank: the same global RNG everywhere
    return torch.cat([x for x, _ in loader.epoch(epoch)])


@pytest.mark.parametrize("workers", [0, 2])
def test_no_two_ranks_or_epochs_draw_the_same_augmentation(demo_dir, monkeypatch, workers):
    """One independent stream per (seed, rank, epoch): the old seed*1000 + rank + epoch gave rank 0 at
    epoch 1 the crops of rank 1 at epoch 0, and without workers every rank cropped alike."""
    keys = [(rank, epoch) for rank in (0, 1) for epoch in (0, 1, 2)]
    draws = {key: _augmentation_draws(demo_dir, monkeypatch, workers, *key) for key in keys}
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            shared = set(draws[a].flatten().tolist()) & set(draws[b].flatten().tolist())
            assert not shared, f"rank/epoch {a} and {b} drew the same random numbers"
    again = _augmentation_draws(demo_dir, monkeypatch, workers, 1, 2)
    assert torch.equal(again, draws[(1, 2)])   # and the same key draws the same again (resume)


def test_without_workers_the_loader_leaves_the_training_rng_alone(demo_dir, monkeypatch):
    """Draws of the training step (dropout, ...) must not shift the crops, nor the crops the step's draws."""
    monkeypatch.setattr(data_mod, "train_transform", lambda preset, size: _Draws())
    from ddp_utils import data as build_mod
    monkeypatch.setattr(build_mod, "train_transform", lambda preset, size: _Draws())
    loader = build_loaders(settings(demo_dir, "demo", workers=0, batch_size=16, max_steps_per_epoch=3), 0, 1).train
    torch.manual_seed(5)
    plain = torch.cat([x for x, _ in loader.epoch(0)])
    torch.manual_seed(5)
    expected_step_draws = torch.rand(3)
    torch.manual_seed(5)
    mixed, step_draws = [], []
    for x, _ in loader.epoch(0):
        mixed.append(x)
        step_draws.append(torch.rand(1))   # a training step that draws
    assert torch.equal(torch.cat(mixed), plain)
    assert torch.equal(torch.cat(step_draws), expected_step_draws)


def test_both_loaders_take_their_seed_from_the_one_recipe():
    from ddp_utils.speed import memdata
    from ddp_utils.loaders import augmentation_seed
    seeds = {augmentation_seed(0, rank, epoch) for rank in range(8) for epoch in range(50)}
    assert len(seeds) == 400
    a = torch.rand(4, generator=memdata.augmentation_generator(3, 1, 2))
    b = torch.rand(4, generator=torch.Generator().manual_seed(augmentation_seed(3, 1, 2)))
    assert torch.equal(a, b)


def test_pin_memory_only_for_cuda(cinic):
    assert build_loaders(settings(cinic), 0, 1, device=torch.device("cuda")).train.loader.pin_memory
    assert not build_loaders(settings(cinic), 0, 1, device="cpu").val.pin_memory


def test_fingerprint_agrees_across_ranks_and_differs_with_the_data(cinic, tmp_path):
    fp = build_loaders(settings(cinic), 0, 2).fingerprint()
    assert fp == build_loaders(settings(cinic), 1, 2).fingerprint()
    json.dumps(fp)
    other = make_cinic(tmp_path / "other", per_class=3)
    assert build_loaders(settings(other), 1, 2).fingerprint()["train_size"] != fp["train_size"]


def test_train_split_smaller_than_one_batch_per_rank(cinic):
    with pytest.raises(DataError, match="lower batch_size"):
        build_loaders(settings(cinic, batch_size=8), 0, 4)  # 20 images / 4 ranks = 5 < 8


def test_hidden_folders_are_not_classes(cinic):
    solid(cinic / "train" / ".ipynb_checkpoints" / "x.png", (32, 32), (0, 0, 0))
    assert check_data(settings(cinic))["classes"] == CINIC


# ---------------------------------------------------------------------------------------------
# Malformed folders: DataError naming the path
# ---------------------------------------------------------------------------------------------
def test_missing_data_dir_names_it_and_the_layout(tmp_path):
    with pytest.raises(DataError) as e:
        check_data(settings(tmp_path / "nowhere", "imagenet"))
    assert str(tmp_path / "nowhere") in str(e.value)
    assert "DATA_DIR/train/<wnid>/*.JPEG" in str(e.value) and "DATA_DIR/val/<wnid>/*.JPEG" in str(e.value)


def test_missing_split_folder(imagenet):
    shutil.rmtree(imagenet / "val")
    with pytest.raises(DataError, match="is missing") as e:
        check_data(settings(imagenet, "imagenet"))
    assert str(imagenet / "val") in str(e.value)


def test_cinic10_preset_on_an_imagenet_folder_says_so(imagenet):
    with pytest.raises(DataError) as e:
        check_data(settings(imagenet, "cinic10"))
    assert str(imagenet / "valid") in str(e.value) and "dataset='imagenet'" in str(e.value)


def test_imagenet_preset_on_a_cinic_folder_says_so(cinic):
    with pytest.raises(DataError) as e:
        check_data(settings(cinic, "imagenet"))
    assert str(cinic / "val") in str(e.value) and "dataset='cinic10'" in str(e.value)


def test_unsorted_imagenet_val_folder(imagenet):
    for jpeg in list((imagenet / "val").rglob("*.JPEG")):
        jpeg.rename(imagenet / "val" / jpeg.name)
        jpeg.parent.rmdir() if not any(jpeg.parent.iterdir()) else None
    with pytest.raises(DataError, match="no class folders") as e:
        check_data(settings(imagenet, "imagenet"))
    assert str(imagenet / "val") in str(e.value) and "6 images" in str(e.value)


def test_empty_class_folder(cinic):
    for png in (cinic / "train" / "cat").iterdir():
        png.unlink()
    (cinic / "train" / "cat" / "notes.txt").write_text("not an image")
    with pytest.raises(DataError, match="hold no images") as e:
        check_data(settings(cinic))
    assert str(cinic / "train" / "cat") in str(e.value)


def test_class_folders_differing_between_splits(imagenet):
    (imagenet / "val" / WNIDS[0]).rename(imagenet / "val" / "n09999999")
    with pytest.raises(DataError) as e:
        check_data(settings(imagenet, "imagenet"))
    msg = str(e.value)
    assert f"{imagenet / 'val'} lacks 1 class(es)" in msg and WNIDS[0] in msg
    assert f"{imagenet / 'val'} has 1 class(es)" in msg and "n09999999" in msg


def test_wrong_number_of_cinic_classes(cinic):
    for split in ("train", "valid"):
        shutil.rmtree(cinic / split / "truck")
    with pytest.raises(DataError, match="expects 10") as e:
        check_data(settings(cinic))
    assert str(cinic / "train") in str(e.value)


def test_cinic_images_of_the_wrong_size(cinic):
    solid(cinic / "valid" / "dog" / "big.png", (64, 64), (0, 0, 0))
    with pytest.raises(DataError, match="64x64") as e:
        check_data(settings(cinic))
    assert str(cinic / "valid" / "dog" / "big.png") in str(e.value)


def test_unreadable_image(imagenet):
    bad = imagenet / "train" / WNIDS[1] / f"{WNIDS[1]}_1001.JPEG"
    bad.write_bytes(b"this is not a JPEG")
    with pytest.raises(DataError, match="Pillow cannot read") as e:
        check_data(settings(imagenet, "imagenet"))
    assert str(bad) in str(e.value)


def test_truncated_jpeg(imagenet):
    bad = imagenet / "val" / WNIDS[2] / "ILSVRC2012_val_00000006.JPEG"
    bad.write_bytes(bad.read_bytes()[:300])
    with pytest.raises(DataError) as e:
        check_data(settings(imagenet, "imagenet"))
    assert str(bad) in str(e.value)


def test_big_splits_check_one_image_per_class_and_name_bad_files_when_loaded(imagenet, monkeypatch):
    monkeypatch.setattr(data_mod, "VERIFY_ALL_UP_TO", 0)
    bad = imagenet / "train" / WNIDS[0] / f"{WNIDS[0]}_1002.JPEG"  # not the first of its class
    bad.write_bytes(b"broken")
    data = build_loaders(settings(imagenet, "imagenet"), 0, 1)   # the check samples past it
    index = data.train.dataset.samples.index((str(bad), 0))
    with pytest.raises(DataError, match="Pillow cannot read") as e:
        data.train.dataset[index]
    assert str(bad) in str(e.value)


def test_demo_dir_that_is_not_a_demo_set(tmp_path):
    make_cinic(tmp_path / "notdemo")
    with pytest.raises(DataError) as e:
        check_data(settings(tmp_path / "notdemo", "demo"))
    assert str(tmp_path / "notdemo") in str(e.value) and "no demo.json" in str(e.value)


# ---------------------------------------------------------------------------------------------
# The demo set
# ---------------------------------------------------------------------------------------------
def test_demo_set_has_the_cinic_layout_and_its_statistics(demo_dir):
    info = read_demo_info(demo_dir)
    counts = {}
    for split in ("train", "valid", "test"):
        assert sorted(p.name for p in (demo_dir / split).iterdir()) == DEMO_CLASSES
        counts[split] = len(list((demo_dir / split).rglob("*.png")))
    assert counts == info["images"] == {"train": 1078, "valid": 359, "test": 360}  # 60/20/20 of 1797
    per_class = [len(list((demo_dir / "train" / c).iterdir())) for c in DEMO_CLASSES]
    assert min(per_class) >= 104 and max(per_class) <= 110  # stratified: 60 % of 174..183 per class
    with Image.open(next((demo_dir / "valid" / "3_three").iterdir())) as image:
        assert (image.format, image.mode, image.size) == ("PNG", "RGB", (32, 32))
    pixels = np.stack([read_png(p) for p in sorted((demo_dir / "train").rglob("*.png"))]) / 255
    assert np.allclose(info["mean"], pixels.mean(axis=(0, 1, 2)), atol=1e-6)
    assert np.allclose(info["std"], pixels.std(axis=(0, 1, 2)), atol=1e-6)
    preset = load_preset("demo", demo_dir)
    assert list(preset.mean) == info["mean"] and list(preset.std) == info["std"]
    assert [type(t) for t in train_transform(preset).transforms] == [T.RandomCrop, T.ToTensor, T.Normalize]


def test_prepare_demo_twice_keeps_the_first_set(demo_dir):
    stamp = (demo_dir / DEMO_JSON).stat().st_mtime_ns
    assert prepare_demo(demo_dir) == demo_dir
    assert (demo_dir / DEMO_JSON).stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_concurrent_prepare_demo_ends_with_one_intact_set(tmp_path):
    root = tmp_path / "demo"
    # demo_data does not import torch, so both processes start fast and really race.
    code = f"from ddp_utils.demo_data import prepare_demo; print(prepare_demo({str(root)!r}))"
    results = procs.run_all([procs.python("-c", code)] * 2, timeout=120)
    assert [r.returncode for r in results] == [0, 0], procs.describe(results)
    assert len(list(root.rglob("*.png"))) == 1797
    assert read_demo_info(root)["images"]["train"] == 1078
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]  # the loser's temporary folder is gone
    assert check_data(settings(root, "demo"))["splits"]["valid"]["images"] == 359


def test_build_data_creates_the_demo_set_and_loads_it(demo_dir):
    data = build_loaders(settings(demo_dir, "demo", batch_size=16), 0, 1)
    assert isinstance(data, Data) and data.classes == DEMO_CLASSES
    x, y = next(data.train.epoch(0))
    assert x.shape == (16, 3, 32, 32) and int(y.max()) < 10
    assert data.fingerprint()["mean"] == [round(m, 6) for m in read_demo_info(demo_dir)["mean"]]


def test_a_bad_image_met_by_a_loader_worker_during_training_is_the_kits_paragraph(imagenet, monkeypatch, tmp_path):
    """Big splits are checked one image per class; a broken file found later must still read as one
    paragraph naming it, not 'Caught DataError in DataLoader worker process 0' and a traceback."""
    from ddp_utils.job import prepare
    from ddp_utils.train import fit
    monkeypatch.setattr(data_mod, "VERIFY_ALL_UP_TO", 0)
    bad = imagenet / "train" / WNIDS[0] / f"{WNIDS[0]}_1002.JPEG"   # not the first of its class
    bad.write_bytes(b"broken")
    s = settings(imagenet, "imagenet", image_size=32, arch="convnet", workers=2, epochs=1, wandb="disabled",
                 run_dir=str(tmp_path / "run"), progress="off")
    with pytest.raises(DataError) as e:
        with prepare(s, log=lambda *_: None) as job:
            fit(job)
    text = str(e.value)
    assert text.startswith(f"{bad}: Pillow cannot read") and "Traceback" not in text and "worker" not in text
    assert f"error: DataError: {bad}" in (tmp_path / "run" / "log.txt").read_text()


def test_loader_workers_do_not_keep_rank_0s_listening_port(demo_dir):
    """Run All again after a run: the port must not be held by a worker the kit forked (a persistent
    validation worker lives as long as its loader)."""
    import psutil
    import torch.distributed as dist
    port = procs.free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)   # as rank 0 hosts it
    try:
        data = build_loaders(settings(demo_dir, "demo", workers=2, batch_size=64), 0, 1)
        next(iter(data.val))              # persistent workers, now alive
        next(iter(data.train.epoch(0)))   # train workers too
        children = psutil.Process().children(recursive=True)
        assert children, "the loaders should have worker processes"
        holders = [c.pid for c in children for conn in c.net_connections(kind="tcp")
                   if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port]
        assert holders == [], f"worker(s) {holders} hold master_port {port}"
    finally:
        del store


@pytest.mark.slow
def test_check_verify_images_finds_every_unreadable_file_that_the_quick_check_skips(imagenet, monkeypatch):
    """Big splits get one image per class checked; --verify-images decodes all of them, on every core."""
    from ddp_utils.tools.check import run_check
    monkeypatch.setattr(data_mod, "VERIFY_ALL_UP_TO", 0)   # as if the split were ImageNet-sized
    bad = [imagenet / "train" / WNIDS[0] / f"{WNIDS[0]}_1002.JPEG", imagenet / "val" / WNIDS[1] / "broken.JPEG"]
    bad[0].write_bytes(b"broken")
    bad[1].write_bytes((imagenet / "val" / WNIDS[2] / "ILSVRC2012_val_00000006.JPEG").read_bytes()[:300])
    lines = []
    assert run_check(settings(imagenet, "imagenet"), log=lines.append) is True   # the quick check passes
    lines.clear()
    assert run_check(settings(imagenet, "imagenet"), log=lines.append, verify_images=True) is False
    text = "\n".join(lines)
    assert "2 of " in text and "images cannot be decoded" in text and "NOT READY" in text
    for path in bad:
        assert str(path) in text


def test_every_training_loader_shares_one_written_protocol():
    """The sampler, set_epoch and the steps per epoch are written once (loaders.TrainLoader); each loader only
    makes its batches. A loader with its own epoch() or __len__ could forget set_epoch or count steps apart."""
    import inspect

    import ddp_utils
    from ddp_utils.loaders import TrainLoader
    from ddp_utils.speed.dali import DaliTrainLoader
    from ddp_utils.speed.fastjpeg import NormalizedEpochLoader
    from ddp_utils.speed.memdata import MemoryLoader
    for loader in (EpochLoader, NormalizedEpochLoader, MemoryLoader, DaliTrainLoader):
        assert issubclass(loader, TrainLoader), loader
        assert not {"epoch", "__len__", "_shuffle", "__iter__"} & set(vars(loader)), loader
    import ast
    package = Path(ddp_utils.__file__).parent
    calling = sorted(f"{p.relative_to(package)}:{node.lineno}" for p in package.rglob("*.py")
                     for node in ast.walk(ast.parse(p.read_text()))
                     if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "set_epoch")
    assert len(calling) == 1 and calling[0].startswith("loaders.py:"), calling
    assert "set_epoch(" in inspect.getsource(TrainLoader._shuffle)


# A forked worker inherits the parent's garbage too; collecting it there must not free the parent's process group.
GARBAGE_GROUP_THEN_WORKERS = """
import gc, sys
import torch.distributed as dist
import ddp_utils.data as data_module
from ddp_utils.settings import Settings

def init_and_collect(worker_id, kit_init=data_module.close_inherited_listeners):
    gc.collect()                  # the worker's collector runs (any allocation may start it)
    kit_init(worker_id)

data_module.close_inherited_listeners = init_and_collect
data = data_module.build_loaders(Settings(dataset="fake", workers=1, batch_size=4, image_size=16,
                                          max_steps_per_epoch=2), 0, 1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
cycle = {"group": dist.new_group([0])}   # e.g. a torn-down run's group, still in a reference cycle
cycle["self"] = cycle
dist.destroy_process_group()
del cycle
gc.disable()                             # it is still garbage when the workers are forked
print("train", [tuple(x.shape) for x, _ in data.train.epoch(0)], flush=True)
print("val", sum(len(y) for _, y in data.val), flush=True)
"""


@pytest.mark.slow
def test_a_worker_never_frees_the_parents_garbage_process_group():
    """Seen: a DataLoader worker's collector freed an old gloo group inherited from its parent; the group's
    destructor waited for threads that exist only in the parent, and worker and rank hung for ever."""
    result, = procs.run_all([procs.python("-c", GARBAGE_GROUP_THEN_WORKERS)], timeout=60)
    assert not result.timed_out and result.returncode == 0, procs.describe([result])
    assert "train [(4, 3, 16, 16), (4, 3, 16, 16)]" in result.output and "val " in result.output


class _SlowImages(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        import time
        time.sleep(0.5)
        return torch.zeros(3), 0


def _slow_loader_and_its_workers():
    """A two-worker EpochLoader over _SlowImages, and a function that lists its live (not zombie) workers."""
    import psutil
    from torch.utils.data import DataLoader, DistributedSampler
    me = psutil.Process()
    before = {c.pid for c in me.children()}
    dataset = _SlowImages()
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    loader = EpochLoader(DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2, drop_last=True,
                                    generator=torch.Generator()))

    def workers():
        return [c for c in me.children() if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE]
    return loader, workers, lambda: [c for c in me.children() if c.pid not in before]


def test_an_interrupt_while_waiting_for_a_batch_lets_the_loaders_workers_go():
    """Stop pressed while the loop waits for a batch: the KeyboardInterrupt's traceback holds the DataLoader's
    iterator, and a notebook keeps that traceback, so the workers were never joined (zombies under the kernel once
    the interrupt ended them too; seen in the JupyterLab test). release_workers frees them, keeping the traceback."""
    import _thread
    import threading
    loader, workers, children = _slow_loader_and_its_workers()
    threading.Timer(1.0, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt) as caught:
        for _ in loader.epoch(0):
            pass
    assert len(workers()) == 2   # kept alive by the traceback a notebook would keep
    assert released(caught.value, workers) and caught.value.__traceback__ is not None
    assert not children(), "a worker left unreaped (a zombie)"


def test_an_error_in_the_loops_own_code_also_lets_the_loaders_workers_go():
    """Issue 43, finding 10: release_workers cleared only the loaders' own frames, so an error raised in other code
    (a model's forward, a Stop during the step) whose frame holds the loader's iterator left its workers alive.
    That frame keeps its locals for a debugger."""
    loader, workers, _ = _slow_loader_and_its_workers()
    error = failed_after_one_batch(loader.epoch(0))
    assert len(workers()) == 2   # kept alive by the traceback
    assert released(error, workers)
    assert error.__traceback__.tb_next.tb_frame.f_locals["step"] == 1   # the loop's frame kept its locals


def test_the_iterator_of_a_loop_that_is_still_running_keeps_its_workers():
    """The frame that caught the error (and its callers) still run: their iterators are left alone."""
    from torch.utils.data import DataLoader
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1)
    seen = []
    for batch in loader:   # the outer loop goes on after each failed attempt
        try:
            raise RuntimeError("one attempt failed")
        except RuntimeError as exc:
            loaders.release_workers(exc)
        seen.append(batch.tolist())
    assert seen == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_forked_loader_worker_imports_nothing_when_it_closes_the_inherited_listeners(monkeypatch):
    """Issue 43, finding 8: the workers imported psutil after the fork, in a parent whose threads (the watch, the
    store's) may hold the loader's lock then: a C extension loaded there can hang the worker for good."""
    import builtins
    from ddp_utils import loaders
    imported, real = [], builtins.__import__

    def noted(name, *args, **kwargs):
        imported.append(name)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", noted)
    loaders.close_inherited_listeners(0)
    monkeypatch.undo()
    assert imported == []

"""ddp_utils.speed.memdata: the in-memory loader gives the same shards and evaluation tensors as the workers path.

Small CINIC-10-layout folders of random-noise PNGs are written into tmp_path (noise, so that every crop
offset and every flip gives a different tensor); the demo set is real handwritten digits.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DistributedSampler

from ddp_utils.speed import memdata
from ddp_utils.data import build_loaders, loader_for
from ddp_utils.datasets import DataError, check_data
from ddp_utils.speed.memdata import MemoryLoader, augmentation_generator, crop_flip, decode_split, normalize
from ddp_utils.settings import MUST_AGREE, Settings
from tests.helpers.folders import CINIC
from tests.helpers.runs import run_ranks


def make_noisy_cinic(root, per_class: int = 3, seed: int = 0):
    """root/{train,valid}/<class>/*.png, 32x32 RGB random noise, the ten CINIC-10 class folders."""
    rng = np.random.default_rng(seed)
    for split in ("train", "valid"):
        for c, name in enumerate(CINIC):
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"cifar10-{split}-{c * 100 + i}.png")
    return root


def settings(path, dataset="cinic10", **kw) -> Settings:
    return Settings(**{"dataset": dataset, "data_dir": str(path), "workers": 0, "batch_size": 4,
                       "loader": "memory", **kw})


@pytest.fixture
def cinic(tmp_path):
    return make_noisy_cinic(tmp_path / "cinic10")   # 30 train, 30 valid images


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("memdata") / "demo"
    check_data(Settings(dataset="demo", data_dir=str(root)))   # writes the demo set
    return root


def batches(loader, epoch):
    return list(loader.epoch(epoch))


def crops(image: torch.Tensor, pad: int):
    """Every (dy, dx, mirrored, crop) of one uint8 image (3, S, S) with ``pad`` pixels of zero padding."""
    s = image.shape[-1]
    padded = F.pad(image, (pad,) * 4)
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            crop = padded[:, dy:dy + s, dx:dx + s]
            yield dy, dx, False, crop
            yield dy, dx, True, crop.flip(-1)


def augmentations_of(loader: MemoryLoader, epoch: int) -> list[tuple[int, int, bool]]:
    """(dy, dx, mirrored) of each sample of the epoch's first batch, found by trying every crop."""
    images, _ = next(loader.epoch(epoch))
    found = []
    for out, i in zip(images, loader.indices(epoch)):
        source = loader.dataset.images[i]
        hits = [(dy, dx, m) for dy, dx, m, crop in crops(source, loader.pad)
                if torch.equal(normalize(crop[None], loader.mean, loader.std)[0], out)]
        assert hits, f"sample {int(i)} is no crop of its source image"
        found.append(hits[0])
    return found


# ---------------------------------------------------------------------------------------------
# Shuffle and shards: DistributedSampler's, exactly
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_train_shards_are_disjoint_and_are_distributed_samplers_indices(cinic, world_size):
    shards = []
    for rank in range(world_size):
        loader = build_loaders(settings(cinic, seed=5, batch_size=2), rank, world_size).train
        reference = DistributedSampler(range(30), num_replicas=world_size, rank=rank, shuffle=True, seed=5,
                                       drop_last=True)
        reference.set_epoch(3)
        workers_path = build_loaders(settings(cinic, seed=5, batch_size=2, loader="workers"), rank, world_size).train
        workers_path.sampler.set_epoch(3)
        shard = loader.indices(3).tolist()
        assert shard == list(reference) == list(workers_path.sampler)
        labels = torch.cat([y for _, y in batches(loader, 3)])
        assert torch.equal(labels, loader.dataset.labels[shard[:len(labels)]])   # batches follow the shard
        assert len(loader) == len(workers_path)
        shards.append(shard)
    union = [i for s in shards for i in s]
    assert len(set(union)) == len(union) == world_size * (30 // world_size)


def test_train_order_changes_with_the_epoch_and_repeats_for_the_same_seed(demo_dir):
    a = build_loaders(settings(demo_dir, "demo"), 0, 2).train
    b = build_loaders(settings(demo_dir, "demo"), 0, 2).train
    c = build_loaders(settings(demo_dir, "demo", seed=1), 0, 2).train
    assert a.indices(0).tolist() != a.indices(1).tolist()
    assert a.indices(1).tolist() == b.indices(1).tolist()
    assert a.indices(1).tolist() != c.indices(1).tolist()


def test_max_steps_per_epoch_is_respected(demo_dir):
    full = build_loaders(settings(demo_dir, "demo", batch_size=64), 0, 2).train
    capped = build_loaders(settings(demo_dir, "demo", batch_size=64, max_steps_per_epoch=3), 0, 2).train
    assert len(full) == 1078 // 2 // 64 == len(batches(full, 0))
    assert len(capped) == 3 == len(batches(capped, 0))


def test_the_train_loader_cannot_be_iterated_without_an_epoch(cinic):
    with pytest.raises(TypeError, match="epoch"):
        iter(build_loaders(settings(cinic), 0, 1).train)


# ---------------------------------------------------------------------------------------------
# Evaluation: exact shards, the workers path's tensors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_eval_covers_every_image_exactly_once_across_ranks(cinic, world_size):
    seen = []
    for rank in range(world_size):
        val = build_loaders(settings(cinic, batch_size=4), rank, world_size).val
        got = list(val)
        assert len(got) == len(val)
        mine = list(val.sampler)
        assert mine == list(range(rank, 30, world_size))                # EvalShardSampler: r, r + W, ...
        assert torch.equal(torch.cat([x for x, _ in got]), normalize(val.dataset.images[mine], val.mean, val.std))
        assert torch.equal(torch.cat([y for _, y in got]), val.dataset.labels[mine])
        seen += mine
    assert sorted(seen) == list(range(30))


@pytest.mark.parametrize("dataset, image_size", [("demo", 0), ("cinic10", 0), ("cinic10", 40)])
def test_eval_images_equal_the_workers_paths_exactly(demo_dir, cinic, dataset, image_size):
    path = demo_dir if dataset == "demo" else cinic
    for rank in range(2):
        memory = build_loaders(settings(path, dataset, image_size=image_size), rank, 2).val
        workers = build_loaders(settings(path, dataset, image_size=image_size, loader="workers"), rank, 2).val
        m_images, m_labels = map(torch.cat, zip(*memory))
        w_images, w_labels = map(torch.cat, zip(*workers))
        assert m_images.dtype == torch.float32 and m_images.shape[-1] == (image_size or 32)
        assert torch.equal(m_images, w_images) and torch.equal(m_labels, w_labels)


def test_decode_split_lists_images_in_image_folder_order(demo_dir):
    images, labels = decode_split(demo_dir, "valid")
    first = sorted((demo_dir / "valid" / "0_zero").iterdir())[0]
    assert images.dtype == torch.uint8 and images.shape == (len(labels), 3, 32, 32)
    assert torch.equal(images[0], torch.from_numpy(np.array(Image.open(first).convert("RGB"))).permute(2, 0, 1))
    assert labels.dtype == torch.int64 and labels.tolist() == sorted(labels.tolist())
    with pytest.raises(DataError, match="class folders"):
        decode_split(demo_dir, "valid", classes=["a", "b"])


def test_big_splits_decoded_by_worker_processes_give_the_same_tensors(cinic, monkeypatch):
    alone = decode_split(cinic, "train")
    monkeypatch.setattr(memdata, "PARALLEL_DECODE_FROM", 1)   # as if the split were CINIC-10-sized
    shared = decode_split(cinic, "train", workers=2)
    assert torch.equal(alone[0], shared[0]) and torch.equal(alone[1], shared[1])


# ---------------------------------------------------------------------------------------------
# Training batches and augmentation
# ---------------------------------------------------------------------------------------------
def test_train_batches_are_full_float32_normalised_images_and_int64_labels(demo_dir):
    loader = build_loaders(settings(demo_dir, "demo", batch_size=32), 1, 2).train
    low, high = (0 - loader.mean) / loader.std, (1 - loader.mean) / loader.std   # pixels 0 and 255, per channel
    for images, labels in batches(loader, 0):
        assert images.shape == (32, 3, 32, 32) and images.dtype == torch.float32
        assert labels.shape == (32,) and labels.dtype == torch.int64 and 0 <= labels.min() <= labels.max() <= 9
        assert (images >= low - 1e-6).all() and (images <= high + 1e-6).all()
        assert (images == low).any()                  # the zero padding, normalised like a black pixel


def test_crops_and_flips_are_drawn_per_sample():
    image = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    batch = image.expand(64, -1, -1, -1)
    out = crop_flip(batch, 4, True, augmentation_generator(0, 0, 0))
    assert out.shape == batch.shape and out.dtype == torch.uint8
    assert len({tuple(o.flatten().tolist()) for o in out}) > 20   # not one crop for the whole batch
    mirrored = [next(m for _, _, m, crop in crops(image[0], 4) if torch.equal(crop, o)) for o in out]
    assert 10 < sum(mirrored) < 54                                # a coin per sample, not per batch
    unflipped = crop_flip(batch, 0, False, augmentation_generator(0, 0, 0))
    assert torch.equal(unflipped, batch)                          # no padding, no flip: unchanged


def test_cinic_batches_are_crops_and_flips_of_their_own_images_with_per_sample_offsets(cinic):
    loader = build_loaders(settings(cinic, batch_size=8), 0, 1).train
    found = augmentations_of(loader, 0) + augmentations_of(loader, 1) + augmentations_of(loader, 2)
    assert len({(dy, dx) for dy, dx, _ in found}) > 1
    assert {m for _, _, m in found} == {False, True}               # cinic10 flips, per sample


def test_demo_batches_are_crops_that_are_never_mirrored(demo_dir):
    loader = build_loaders(settings(demo_dir, "demo", batch_size=64), 0, 2).train
    assert not loader.flip
    found = augmentations_of(loader, 0)
    assert len({(dy, dx) for dy, dx, _ in found}) > 1
    # A digit can equal its own mirror image (a centred 0, 1 or 8), so check the crops directly:
    images, _ = next(loader.epoch(0))
    for out, i, (dy, dx, _) in zip(images, loader.indices(0), found):
        crop = F.pad(loader.dataset.images[i], (4,) * 4)[:, dy:dy + 32, dx:dx + 32]
        assert torch.equal(out, normalize(crop[None], loader.mean, loader.std)[0])


def test_augmentation_is_reproducible_for_the_same_seed_rank_and_epoch(demo_dir):
    a = build_loaders(settings(demo_dir, "demo", batch_size=64), 1, 2).train
    b = build_loaders(settings(demo_dir, "demo", batch_size=64), 1, 2).train
    first = batches(a, 1)
    batches(a, 2)
    for (x, y), (x2, y2), (x3, y3) in zip(first, batches(b, 1), batches(a, 1)):
        assert torch.equal(x, x2) and torch.equal(x, x3) and torch.equal(y, y2) and torch.equal(y, y3)
    draws = lambda *key: torch.randint(0, 9, (64,), generator=augmentation_generator(*key)).tolist()  # noqa: E731
    assert draws(0, 1, 1) == draws(0, 1, 1)
    assert len({str(draws(*key)) for key in [(0, 1, 1), (1, 1, 1), (0, 0, 1), (0, 1, 2)]}) == 4


# ---------------------------------------------------------------------------------------------
# Settings, errors and a real run
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dataset, reason", [("imagenet", "ImageNet does not fit in memory"),
                                             ("fake", "on the fly")])
def test_memory_loader_with_imagenet_or_fake_is_a_clear_data_error(tmp_path, dataset, reason):
    with pytest.raises(DataError) as err:
        build_loaders(settings(tmp_path, dataset), 0, 1)
    assert reason in str(err.value) and "loader='workers'" in str(err.value)


def test_loader_is_a_setting_the_ranks_need_not_share():
    assert Settings().loader == "workers"
    assert "loader" not in MUST_AGREE   # same shards, steps and eval tensors either way
    with pytest.raises(ValueError, match="loader"):
        Settings(loader="gpu")


def test_auto_decodes_the_small_presets_once_into_memory_and_leaves_imagenet_to_the_workers(tmp_path, demo_dir):
    # the notebooks' default: on a CPU rehearsal two ranks' DataLoader workers took the cores the ranks train on
    # (benchmarks/notebook_rehearsal.py: 1.55x single.ipynb with workers, 1.72x without)
    assert [loader_for(Settings(dataset=d, loader="auto")) for d in ("demo", "cinic10", "imagenet", "fake")] == [
        "memory", "memory", "workers", "workers"]
    assert loader_for(Settings(dataset="demo", loader="workers")) == "workers"   # an explicit choice stands
    data = build_loaders(Settings(dataset="demo", data_dir=demo_dir, loader="auto", batch_size=64), 0, 1)
    assert isinstance(data.train, MemoryLoader)


@pytest.mark.slow
def test_two_ranks_train_one_epoch_of_the_demo_set_with_the_memory_loader(tmp_path, demo_dir):
    run_ranks(tmp_path, "run", 2, "--dataset", "demo", "--data-dir", demo_dir, "--loader", "memory",
              "--epochs", "1", "--max-steps-per-epoch", "4", "--batch-size", "16")
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["world_size"] == 2 and results["val_images"] == 359
    assert json.loads((tmp_path / "run" / "settings.json").read_text())["loader"] == "memory"

"""ddp_utils.speed.fastjpeg: ImageNet's workers path sends uint8 and normalises after, with the classic path's
shards, steps, crops and validation tensors (within the rounding of two antialiased resizes).

The classic path is the course's: Pillow decodes, ``datasets.train_transform`` / ``eval_transform``
(RandomResizedCrop or Resize + CenterCrop, ToTensor, Normalize) in the workers, float32 batches out.
Tolerance: the two paths decode to identical pixels (both are libjpeg-turbo); Pillow's and torchvision's
antialiased resizes round differently, by at most 2 of 255 levels per pixel (measured: at most 2 on
ImageNet-size photos, 0.002 levels on average). The photos are cut from the two real photos that
scikit-learn ships, so every crop and every pixel of rounding shows.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler

from ddp_utils.speed import fastjpeg
from ddp_utils.data import build_loaders
from ddp_utils.datasets import DataError, ImageFolderDataset, eval_transform, load_preset, train_transform
from ddp_utils.loaders import EpochLoader, EvalShardSampler, augmentation_seed
from ddp_utils.speed.memdata import normalize
from ddp_utils.settings import Settings
from tests.helpers.folders import WNIDS, make_imagenet
from tests.helpers.folders import levels, make_photo_imagenet, pillow

LEVELS = 2   # of 255: the most the two resizes may differ per pixel


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return make_photo_imagenet(tmp_path_factory.mktemp("fastjpeg") / "imagenet")


@pytest.fixture
def imagenet(tmp_path):
    return make_imagenet(tmp_path / "imagenet", train_per_class=5)   # 15 train, 6 val: test_data's folders


def settings(path, **kw) -> Settings:
    return Settings(**{"dataset": "imagenet", "data_dir": str(path), "workers": 0, "batch_size": 2, **kw})


def classic(s: Settings, rank: int, world_size: int):
    """The course's path, as build_loaders assembled it before fastjpeg: float32 out of the workers."""
    preset, root = load_preset("imagenet"), Path(s.data_dir)
    size = s.image_size or preset.image_size
    train_set = ImageFolderDataset(root / "train", train_transform(preset, size))
    val_set = ImageFolderDataset(root / "val", eval_transform(preset, size))
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=s.seed,
                                 drop_last=True)
    train = DataLoader(train_set, batch_size=s.batch_size, sampler=sampler, drop_last=True,
                       num_workers=s.workers, generator=torch.Generator())
    val = DataLoader(val_set, batch_size=s.batch_size, sampler=EvalShardSampler(val_set, rank, world_size))
    return EpochLoader(train, s.max_steps_per_epoch, seed=s.seed, rank=rank), val


# ---------------------------------------------------------------------------------------------
# Shards and steps: the classic path's, exactly
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_rank_gets_the_classic_paths_shard_and_steps(imagenet, world_size):
    shards = []
    for rank in range(world_size):
        fast = build_loaders(settings(imagenet, seed=3, image_size=32), rank, world_size).train
        old, _ = classic(settings(imagenet, seed=3, image_size=32), rank, world_size)
        assert isinstance(fast, fastjpeg.NormalizedEpochLoader) and len(fast) == len(old) == 15 // world_size // 2
        for epoch in (0, 1):
            fast_labels = [y.tolist() for _, y in fast.epoch(epoch)]
            assert fast_labels == [y.tolist() for _, y in old.epoch(epoch)]   # same indices, same order
            assert len(fast_labels) == len(fast)
            assert list(fast.sampler) == list(old.sampler)                    # set_epoch(epoch) on both
        shards.append(list(fast.sampler))
    union = [i for shard in shards for i in shard]
    assert len(set(union)) == len(union) == world_size * (15 // world_size)   # disjoint


@pytest.mark.parametrize("workers", [0, 1])
def test_same_seed_rank_and_epoch_cut_the_classic_paths_crops(photos, workers):
    """The v2 transforms draw the classic ones' random numbers: same crop and flip, pixels within 2 levels."""
    s = settings(photos, workers=workers, batch_size=4, image_size=64, seed=7)
    fast = build_loaders(s, 1, 2).train
    old, _ = classic(s, 1, 2)
    for epoch in (0, 2):
        a = torch.cat([x for x, _ in fast.epoch(epoch)])
        b = torch.cat([x for x, _ in old.epoch(epoch)])
        assert a.shape == b.shape == (4, 3, 64, 64) and a.dtype == torch.float32
        assert levels(a, b).max() <= LEVELS + 1e-3


def test_augmentation_depends_on_seed_rank_and_epoch_only(photos):
    def draw(rank, epoch, seed=0):
        loader = build_loaders(settings(photos, batch_size=4, image_size=48, seed=seed), rank, 2).train
        torch.manual_seed(0)   # the training's global RNG, the same on every rank: must not matter
        return torch.cat([x for x, _ in loader.epoch(epoch)])
    assert torch.equal(draw(1, 1), draw(1, 1))             # a re-run (or a resume) draws the same crops
    assert not torch.equal(draw(1, 1), draw(1, 2))         # other epoch, other crops
    assert not torch.equal(draw(1, 1), draw(1, 1, seed=1))


# ---------------------------------------------------------------------------------------------
# Exact evaluation: the classic path's tensors within 2 levels
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("image_size", [224, 64])
def test_validation_tensors_match_the_classic_paths_within_2_of_255_levels(photos, image_size):
    seen = []
    for rank in range(2):
        s = settings(photos, batch_size=2, image_size=image_size)
        fast = build_loaders(s, rank, 2).val
        _, old = classic(s, rank, 2)
        assert list(fast.sampler) == list(old.sampler) == list(range(rank, 9, 2)) and len(fast) == len(old)
        a, a_labels = map(torch.cat, zip(*fast))
        b, b_labels = map(torch.cat, zip(*old))
        assert torch.equal(a_labels, b_labels) and a.shape == b.shape == (len(old.sampler), 3, image_size, image_size)
        diff = levels(a, b)
        # mean: torchvision's bundled libjpeg-turbo and Pillow's round the decode differently by build and CPU
        # (torch 2.6's torchvision 0.21 on this VM: 1 level on ~15 % of pixels; 0.29: on under 0.3 %)
        assert diff.max() <= LEVELS + 1e-3 and diff.mean() < 0.2
        seen += list(fast.sampler)
    assert sorted(seen) == list(range(9))                  # every validation image once across the ranks


# ---------------------------------------------------------------------------------------------
# uint8 through the queues, normalisation after
# ---------------------------------------------------------------------------------------------
def test_uint8_goes_through_the_worker_queue_and_is_normalised_after(photos):
    data = build_loaders(settings(photos, workers=1, batch_size=4, image_size=32), 0, 1)
    queued = [x for x, _ in data.train.loader]                              # what the worker process sent
    assert queued and all(x.dtype == torch.uint8 and x.shape == (4, 3, 32, 32) for x in queued)
    out = [x for x, _ in data.train.epoch(0)]
    norm = data.train.to_device
    assert all(x.dtype == torch.float32 for x in out)
    data.train.loader.generator.manual_seed(augmentation_seed(0, 0, 0))   # what epoch(0) seeded the workers with
    again = [x for x, _ in data.train.loader]                               # so: the same uint8 crops
    assert len(again) == len(out) == 3
    assert all(torch.equal(normalize(u, norm.mean, norm.std), f) for u, f in zip(again, out))
    val_queued = next(iter(data.val.loader))[0]
    assert val_queued.dtype == torch.uint8
    assert torch.equal(next(iter(data.val))[0], normalize(val_queued, norm.mean, norm.std))


def test_device_normalize_keeps_cpu_batches_contiguous_and_moves_labels():
    preset = load_preset("imagenet")
    to_device = fastjpeg.DeviceNormalize(preset, "cpu", channels_last=True)   # channels_last is for GPUs
    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    (x, y), = to_device([(images, torch.tensor([1, 2]))])
    assert x.is_contiguous() and x.dtype == torch.float32 and y.tolist() == [1, 2]
    expected = (images.float() / 255 - torch.tensor(preset.mean).view(3, 1, 1)) / torch.tensor(preset.std).view(3, 1, 1)
    assert torch.allclose(x, expected, atol=1e-6)


def test_decode_rgb_gives_pillows_pixels_for_jpeg_png_cmyk_and_grey(photos, tmp_path):
    jpeg = next((photos / "train" / WNIDS[0]).iterdir())
    image = Image.open(jpeg).convert("RGB")
    image.save(tmp_path / "png.JPEG", format="PNG")              # ImageNet has a PNG named .JPEG
    image.convert("CMYK").save(tmp_path / "cmyk.JPEG")           # and CMYK JPEGs
    image.convert("L").save(tmp_path / "grey.JPEG")
    for path in (jpeg, tmp_path / "png.JPEG", tmp_path / "cmyk.JPEG", tmp_path / "grey.JPEG"):
        out = fastjpeg.decode_rgb(str(path))
        assert out.dtype == torch.uint8 and out.shape[0] == 3 and torch.equal(out, pillow(path)), path.name


def test_decode_rgb_without_torchvisions_decoder_uses_pillow(photos, monkeypatch):
    jpeg = next((photos / "val" / WNIDS[1]).iterdir())
    monkeypatch.setattr(fastjpeg, "decode_jpeg", None)   # a torchvision whose decoders are gone
    assert torch.equal(fastjpeg.decode_rgb(str(jpeg)), pillow(jpeg))


def test_an_unreadable_file_is_the_kits_paragraph_naming_it(imagenet):
    bad = imagenet / "train" / WNIDS[2] / "broken.JPEG"
    bad.write_bytes((imagenet / "val" / WNIDS[2] / "ILSVRC2012_val_00000006.JPEG").read_bytes()[:300])
    with pytest.raises(DataError, match="Pillow cannot read") as e:
        fastjpeg.decode_rgb(str(bad))
    assert str(bad) in str(e.value)


# ---------------------------------------------------------------------------------------------
# The CPU's normalisation: ToTensor + Normalize's bits, into memory reused only when nothing holds it
# ---------------------------------------------------------------------------------------------
def test_cpu_normalisation_gives_to_tensor_and_normalize_bits_for_every_level_and_channel():
    from torchvision import transforms as T
    preset = load_preset("imagenet")
    every = torch.arange(256, dtype=torch.uint8).view(16, 16).expand(3, 16, 16).contiguous()   # all 256 levels
    images = torch.stack([every, torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8)])
    classic_bits = torch.stack([T.Normalize(preset.mean, preset.std)(T.ToTensor()(Image.fromarray(im.permute(1, 2, 0)
                                                                                                  .numpy())))
                                for im in images])
    to_device = fastjpeg.DeviceNormalize(preset, "cpu")
    for _ in range(3):   # a fresh buffer, then reused ones
        (x, _), = to_device([(images, torch.tensor([0, 1]))])
        assert torch.equal(x, classic_bits)
        del x


def test_cpu_batches_reuse_memory_only_once_nothing_holds_them():
    preset = load_preset("imagenet")
    batches = [(torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8), torch.arange(4)) for _ in range(6)]
    expected = [normalize(x, fastjpeg.DeviceNormalize(preset).mean, fastjpeg.DeviceNormalize(preset).std)
                for x, _ in batches]

    kept = [x for x, _ in fastjpeg.DeviceNormalize(preset, "cpu")(batches)]   # a loop that keeps its batches
    assert len({x.data_ptr() for x in kept}) == 6 and all(torch.equal(a, b) for a, b in zip(kept, expected))

    to_device = fastjpeg.DeviceNormalize(preset, "cpu")
    addresses = [x.data_ptr() for x, _ in to_device(batches)]   # a training loop: each batch dropped for the next
    kept_memory = {s.data_ptr() for s in to_device.reuse.storages}
    assert len(kept_memory) == 2 and set(addresses) == kept_memory   # two buffers serve all six batches

    # a view of a batch, or a graph still to run backward, keeps that batch's memory out of reuse
    conv = torch.nn.Conv2d(3, 2, 3)
    losses, views = [], []
    for i, (x, _) in enumerate(fastjpeg.DeviceNormalize(preset, "cpu")(batches)):
        assert torch.equal(x, expected[i])
        if i < 2:
            losses.append(conv(x.requires_grad_(False)).sum())   # conv saves its input for the weight gradient
        elif i < 4:
            views.append(x[0])
    sum(losses).backward()   # would fail ("modified by an inplace operation") had a saved input been overwritten
    assert all(torch.equal(v, expected[2 + k][0]) for k, v in enumerate(views))


def test_train_crops_are_the_classic_random_resized_crops_and_flips_for_the_same_draws(photos):
    from torchvision import transforms as T
    image = fastjpeg.decode_rgb(str(next((photos / "train").glob("*/*.JPEG"))))
    fast = fastjpeg.train_transform(load_preset("imagenet"), 48)
    v2_steps = T.v2.Compose([T.v2.RandomResizedCrop(48, antialias=True), T.v2.RandomHorizontalFlip()])
    torch.manual_seed(5)
    ours = [fast(image) for _ in range(20)]
    torch.manual_seed(5)
    assert all(torch.equal(a, v2_steps(image)) for a in ours)   # the same draws, the same kernels: the same bits
    assert len({a.sum().item() for a in ours}) > 10             # and they are random crops

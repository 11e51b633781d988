"""ddp_utils.speed.regionjpeg: a JPEG's crop box decoded alone is the whole decode's crop, and what it cannot take
goes to the whole decode (fastjpeg.decode_rgb), so the result never differs in kind.

Bound: LEVELS (2 of 255) per pixel between the box decoded alone and the crop of the whole decode, the kit's
tolerance elsewhere; measured: 0 (nvImageCodec 0.9 decodes a box by the same libjpeg-turbo arithmetic as
torchvision's whole decode, upsampling at the box's edges included), on these photos and on 512
benchmarks/photos.py ones. The photos are cut from the two real photos scikit-learn ships, at sizes that are not
multiples of a JPEG block, in every chroma subsampling, progressive and grey.
"""
from __future__ import annotations

import multiprocessing
import random
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import v2

from ddp_utils.datasets import DataError, load_preset
from ddp_utils.speed import fastjpeg, regionjpeg

LEVELS = 2   # of 255
needs_nvimgcodec = pytest.mark.skipif(not regionjpeg.available(), reason="nvImageCodec is not installed here "
                                      "(pip install nvidia-nvimgcodec-cu12; requirements-dev.txt's DALI brings it)")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Path]:
    from sklearn.datasets import load_sample_images
    sources = [Image.fromarray(a) for a in load_sample_images().images]   # 640 x 427 each
    root, rng = tmp_path_factory.mktemp("regionjpeg"), random.Random(0)
    saves = [dict(quality=95), dict(quality=90, subsampling=0), dict(quality=90, subsampling=1),
             dict(quality=90, progressive=True), dict(quality=85)]
    paths = []
    for i, options in enumerate(saves):
        width, height = rng.randint(300, 500), rng.randint(250, 400)          # not multiples of 8 or 16
        image = sources[i % 2].crop((0, 0, width, height))
        if i == len(saves) - 1:
            image = image.convert("L")
        paths.append(root / f"photo{i}.JPEG")
        image.save(paths[-1], **options)
    return paths


def boxes(height: int, width: int, rng: random.Random) -> list[tuple[int, int, int, int]]:
    crop = T.RandomResizedCrop(224)
    torch.manual_seed(rng.randrange(1000))
    drawn = [crop.get_params(torch.empty(3, height, width), crop.scale, crop.ratio) for _ in range(6)]
    return drawn + [(0, 0, height, width), (0, 16, 40, 32), (height - 17, width - 33, 17, 33), (5, 7, 1, 1)]


def whole_crop(path, top, left, height, width):
    return fastjpeg.decode_rgb(str(path))[:, top:top + height, left:left + width]


@needs_nvimgcodec
def test_a_box_decoded_alone_is_the_whole_decodes_crop_within_2_of_255_levels(photos):
    rng = random.Random(1)
    for path in photos:
        assert regionjpeg.fallback_reason(str(path)) is None, path.name     # each of them is decoded as a box
        whole = fastjpeg.decode_rgb(str(path))
        for top, left, height, width in boxes(whole.shape[1], whole.shape[2], rng):
            box = regionjpeg.decode_region(str(path), top, left, height, width)
            assert box.dtype == torch.uint8 and box.shape == (3, height, width), (path.name, top, left)
            crop = whole[:, top:top + height, left:left + width]
            assert (box.int() - crop.int()).abs().max() <= LEVELS, (path.name, top, left, height, width)


@needs_nvimgcodec
def test_drawn_boxes_give_random_crop_flips_bits_for_the_same_seed(photos):
    # the wiring this module is for: the box drawn on the header's size, decoded alone, resized and flipped
    kit = fastjpeg.train_transform(load_preset("imagenet"), 64)
    crop = kit.crop

    def region_crop_flip(path):
        draw = lambda h, w: crop.get_params(torch.empty(3, h, w, device="meta"), crop.scale, crop.ratio)  # noqa: E731
        out = v2.functional.resize(regionjpeg.decode_drawn(str(path), draw), list(crop.size), antialias=True)
        return v2.functional.horizontal_flip(out) if torch.rand(1) < 0.5 else out

    for path in photos:
        torch.manual_seed(3)
        ours = [region_crop_flip(path) for _ in range(8)]
        torch.manual_seed(3)
        theirs = [kit(fastjpeg.decode_rgb(str(path))) for _ in range(8)]
        assert all((a.int() - b.int()).abs().max() <= LEVELS for a, b in zip(ours, theirs)), path.name
        assert len({a.sum().item() for a in ours}) > 4                    # and they are different crops


def test_a_png_a_cmyk_jpeg_and_a_truncated_one_go_to_the_whole_decode(photos, tmp_path):
    image = Image.open(photos[0]).convert("RGB")
    image.save(tmp_path / "png.JPEG", format="PNG")              # ImageNet has a PNG named .JPEG
    image.convert("CMYK").save(tmp_path / "cmyk.JPEG")           # and CMYK JPEGs
    (tmp_path / "cut.JPEG").write_bytes(photos[0].read_bytes()[:20000])
    box = (10, 20, 100, 150)
    reasons = {"png.JPEG": "not a JPEG", "cmyk.JPEG": "CMYK", "cut.JPEG": "end-of-image"}
    for name, reason in reasons.items():      # (without nvImageCodec, the reason is that, for every file)
        assert (reason if regionjpeg.available() else "not installed") in regionjpeg.fallback_reason(
            str(tmp_path / name)), name
    for name in ("png.JPEG", "cmyk.JPEG"):
        path = str(tmp_path / name)
        out = regionjpeg.decode_region(path, *box)
        assert out.dtype == torch.uint8 and out.shape == (3, 100, 150) and torch.equal(out, whole_crop(path, *box))
    with pytest.raises(DataError, match="cut.JPEG"):             # as the whole decode: the kit names the file
        regionjpeg.decode_region(str(tmp_path / "cut.JPEG"), 0, 0, 8, 8)   # though the box's rows are all there
    (tmp_path / "junk.JPEG").write_bytes(b"\xff\xd8\xff\xe0 not a JPEG after all" * 4)
    with pytest.raises(DataError, match="junk.JPEG"):
        regionjpeg.decode_region(str(tmp_path / "junk.JPEG"), 0, 0, 8, 8)


def test_the_decision_follows_nvimgcodec_and_the_result_does_not(photos, monkeypatch):
    path, box = str(photos[1]), (30, 40, 120, 90)
    assert regionjpeg.available() == (regionjpeg.fallback_reason(path) is None)
    monkeypatch.setattr(regionjpeg, "_unavailable", "nvImageCodec is not installed (a test)")
    assert not regionjpeg.available()
    assert regionjpeg.fallback_reason(path) == "nvImageCodec is not installed (a test)"
    assert torch.equal(regionjpeg.decode_region(path, *box), whole_crop(path, *box))
    sizes = []
    out = regionjpeg.decode_drawn(path, lambda h, w: sizes.append((h, w)) or (0, 0, h, w))
    assert sizes == [tuple(out.shape[1:])]                       # drawn once, on the image's size


def test_a_box_outside_the_image_is_a_value_error(photos):
    whole = fastjpeg.decode_rgb(str(photos[2]))
    height, width = whole.shape[1:]
    for box in ((0, 0, height + 1, width), (0, width - 10, 10, 11), (-1, 0, 5, 5), (0, 0, 0, 5)):
        with pytest.raises(ValueError, match="box"):
            regionjpeg.decode_region(str(photos[2]), *box)


def _decode_in_child(path: str) -> tuple:
    return tuple(regionjpeg.decode_region(path, 0, 0, 32, 48).shape), regionjpeg.fallback_reason(path)


@pytest.mark.slow
@needs_nvimgcodec
def test_a_forked_worker_makes_its_own_decoder(photos):
    # DataLoader workers are forked after the parent used the decoder: fork copies no thread, so a child makes
    # its own decoder rather than lean on the parent's (nvImageCodec 0.9 coped with that, a later one need not)
    regionjpeg.decode_region(str(photos[0]), 0, 0, 8, 8)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        shape, reason = pool.apply_async(_decode_in_child, (str(photos[0]),)).get(timeout=60)
    assert shape == (3, 32, 48) and reason is None


@needs_nvimgcodec
def test_the_kits_imagenet_loader_decodes_regions_and_cuts_the_same_batches_as_the_whole_decode(tmp_path,
                                                                                                monkeypatch):
    """--loader workers for ImageNet takes RegionCropFlip where nvImageCodec imports; without it RandomCropFlip on
    the whole decode: the same seed gives the same uint8 batches either way (same draws, same order, same pixels)."""
    from ddp_utils.data import build_loaders
    from ddp_utils.settings import Settings
    from tests.helpers.folders import make_imagenet
    root = make_imagenet(tmp_path / "imagenet")
    settings = Settings(dataset="imagenet", data_dir=str(root), batch_size=3, workers=0, seed=7)

    def first_batches(region: bool):
        monkeypatch.setattr(regionjpeg, "available", lambda: region)
        data = build_loaders(settings, 0, 1, "cpu")
        crop = data.train.loader.dataset.transform
        assert isinstance(crop, regionjpeg.RegionCropFlip if region else fastjpeg.RandomCropFlip), crop
        return [images for images, _ in data.train.epoch(1)]

    region, whole = first_batches(True), first_batches(False)
    assert len(region) == len(whole) > 1
    for a, b in zip(region, whole):
        assert (a.float() - b.float()).abs().max() <= LEVELS

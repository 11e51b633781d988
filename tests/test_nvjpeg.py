"""ddp_utils.speed.nvjpeg: loader='nvjpeg' decodes and crops on the device (the CPU here) with the workers path's
shards, steps, crops and validation tensors, within the one level of 255 that path's rounding to uint8 adds.

Both paths decode with libjpeg-turbo on the CPU and draw the crops with the classic RandomResizedCrop's draws
from the same (seed, rank, epoch) stream (the workers path without worker processes); this path resizes in
float32 and keeps the fractions, that one rounds to uint8. On a GPU nvJPEG decodes instead (the gpu-marked test).
"""
from __future__ import annotations

import pytest
import torch
from PIL import Image

from ddp_utils.data import build_loaders
from ddp_utils.datasets import DataError
from ddp_utils.settings import Settings
from ddp_utils.speed import nvjpeg
from ddp_utils.speed.nvjpeg import DECODED, BYTES, JpegBytes, NvjpegEvalLoader, NvjpegTrainLoader, jpeg_header
from tests.helpers.folders import WNIDS, make_cinic, make_imagenet
from tests.helpers.loading import failed_after_one_batch, released
from tests.helpers.folders import levels, make_photo_imagenet, pillow


def settings(path, **kw) -> Settings:
    return Settings(**{"dataset": "imagenet", "data_dir": str(path), "workers": 0, "batch_size": 4,
                       "loader": "nvjpeg", "image_size": 48, **kw})


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return make_photo_imagenet(tmp_path_factory.mktemp("nvjpeg") / "imagenet")   # 12 train, 9 val, 70-150 px


@pytest.mark.parametrize("workers", [0, 1])
def test_train_batches_are_the_workers_paths_crops_within_its_rounding(photos, workers):
    for rank in (0, 1):
        for epoch in (0, 1):
            mine = build_loaders(settings(photos, seed=5, workers=workers), rank, 2).train
            workers_path = build_loaders(settings(photos, seed=5, workers=workers, loader="workers"), rank, 2).train
            assert isinstance(mine, NvjpegTrainLoader) and len(mine) == len(workers_path) == 12 // 2 // 4
            assert mine.indices(epoch) == workers_path.indices(epoch)    # the DistributedSampler's shard
            pairs = list(zip(mine.epoch(epoch), workers_path.epoch(epoch)))
            assert len(pairs) == len(mine)
            for (a, ya), (b, yb) in zip(*zip(*pairs)):
                assert a.shape == (4, 3, 48, 48) and a.dtype == torch.float32 and ya.dtype == torch.int64
                assert torch.equal(ya, yb)
                assert levels(a, b).max() <= 1.001                       # same crop and flip, unrounded
            assert a.std() > 0.2                                          # photos, not a constant


def test_crops_depend_on_seed_rank_and_epoch_only_and_workers_change_nothing(photos):
    def draw(rank, epoch, seed=0, workers=0):
        loader = build_loaders(settings(photos, seed=seed, workers=workers), rank, 2).train
        return torch.cat([x for x, _ in loader.epoch(epoch)])
    torch.manual_seed(123)
    first = draw(1, 1)
    torch.manual_seed(456)                                   # the training's own random state plays no part
    assert torch.equal(first, draw(1, 1))
    assert not torch.equal(first, draw(0, 1))                # every rank its own crops
    assert not torch.equal(first, draw(1, 0))                # and every epoch
    assert not torch.equal(first, draw(1, 1, seed=1))


def test_drawing_crops_leaves_the_trainings_random_state_alone(photos):
    loader = build_loaders(settings(photos), 0, 1).train
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    for _ in loader.epoch(0):
        pass
    assert torch.equal(torch.rand(3), expected)


def test_validation_is_the_workers_paths_exactly_once_across_ranks(photos):
    seen = []
    for rank in (0, 1):
        mine = build_loaders(settings(photos, workers=1), rank, 2).val
        workers = build_loaders(settings(photos, loader="workers"), rank, 2).val
        assert isinstance(mine, NvjpegEvalLoader) and list(mine.sampler) == list(range(rank, 9, 2))
        for _ in range(2):   # persistent workers: a second pass gives the same batches
            batches = list(mine)
            assert len(batches) == len(mine) and [len(y) for _, y in batches] == ([4, 1] if rank == 0 else [4])
            for (a, ya), (b, yb) in zip(batches, workers):
                assert torch.equal(ya, yb) and levels(a, b).max() <= 1.001
        seen += list(mine.sampler)
    assert sorted(seen) == list(range(9))


def test_max_steps_per_epoch_is_respected(photos):
    capped = build_loaders(settings(photos, batch_size=2, max_steps_per_epoch=2), 0, 1).train
    assert len(capped) == 2 == len(list(capped.epoch(0)))


# ---------------------------------------------------------------------------------------------
# What nvJPEG is given, and what the CPU decodes instead
# ---------------------------------------------------------------------------------------------
def test_jpeg_header_reads_the_frame_header(photos, tmp_path):
    jpeg = next((photos / "train" / WNIDS[0]).iterdir())
    image = Image.open(jpeg).convert("RGB")
    image.save(tmp_path / "progressive.jpg", progressive=True)
    image.convert("L").save(tmp_path / "grey.jpg")
    image.convert("CMYK").save(tmp_path / "cmyk.jpg")
    image.save(tmp_path / "png.JPEG", format="PNG")
    found = {p.name: jpeg_header(p.read_bytes()) for p in tmp_path.iterdir()}
    size = (image.height, image.width)
    assert found == {"progressive.jpg": (3, *size), "grey.jpg": (1, *size), "cmyk.jpg": None, "png.JPEG": None}
    assert jpeg_header(jpeg.read_bytes()) == (3, *size)
    assert jpeg_header(jpeg.read_bytes()[:20]) is None            # cut before its frame header
    assert jpeg_header(b"") is None


def test_files_nvjpeg_is_not_given_are_decoded_in_the_worker_with_pillows_pixels(photos, tmp_path):
    jpeg = next((photos / "train" / WNIDS[0]).iterdir())
    image = Image.open(jpeg).convert("RGB")
    image.save(tmp_path / "png.JPEG", format="PNG")              # ImageNet has a PNG named .JPEG
    image.convert("CMYK").save(tmp_path / "cmyk.JPEG")           # and CMYK JPEGs
    samples = [(str(jpeg), 0), (str(tmp_path / "png.JPEG"), 1), (str(tmp_path / "cmyk.JPEG"), 2)]
    items = [JpegBytes(samples)[i] for i in range(3)]
    assert [kind for _, _, kind, _, _ in items] == [BYTES, DECODED, DECODED]
    assert torch.equal(items[0][0], torch.frombuffer(bytearray(jpeg.read_bytes()), dtype=torch.uint8))
    for (tensor, _, _, _, box), (path, _) in zip(items[1:], samples[1:]):
        assert torch.equal(tensor, pillow(path)) and box == (0, 0, image.height, image.width, 0)
    preset = build_loaders(settings(photos), 0, 1).preset
    batch = nvjpeg.collate(items)                                  # a batch of all three kinds
    assert batch.sizes == [jpeg.stat().st_size] and len(batch.decoded) == 2
    for train in (False, True):
        (images, labels), = nvjpeg.DeviceCrops(samples, preset, 48, train=train)([batch])
        assert images.shape == (3, 3, 48, 48) and labels.tolist() == [0, 1, 2]
        assert levels(images[:1], images[1:2]).max() < 0.01       # the PNG holds the JPEG's decoded pixels
        assert levels(images[1:2], images[2:3]).mean() <= 3       # the CMYK file: another lossy encoding of them


def test_a_broken_jpeg_is_the_kits_paragraph_naming_it(tmp_path):
    imagenet = make_imagenet(tmp_path / "imagenet", train_per_class=4)
    bad = imagenet / "train" / WNIDS[2] / "broken.JPEG"
    good = (imagenet / "val" / WNIDS[2] / "ILSVRC2012_val_00000006.JPEG").read_bytes()
    bad.write_bytes(good)
    loader = build_loaders(settings(imagenet, batch_size=13), 0, 1).train   # checked whole, broken after
    bad.write_bytes(good[:300])
    assert jpeg_header(bad.read_bytes())                          # its header is whole: nvJPEG is given it
    with pytest.raises(DataError, match="Pillow cannot read") as e:
        list(loader.epoch(0))
    assert str(bad) in str(e.value)


def test_the_loader_serves_imagenet_only(tmp_path):
    with pytest.raises(DataError, match="loader='nvjpeg' is for imagenet"):
        build_loaders(settings(make_cinic(tmp_path / "cinic"), dataset="cinic10"), 0, 1)


def test_without_torchvisions_decoder_the_loader_says_what_to_do(photos, monkeypatch):
    monkeypatch.setattr(nvjpeg, "decode_jpeg", None)
    with pytest.raises(DataError, match="--loader workers"):
        build_loaders(settings(photos), 0, 1)


# ---------------------------------------------------------------------------------------------
# On a GPU: nvJPEG, the side stream, CUDA batches
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_nvjpeg_gives_cuda_batches_with_the_cpus_crops(photos):
    """The GPU suite: the same crops and validation tensors as on the CPU, within nvJPEG's own rounding of the
    decode (its IDCT is not libjpeg-turbo's), batch after batch from the side stream, channels_last when asked."""
    cpu = build_loaders(settings(photos, seed=2, workers=2), 0, 1, torch.device("cpu"))   # the same worker seeds
    gpu = build_loaders(settings(photos, seed=2, workers=2, channels_last=True), 0, 1, torch.device("cuda", 0))
    for data in (cpu, gpu):
        data.cpu_batches = [(x.cpu(), y.cpu()) for x, y in data.train.epoch(1)]   # each copied as it arrives
        data.cpu_val = [(x.cpu(), y.cpu()) for x, y in data.val]
    x, _ = next(iter(gpu.train.epoch(0)))
    assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last)
    for (a, ya), (b, yb) in [*zip(cpu.cpu_batches, gpu.cpu_batches), *zip(cpu.cpu_val, gpu.cpu_val)]:
        assert torch.equal(ya, yb)
        assert levels(a, b).mean() <= 3 and levels(a, b).max() <= 40    # nvJPEG's IDCT, the same crops


# ---------------------------------------------------------------------------------------------
# The whole command
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_train_with_nvjpeg_as_with_the_workers_path(tmp_path, photos):
    """`train --loader nvjpeg` over two ranks: the workers path's run within the rounding its uint8 crops add."""
    import json
    from tests.helpers.runs import run_ranks
    common = ("--dataset", "imagenet", "--data-dir", str(photos), "--epochs", "2", "--batch-size", "3",
              "--image-size", "32", "--workers", "1", "--arch", "convnet", "--seed", "4")
    run_ranks(tmp_path, "nvjpeg", 2, *common, "--loader", "nvjpeg")
    run_ranks(tmp_path, "workers", 2, *common, "--loader", "workers")
    mine, theirs = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("nvjpeg", "workers"))
    assert mine["world_size"] == 2 and mine["val_images"] == 9 and mine["steps"] == theirs["steps"] == 4
    assert json.loads((tmp_path / "nvjpeg" / "settings.json").read_text())["loader"] == "nvjpeg"
    for a, b in zip(mine["history"], theirs["history"]):   # measured: 5e-5 and 3e-6 apart; without the flips 8e-4
        assert a["train"]["loss"] == pytest.approx(b["train"]["loss"], rel=3e-4), (a["train"], b["train"])
        assert a["val"]["loss"] == pytest.approx(b["val"]["loss"], rel=3e-5), (a["val"], b["val"])


# ---------------------------------------------------------------------------------------------
# The decode thread: batch k + 1 decoded there while step k trains, joined whenever the epoch ends
# ---------------------------------------------------------------------------------------------
def decode_threads() -> list:
    import threading
    return [t for t in threading.enumerate() if t.name.startswith(nvjpeg.DECODE_THREAD)]


def test_batches_are_decoded_on_one_thread_that_is_joined_after_the_epoch(photos, monkeypatch):
    import threading
    loader = build_loaders(settings(photos), 0, 1).train
    makers = set()
    make = nvjpeg.DeviceCrops._make
    monkeypatch.setattr(nvjpeg.DeviceCrops, "_make", lambda self, batch: makers.add(threading.current_thread().name)
                        or make(self, batch))
    batches = list(loader.epoch(0))
    assert len(batches) == len(loader) == 3
    assert len(makers) == 1 and next(iter(makers)).startswith(nvjpeg.DECODE_THREAD)   # not the training thread
    assert decode_threads() == []


@pytest.mark.parametrize("how", ["break", "max_steps_per_epoch"])
def test_the_decode_thread_is_joined_when_the_epoch_is_left_early(photos, how):
    loader = build_loaders(settings(photos, batch_size=2, max_steps_per_epoch=2 if how != "break" else 0), 0, 1).train
    for i, _ in enumerate(loader.epoch(0)):
        assert len(decode_threads()) == 1                 # running beside the step
        if how == "break" and i == 1:
            break
    assert decode_threads() == []


def test_a_broken_jpeg_decoded_on_the_thread_reaches_the_caller_naming_it_and_the_thread_is_joined(tmp_path):
    imagenet = make_imagenet(tmp_path / "imagenet", train_per_class=4)
    bad = imagenet / "train" / WNIDS[2] / "broken.JPEG"
    good = (imagenet / "val" / WNIDS[2] / "ILSVRC2012_val_00000006.JPEG").read_bytes()
    bad.write_bytes(good)
    loader = build_loaders(settings(imagenet, batch_size=2), 0, 1).train
    bad.write_bytes(good[:300])
    with pytest.raises(DataError, match="Pillow cannot read") as e:
        for _ in loader.epoch(0):
            pass
    assert str(bad) in str(e.value)
    assert decode_threads() == []


def test_an_error_in_the_step_lets_the_decode_thread_go_although_the_traceback_is_kept(photos):
    """An error in the training step (a Stop, a failed forward) while the epoch's generator waits: a notebook keeps
    the traceback, which keeps the generator, its decode thread and the batches made ahead (GPU memory on a GPU).
    release_workers (what the kit's loop calls) shuts the thread down; the loop's frame keeps its locals."""
    from ddp_utils.robust import workers
    assert nvjpeg.DECODE_THREAD in workers.KIT_THREADS
    loader = build_loaders(settings(photos, batch_size=2), 0, 1).train
    error = failed_after_one_batch(loader.epoch(0))
    assert len(decode_threads()) == 1   # kept alive by the traceback
    assert released(error, decode_threads)
    assert error.__traceback__.tb_next.tb_frame.f_locals["step"] == 1


# ---------------------------------------------------------------------------------------------
# GPUs without nvJPEG's hardware decoder: a paragraph at start, and the run goes on
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, capability, hardware", [
    ("Tesla T4", (7, 5), False), ("NVIDIA A10G", (8, 6), False), ("NVIDIA A10", (8, 6), False),
    ("Tesla V100-SXM2-16GB", (7, 0), False), ("NVIDIA A100-SXM4-40GB", (8, 0), True),
    ("NVIDIA H100 80GB HBM3", (9, 0), True), ("NVIDIA H200", (9, 0), True), ("NVIDIA L4", (8, 9), True),
    ("NVIDIA GeForce RTX 4090", (8, 9), False), ("NVIDIA L40", (8, 9), False), ("NVIDIA B200", (10, 0), True)])
def test_which_gpus_have_a_hardware_jpeg_decoder(name, capability, hardware):
    assert nvjpeg.has_hardware_jpeg_decoder(capability, name) is hardware


def start_paragraphs(photos, monkeypatch, gpu) -> list[str]:
    """What build_data prints on rank 0 of a one-rank nvjpeg run on an emulated ``gpu`` (the loaders are not built:
    nothing may run on an emulated GPU)."""
    from ddp_utils import data as data_module
    from ddp_utils.distributed import DistContext
    from tests.helpers.gpu_emulation import pretend_gpu
    cpu_data = build_loaders(settings(photos), 0, 1)
    pretend_gpu(monkeypatch.setattr, gpu)
    monkeypatch.setattr(data_module, "build_loaders", lambda *args: cpu_data)
    said = []
    data_module.build_data(settings(photos), DistContext(0, 1, 0, torch.device("cuda", 0), None), said.append)
    return said


def test_on_a_t4_rank_0_says_at_start_that_this_loader_is_likely_slower_and_what_to_use(photos, monkeypatch):
    from tests.helpers.gpu_emulation import T4
    said = [line for line in start_paragraphs(photos, monkeypatch, T4) if "nvjpeg" in line]
    assert len(said) == 1, said
    assert "Tesla T4 (compute capability 7.5) has no hardware JPEG decoder" in said[0]
    assert "one image at a time" in said[0] and "--loader workers" in said[0] and "--loader dali" in said[0]


def test_on_an_h100_nothing_is_said(photos, monkeypatch):
    h100 = {"name": "NVIDIA H100 80GB HBM3", "capability": (9, 0), "uuid": "GPU-h100-0000"}
    assert not [line for line in start_paragraphs(photos, monkeypatch, h100) if "nvjpeg" in line]
    assert nvjpeg.decoder_warning(torch.device("cpu")) is None     # a CPU rehearsal: no GPU to warn about


def test_check_says_before_the_run_that_a_t4_has_no_hardware_decoder(monkeypatch):
    """``python -m ddp_utils check --loader nvjpeg`` on the node: the run's own paragraph, before any run starts."""
    from ddp_utils.tools.check import nvjpeg_line
    from tests.helpers.gpu_emulation import A100, T4, pretend_gpu
    nvjpeg_run = Settings(dataset="imagenet", loader="nvjpeg")
    assert "no GPU here" in nvjpeg_line(nvjpeg_run, cuda=False)
    pretend_gpu(monkeypatch.setattr, T4)
    said = nvjpeg_line(nvjpeg_run, cuda=True)
    assert "Tesla T4 (compute capability 7.5) has no hardware JPEG decoder" in said and "--loader workers" in said
    pretend_gpu(monkeypatch.setattr, A100)
    assert nvjpeg_line(nvjpeg_run, cuda=True).endswith("on the GPU's hardware JPEG decoder (nvJPEG)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_this_gpu_the_paragraph_follows_its_hardware_decoder():
    device = torch.device("cuda", 0)
    hardware = nvjpeg.has_hardware_jpeg_decoder(torch.cuda.get_device_capability(device),
                                                torch.cuda.get_device_name(device))
    warning = nvjpeg.decoder_warning(device)
    assert (warning is None) == hardware, (torch.cuda.get_device_name(device), warning)
    from ddp_utils.tools.check import nvjpeg_line
    said = nvjpeg_line(Settings(dataset="imagenet", loader="nvjpeg"), cuda=True)   # what check prints here
    assert said == (warning or "loader nvjpeg: torchvision decodes the JPEGs on the GPU's hardware JPEG decoder "
                               "(nvJPEG)"), said

"""ddp_utils.speed.dali: loader='dali' on DALI's CPU pipeline (no GPU needed) keeps the kit's shards, steps and
exact evaluation, since the kit's own samplers feed it the files.

DALI comes with requirements-dev.txt (``nvidia-dali-cuda120``), so these tests run everywhere the suite does.
Its validation tensors are close to the workers path's, not equal: the decoders agree pixel for pixel, but
DALI rounds the resized long side and the centre crop's offset (.5 up) its own way, so some images sit one
pixel off. Measured mean difference: 0.8 of 255 levels on these small photos, 3.3 on 400-500 px ones; the
tests allow 4.
"""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from torch.utils.data import DistributedSampler

from ddp_utils import datasets as data_mod
from ddp_utils.speed.dali import DaliEvalLoader, DaliTrainLoader
from ddp_utils.data import build_loaders
from ddp_utils.datasets import DataError
from ddp_utils.settings import Settings
from tests.helpers.folders import make_cinic, make_imagenet
from tests.helpers.folders import levels, make_photo_imagenet
from tests.helpers.runs import run_ranks


def settings(path, **kw) -> Settings:
    return Settings(**{"dataset": "imagenet", "data_dir": str(path), "workers": 1, "batch_size": 2,
                       "loader": "dali", "image_size": 32, **kw})


@pytest.fixture
def imagenet(tmp_path):
    return make_imagenet(tmp_path / "imagenet", train_per_class=5)   # test_data's folders: 15 train, 6 val


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return make_photo_imagenet(tmp_path_factory.mktemp("dali") / "imagenet")


def labels_of(dataset, indices) -> list[int]:
    return [dataset.targets[i] for i in indices]


# ---------------------------------------------------------------------------------------------
# Shards and steps: the workers path's, through external_source
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_rank_gets_the_workers_paths_shard_and_steps(imagenet, world_size):
    shards = []
    for rank in range(world_size):
        dali = build_loaders(settings(imagenet, seed=4), rank, world_size).train
        workers = build_loaders(settings(imagenet, seed=4, loader="workers", workers=0), rank, world_size).train
        assert isinstance(dali, DaliTrainLoader) and len(dali) == len(workers) == 15 // world_size // 2
        for epoch in (0, 1):
            workers.sampler.set_epoch(epoch)
            shard = dali.indices(epoch)
            reference = DistributedSampler(range(15), num_replicas=world_size, rank=rank, shuffle=True, seed=4,
                                           drop_last=True)
            reference.set_epoch(epoch)
            assert shard == list(workers.sampler) == list(reference)
            batches = list(dali.epoch(epoch))
            assert len(batches) == len(dali)
            got = torch.cat([y for _, y in batches]).tolist()
            assert got == labels_of(dali.dataset, shard[:len(got)])          # the batches follow the shard
        shards.append(dali.indices(0))
    union = [i for shard in shards for i in shard]
    assert len(set(union)) == len(union) == world_size * (15 // world_size)   # disjoint


def test_train_batches_are_full_normalised_float32_images_and_int64_labels(photos):
    loader = build_loaders(settings(photos, batch_size=4, image_size=48), 1, 2).train
    low = (0 - torch.tensor(loader.how.preset.mean)) / torch.tensor(loader.how.preset.std)
    high = (1 - torch.tensor(loader.how.preset.mean)) / torch.tensor(loader.how.preset.std)
    for images, labels in loader.epoch(0):
        assert images.shape == (4, 3, 48, 48) and images.dtype == torch.float32 and images.device.type == "cpu"
        assert labels.shape == (4,) and labels.dtype == torch.int64
        per_channel = images.transpose(0, 1).reshape(3, -1)
        assert (per_channel.min(1).values >= low - 1e-4).all() and (per_channel.max(1).values <= high + 1e-4).all()
        assert images.std() > 0.2                  # photos, not a constant


def test_max_steps_per_epoch_is_respected(imagenet):
    capped = build_loaders(settings(imagenet, max_steps_per_epoch=2), 0, 1).train
    assert len(capped) == 2 == len(list(capped.epoch(0)))


def test_augmentation_depends_on_seed_rank_and_epoch_only(photos):
    def draw(rank, epoch, seed=0):
        loader = build_loaders(settings(photos, batch_size=4), rank, 2).train
        loader.seed = seed
        return torch.cat([x for x, _ in loader.epoch(epoch)])
    assert torch.equal(draw(1, 1), draw(1, 1))              # a re-run (or a resume) draws the same crops
    assert not torch.equal(draw(0, 1), draw(1, 1))          # every rank its own crops
    assert not torch.equal(draw(1, 1), draw(1, 2))          # and every epoch
    assert not torch.equal(draw(1, 1), draw(1, 1, seed=1))


# ---------------------------------------------------------------------------------------------
# Exact evaluation
# ---------------------------------------------------------------------------------------------
def test_exact_evaluation_counts_each_validation_image_once_across_2_ranks(imagenet):
    seen, count = [], 0
    for rank in range(2):
        val = build_loaders(settings(imagenet, batch_size=2), rank, 2).val
        assert isinstance(val, DaliEvalLoader)
        mine = list(val.sampler)
        assert mine == list(range(rank, 6, 2))                          # EvalShardSampler: r, r + W, ...
        batches = list(val)
        assert len(batches) == len(val) == 2 and [len(y) for _, y in batches] == [2, 1]   # the last one short
        assert torch.cat([y for _, y in batches]).tolist() == labels_of(val.dataset, mine)
        count += sum(len(y) for _, y in batches)
        seen += mine
    assert sorted(seen) == list(range(6)) and count == 6


def test_validation_tensors_are_close_to_the_workers_paths(photos):
    for rank in range(2):
        dali = build_loaders(settings(photos, image_size=224), rank, 2).val
        workers = build_loaders(settings(photos, image_size=224, loader="workers", workers=0), rank, 2).val
        a, a_labels = map(torch.cat, zip(*dali))
        b, b_labels = map(torch.cat, zip(*workers))
        assert a.shape == b.shape and torch.equal(a_labels, b_labels)
        assert levels(a, b).mean() < 4


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
def test_missing_dali_is_a_paragraph_naming_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)   # import nvidia.dali now raises ImportError
    with pytest.raises(DataError) as err:
        build_loaders(settings(tmp_path / "not-there"), 0, 1)   # before the folders are even looked at
    text = str(err.value)
    assert "pip install nvidia-dali-cuda120" in text and "container" in text and "--loader workers" in text
    assert "not-there" not in text and "\n" not in text


def test_check_with_loader_dali_says_whether_dali_imports(imagenet, monkeypatch):
    """`check --loader dali` on a node: READY with DALI's version, else NOT READY with what to install."""
    from ddp_utils.tools.check import run_check
    lines = []
    assert run_check(settings(imagenet), log=lines.append) is True
    assert any(line.startswith("loader dali: NVIDIA DALI ") for line in lines), lines
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    lines.clear()
    assert run_check(settings(imagenet), log=lines.append) is False
    text = "\n".join(lines)
    assert "NOT READY (data): loader='dali' needs NVIDIA DALI" in text and "pip install nvidia-dali-cuda120" in text


def test_dali_for_cinic10_points_to_the_memory_loader(tmp_path):
    with pytest.raises(DataError, match="loader='memory'"):
        build_loaders(Settings(dataset="cinic10", data_dir=str(make_cinic(tmp_path / "cinic")), loader="dali"), 0, 1)


def test_a_file_dali_cannot_decode_is_the_kits_paragraph_naming_it(imagenet, monkeypatch):
    monkeypatch.setattr(data_mod, "VERIFY_ALL_UP_TO", 0)    # as for ImageNet: one image per class checked
    bad = imagenet / "train" / "n01440764" / "n01440764_1003.JPEG"
    bad.write_bytes(b"broken")
    loader = build_loaders(settings(imagenet, batch_size=5), 0, 1).train
    with pytest.raises(DataError) as err:
        list(loader.epoch(0))
    assert str(err.value).startswith(f"{bad}: Pillow cannot read")   # the same words as the workers path


@pytest.mark.slow
def test_two_ranks_train_an_epoch_with_the_dali_loader(tmp_path, imagenet):
    run_ranks(tmp_path, "run", 2, "--dataset", "imagenet", "--data-dir", imagenet, "--loader", "dali",
              "--epochs", "1", "--batch-size", "2", "--workers", "1")
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["world_size"] == 2 and results["val_images"] == 6
    assert json.loads((tmp_path / "run" / "settings.json").read_text())["loader"] == "dali"


def dali_installed() -> bool:
    """Without importing it (1.5 s at collection)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ImportError:   # no nvidia namespace at all
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not dali_installed(), reason="needs NVIDIA DALI (the NGC container has it; requirements-dev.txt "
                    "installs nvidia-dali-cuda120)")
def test_on_a_gpu_dali_decodes_with_nvjpeg_into_cuda_batches_close_to_the_cpu_pipelines(photos):
    """The GPU suite: the "mixed" pipeline (nvJPEG) gives CUDA tensors with the CPU pipeline's validation pixels."""
    cpu = build_loaders(settings(photos, batch_size=4, image_size=48), 0, 1, torch.device("cpu"))
    gpu = build_loaders(settings(photos, batch_size=4, image_size=48), 0, 1, torch.device("cuda", 0))
    images, labels = next(iter(gpu.train.epoch(0)))
    assert images.is_cuda and images.shape == (4, 3, 48, 48)
    for (a, la), (b, lb) in zip(cpu.val, gpu.val):
        assert torch.equal(la, lb.cpu())
        assert levels(a, b.cpu()).mean() <= 4   # nvJPEG and DALI's CPU decoder may round differently


def test_every_evaluation_reuses_one_pipeline_and_gives_the_same_batches(imagenet, monkeypatch):
    """Validation has no randomness: the pipeline is built once, not at every evaluation (a build costs
    DALI's threads and, on a GPU, nvJPEG's state)."""
    from ddp_utils.speed import dali
    builds = []
    real = dali._pipeline
    monkeypatch.setattr(dali, "_pipeline", lambda *a, **k: (builds.append(1), real(*a, **k))[1])
    val = build_loaders(settings(imagenet, batch_size=2), 0, 2).val
    passes = [[(x.clone(), y.clone()) for x, y in val] for _ in range(3)]
    assert len(builds) == 1
    for later in passes[1:]:
        assert len(later) == len(passes[0]) == 2
        for (a, ya), (b, yb) in zip(passes[0], later):
            assert torch.equal(a, b) and torch.equal(ya, yb)


def test_no_file_is_read_by_python_on_the_training_thread(imagenet, monkeypatch):
    """DALI's own reader reads the files on its threads; an external_source callback read them on the training
    thread between steps (np.fromfile of a whole batch)."""
    import numpy as np

    def no_python_reads(*args, **kwargs):
        raise AssertionError("a file was read by Python")
    monkeypatch.setattr(np, "fromfile", no_python_reads)
    loader = build_loaders(settings(imagenet, batch_size=2), 0, 1).train
    batches = list(loader.epoch(0))
    assert len(batches) == len(loader) and all(len(y) == 2 for _, y in batches)


def test_an_evaluation_left_midway_does_not_shift_the_next_one(imagenet):
    val = build_loaders(settings(imagenet, batch_size=2), 0, 2).val
    whole = [y.clone() for _, y in val]
    for _ in val:
        break                                   # a pass left after its first batch
    assert [y.tolist() for _, y in val] == [y.tolist() for y in whole]

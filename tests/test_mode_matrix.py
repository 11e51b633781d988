"""Every parallel mode on the settings a GPU run takes: the mode matrix (tests/helpers/mode_matrix.py runs each rank).

{ddp, zero1, fsdp} saved x {ddp, zero1, fsdp} resumed x {1, 2, 3} ranks each way x {SGD without and with momentum,
AdamW} in channels_last (forced on this CPU), and SGD with momentum also without it (mode_matrix.VARIANTS), on a net with a parameter that no forward uses (at the kit's
default: find_unused_parameters under DDP), trained in bf16 autocast with fp16's gradient scaler in the loop: each
checkpoint resumes in every other mode and world size with, on EVERY rank, the state restored bit for bit, the state
it was given unchanged, and the next step the source mode's own (within mode_matrix.STEP_RTOL); best.pt and last.pt
written after the resume load here, by a process that made none of them. Where this torch cannot run FSDP on a CPU
(2.6, the floor) the matrix is ddp and zero1 (the test says so). What a CPU cannot run of a GPU's defaults is listed
in docs/gpu.md.
"""
from __future__ import annotations

import pytest
import torch

from ddp_utils import checkpoint
from ddp_utils.distributed import DistContext
from ddp_utils.robust import compat
from tests.helpers import mode_matrix
from tests.helpers.sharding_ranks import same
from tests.helpers.mode_matrix import phase
from tests.helpers.procs import base_env

WORLDS = (1, 2, 3)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> tuple:
    folder = tmp_path_factory.mktemp("matrix")
    for world in WORLDS:
        phase("save", world, folder)
    lines = [line for world in WORLDS for line in phase("resume", world, folder)]
    return folder, lines


@pytest.mark.slow
@pytest.mark.floor
def test_every_mode_resumes_every_modes_checkpoint_on_any_number_of_ranks(matrix):
    folder, lines = matrix
    modes = mode_matrix.modes()
    if compat.fsdp_refusal("cpu", "gloo"):
        assert modes == ["ddp", "zero1"]   # the floor: FSDP2 needs torch 2.7 on a CPU (docs/gpu.md)
    sources = len(modes) * len(WORLDS) * len(mode_matrix.VARIANTS)
    trips = mode_matrix.round_trips(lines)
    assert len(trips) == sources * len(modes) * len(WORLDS)
    assert all(sorted(ranks) == list(range(int(name.split("@")[1]))) for name, ranks in trips.items())   # every rank
    bad = mode_matrix.wrong(lines)
    assert not bad, "\n".join(bad)
    unbuilt = mode_matrix.built_wrong(lines)   # the objects each mode claims: DDP, ZeRO, FSDP
    assert not unbuilt, "\n".join(unbuilt)


@pytest.mark.slow
def test_the_matrix_fails_when_one_ranks_restore_went_wrong_and_rank_0s_did_not(tmp_path):
    """Issue 55: the matrix read rank 0's line alone, and forced the others' equal to True. Rank 1 now breaks its
    restore on purpose (MATRIX_BREAK): rank 0 still holds the file's state; rank 1 is the one that says it does not."""
    env = base_env(MATRIX_MODES="ddp", MATRIX_VARIANTS="sgd-m0.9-nhwc", MATRIX_BREAK="1")
    phase("save", 2, tmp_path, env)
    lines = phase("resume", 2, tmp_path, env)
    rank0, rank1 = ([line for line in lines if f" rank={r} " in line] for r in (0, 1))
    assert len(rank0) == len(rank1) == 1, "\n".join(lines)
    assert " equal=True " in rank0[0], rank0   # rank 0's own copy is the file's: reading it alone passed
    assert " equal=/model/block1.0.weight: " in rank1[0] and " stepped=/model/" in rank1[0], rank1
    assert rank1[0] in mode_matrix.wrong(lines)   # so the matrix fails


@pytest.mark.slow
@pytest.mark.floor
def test_best_and_last_written_after_a_resume_load_in_a_fresh_process_whole(matrix):
    folder, _ = matrix
    targets = sorted(folder.glob("*/to-*"))
    modes = len(mode_matrix.modes())
    assert len(targets) == (modes * len(WORLDS) * len(mode_matrix.VARIANTS)) * modes * len(WORLDS)
    for target in targets:
        saved = checkpoint.load_checkpoint(target.parent / "last.pt")
        best = checkpoint.load_checkpoint(target / "best.pt")   # mend_best's: the resumed state, whole
        assert same(best["model"], saved["model"]), target
        last = checkpoint.load_checkpoint(target / "last.pt")   # a step later, in the other mode
        for name, tensor in saved["model"].items():
            assert last["model"][name].shape == tensor.shape, (target, name)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_channels_last_reaches_the_convolutions_and_fsdps_weights_stay_contiguous(monkeypatch, mode):
    """What the matrix forces on the CPU: a GPU run's layout. FSDP2 shards only contiguous parameters (finding 1:
    every fsdp run on a GPU stopped with NotImplementedError), so under fsdp the batches alone take it."""
    from ddp_utils import model as kit_model, optim
    monkeypatch.setattr(optim, "NHWC_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(kit_model, "channels_last_on", optim.channels_last_on)
    monkeypatch.setattr(kit_model, "parallel_mode", lambda settings, ctx: mode)   # no group needed to ask it
    from ddp_utils.speed import sharding
    monkeypatch.setattr(sharding, "shard_model", lambda net, ctx, units=None: net)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    settings = mode_matrix.settings_for(mode, ("sgd", 0.9, "nhwc"), 0, 1, 29500)
    model = kit_model.prepare_model(mode_matrix.MatrixNet(), settings, ctx, log=lambda *_: None)
    weight = model.block1[0].weight
    assert weight.is_contiguous(memory_format=torch.channels_last) == (mode == "ddp")
    assert weight.is_contiguous() == (mode == "fsdp")
    images, _ = optim.to_device(torch.randn(2, 3, 8, 8), torch.zeros(2), settings, ctx.device)
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert model(images).shape == (2, mode_matrix.CLASSES)


def test_a_cpu_run_keeps_the_layout_it_was_given():
    """--channels-last is the GPU's: a CPU run is not switched (the matrix forces it on purpose)."""
    from ddp_utils import optim
    settings = mode_matrix.settings_for("ddp", ("sgd", 0.9, "nhwc"), 0, 1, 29500)
    assert settings.channels_last and not optim.channels_last_on(settings, torch.device("cpu"))
    assert optim.channels_last_on(settings, torch.device("cuda"))

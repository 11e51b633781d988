"""Gradient accumulation (``--accumulate K``): the gradients of K batches are added up on each rank and
all-reduced once (DDP's ``no_sync()`` for the others), so a slow link carries 1/K of the traffic. It changes the
recipe: the global batch is K times larger, the lr scales with it, an epoch has 1/K of the optimizer steps."""
from __future__ import annotations

import pytest
import torch

from ddp_utils import checkpoint
from ddp_utils.data import build_loaders
from ddp_utils.distributed import DistContext
from ddp_utils.model import build_model
from ddp_utils.optim import build_optimizer, build_scheduler, make_scaler, optimizer_steps
from ddp_utils.runlog import NullLogger
from ddp_utils.settings import MUST_AGREE, Settings, describe_batch
from ddp_utils.observers import Loop
from ddp_utils.train import train_one_epoch
from tests.helpers.procs import base_env, describe, free_port, run_all
from tests.helpers.groups import one_rank_group
from tests.helpers.runs import tiny, train_command
from tests.helpers.groups import count_all_reduces


def test_the_global_batch_and_the_lr_count_the_accumulated_steps():
    s = Settings(dataset="fake", batch_size=32, world_size=2, rank=0, lr=0.1, accumulate=4)
    assert s.global_batch_size == 256 and s.effective_lr == pytest.approx(0.1)
    assert describe_batch(s).startswith("global batch 256 = 32 per rank x 2 rank(s) x 4 accumulated steps; lr 0.1 x")
    assert "accumulated" not in describe_batch(s.replace(accumulate=1))
    assert "accumulate" in MUST_AGREE   # ranks that accumulate differently would wait at different steps


def test_accumulation_with_static_graph_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"accumulate=2 with static_graph: .*pytorch/pytorch#187732"):
        Settings(dataset="fake", accumulate=2, static_graph=True)
    with pytest.raises(ValueError, match="accumulate=0: must be positive"):
        Settings(dataset="fake", accumulate=0)


def test_an_epoch_has_one_optimizer_step_per_group_and_a_short_last_group():
    assert [optimizer_steps(n, 3) for n in (6, 7, 1)] == [2, 3, 1]


@pytest.mark.slow
def test_ddp_all_reduces_once_per_group_and_the_optimizer_steps_once_per_group(clean_env):
    """7 batches, accumulate 3: groups of 3, 3 and 1 batches, so 3 all-reduces and 3 optimizer steps."""
    settings = Settings(dataset="fake", image_size=32, arch="convnet", batch_size=4, max_steps_per_epoch=7,
                        workers=0, accumulate=3, progress="off", wandb="disabled")
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    data = build_loaders(settings, 0, 1, "cpu")
    assert len(data.train) == 7
    with one_rank_group():
        model = torch.nn.parallel.DistributedDataParallel(build_model("convnet", data.num_classes, seed=0))
        rounds = count_all_reduces(model)
        optimizer = build_optimizer(model, settings)
        scheduler = build_scheduler(optimizer, settings, optimizer_steps(7, 3))
        train_one_epoch(Loop(model, data, optimizer, scheduler, make_scaler(None, ctx.device), settings, ctx,
                             NullLogger()), 0)
    assert rounds.count(0) == 3, rounds   # bucket 0 travelled once per group, not once per batch
    assert scheduler.last_epoch == 3


@pytest.mark.slow
def test_fsdp_reduce_scatters_once_per_group(clean_env, monkeypatch):
    """Issue 43, finding 7: under --parallel fsdp every batch reduce-scattered, so accumulate=3 saved no traffic.
    7 batches in groups of 3, 3 and 1: each FSDP unit reduce-scatters 3 times, once per group."""
    from ddp_utils.robust import compat
    from ddp_utils.speed import sharding
    refusal = compat.fsdp_refusal("cpu", "gloo")
    if refusal:
        pytest.skip(refusal)
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group
    reduces = []
    real = param_group.foreach_reduce
    monkeypatch.setattr(param_group, "foreach_reduce", lambda *a, **k: (reduces.append(1), real(*a, **k))[1])
    settings = Settings(dataset="fake", image_size=32, arch="convnet", batch_size=4, max_steps_per_epoch=7,
                        workers=0, accumulate=3, progress="off", wandb="disabled", parallel="fsdp")
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    data = build_loaders(settings, 0, 1, "cpu")
    with one_rank_group():
        model = sharding.shard_model(build_model("convnet", data.num_classes, seed=0), ctx)
        optimizer = build_optimizer(model, settings)
        scheduler = build_scheduler(optimizer, settings, optimizer_steps(7, 3))
        train_one_epoch(Loop(model, data, optimizer, scheduler, make_scaler(None, ctx.device), settings, ctx,
                             NullLogger()), 0)
    assert len(reduces) == 3 * len(sharding.units(model)), reduces
    assert scheduler.last_epoch == 3


@pytest.mark.slow
def test_two_ranks_accumulating_two_batches_train_like_one_process_with_four_times_the_batch(tmp_path):
    """2 ranks x 8 images x 2 accumulated batches = 1 process x 32 images: the same weights after 2 optimizer
    steps an epoch (GroupNorm and fake images without random crops: nothing differs between the ranks)."""
    steps = ["--epochs", "2", "--lr", "0.5"]
    port = free_port()
    ranks = run_all([train_command(*tiny(), *steps, "--batch-size", 8, "--accumulate", 2, "--max-steps-per-epoch", 4,
                               "--rank", r, "--world-size", 2, "--master-port", port, "--run-dir", tmp_path / "acc")
                     for r in range(2)], timeout=180, env=base_env())
    single = run_all([train_command(*tiny(), *steps, "--batch-size", 32, "--max-steps-per-epoch", 2,
                                "--run-dir", tmp_path / "single")], timeout=180, env=base_env())
    assert all(r.returncode == 0 for r in ranks + single), describe(ranks + single)
    assert "global batch 32 = 8 per rank x 2 rank(s) x 2 accumulated steps" in ranks[0].output
    a, b = checkpoint.load_checkpoint(tmp_path / "acc" / "last.pt"), checkpoint.load_checkpoint(tmp_path / "single" /
                                                                                                  "last.pt")
    assert a["step"] == 8 and b["step"] == 4   # batches: 2 per optimizer step on each rank
    for name in b["model"]:
        assert torch.allclose(a["model"][name], b["model"][name], atol=1e-5, rtol=1e-4), name
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 4   # optimizer steps

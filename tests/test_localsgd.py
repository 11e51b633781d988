"""Local SGD (``--comm localsgd``): after ``localsgd_warmup_steps`` steps of plain DDP each rank steps on its own
gradients (no all-reduce) and the ranks average their weights every ``average_every`` steps, and their weights
and momentum at the end of every epoch (so the evaluation and the checkpoint see one model)."""
from __future__ import annotations

import pytest
import torch

from ddp_utils.data import build_loaders
from ddp_utils.distributed import DistContext
from ddp_utils.model import build_model
from ddp_utils.optim import build_optimizer, build_scheduler, make_scaler
from ddp_utils.runlog import NullLogger
from ddp_utils.settings import MUST_AGREE, Settings
from ddp_utils.speed import localsgd
from ddp_utils.speed.localsgd import LocalSGD, LocalSgd
from ddp_utils.observers import Around, Loop
from ddp_utils.train import train_one_epoch
from tests.helpers.groups import count_all_reduces
from tests.helpers.runs import run_two
from tests.helpers.groups import one_rank_group


def record_averages(monkeypatch) -> list:
    """The number of tensors of each average, in order (none is sent)."""
    averaged = []

    class Recorded:
        def __init__(self, tensors, anchors):
            averaged.append(len(tensors))

        def wait(self):
            pass
    monkeypatch.setattr(localsgd, "Average", Recorded)
    return averaged


def test_an_average_keeps_tiny_updates_and_a_sum_over_many_ranks_finite(monkeypatch):
    """A late update of 1e-9 (a cosine tail) must move the weights, and 16 ranks' summed changes must stay finite:
    in fp16 the first is 0 and the second inf, and either overwrites every rank's weights at the average."""
    class Done:
        def wait(self):
            pass

    def sixteen_alike(tensor, group=None, async_op=False):   # the sum over 16 ranks holding the same change
        tensor.mul_(16)
        return Done()
    monkeypatch.setattr(localsgd.dist, "all_reduce", sixteen_alike)
    monkeypatch.setattr(localsgd.dist, "get_world_size", lambda group=None: 16)
    anchor = torch.zeros(3)
    weights = torch.tensor([1e-9, 5000.0, -1.0])   # each rank's change since the last average (5000 x 16 > 65504)
    localsgd.Average([weights], [anchor]).wait()
    assert weights.tolist() == pytest.approx([1e-9, 5000.0, -1.0], rel=1e-2)
    assert torch.equal(anchor, weights)


def test_the_settings_are_checked_and_shared_by_every_rank():
    with pytest.raises(ValueError, match=r"comm=localsgd with static_graph: .*pytorch/pytorch#187732"):
        Settings(dataset="fake", comm="localsgd", static_graph=True)
    with pytest.raises(ValueError, match="average_every=0: must be positive"):
        Settings(dataset="fake", comm="localsgd", average_every=0)
    assert {"average_every", "localsgd_warmup_steps"} <= set(MUST_AGREE)   # or the ranks average at other steps


def test_steps_are_local_after_the_warmup_and_the_weights_are_averaged_every_few_steps(monkeypatch):
    averaged = record_averages(monkeypatch)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()   # a momentum buffer per parameter
    sgd = LocalSGD(model, optimizer, every=3, warmup_steps=2)
    local = []
    for _ in range(9):
        local.append(sgd.local)
        sgd.step_done()
    assert local == [False, False] + [True] * 7
    assert averaged == [2, 2]   # weight and bias, after the 3rd and the 6th local step
    sgd.end_of_epoch()
    assert averaged == [2, 2, 2, 2]   # the last local step's weights, then (while evaluating) the two momentum buffers
    assert LocalSGD(model, optimizer, 3, 2, steps_done=9).local   # a resume continues local from its step count


def test_an_epoch_inside_the_warmup_sends_nothing_extra_at_its_end(monkeypatch):
    averaged = record_averages(monkeypatch)
    model = torch.nn.Linear(3, 2)
    sgd = LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), every=3, warmup_steps=10)
    for _ in range(4):
        sgd.step_done()
    sgd.end_of_epoch()
    assert averaged == []   # plain DDP steps: the ranks are identical already


@pytest.mark.slow
def test_gradients_travel_only_in_the_warmup_steps(clean_env):
    """8 batches, warm-up 2, average every 3: 2 gradient all-reduces (DDP), then none; the weights are
    averaged after local step 3, and after local step 6, the epoch's last, by end_of_epoch."""
    settings = Settings(dataset="fake", image_size=32, arch="convnet", batch_size=4, max_steps_per_epoch=8,
                        workers=0, comm="localsgd", average_every=3, localsgd_warmup_steps=2, progress="off",
                        wandb="disabled")
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    data = build_loaders(settings, 0, 1, "cpu")
    with one_rank_group():
        model = torch.nn.parallel.DistributedDataParallel(build_model("convnet", data.num_classes, seed=0))
        rounds = count_all_reduces(model)
        optimizer = build_optimizer(model, settings)
        scheduler = build_scheduler(optimizer, settings, 8)
        sgd = LocalSGD(model, optimizer, settings.average_every, settings.localsgd_warmup_steps)
        train_one_epoch(Loop(model, data, optimizer, scheduler, make_scaler(None, ctx.device), settings, ctx,
                             NullLogger(), given=[LocalSgd(sgd)]), 0)
    assert rounds.count(0) == 2, rounds
    assert sgd.averages == 3   # and the momentum at the end


@pytest.mark.slow
def test_two_ranks_train_apart_and_end_every_epoch_with_one_model(tmp_path):
    ranks = run_two(tmp_path, "localsgd", average_every=3, localsgd_warmup_steps=2)
    exact = run_two(tmp_path / "exact", "none")
    assert ranks[0]["weights"] == ranks[1]["weights"], "the ranks ended the run with different weights"
    assert ranks[0]["weights"] != exact[0]["weights"], "the steps were not local"
    assert ranks[0]["results"]["comm"] == "localsgd" and float(ranks[0]["comm_s"]) > 0   # the averages, timed
    assert float(ranks[0]["loss"]) == pytest.approx(float(exact[0]["loss"]), rel=0.05)   # still the same training


def test_a_rank_waiting_in_the_epochs_last_average_is_not_waiting_for_its_data():
    """Issue 43, finding 9: after the epoch's last step the watch still counted this rank as fetching its next
    batch, so a wait in local SGD's end-of-epoch average (a slower peer) named this rank's own loader as stuck."""
    from ddp_utils.robust.heartbeat import Heartbeat
    settings = Settings(dataset="fake", image_size=32, arch="convnet", batch_size=4, max_steps_per_epoch=3,
                        workers=0, progress="off", wandb="disabled")
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    data = build_loaders(settings, 0, 1, "cpu")
    model = build_model("convnet", data.num_classes, seed=0)
    optimizer = build_optimizer(model, settings)
    heartbeat = Heartbeat(ctx, log=lambda *_: None)   # not started: the loop only marks what it does
    seen = []

    class Averaging:   # what train_one_epoch asks of LocalSGD; the average is where a slower peer is waited for
        local = False

        def step_done(self, last=False):
            pass

        def end_of_epoch(self):
            seen.append(heartbeat.fetching_since)
    train_one_epoch(Loop(model, data, optimizer, build_scheduler(optimizer, settings, 3), make_scaler(None, ctx.device),
                         settings, ctx, NullLogger(), around=Around(heartbeat), given=[LocalSgd(Averaging())]), 0)
    assert seen == [None]

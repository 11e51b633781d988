"""checkpoint.py: atomic saves, weights_only loads with clear errors, RNG round trips."""
import math
import os
import pickle
import random
import types

import numpy as np
import pytest
import torch
from torch import nn

from ddp_utils.checkpoint import (
    CheckpointError,
    checkpoint_paths,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from ddp_utils.settings import Settings


class NotAllowed:
    """An arbitrary Python object: weights_only loading must refuse it."""


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))


def training_state(epochs=3):
    """The dict the train module saves, after one real step (momentum buffers, BN statistics)."""
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    scaler = torch.amp.GradScaler("cpu")
    loss = nn.functional.cross_entropy(model(torch.randn(4, 3, 8, 8)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    optimizer.step()
    warmup.step()
    cosine.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": {"warmup": warmup.state_dict(), "cosine": cosine.state_dict()},
            "scaler": scaler.state_dict(), "epoch": 1, "step": 1, "best_acc1": 12.5,
            "settings": Settings().to_dict(), "rng": rng_state(),
            "torch_version": str(torch.__version__)}


def assert_same(a, b, where="state"):
    """Deep equality: tensors by value, dtype and shape; everything else with ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, where


def test_checkpoint_paths_are_last_and_best_in_the_run_dir(tmp_path):
    assert checkpoint_paths(tmp_path) == (tmp_path / "last.pt", tmp_path / "best.pt")


def test_training_state_round_trips_exactly(tmp_path):
    state = training_state()
    path = tmp_path / "new_folder" / "last.pt"  # the folder is created
    save_checkpoint(path, state)
    assert_same(state, load_checkpoint(path))


def test_training_state_loads_with_plain_torch_load_weights_only(tmp_path):
    save_checkpoint(tmp_path / "last.pt", training_state())
    torch.load(tmp_path / "last.pt", weights_only=True)


def test_loaded_state_restores_model_optimizer_and_schedulers(tmp_path):
    state = training_state()
    save_checkpoint(tmp_path / "last.pt", state)
    loaded = load_checkpoint(tmp_path / "last.pt")
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=3)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    cosine.load_state_dict(loaded["scheduler"]["cosine"])
    assert_same(state["model"], model.state_dict())
    assert_same(state["optimizer"], optimizer.state_dict())
    assert cosine.last_epoch == 1


def test_save_replaces_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path / "last.pt", {"epoch": 1})
    save_checkpoint(tmp_path / "last.pt", {"epoch": 2})
    assert load_checkpoint(tmp_path / "last.pt") == {"epoch": 2}
    assert os.listdir(tmp_path) == ["last.pt"]


@pytest.mark.parametrize("failure", [OSError("No space left on device"), KeyboardInterrupt()])
def test_failed_save_keeps_old_checkpoint_and_leaves_no_temp_file(tmp_path, monkeypatch, failure):
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"epoch": 1, "w": torch.arange(10)})

    def save_half_then_fail(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip file")
        raise failure

    monkeypatch.setattr(torch, "save", save_half_then_fail)
    with pytest.raises(type(failure)):
        save_checkpoint(path, {"epoch": 2, "w": torch.zeros(10)})
    monkeypatch.undo()
    assert_same(load_checkpoint(path), {"epoch": 1, "w": torch.arange(10)})
    assert os.listdir(tmp_path) == ["last.pt"]


def test_ctrl_c_inside_torch_save_stays_a_ctrl_c_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """Ctrl-C while torch.save writes: its zip writer's cleanup raises "unexpected pos" over the KeyboardInterrupt,
    and the run would end with that traceback (exit 2) instead of the interrupt's message (exit 130)."""
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"epoch": 1, "w": torch.arange(10)})
    real_save = torch.save

    class CtrlCMidway:   # the file, with Ctrl-C arriving after some bytes were written
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            if self.written > 1000:
                raise KeyboardInterrupt
            self.written += len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: real_save(obj, CtrlCMidway(f), *a, **k))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"epoch": 2, "w": torch.zeros(100_000)})
    monkeypatch.undo()
    assert_same(load_checkpoint(path), {"epoch": 1, "w": torch.arange(10)})
    assert os.listdir(tmp_path) == ["last.pt"]


def test_save_refuses_a_state_that_weights_only_cannot_load_back(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"epoch": 1})
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(path, {"epoch": 2, "torch_version": torch.__version__})  # a TorchVersion
    assert "TorchVersion" in str(err.value) and "str(torch.__version__)" in str(err.value)
    assert load_checkpoint(path) == {"epoch": 1}
    assert os.listdir(tmp_path) == ["last.pt"]


def test_load_refuses_arbitrary_python_objects_with_a_clear_message(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "extra": NotAllowed()}, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    message = str(err.value)
    assert str(path) in message and "NotAllowed" in message and "weights_only" in message


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_load_refuses_a_plain_pickle_of_an_object(tmp_path):
    path = tmp_path / "object.pkl"
    path.write_bytes(pickle.dumps(NotAllowed()))
    with pytest.raises(CheckpointError, match="weights_only"):
        load_checkpoint(path)


def test_truncated_file_gives_an_error_naming_the_path(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(path, training_state())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(path) in str(err.value) and "truncated" in str(err.value)


@pytest.mark.parametrize("content", [b"", b"hello, not a checkpoint\n"])
def test_non_checkpoint_file_gives_an_error_naming_the_path(tmp_path, content):
    path = tmp_path / "notes.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="not a complete checkpoint") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


def test_a_file_holding_no_dict_is_not_a_checkpoint(tmp_path):
    torch.save(torch.ones(3), tmp_path / "tensor.pt")
    with pytest.raises(CheckpointError, match="not a checkpoint dict"):
        load_checkpoint(tmp_path / "tensor.pt")


def test_missing_file_error_names_the_path_and_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_checkpoint(tmp_path / "runs" / "x" / "last.pt")
    assert str(tmp_path / "runs" / "x" / "last.pt") in str(err.value)
    assert "--resume" in str(err.value)


def draw():
    return random.random(), torch.rand(5), float(np.random.rand())


def test_rng_round_trip_repeats_the_same_random_numbers(tmp_path):
    random.seed(1), torch.manual_seed(1), np.random.seed(1)
    draw()  # move away from the seeded state
    save_checkpoint(tmp_path / "last.pt", {"rng": rng_state()})
    expected = draw()
    draw()  # the run goes on, then crashes
    set_rng_state(load_checkpoint(tmp_path / "last.pt")["rng"])
    assert_same(draw(), expected)


def test_rng_state_holds_plain_values_only():
    state = rng_state()
    assert set(state) >= {"python", "torch", "cuda"}
    assert not any(isinstance(v, np.ndarray) for v in state.get("numpy", ()))


# -- nothing left behind, and a full disk said plainly ---------------------------------------------

def test_an_interrupted_write_leaves_one_temporary_file_per_target_that_the_next_start_removes(tmp_path):
    from ddp_utils.runlog import RunLogger
    run = tmp_path / "run"
    RunLogger(Settings(wandb="disabled"), run).close()
    save_checkpoint(run / "last.pt", {"epoch": 0})
    state = {"w": torch.zeros(10)}

    class Killed(BaseException):
        pass

    def killed_midway(f):
        f.write(b"half a checkpoint")
        raise Killed
    from ddp_utils.robust import files
    for _ in range(3):   # killed three times: still one name per target, never one per process
        with pytest.raises(Killed):
            files.atomic_write(run / "last.pt", killed_midway)
    (run / ".best.pt.tmp").write_bytes(b"left by a SIGKILL")   # what a hard kill leaves (no except clause ran)
    (run / ".last.pt.tmp").write_bytes(b"left by a SIGKILL")
    RunLogger(Settings(wandb="disabled"), run, resume=True).close()
    assert not list(run.glob(".*.tmp"))
    assert load_checkpoint(run / "last.pt") == {"epoch": 0}
    save_checkpoint(run / "best.pt", state)
    assert torch.equal(load_checkpoint(run / "best.pt")["w"], state["w"])


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs: a real full disk, as a run folder on a full volume meets it (needs root to mount)."""
    import subprocess
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_a_full_disk_names_the_folder_and_the_sizes_and_keeps_the_previous_checkpoint(small_disk):
    from ddp_utils.robust.files import DiskFull
    save_checkpoint(small_disk / "last.pt", {"w": torch.zeros(50_000)})      # 200 KB: fits
    with pytest.raises(DiskFull) as err:
        save_checkpoint(small_disk / "last.pt", {"w": torch.ones(400_000)})  # 1.6 MB: does not
    text = str(err.value)
    assert f"No space left on the disk that holds {small_disk}" in text and "MB are free" in text
    assert "The previous last.pt (if any) is unchanged" in text and "resume" in text
    assert torch.equal(load_checkpoint(small_disk / "last.pt")["w"], torch.zeros(50_000))
    assert not list(small_disk.glob(".*.tmp"))


def test_random_bytes_are_not_a_checkpoint_rather_than_an_unsafe_pickle(tmp_path):
    path = tmp_path / "last.pt"
    path.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(5000)))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert "not a complete checkpoint" in str(err.value) and "arbitrary code" not in str(err.value)


def test_mend_best_writes_best_pt_only_when_last_pt_holds_a_newer_best_epoch(tmp_path):
    """The three cases after a resume: killed between the writes of a best epoch (rewrite best.pt from the
    state), a best.pt written after last.pt (leave it), the last epoch saved not the best (leave it)."""
    import time

    from ddp_utils.checkpoint import mend_best
    from ddp_utils.distributed import DistContext
    rank0 = DistContext(0, 1, 0, torch.device("cpu"), None)
    history = [{"epoch": 1, "val": {"acc1": 40.0}}, {"epoch": 2, "val": {"acc1": 55.0}}]
    state = {"epoch": 1, "best_acc1": 55.0, "history": history, "model": {"w": torch.ones(2)}}
    save_checkpoint(tmp_path / "best.pt", {**state, "epoch": 0, "best_acc1": 40.0, "history": history[:1]})
    time.sleep(0.01)
    save_checkpoint(tmp_path / "last.pt", state)                 # killed here: best.pt is epoch 1's
    assert mend_best(state, tmp_path, rank0)
    assert load_checkpoint(tmp_path / "best.pt")["epoch"] == 1   # now the best epoch's
    assert not mend_best(state, tmp_path, rank0)                 # best.pt is newer than last.pt now
    worse = {**state, "epoch": 2, "history": [*history, {"epoch": 3, "val": {"acc1": 50.0}}]}
    time.sleep(0.01)
    save_checkpoint(tmp_path / "last.pt", worse)
    assert not mend_best(worse, tmp_path, rank0)                 # epoch 3 was not the best: best.pt stays
    assert load_checkpoint(tmp_path / "best.pt")["epoch"] == 1
    tie = {**state, "epoch": 2, "history": [*history, {"epoch": 3, "val": {"acc1": 55.0}}]}
    time.sleep(0.01)
    save_checkpoint(tmp_path / "last.pt", tie)
    assert not mend_best(tie, tmp_path, rank0)                   # epoch 3 only tied epoch 2: best.pt is epoch 2's
    assert load_checkpoint(tmp_path / "best.pt")["epoch"] == 1
    (tmp_path / "best.pt").unlink()
    assert not mend_best(state, tmp_path, DistContext(1, 2, 0, torch.device("cpu"), "gloo"))   # rank 0 writes
    assert not (tmp_path / "best.pt").exists()


def test_every_ranks_fp16_scaler_is_saved_and_each_rank_resumes_with_its_own(tmp_path, monkeypatch):
    """With local SGD each rank's scaler sees only its own gradients, so the scales can differ: a resume that gave
    every rank rank 0's scale would not continue the run exactly."""
    import torch.distributed as dist

    from ddp_utils import checkpoint
    from ddp_utils.distributed import DistContext
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    rank1 = {"rng": rng_state(), "scaler": {**scaler.state_dict(), "scale": 256.0}}   # rank 1 halved it twice

    def two_ranks(values, value):   # the collective, as rank 0 of two sees it
        values[:] = [value, rank1]
    monkeypatch.setattr(dist, "all_gather_object", two_ranks)
    ctx = DistContext(0, 2, 0, torch.device("cpu"), "gloo")
    checkpoint.save_state([tmp_path / "last.pt"], types.SimpleNamespace(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, epoch=0, step=10, best_acc1=50.0,
        history=[], settings=Settings(), ctx=ctx, kept={}))
    state = load_checkpoint(tmp_path / "last.pt")
    assert [s["scale"] for s in state["scalers"]] == [1024.0, 256.0] and state["scaler"]["scale"] == 1024.0
    for rank, scale in ((0, 1024.0), (1, 256.0)):
        resumed = torch.amp.GradScaler("cpu")
        checkpoint.restore(state, small_model(), optimizer, scheduler, resumed, DistContext(rank, 2, rank,
                                                                                             torch.device("cpu"), "gloo"))
        assert resumed.get_scale() == scale
    on_three = torch.amp.GradScaler("cpu")   # resumed on another number of ranks: rank 0's, as before
    checkpoint.restore(state, small_model(), optimizer, scheduler, on_three,
                       DistContext(2, 3, 0, torch.device("cpu"), "gloo"))
    assert on_three.get_scale() == 1024.0


def test_a_failing_rank_0_says_its_checkpoints_epoch_without_reading_it_whole_and_in_bounded_time(tmp_path,
                                                                                                 monkeypatch):
    """Issue 55, D9: rank 0 torch.load-ed its whole last.pt for one sentence before it told the others why it failed;
    on a slow disk they named "rank 0 stopped answering" instead of its error. The epoch is now read from the
    pickle alone (mmap), and no longer than READ_EPOCH_S."""
    import time
    from types import SimpleNamespace
    from ddp_utils import checkpoint as ckpt
    main = SimpleNamespace(is_main=True)
    ckpt.save_checkpoint(tmp_path / "last.pt", {"epoch": 2, "model": {"w": torch.ones(4)}})
    loads = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k) or real(*a, **k))
    assert ckpt.kept_checkpoint(tmp_path, main) == f"the checkpoint {tmp_path / 'last.pt'} holds epoch 3"
    assert [k.get("mmap") for k in loads] == [True]   # the tensors' bytes stay on the disk
    monkeypatch.setattr(torch, "load", lambda *a, **k: time.sleep(30))   # a disk that answers in half a minute
    monkeypatch.setattr(ckpt, "READ_EPOCH_S", 0.5)
    started = time.monotonic()
    said = ckpt.kept_checkpoint(tmp_path, main)
    assert time.monotonic() - started < 2 and said == f"the checkpoint {tmp_path / 'last.pt'} is kept as it was"
    assert ckpt.kept_checkpoint(tmp_path, SimpleNamespace(is_main=False)) == ""

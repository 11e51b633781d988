"""PowerSGD's memory in the checkpoint (``ddp_utils/speed/powersgd.py``): a run resumed from it ends with the
weights of a run never stopped, although the resumed run's new DDP groups its buckets differently."""
from __future__ import annotations

import contextlib
import copy
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ddp_utils.checkpoint import CheckpointError
from ddp_utils.distributed import DistContext
from ddp_utils.settings import Settings
from ddp_utils.speed import comm
from tests.helpers.procs import base_env, describe, free_port, python, run_all
from tests.helpers.groups import gpu_only, one_rank_group
from tests.helpers.powersgd_ranks import Run, SETTINGS, batches


@pytest.fixture(autouse=True)
def cpu_node(monkeypatch, request):
    """The CPU tests run as on a node without a GPU, also on a machine with one: torch's PowerSGD calls
    torch.cuda.synchronize(the bucket's device) whenever CUDA is available, which a CPU bucket refuses
    (the kit trains on the GPU wherever there is one, so only a test meets this)."""
    if not request.node.get_closest_marker("gpu"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def one_rank_of_a_group(device, backend):
    """This process as a distributed rank (a group of one): the checkpoint's collection of the error feedback runs."""
    return SimpleNamespace(rank=0, world_size=1, is_main=True, distributed=True, device=device, backend=backend)


def straight_and_resumed(device, backend, stops):
    """The weights after STEPS steps straight, and after each stop in ``stops`` and a resume (a new model, new
    DDP, new hook) from the weights, the optimizer and PowerSGD's memory; with the lines the resumes printed."""
    ctx = one_rank_of_a_group(device, backend)
    data = batches(device)
    straight = Run(device, backend)
    straight.steps(data)
    resumed, said = {}, {}
    for stop in stops:
        first = Run(device, backend)
        first.steps(data[:stop])
        memory = first.memory.state_dict(ctx)
        again = Run(device, backend, weights=first.weights(), optimizer=first.optimizer.state_dict())
        said[stop] = again.memory.load_state_dict(memory, ctx)
        again.steps(data[stop:])
        resumed[stop] = again.weights()
    return straight, resumed, said, again


def test_a_resume_continues_powersgd_exactly_whenever_it_stopped():
    with one_rank_group():
        straight, resumed, said, last = straight_and_resumed(torch.device("cpu"), "gloo", stops=(2, 3, 4, 7))
    # what makes it hard: the resumed run's first step (after 7) has one bucket, the next ones regroup into several
    assert len(last.groupings[0]) == 1 and len(last.groupings[1]) > 1 and last.groupings[1] == straight.groupings[-1]
    for stop, weights in resumed.items():   # stopped in the warm-up, at PowerSGD's first step, after it
        for name, value in straight.weights().items():
            assert torch.equal(weights[name], value), (stop, name)
    assert said[2] == "PowerSGD continues at step 2 (no memory yet)"   # in the exact warm-up
    assert said[7] == "PowerSGD continues at step 7 with its error feedback and warm start"


def gradients_through_the_hook(settings, steps: int, device="cpu", backend="gloo"):
    """Per step: the gradients the hook handed back to DDP, and the same step's gradients of the model alone."""
    run = Run(device, backend, settings=settings)
    out = []
    for x, y in batches(device)[:steps]:
        alone = copy.deepcopy(run.ddp.module)
        nn.functional.cross_entropy(alone(x), y).backward()
        run.optimizer.zero_grad()
        nn.functional.cross_entropy(run.ddp(x), y).backward()
        out.append(([p.grad.clone() for p in run.ddp.parameters()], [p.grad for p in alone.parameters()]))
        run.optimizer.step()
    return out, run


def bf16_warm_up_checked(device, backend) -> None:
    """--powersgd-warmup-precision bf16: the warm-up's gradients travel in bf16 (half of fp32's bytes), so each
    arrives rounded to bf16; the default warm-up sends them exact. Both compress from the same step on."""
    halved = Settings(**{**SETTINGS.to_dict(), "powersgd_warmup_precision": "bf16"})
    warmup, steps = SETTINGS.powersgd_warmup_steps, SETTINGS.powersgd_warmup_steps + 2
    exact, _ = gradients_through_the_hook(SETTINGS, steps, device, backend)
    rounded, run = gradients_through_the_hook(halved, steps, device, backend)

    def same(got, want):
        return all(torch.equal(g, w) for g, w in zip(got, want))

    def in_bf16(want):
        return [w.bfloat16().float() for w in want]
    for step in range(warmup):
        assert same(*exact[step]), f"the fp32 warm-up changed a gradient at step {step}"
        sent, alone = rounded[step]
        assert same(sent, in_bf16(alone)) and not same(sent, alone), f"step {step} did not travel in bf16"
    for step in range(warmup, steps):   # compressed: the fc layer's gradient is neither exact nor only rounded
        for got in (exact, rounded):
            sent, alone = got[step]
            assert not same(sent, alone) and not same(sent, in_bf16(alone)), f"step {step} was not compressed"
    assert run.memory.state.iter == steps


def test_a_bf16_warm_up_sends_the_gradients_rounded_to_bf16_and_compresses_from_the_same_step():
    with one_rank_group():
        bf16_warm_up_checked(torch.device("cpu"), "gloo")


@gpu_only
def test_a_bf16_warm_up_on_a_gpu_over_nccl():
    device = torch.device("cuda", 0)
    with one_rank_group("nccl", device), deterministic_cudnn():
        bf16_warm_up_checked(device, "nccl")


def test_a_warm_up_precision_other_than_fp32_or_bf16_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="powersgd_warmup_precision='fp16' is not one of fp32, bf16"):
        Settings(dataset="fake", comm="powersgd", powersgd_warmup_precision="fp16")


def test_a_resume_with_more_steps_keeps_the_warm_up_the_run_started_with():
    """Issue 43, finding 6: the warm-up (a quarter of the run's steps) was recomputed on resume, so a resume with
    more epochs moved it past the step reached: exact all-reduce again, then compression with stale feedback."""
    device = torch.device("cpu")
    with one_rank_group():
        data, ctx = batches(device), one_rank_of_a_group(device, "gloo")
        straight = Run(device, "gloo", SETTINGS)   # warm-up: 3 steps
        straight.steps(data)
        first = Run(device, "gloo", SETTINGS)
        first.steps(data[:5])   # compressing since step 3
        longer = Settings(**{**SETTINGS.to_dict(), "powersgd_warmup_steps": 9})   # what more epochs would give
        again = Run(device, "gloo", longer, weights=first.weights(), optimizer=first.optimizer.state_dict())
        said = again.memory.load_state_dict(first.memory.state_dict(ctx), ctx)
        assert again.memory.state.start_powerSGD_iter == 3
        again.steps(data[5:])
    assert "warm-up of 3 steps kept" in said
    for name, value in straight.weights().items():
        assert torch.equal(again.weights()[name], value), name


def test_a_resumed_run_says_one_warm_up_figure_the_checkpoints():
    """Issue 55, D10: a resumed run said "exact for the first 9 of 36 steps" (this run's share) and then "its
    warm-up of 3 steps kept" (the checkpoint's): two figures for one warm-up. The first line now reads the kept one."""
    device = torch.device("cpu")
    longer = Settings(**{**SETTINGS.to_dict(), "powersgd_warmup_steps": 9})
    with one_rank_group():
        ctx = one_rank_of_a_group(device, "gloo")
        first = Run(device, "gloo")
        first.steps(batches(device)[:5])
        kept = {"choice": "powersgd", "powersgd": first.memory.state_dict(ctx)}
        again = Run(device, "gloo", longer)
        said = again.memory.load_state_dict(kept["powersgd"], ctx)
    assert "warm-up of 3 steps kept" in said
    assert comm.warmup_said(longer, 36, kept).startswith(";\n  exact for the first 3 of 36 steps")
    assert comm.warmup_said(longer, 36, {}).startswith(";\n  exact for the first 9 of 36 steps")   # a new run's own


def test_without_its_memory_a_resumed_run_is_not_the_same():
    """What the test above guards: a resumed PowerSGD that starts its memory afresh ends elsewhere."""
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    with one_rank_group():
        data = batches("cpu")
        straight = Run("cpu", "gloo")
        straight.steps(data)
        first = Run("cpu", "gloo")
        first.steps(data[:7])
        memory = first.memory.state_dict(ctx)
        again = Run("cpu", "gloo", weights=first.weights(), optimizer=first.optimizer.state_dict())
        again.memory.load_state_dict({**memory, "names": [], "errors": []}, ctx)   # the step count alone
        again.steps(data[7:])
    assert any(not torch.equal(again.weights()[n], v) for n, v in straight.weights().items())


def saved_on_two_ranks(memory) -> dict:
    """A checkpoint's PowerSGD memory as two ranks would have saved it: rank 1's error differs."""
    names = list(memory.order)
    sizes = {name: p.numel() for p, name in memory.names.items()}
    total = sum(sizes[n] for n in names)
    return {"iter": 9, "rank": 2, "names": names, "errors": [torch.zeros(total), torch.full((total,), 2.0)],
            "p": {}, "q": {}}


def test_resumed_on_another_number_of_ranks_every_rank_takes_the_mean_error_feedback():
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    with one_rank_group():
        run = Run("cpu", "gloo")
        said = run.memory.load_state_dict(saved_on_two_ranks(run.memory), ctx)
    assert said.endswith("the error feedback of 2 ranks, averaged, on each of 1")
    assert run.memory.state.iter == 9
    errors = [piece["error"] for piece in run.memory.store.values()]
    assert errors and all(torch.equal(e, torch.ones_like(e)) for e in errors)   # the mean of 0 and 2


def test_another_powersgd_rank_keeps_the_error_feedback_and_starts_the_warm_start_afresh():
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    with one_rank_group():
        first = Run("cpu", "gloo")
        first.steps(batches("cpu")[:5])
        memory = first.memory.state_dict(ctx)
        again = Run("cpu", "gloo", settings=Settings(dataset="fake", comm="powersgd", powersgd_warmup_steps=3,
                                                      powersgd_rank=1))
        said = again.memory.load_state_dict(memory, ctx)
        assert said.endswith("saved with rank 2: the warm start afresh")
        assert not any("q" in piece for piece in again.memory.store.values())
        again.steps(batches("cpu")[5:7])   # the new rank's matrices are drawn afresh: the steps run
    assert all(torch.isfinite(v).all() for v in again.weights().values())


def test_a_model_without_a_saved_parameter_is_refused_with_its_name():
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    with one_rank_group():
        run = Run("cpu", "gloo")
        saved = saved_on_two_ranks(run.memory)
        with pytest.raises(CheckpointError, match="for a parameter 'stem.weight', which this model does not have"):
            run.memory.load_state_dict({**saved, "names": ["stem.weight"] + saved["names"]}, ctx)


@pytest.mark.slow
def test_three_ranks_resume_each_with_its_own_error_feedback_sent_to_it_alone(tmp_path):
    """Rank 0 writes every rank's error feedback (fetched one rank at a time); the resume gives each rank its own,
    one buffer at a time, never the whole list to everyone (ResNet-50 at 64 ranks: 6.5 GB to every rank); both ways
    by broadcasts on the group the ranks share, never send/recv (tests/helpers/powersgd_ranks.py forbids them)."""
    port = free_port()
    results = run_all([python("-m", "tests.helpers.powersgd_ranks", str(r), str(port), str(tmp_path)) for r in range(3)],
                      timeout=120, env=base_env())
    assert all(r.returncode == 0 for r in results), describe(results)
    checks = [dict(re.findall(r"^CHECK (\w+)=(.*)$", r.output, re.M)) for r in results]
    assert [c["own"] for c in checks] == ["True"] * 3, describe(results)
    assert [c["errors_received"] for c in checks] == ["3 tensors", "3", "3"], describe(results)
    saved = torch.load(tmp_path / "last.pt", weights_only=False)["comm"]["powersgd"]["errors"]
    assert len(saved) == 3 and not torch.equal(saved[0], saved[1])   # each rank's own, all in the file


@contextlib.contextmanager
def deterministic_cudnn():
    """cuDNN's deterministic kernels, as a bit-exact GPU resume needs: with ``cudnn.benchmark``, which a GPU run of
    the kit sets (``optim.py``), cuDNN may pick kernels that add with atomics, and then two runs of the same steps
    differ in their last bits whatever PowerSGD keeps (seen in the GPU suite on an H100 after a kit run)."""
    kept = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = kept


@gpu_only
def test_a_resume_continues_powersgd_exactly_on_a_gpu_over_nccl():
    device = torch.device("cuda", 0)
    with one_rank_group("nccl", device), deterministic_cudnn():
        straight, resumed, _, _ = straight_and_resumed(device, "nccl", stops=(3, 7))
    for stop, weights in resumed.items():
        for name, value in straight.weights().items():
            assert weights[name].device == device and torch.equal(weights[name], value), (stop, name)

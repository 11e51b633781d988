"""The training loop as users rely on it: same maths on 1 and N ranks, exact evaluation, resume, logs."""
from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch

from ddp_utils import checkpoint, optim, train
from ddp_utils.metrics import Meter, topk_correct
from ddp_utils.settings import Settings, describe_batch
from tests.helpers.procs import base_env, describe, free_port, python, run_all
from tests.helpers.runs import FAST, run_ranks, train_cmd, weights


# -- metrics and schedule ---------------------------------------------------------------------

def test_topk_correct_counts_hits_and_caps_k_at_the_number_of_classes():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.05, 0.15], [0.2, 0.3, 0.5]])
    target = torch.tensor([1, 2, 0])
    assert topk_correct(logits, target, ks=(1, 2, 5)).tolist() == [1.0, 2.0, 3.0]


def test_meter_reports_sample_weighted_means_in_percent():
    from ddp_utils.distributed import DistContext
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    meter = Meter("cpu")
    meter.update(torch.tensor(4.0), torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([0, 1]))
    meter.update(torch.tensor(1.0), torch.tensor([[0.0, 1.0]]), torch.tensor([1]))
    stats = meter.reduced(ctx)
    assert stats["count"] == 3 and math.isclose(stats["loss"], 5 / 3)
    assert math.isclose(stats["acc1"], 200 / 3) and stats["acc5"] == 100.0


def test_lr_warms_up_linearly_then_decays_along_a_cosine_to_zero():
    assert optim.lr_factor(0, 100, 10) == pytest.approx(0.1)
    assert optim.lr_factor(9, 100, 10) == pytest.approx(1.0)
    assert optim.lr_factor(55, 100, 10) == pytest.approx(0.5)
    assert optim.lr_factor(100, 100, 10) == pytest.approx(0.0)
    assert optim.lr_factor(0, 100, 0) == pytest.approx(1.0)


def test_lr_is_scaled_with_the_global_batch_and_both_are_printed():
    s = Settings(batch_size=500, world_size=2, rank=1, lr=0.1)
    assert s.global_batch_size == 1000 and s.effective_lr == pytest.approx(0.1 * 1000 / 256)
    text = describe_batch(s)
    assert "global batch 1000" in text and "0.3906" in text
    assert Settings(lr=0.1, scale_lr=False, batch_size=500, world_size=2).effective_lr == 0.1


def test_no_weight_decay_on_biases_and_norm_weights():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GroupNorm(2, 8))
    opt = optim.build_optimizer(model, Settings(weight_decay=0.05))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[0].weight)}


def test_amp_is_off_on_cpu_by_default_and_bf16_when_asked():
    cpu = torch.device("cpu")
    assert optim.amp_dtype(Settings(), cpu) is None
    assert optim.amp_dtype(Settings(amp="bf16"), cpu) is torch.bfloat16


@pytest.mark.slow
def test_fp16_on_a_cpu_is_said_to_be_slow_and_the_loop_says_it(tmp_path):
    """Issue 55: `--amp fp16` on a CPU ran many times slower without a word."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert optim.precision_note(Settings(amp="fp16"), cpu).startswith("note: amp=fp16 on a CPU: a CPU has no fast "
                                                                      "float16 arithmetic")
    assert optim.precision_note(Settings(amp="fp16"), gpu) == "" == optim.precision_note(Settings(amp="bf16"), cpu)
    _in_process_fit(tmp_path / "run", epochs=1, amp="fp16", workers=0, arch="mlp")   # fp16 convolutions: ~10 s a step
    assert "note: amp=fp16 on a CPU" in (tmp_path / "run" / "log.txt").read_text()


# -- DDP maths ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_ranks_with_batch_b_end_with_the_weights_of_one_process_with_batch_2b(tmp_path):
    # GroupNorm: no per-rank batch statistics, so the two runs must agree to float tolerance
    steps = ["--epochs", "2", "--max-steps-per-epoch", "3", "--arch", "convnet_gn"]
    run_ranks(tmp_path, "ddp", 2, "--batch-size", 8, *steps)
    run_ranks(tmp_path, "single", 1, "--batch-size", 16, *steps)
    ddp, single = weights(tmp_path / "ddp" / "last.pt"), weights(tmp_path / "single" / "last.pt")
    for name in single:
        assert torch.allclose(ddp[name], single[name], atol=1e-5, rtol=1e-4), name
    # both really trained 2 x 3 steps: the comparison is not between two untouched initialisations
    for run in ("ddp", "single"):
        assert checkpoint.load_checkpoint(tmp_path / run / "last.pt")["step"] == 6


@pytest.mark.slow
def test_evaluation_is_exact_across_ranks_for_a_split_not_divisible_by_the_world_size(tmp_path):
    # train briefly on the demo digits, then evaluate the same checkpoint on 1 and on 3 ranks
    demo = ["--dataset", "demo", "--data-dir", str(tmp_path / "demo"), "--image-size", "32"]
    run_ranks(tmp_path, "trained", 1, *demo, "--epochs", "1", "--max-steps-per-epoch", "5", "--batch-size", "16")
    ckpt = tmp_path / "trained" / "last.pt"
    run_ranks(tmp_path, "eval1", 1, *demo, "--batch-size", "16", "--evaluate", "--resume", ckpt)
    run_ranks(tmp_path, "eval3", 3, *demo, "--batch-size", "16", "--evaluate", "--resume", ckpt)
    one = json.loads((tmp_path / "eval1" / "results.json").read_text())
    three = json.loads((tmp_path / "eval3" / "results.json").read_text())
    assert one["val_images"] % 3 != 0, "pick a split size that does not divide evenly"
    assert three["val_images"] == one["val_images"]
    assert three["acc1"] == pytest.approx(one["acc1"]) and three["acc5"] == pytest.approx(one["acc5"])
    assert three["loss"] == pytest.approx(one["loss"], rel=1e-5)


# -- checkpoints and resume --------------------------------------------------------------------

def _in_process_fit(run_dir, epochs=3, resume=None, dataset="fake", data_dir="data/demo", **changes):
    """What a notebook does: prepare() then fit(job), in this process."""
    from ddp_utils.job import prepare
    settings = Settings(**{**dict(dataset=dataset, data_dir=str(data_dir), image_size=32, arch="convnet", workers=2,
                                  wandb="disabled", epochs=epochs, batch_size=8, max_steps_per_epoch=3,
                                  run_dir=str(run_dir), log_every=1), **changes})
    with prepare(settings, resume=resume, log=lambda *_: None) as job:
        return train.fit(job)


@pytest.mark.slow
def test_interrupted_then_resumed_run_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, monkeypatch):
    _in_process_fit(tmp_path / "straight")
    real_save, saves = checkpoint.save_checkpoint, []

    def save_then_die_after_epoch_1(path, state):
        real_save(path, state)
        saves.append(path)
        if state["epoch"] == 1:
            raise KeyboardInterrupt   # the node dies right after the epoch-2 checkpoint
    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_die_after_epoch_1)
    with pytest.raises(KeyboardInterrupt):
        _in_process_fit(tmp_path / "interrupted")
    monkeypatch.setattr(checkpoint, "save_checkpoint", real_save)
    assert checkpoint.load_checkpoint(tmp_path / "interrupted" / "last.pt")["epoch"] == 1
    results = _in_process_fit(tmp_path / "interrupted", resume=str(tmp_path / "interrupted" / "last.pt"))
    assert results["epochs_run"] == 1
    a, b = weights(tmp_path / "straight" / "last.pt"), weights(tmp_path / "interrupted" / "last.pt")
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_a_resumed_run_lets_go_of_the_checkpoint_once_it_has_restored_from_it(tmp_path, monkeypatch):
    """Issue 55, D8: a whole CPU copy of the checkpoint stayed on every rank for the run and after it (Loop.state,
    Job.state): about 1 GB a rank for ViT-B with AdamW."""
    from ddp_utils.job import prepare
    _in_process_fit(tmp_path / "run", epochs=1)
    held, real = [], train.train_and_evaluate
    monkeypatch.setattr(train, "train_and_evaluate", lambda loop, epoch: held.append(loop.state) or real(loop, epoch))
    settings = Settings(dataset="fake", data_dir="data/demo", image_size=32, arch="convnet", workers=0,
                        wandb="disabled", epochs=2, batch_size=8, max_steps_per_epoch=3, run_dir=str(tmp_path / "run"))
    with prepare(settings, resume=str(tmp_path / "run" / "last.pt"), log=lambda *_: None) as job:
        assert job.state is not None and job.state["epoch"] == 0
        results = train.fit(job)
        assert job.state is None
    assert results["epochs_run"] == 1 and held == [None]


def test_a_failed_run_hands_release_group_its_optimizer_and_a_finished_job_keeps_no_optimizer(tmp_path, monkeypatch):
    """Issue 55: ZeRO's optimizer holds the process group, and the loop (not the job) owns the optimizer: Job.fail
    must still reach it (a weak reference), and a job that ran must not keep the optimizer's state alive."""
    import gc
    from ddp_utils import job as job_module
    released = []
    monkeypatch.setattr(job_module, "release_group", lambda model, optimizer=None: released.append(optimizer))
    real = train.train_and_evaluate

    def fail_after_a_step(loop, epoch):
        released.append(("the loop's", loop.optimizer))
        raise RuntimeError("a failure inside the run")
    monkeypatch.setattr(train, "train_and_evaluate", fail_after_a_step)
    with pytest.raises(RuntimeError, match="a failure inside the run"):
        _in_process_fit(tmp_path / "failed", epochs=1, workers=0)
    assert released[1] is released[0][1] and released[1] is not None
    monkeypatch.setattr(train, "train_and_evaluate", real)
    settings = Settings(dataset="fake", data_dir="data/demo", image_size=32, arch="convnet", workers=0,
                        wandb="disabled", epochs=1, batch_size=8, max_steps_per_epoch=2, run_dir=str(tmp_path / "ok"))
    with job_module.prepare(settings, log=lambda *_: None) as job:
        train.fit(job)
    gc.collect()
    assert job.optimizer is not None and job.optimizer() is None


@pytest.mark.slow
def test_compile_trains_for_real_and_resumes_from_an_eager_checkpoint_to_the_eager_runs_weights(tmp_path):
    """Issues 36/37: --compile had only run with torch.compile stubbed. For real on the CPU (inductor and the
    machine's C++ compiler): a compiled run ends with the eager run's weights within float rounding, and a compiled
    run resumed from the eager run's checkpoint (plain parameter names, no `_orig_mod.`) with the eager resume's.
    The MLP: inductor compiles its graph in less than half the convnet's time, and the path is the same."""
    common = ["--dataset", "fake", "--image-size", "32", "--arch", "mlp", "--workers", "0", "--threads", "1",
              "--wandb", "disabled", "--progress", "off", "--max-steps-per-epoch", "3", "--batch-size", "8"]

    inductor = tmp_path / "inductor"   # its own cache: the code inductor generates shows that it compiled

    def run(name, *extra):
        [done] = run_all([python("-m", "ddp_utils", "train", *common, "--run-dir", str(tmp_path / name), *extra)],
                         timeout=300, env=base_env(TORCHINDUCTOR_CACHE_DIR=str(inductor)))
        assert done.returncode == 0, describe([done])
        return done.output
    run("eager", "--epochs", "2")
    run("compiled", "--epochs", "2", "--compile")
    assert list(inductor.rglob("*.py")), "inductor generated no code: the run did not compile"
    resumed = str(tmp_path / "eager" / "last.pt")
    run("eager-resumed", "--epochs", "3", "--resume", resumed)
    said = run("compiled-resumed", "--epochs", "3", "--resume", resumed, "--compile")
    assert "continuing at epoch 3" in said, said
    for compiled, eager in (("compiled", "eager"), ("compiled-resumed", "eager-resumed")):
        a, b = weights(tmp_path / compiled / "last.pt"), weights(tmp_path / eager / "last.pt")
        assert a.keys() == b.keys() and not any(k.startswith("_orig_mod") for k in a)
        for name in a:
            assert torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-5), (compiled, name)
    assert json.loads((tmp_path / "compiled" / "settings.json").read_text())["compile"] is True


# A process killed (SIGKILL) right after it wrote last.pt of a best epoch, before best.pt.
KILLED_BETWEEN_THE_WRITES = """
import os, signal, sys
from ddp_utils import checkpoint
from ddp_utils.tools import cli
real = checkpoint.save_checkpoint
def save(path, state, verify=True):
    real(path, state, verify)
    if path.name == "last.pt":
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save_checkpoint = save
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_kill_between_last_pt_and_best_pt_still_ends_with_the_best_epochs_weights_in_best_pt(tmp_path):
    """The only epoch is the best: killed before best.pt was written, the resume (nothing left to train)
    must still leave best.pt, the epoch last.pt records as the best, not a run without its best weights."""
    run = tmp_path / "run"
    args = ["train", "--dataset", "fake", "--image-size", "32", "--arch", "convnet", "--workers", "0", "--wandb",
            "disabled", "--progress", "off", "--epochs", "1", "--max-steps-per-epoch", "2", "--batch-size", "8",
            "--run-dir", str(run)]
    [killed] = run_all([python("-c", KILLED_BETWEEN_THE_WRITES, *args)], timeout=120, env=base_env())
    assert killed.returncode == -9 and (run / "last.pt").exists() and not (run / "best.pt").exists(), describe([killed])
    [resumed] = run_all([python("-m", "ddp_utils", *args, "--resume", str(run / "last.pt"))], timeout=120,
                        env=base_env())
    assert resumed.returncode == 0, describe([resumed])
    assert "best.pt was older than the best epoch (1) that last.pt records" in resumed.output
    best, last = checkpoint.load_checkpoint(run / "best.pt"), checkpoint.load_checkpoint(run / "last.pt")
    history = json.loads((run / "results.json").read_text())["history"]
    best_epoch = max(range(len(history)), key=lambda e: history[e]["val"]["acc1"])   # the first of the best
    assert best["epoch"] == best_epoch == 0 and best["best_acc1"] == last["best_acc1"]
    assert all(torch.equal(best["model"][k], last["model"][k]) for k in best["model"])


def test_checkpoint_holds_everything_needed_to_resume(tmp_path):
    _in_process_fit(tmp_path / "run", epochs=1)
    state = checkpoint.load_checkpoint(tmp_path / "run" / "last.pt")
    assert {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "settings", "rng"} <= set(state)
    assert state["settings"]["batch_size"] == 8 and state["step"] == 3
    assert (tmp_path / "run" / "best.pt").exists()


# -- what the command line writes --------------------------------------------------------------

@pytest.mark.slow
def test_two_rank_run_writes_one_run_folder_from_rank_0_with_results_and_tensorboard(tmp_path):
    run_ranks(tmp_path, "run", 2, "--epochs", "1", "--max-steps-per-epoch", "4", "--batch-size", "8",
              "--wandb", "offline")
    run = tmp_path / "run"
    results = json.loads((run / "results.json").read_text())
    for key in ("acc1", "acc5", "loss", "epochs", "world_size", "global_batch_size", "wall_time_s", "images_per_s"):
        assert key in results, key
    assert results["world_size"] == 2 and results["global_batch_size"] == 16
    assert json.loads((run / "settings.json").read_text())["world_size"] == 2
    events = [p for p in run.rglob("events.out.tfevents*")]
    assert len(events) == 1, events   # rank 1 wrote none
    from ddp_utils.runlog import read_scalars
    scalars = read_scalars(run)
    for tag in ("Loss/train", "acc1/train", "acc5/train", "Loss/val", "acc1/val", "acc5/val", "lr"):
        assert tag in scalars, tag
    assert scalars["acc1/val"][-1][1] == pytest.approx(results["acc1"])
    wandb_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1, wandb_runs   # one W&B run, not one per rank


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_torchrun_launches_two_ranks_that_take_rank_and_world_size_from_the_environment(tmp_path):
    port = free_port()
    cmd = ["torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "ddp_utils", "train", *FAST, "--epochs", "1", "--max-steps-per-epoch", "2",
           "--batch-size", "8", "--run-dir", str(tmp_path / "tr")]
    [res] = run_all([cmd], timeout=180, env=base_env())
    assert res.returncode == 0, describe([res])
    assert json.loads((tmp_path / "tr" / "results.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_bad_input_exits_non_zero_with_a_readable_message_and_no_traceback(tmp_path):
    [res] = run_all([python("-m", "ddp_utils", "train", "--rank", "2", "--world-size", "2")], timeout=60)
    assert res.returncode == 2, res.output
    assert "rank=2" in res.output and "Traceback" not in res.output


@pytest.mark.slow
def test_two_ranks_resume_from_rank_0s_checkpoint_when_the_worker_has_no_copy(tmp_path):
    run_ranks(tmp_path, "run", 2, "--epochs", "1", "--max-steps-per-epoch", "2", "--batch-size", "8")
    port = free_port()
    common = ["--epochs", "2", "--max-steps-per-epoch", "2", "--batch-size", "8"]
    cmds = [train_cmd(tmp_path / "run", 0, 2, port, *common, "--resume", tmp_path / "run" / "last.pt"),
            # the worker node has no shared folder: its path does not exist there
            train_cmd(tmp_path / "elsewhere", 1, 2, port, *common, "--resume", tmp_path / "nowhere" / "last.pt")]
    results = run_all(cmds, timeout=180, env=base_env())
    assert all(r.returncode == 0 for r in results), describe(results)
    out = json.loads((tmp_path / "run" / "results.json").read_text())
    assert out["epochs_run"] == 1 and [h["epoch"] for h in out["history"]] == [1, 2]
    assert checkpoint.load_checkpoint(tmp_path / "run" / "last.pt")["step"] == 4
    assert not (tmp_path / "elsewhere").exists()   # rank 1 wrote nothing


@pytest.mark.slow
def test_final_metrics_of_a_two_rank_run_equal_a_single_process_evaluation_of_its_checkpoint(tmp_path):
    # BatchNorm model: each rank's running statistics drift apart during training; evaluation must
    # still be that of the saved (rank 0) model, counted once per image.
    demo = ["--dataset", "demo", "--data-dir", str(tmp_path / "demo"), "--arch", "convnet", "--batch-size", "16",
            "--lr", "1.6"]   # enough learning for the statistics to matter
    run_ranks(tmp_path, "ddp", 2, *demo, "--epochs", "1", "--max-steps-per-epoch", "15")
    run_ranks(tmp_path, "eval", 1, *demo, "--evaluate", "--resume", tmp_path / "ddp" / "last.pt")
    trained = json.loads((tmp_path / "ddp" / "results.json").read_text())
    single = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert trained["val_images"] == single["val_images"]
    assert trained["loss"] == pytest.approx(single["loss"], rel=1e-6)
    assert trained["acc1"] == pytest.approx(single["acc1"]) and trained["acc5"] == pytest.approx(single["acc5"])


# -- defaults that learn, threads, output -----------------------------------------------------

@pytest.fixture(scope="module")
def at_defaults(tmp_path_factory):
    """`python -m ddp_utils train --dataset demo` with nothing else set but a short run (2 epochs of 3 steps), on 2
    ranks and on 1, output piped. (The default recipe's accuracy: tests/test_quotes.py, on the demo's runs.)"""
    tmp = tmp_path_factory.mktemp("defaults")
    port = free_port()
    base = ["--dataset", "demo", "--data-dir", str(tmp / "demo"), "--wandb", "disabled", "--epochs", "2",
            "--max-steps-per-epoch", "3"]
    from ddp_utils.demo_data import prepare_demo
    prepare_demo(tmp / "demo")
    env = base_env()
    env.pop("OMP_NUM_THREADS")   # the kit chooses the threads itself
    two = run_all([python("-m", "ddp_utils", "train", *base, "--run-dir", str(tmp / "ddp"), "--world-size", "2",
                          "--rank", str(r), "--master-port", str(port)) for r in range(2)], timeout=300, env=env)
    one = run_all([python("-m", "ddp_utils", "train", *base, "--run-dir", str(tmp / "single"))], timeout=300,
                  env=env)
    return tmp, two, one


@pytest.mark.slow
def test_ranks_sharing_a_machine_share_its_cores(at_defaults):
    import os
    tmp, two, one = at_defaults
    assert all(r.returncode == 0 for r in two + one), describe(two + one)
    cores = len(os.sched_getaffinity(0))
    assert json.loads((tmp / "ddp" / "results.json").read_text())["threads"] == max(1, cores // 2)
    assert json.loads((tmp / "single" / "results.json").read_text())["threads"] == cores
    assert f"CPU threads per process: {max(1, cores // 2)} ({cores} cores / 2 rank(s) on this machine)" in two[0].output


@pytest.mark.slow
def test_piped_output_has_one_line_per_epoch_and_no_progress_bar_frames(at_defaults):
    tmp, two, one = at_defaults
    assert all(r.returncode == 0 for r in two + one), describe(two + one)
    for output in (two[0].output, one[0].output):
        assert "\r" not in output and not re.search(r"\dit/s", output)   # tqdm's rate; "Gbit/s" is fine
        assert [line.split(":")[0] for line in output.splitlines() if line.startswith("epoch ")] == [
            f"epoch {e}/2" for e in range(1, 3)]


@pytest.mark.slow
def test_progress_steps_prints_a_line_per_log_point(tmp_path):
    [res] = run_all([python("-m", "ddp_utils", "train", *FAST, "--run-dir", str(tmp_path / "r"), "--epochs", "1",
                            "--max-steps-per-epoch", "4", "--batch-size", "8", "--progress", "steps")],
                    timeout=120, env=base_env())
    assert res.returncode == 0, describe([res])
    assert "epoch 1/1 step 2/4: loss" in res.output and "epoch 1/1 step 4/4: loss" in res.output
    assert "\r" not in res.output


@pytest.mark.parametrize("setting, env, expected", [
    (0, {}, (1, "2 cores / 2 rank(s) on this machine")),
    (0, {"OMP_NUM_THREADS": "3"}, (3, "OMP_NUM_THREADS")),
    (2, {"OMP_NUM_THREADS": "3"}, (2, "the threads setting")),
])
def test_threads_are_the_setting_else_omp_num_threads_else_a_share_of_the_cores(setting, env, expected):
    from ddp_utils.robust.threads import choose_threads
    assert choose_threads(setting, cores=2, ranks_here=2, environ=env) == expected
    assert choose_threads(0, cores=1, ranks_here=4, environ={})[0] == 1


@pytest.mark.slow
def test_resume_through_prepare_drops_the_tensorboard_points_logged_after_the_checkpoint(tmp_path):
    """What the notebooks do on RESUME: the interrupted epoch's points must not show twice."""
    from torch.utils.tensorboard import SummaryWriter

    from ddp_utils.runlog import read_scalars
    run = tmp_path / "run"
    _in_process_fit(run, epochs=1)
    saved_step = checkpoint.load_checkpoint(run / "last.pt")["step"]
    stray = SummaryWriter(str(run / "tb"))   # the interrupted epoch 2 logged these before dying
    for step in range(saved_step + 1, saved_step + 3):
        stray.add_scalar("Loss/train", 1234.0, step)
    stray.close()
    _in_process_fit(run, epochs=2, resume=str(run / "last.pt"))
    points = read_scalars(run)["Loss/train"]
    assert 1234.0 not in [value for _, value in points]
    steps = [step for step, _ in points]
    assert steps == sorted(set(steps)) and steps[-1] == 2 * saved_step


# -- divergence: a NaN run is never saved, and every rank stops ------------------------------------

@pytest.mark.slow
def test_a_diverging_run_stops_every_rank_and_saves_no_nan_model(tmp_path):
    import hashlib
    run_ranks(tmp_path, "run", 2, "--epochs", "1", "--max-steps-per-epoch", "4", "--batch-size", "8")
    saved = {name: hashlib.sha1((tmp_path / "run" / name).read_bytes()).hexdigest() for name in ("last.pt", "best.pt")}
    port = free_port()
    common = ["--epochs", "3", "--max-steps-per-epoch", "4", "--batch-size", "8", "--lr", "1e20"]
    cmds = [train_cmd(tmp_path / "run", r, 2, port, *common, "--resume", tmp_path / "run" / "last.pt") for r in range(2)]
    results = run_all(cmds, timeout=120, env=base_env())
    assert [r.returncode for r in results] == [2, 2], describe(results)
    for rank, r in enumerate(results):
        assert f"rank {rank}: training diverged at step" in r.output and "is nan with lr " in r.output, r.output[-2000:]
        assert "Traceback" not in r.output and r.output.count("training diverged") == 1
    assert "holds epoch 1, the last one with finite numbers" in results[0].output
    for name, digest in saved.items():   # both checkpoints untouched: no NaN epoch became last or best
        assert hashlib.sha1((tmp_path / "run" / name).read_bytes()).hexdigest() == digest, name
    assert "training diverged" in (tmp_path / "run" / "log.txt").read_text()


@pytest.mark.slow
def test_a_run_that_diverges_in_its_first_epoch_says_nothing_was_saved(tmp_path):
    [res] = run_all([train_cmd(tmp_path / "run", 0, 1, free_port(), "--epochs", "1", "--max-steps-per-epoch", "4",
                               "--batch-size", "8", "--lr", "1e20")], timeout=120, env=base_env())
    assert res.returncode == 2 and "no checkpoint was written yet" in res.output, res.output[-2000:]
    assert not (tmp_path / "run" / "last.pt").exists() and not (tmp_path / "run" / "best.pt").exists()


@pytest.mark.slow
def test_a_failed_first_start_does_not_block_the_next_one_and_its_files_are_kept_aside(tmp_path):
    first = run_all([train_cmd(tmp_path / "run", 0, 1, free_port(), "--epochs", "1", "--max-steps-per-epoch", "4",
                               "--batch-size", "8", "--lr", "1e20")], timeout=120, env=base_env())
    assert first[0].returncode == 2, describe(first)
    again = run_all([train_cmd(tmp_path / "run", 0, 1, free_port(), "--epochs", "1", "--max-steps-per-epoch", "4",
                               "--batch-size", "8")], timeout=120, env=base_env())
    assert again[0].returncode == 0, describe(again)
    [aside] = list((tmp_path / "run").glob("attempt-*"))
    assert "training diverged" in (aside / "log.txt").read_text()
    assert (tmp_path / "run" / "last.pt").exists() and "kept in attempt-" in again[0].output


@pytest.mark.slow
def test_resuming_with_another_architecture_names_both_and_writes_nothing(tmp_path):
    run_ranks(tmp_path, "run", 1, "--epochs", "1", "--max-steps-per-epoch", "2", "--batch-size", "8")
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    [res] = run_all([train_cmd(tmp_path / "run", 0, 1, free_port(), "--epochs", "2", "--max-steps-per-epoch", "2",
                               "--batch-size", "8", "--arch", "convnet_gn", "--resume", tmp_path / "run" / "last.pt")],
                    timeout=120, env=base_env())
    assert res.returncode == 2, describe([res])
    assert "is a checkpoint of arch='convnet', but these settings say arch='convnet_gn'" in res.output
    assert "--arch convnet" in res.output and "Traceback" not in res.output and len(res.output) < 3000
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before


# -- resuming on another world size (a node lost or added) -----------------------------------------
def _train_then_resume(tmp_path, before: int, after: int):
    """Epoch 1 of 3 on ``before`` ranks, then the rest on ``after`` ranks from its last.pt."""
    # fake data: 10 steps on 1 rank, 5 on 2 (16 px: the schedule is the point, not the pictures)
    steps = ("--epochs", "3", "--max-steps-per-epoch", "0", "--batch-size", "256", "--image-size", "16",
             "--no-link-probe")
    run_ranks(tmp_path, "run", before, *steps[:1], "1", *steps[2:])   # a 1-epoch run: its last.pt is epoch 1
    state = checkpoint.load_checkpoint(tmp_path / "run" / "last.pt")
    assert state["settings"]["world_size"] == before and state["epoch"] == 0
    ranks = run_ranks(tmp_path, "run", after, *steps, "--resume", tmp_path / "run" / "last.pt")
    out = ranks[0].output
    assert "Traceback" not in out and "continuing at epoch 2" in out, out[-3000:]
    return json.loads((tmp_path / "run" / "results.json").read_text()), out


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_run_resumes_on_another_world_size_and_its_schedule_continues_where_a_run_of_that_size_would_be(
        tmp_path, before, after):
    results, out = _train_then_resume(tmp_path, before, after)
    assert results["world_size"] == after and len(results["history"]) == 3
    assert [len(h["train"]["per_rank"]) for h in results["history"]] == [before, after, after]
    assert results["per_rank"] == []   # epochs of two world sizes: the ranks' means only, no mixed rows
    assert f"(world size {before}); this run takes" in out
    # The lr of the resumed epochs is what a run on `after` ranks from the start has at those epochs.
    straight = run_ranks(tmp_path, "straight", after, "--epochs", "3", "--max-steps-per-epoch", "0",
                         "--batch-size", "256", "--image-size", "16", "--no-link-probe")
    assert straight[0].returncode == 0
    same = json.loads((tmp_path / "straight" / "results.json").read_text())["history"]
    assert [h["train"]["lr"] for h in results["history"][1:]] == pytest.approx([h["train"]["lr"] for h in same[1:]])

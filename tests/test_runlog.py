"""runlog.py and summary.py: one run folder written by rank 0, W&B that never prompts or leaks keys."""
import json
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_utils.runlog import (
    NullLogger,
    RunLogger,
    default_run_dir,
    has_wandb_key,
    make_logger,
    read_scalars,
    wandb_mode,
)
from ddp_utils.settings import Settings
from ddp_utils.model import unwrap as unwrap_model
from ddp_utils.summary import model_summary
from tests.helpers.runs import tree

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 hex characters, like a real W&B key

# W&B modes: every test that does not test W&B itself keeps it disabled (fast, no service process).
OFF = Settings(wandb="disabled", epochs=2)


@pytest.fixture(autouse=True)
def no_wandb_credentials(tmp_path, monkeypatch):
    """No key, no netrc, no server: W&B can only run offline or disabled in these tests."""
    home = tmp_path / "home"
    home.mkdir()
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / ".cache" / "wandb"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / ".local" / "share" / "wandb"))


def small_model():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


# -- run folder name -----------------------------------------------------------------------------
def test_default_run_dir_names_dataset_arch_world_size_and_time():
    path = default_run_dir(Settings(dataset="cinic10", arch="resnet18", world_size=2))
    assert re.fullmatch(r"runs/cinic10-resnet18-ws2-\d{8}-\d{6}", path.as_posix())


def test_default_run_dir_is_settings_run_dir_when_given():
    assert default_run_dir(Settings(run_dir="runs/mine")).as_posix() == "runs/mine"


# -- W&B mode ------------------------------------------------------------------------------------
def write_netrc(home, machine):
    (home / ".netrc").write_text(f"machine {machine}\n  login user\n  password {FAKE_KEY}\n")


def test_auto_is_online_with_an_api_key_in_the_environment(tmp_path):
    assert wandb_mode(Settings(), {"WANDB_API_KEY": FAKE_KEY, "HOME": str(tmp_path)}) == "online"


def test_auto_is_online_after_wandb_login_wrote_netrc(tmp_path):
    write_netrc(tmp_path, "api.wandb.ai")
    assert wandb_mode(Settings(), {"HOME": str(tmp_path)}) == "online"


def test_auto_is_offline_without_any_key(tmp_path):
    assert wandb_mode(Settings(), {"HOME": str(tmp_path)}) == "offline"


def test_auto_ignores_netrc_entries_for_other_hosts(tmp_path):
    write_netrc(tmp_path, "github.com")
    assert not has_wandb_key({"HOME": str(tmp_path)})
    assert wandb_mode(Settings(), {"HOME": str(tmp_path)}) == "offline"


def test_auto_follows_wandb_mode_variable(tmp_path):
    env = {"HOME": str(tmp_path), "WANDB_API_KEY": FAKE_KEY, "WANDB_MODE": "disabled"}
    assert wandb_mode(Settings(), env) == "disabled"


def test_online_without_a_key_is_a_clear_error_not_a_prompt(tmp_path):
    with pytest.raises(ValueError) as err:
        wandb_mode(Settings(wandb="online"), {"HOME": str(tmp_path)})
    assert "wandb login" in str(err.value) and "WANDB_API_KEY" in str(err.value)


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_offline_and_disabled_are_kept_even_with_a_key(tmp_path, mode):
    assert wandb_mode(Settings(wandb=mode), {"WANDB_API_KEY": FAKE_KEY, "HOME": str(tmp_path)}) == mode


def test_online_without_a_key_fails_before_writing_anything(tmp_path):
    with pytest.raises(ValueError):
        RunLogger(Settings(wandb="online"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


# -- RunLogger -----------------------------------------------------------------------------------
def test_settings_json_equals_the_settings(tmp_path):
    settings = OFF.replace(dataset="cinic10", batch_size=500, world_size=2)
    with RunLogger(settings, tmp_path / "run"):
        pass
    saved = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert Settings.from_dict(saved) == settings


def test_info_prints_and_appends_to_log_txt(tmp_path, capsys):
    with RunLogger(OFF, tmp_path / "run") as log:
        capsys.readouterr()
        log.info("epoch 1: acc1 12.5")
        log.info("epoch 2: acc1 25.0")
    printed = capsys.readouterr().out
    assert printed == "epoch 1: acc1 12.5\nepoch 2: acc1 25.0\n"
    assert (tmp_path / "run" / "log.txt").read_text().endswith(printed)


def test_log_txt_holds_everything_the_logger_printed(tmp_path, capsys):
    with RunLogger(OFF, tmp_path / "run") as log:
        log.info("hello")
    assert (tmp_path / "run" / "log.txt").read_text() == capsys.readouterr().out


def test_scalars_read_back_from_tensorboard_with_exact_tags_and_values(tmp_path):
    tags = ["Loss/train", "acc1/train", "acc5/train", "Loss/val", "acc1/val", "acc5/val", "lr",
            "throughput/images_per_s", "time/data_s", "time/compute_s"]
    with RunLogger(OFF, tmp_path / "run") as log:
        for step in (0, 20, 40):
            log.scalars({tag: step + i / 4 for i, tag in enumerate(tags)}, step=step)
        log.scalars({"acc1/val": torch.tensor(50.5)}, step=60)  # 0-d tensors are fine too
    scalars = read_scalars(tmp_path / "run")
    assert set(scalars) == set(tags)
    for i, tag in enumerate(tags):
        expected = [(step, step + i / 4) for step in (0, 20, 40)]
        assert scalars[tag] == expected + ([(60, 50.5)] if tag == "acc1/val" else [])


def test_results_json_is_complete_and_replaced_atomically(tmp_path, monkeypatch):
    run = tmp_path / "run"
    with RunLogger(OFF, run) as log:
        log.results({"acc1": 32.25, "acc5": torch.tensor(58.5), "wall_time_s": 4487})
        assert json.loads((run / "results.json").read_text()) == \
            {"acc1": 32.25, "acc5": 58.5, "wall_time_s": 4487}
        before = tree(run)

        def disk_full(fd):
            raise OSError("No space left on device")

        monkeypatch.setattr(os, "fsync", disk_full)
        with pytest.raises(OSError):
            log.results({"acc1": 99.0})
        monkeypatch.undo()
    assert tree(run)["results.json"] == before["results.json"]
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]


def test_model_summary_is_written_and_returned(tmp_path):
    with RunLogger(OFF, tmp_path / "run") as log:
        text = log.model_summary(small_model(), (3, 8, 8))
    assert (tmp_path / "run" / "model_summary.txt").read_text() == text
    assert "Linear" in text


def test_close_twice_is_harmless_and_logging_after_close_is_an_error(tmp_path):
    log = RunLogger(OFF, tmp_path / "run")
    log.close()
    log.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.scalars({"lr": 0.1}, step=1)


# -- safety of existing runs ---------------------------------------------------------------------
def test_existing_run_is_refused_without_resume_and_left_untouched(tmp_path, capsys):
    run = tmp_path / "run"
    with RunLogger(OFF, run) as log:
        log.scalars({"Loss/train": 2.0}, step=0)
        log.results({"acc1": 10.0})
    (run / "last.pt").write_bytes(b"checkpoint bytes")
    before = tree(run)
    with pytest.raises(FileExistsError) as err:
        RunLogger(OFF.replace(epochs=5), run)
    assert str(run) in str(err.value) and "--resume" in str(err.value)
    assert tree(run) == before


def test_a_run_folder_that_is_a_file_or_inside_one_is_named_before_anything_is_written(tmp_path):
    """Issue 55: `--run-dir` naming a file printed only "[Errno 17] File exists", after the data and model were built."""
    from ddp_utils.runlog import run_folder_refusal
    tmp_path = tmp_path / "work"   # beside this module's W&B home
    tmp_path.mkdir()
    (tmp_path / "notes.txt").write_text("a student's file\n")
    said = run_folder_refusal(tmp_path / "notes.txt", new_run=True)
    assert said == (f"the run folder {tmp_path / 'notes.txt'} is a file, not a folder. Name a folder (a new one is "
                    f"made) and start again.")
    said = run_folder_refusal(tmp_path / "notes.txt" / "run", new_run=True)
    assert f"the run folder {tmp_path / 'notes.txt' / 'run'} cannot be made: {tmp_path / 'notes.txt'} is a file" in said
    assert (tmp_path / "notes.txt").read_text() == "a student's file\n"
    assert run_folder_refusal(tmp_path / "new" / "run", new_run=True) is None   # made later, by the run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]   # the write probe left nothing


def test_a_new_run_in_a_folder_holding_a_run_is_named_and_a_start_that_never_saved_is_not(tmp_path):
    from ddp_utils.runlog import run_folder_refusal
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.txt").write_text("a start that failed before its first checkpoint\n")
    assert run_folder_refusal(run, new_run=True) is None      # set aside into attempt-*/ when the run opens
    (run / "results.json").write_text("{}")
    said = run_folder_refusal(run, new_run=True)
    assert said.startswith(f"{run} already holds a run (results.json, log.txt)"), said
    assert run_folder_refusal(run, new_run=False) is None     # a resume continues it
    assert run_folder_refusal(run, new_run=None) is None      # resume=auto: decided when the run opens


@pytest.mark.slow
def test_a_run_folder_on_a_read_only_disk_is_named_as_such_also_for_root(tmp_path):
    """root writes through any permission: the probe writes for real, so a read-only mount is what it meets here."""
    import subprocess
    import sys
    folder = tmp_path / "ro"
    folder.mkdir()
    probe = (f"from ddp_utils.robust.files import folder_refusal; "
             f"print(folder_refusal({str(folder / 'run')!r}, 'the run folder'))")
    script = (f"mount --bind {folder} {folder} && mount -o remount,ro,bind {folder} {folder} && "
              f"exec {sys.executable} -c {probe!r}")
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (f"the run folder {folder / 'run'} cannot be written (it would be made in {folder}): "
                                   f"Read-only file system. Choose a folder this user can write (a path under your "
                                   f"home folder or the current one), or fix its permissions, and start again.")
    assert list(folder.iterdir()) == []


def test_a_resume_that_names_its_folder_another_way_keeps_its_settings_json(tmp_path, monkeypatch):
    """Issue 55: a resume wrote the run folder as an absolute path, so settings.json was renamed as if changed."""
    monkeypatch.chdir(tmp_path)
    with RunLogger(OFF.replace(run_dir="runs/a"), resume=False) as log:
        log.info("first part")
    before = (tmp_path / "runs" / "a" / "settings.json").read_text()
    with RunLogger(OFF.replace(run_dir=str(tmp_path / "runs" / "a")), resume=True):
        pass
    with RunLogger(OFF.replace(run_dir="runs/./a"), resume=True):
        pass
    assert sorted(p.name for p in (tmp_path / "runs" / "a").glob("settings*.json")) == ["settings.json"]
    assert (tmp_path / "runs" / "a" / "settings.json").read_text() == before
    with RunLogger(OFF.replace(run_dir="runs/a", epochs=3), resume=True):   # a real change is still kept aside
        pass
    assert len(list((tmp_path / "runs" / "a").glob("settings.*.json"))) == 1


def test_resume_appends_to_the_log_and_keeps_old_events(tmp_path):
    run = tmp_path / "run"
    with RunLogger(OFF, run) as log:
        log.info("first part")
        for step in range(5):
            log.scalars({"Loss/train": 1.0}, step=step)
    time.sleep(1.1)  # event file names carry the second they were made: keep them in order
    with RunLogger(OFF, run, resume=True, resume_step=3) as log:  # the checkpoint was at step 3
        log.info("second part")
        for step in (3, 4, 5):
            log.scalars({"Loss/train": 0.5}, step=step)
    text = (run / "log.txt").read_text()
    assert text.index("first part") < text.index("resumed") < text.index("second part")
    assert len(list((run / "tb").iterdir())) == 2
    # Steps 3 and 4 of the first part were logged after the checkpoint: TensorBoard drops them.
    assert read_scalars(run)["Loss/train"] == [(0, 1.0), (1, 1.0), (2, 1.0),
                                                (3, 0.5), (4, 0.5), (5, 0.5)]


def test_resume_with_changed_settings_keeps_the_earlier_settings_file(tmp_path):
    run = tmp_path / "run"
    RunLogger(OFF, run).close()
    original = (run / "settings.json").read_text()
    RunLogger(OFF.replace(epochs=5), run, resume=True).close()
    kept = list(run.glob("settings.*.json"))
    assert len(kept) == 1 and kept[0].read_text() == original
    assert json.loads((run / "settings.json").read_text())["epochs"] == 5
    assert "epochs: 2 -> 5" in (run / "log.txt").read_text()


def test_resume_with_the_same_settings_keeps_one_settings_file(tmp_path):
    run = tmp_path / "run"
    RunLogger(OFF, run).close()
    RunLogger(OFF, run, resume=True).close()
    assert [p.name for p in run.glob("settings*.json")] == ["settings.json"]


# -- W&B -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_offline_wandb_run_lives_in_the_run_dir_and_the_key_is_in_no_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)  # set up, but the run is offline
    run = tmp_path / "run"
    with RunLogger(Settings(wandb="offline"), run) as log:
        log.info("training")
        log.scalars({"Loss/train": 2.5, "lr": 0.1}, step=1)
        log.model_summary(small_model(), (3, 8, 8))
        log.results({"acc1": 12.5})
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1
    assert (run / "wandb_run_id.txt").read_text().strip()
    files = [p for p in run.rglob("*") if p.is_file()]
    assert len(files) > 5
    for path in files:
        assert FAKE_KEY.encode() not in path.read_bytes(), path
    assert FAKE_KEY not in capsys.readouterr().out


def test_resumed_offline_run_continues_the_same_wandb_run(tmp_path):
    run = tmp_path / "run"
    RunLogger(Settings(wandb="offline"), run).close()
    first_id = (run / "wandb_run_id.txt").read_text()
    RunLogger(Settings(wandb="offline"), run, resume=True).close()
    assert (run / "wandb_run_id.txt").read_text() == first_id
    assert len(list((run / "wandb").glob(f"offline-run-*-{first_id.strip()}*"))) == 2


def test_disabled_wandb_leaves_no_wandb_folder(tmp_path):
    with RunLogger(OFF, tmp_path / "run") as log:
        log.scalars({"lr": 0.1}, step=0)
    assert not (tmp_path / "run" / "wandb").exists()
    assert not (tmp_path / "run" / "wandb_run_id.txt").exists()


# -- other ranks ---------------------------------------------------------------------------------
def test_null_logger_writes_nothing_but_shows_the_global_lines(tmp_path, monkeypatch, capsys):
    # other ranks print what rank 0 prints (the numbers are global), only rank 0 writes files
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    with NullLogger(Settings(), resume=False) as log:
        log.info("epoch 1/2: the same line on every rank")
        log.scalars({"Loss/train": 1.0}, step=0)
        assert log.model_summary(small_model(), (3, 8, 8)) == ""
        log.results({"acc1": 1.0})
    log.close()
    assert log.run_dir is None
    assert tree(tmp_path) == before
    assert capsys.readouterr() == ("epoch 1/2: the same line on every rank\n", "")


def test_make_logger_gives_rank_0_a_run_logger_and_others_a_null_logger(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = OFF.replace(world_size=2)
    assert isinstance(make_logger(settings, rank=1), NullLogger)
    assert not (tmp_path / "runs").exists()
    log = make_logger(settings, rank=0)
    log.close()
    assert isinstance(log, RunLogger) and (tmp_path / log.run_dir / "settings.json").is_file()


# -- model summary -------------------------------------------------------------------------------
def column_total(text):
    lines = text.splitlines()
    top, bottom = [i for i, line in enumerate(lines) if set(line) == {"="}]
    rows = lines[top + 1:bottom]  # the layer rows between the two rules
    return sum(int(row.split()[-1].replace(",", "")) for row in rows)


def test_model_summary_totals_equal_the_parameter_count():
    model = small_model()
    model[0].weight.requires_grad_(False)  # a frozen layer: trainable < total
    text = model_summary(model, (3, 8, 8))
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert f"Total params: {total:,}" in text
    assert f"Trainable params: {trainable:,}" in text
    assert f"Params size (MB): {total * 4 / 2**20:.2f}" in text
    assert column_total(text) == total
    assert "0 (Conv2d)" in text and "[2, 8, 8, 8]" in text and "[2, 10]" in text


class SharedLayers(nn.Module):
    """One ReLU called twice and an output layer tied to the input embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)
        self.out = nn.Linear(4, 4, bias=False)
        self.out.weight = self.embed.weight
        self.act = nn.ReLU()
        self.scale = nn.Parameter(torch.ones(4))  # owned by the top module itself

    def forward(self, x):
        return self.act(self.out(self.act(self.embed(x)))) * self.scale


def test_model_summary_counts_shared_and_tied_parameters_once():
    model = SharedLayers()
    text = model_summary(model, (4,))
    assert column_total(text) == sum(p.numel() for p in model.parameters()) == 20
    assert text.count("act (ReLU)") == 2


def test_model_summary_restores_train_mode_and_leaves_batchnorm_statistics_alone():
    model = small_model().train()
    model[1].eval()  # frozen BatchNorm stays frozen
    stats = model[1].running_mean.clone()
    model_summary(model, (3, 8, 8))
    assert model.training and model[0].training and not model[1].training
    assert torch.equal(model[1].running_mean, stats)


def test_model_summary_does_not_draw_random_numbers():
    torch.manual_seed(0)
    model_summary(small_model(), (3, 8, 8))
    after = torch.rand(1)
    torch.manual_seed(0)
    small_model()  # building the model draws its initial weights
    assert torch.equal(torch.rand(1), after)


class LikeCompiled(nn.Module):
    """Stands in for torch.compile's wrapper (same ``_orig_mod``) without importing dynamo (4 s)."""

    def __init__(self, model):
        super().__init__()
        self._orig_mod = model


def test_model_summary_unwraps_compiled_and_data_parallel_models():
    model = small_model()
    assert unwrap_model(LikeCompiled(model)) is model
    assert unwrap_model(nn.DataParallel(LikeCompiled(model))) is model
    assert model_summary(LikeCompiled(model), (3, 8, 8)) == model_summary(model, (3, 8, 8))


@pytest.mark.skipif(dist.is_initialized(), reason="a process group is already set up")
def test_model_summary_unwraps_ddp(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = small_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        assert unwrap_model(ddp) is model
        assert model_summary(ddp, (3, 8, 8)) == model_summary(model, (3, 8, 8))
    finally:
        dist.destroy_process_group()


def test_leaving_a_job_closes_its_logger_after_success_and_after_an_error(tmp_path):
    """The notebooks' `with job:`: TensorBoard flushed and the W&B run finished, whatever happened."""
    from ddp_utils.job import prepare
    for name, error in (("ok", None), ("failed", ValueError("boom"))):
        settings = Settings(dataset="fake", image_size=32, workers=0, wandb="disabled", epochs=1, batch_size=8,
                            max_steps_per_epoch=1, run_dir=str(tmp_path / name), progress="off")
        job = prepare(settings, log=lambda *_: None)
        try:
            with job:
                if error:
                    raise error
        except ValueError:
            pass
        assert job.logger._closed, name
    assert "error: ValueError: boom" in (tmp_path / "failed" / "log.txt").read_text()


@pytest.mark.slow
def test_wandb_online_with_no_route_to_its_servers_costs_no_training_run(tmp_path):
    """Two namespace hosts, a key set, W&B's server an address nobody has: rank 0's W&B start gives up within
    its bound (a third of init_timeout), the run logs offline and says how to upload, both ranks finish, and
    the key is written nowhere."""
    from tests.helpers import netns
    from tests.helpers.procs import base_env, describe, free_port, python, run_all
    home = tmp_path / "home"
    env = base_env(WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL="http://10.213.7.99:8080", HOME=home,
                   WANDB_CONFIG_DIR=home / ".config" / "wandb", WANDB_CACHE_DIR=home / ".cache" / "wandb",
                   WANDB_DATA_DIR=home / ".local" / "share" / "wandb")
    run = tmp_path / "run"
    with netns.two_hosts_or_skip("10.213.7") as hosts:
        common = ["-m", "ddp_utils", "train", "--dataset", "fake", "--image-size", "32", "--arch", "convnet",
                  "--workers", "0", "--epochs", "1", "--max-steps-per-epoch", "2", "--batch-size", "8",
                  "--progress", "off", "--wandb", "online", "--init-timeout", "30", "--backend", "gloo",
                  "--world-size", "2", "--master-addr", hosts.addrs[0], "--master-port", str(free_port()),
                  "--run-dir", str(run)]
        results = run_all([python(*common, "--rank", "0"), python(*common, "--rank", "1")], timeout=150, env=env,
                          prefix=[hosts.exec_prefix(0), hosts.exec_prefix(1)])
    assert [r.returncode for r in results] == [0, 0], describe(results)
    assert "W&B online start failed" in results[0].output and "upload later with: wandb sync" in results[0].output
    assert json.loads((run / "results.json").read_text())["epochs_run"] == 1
    holding_the_key = [str(p) for p in tmp_path.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert holding_the_key == []


RECORD = {"epoch": 3, "val": {"loss": 0.5123, "acc1": 91.25, "acc5": 99.5, "count": 800},
          "train": {"loss": 0.61234, "acc1": 88.5, "acc5": 99.0, "images_per_s": 1234.4, "images_per_s_rank": 617.2,
                    "data_s": 1.0, "compute_s": 6.0, "comm_s": 2.0, "idle_s": 1.0, "wall_s": 10.2,
                    "wall_mean_s": 10.0}}


def test_the_epoch_line_and_the_epochs_scalars_come_from_its_record():
    """Issue 44, part 2: the epoch line, TensorBoard's (and W&B's) scalars and results.json's history are written
    from one record per epoch. The line's shape is what the notebooks' and the pages' readers see: a change to it
    fails here, in the fast tier, not only in a slow test."""
    from ddp_utils.runlog import epoch_line, epoch_scalars
    one = epoch_line(Settings(epochs=5), RECORD["train"], RECORD["val"], RECORD["epoch"] - 1)
    assert one == ("epoch 3/5: train loss 0.6123 acc1 88.50 | val loss 0.5123 acc1 91.25 acc5 99.50\n"
                   "  1234 img/s global, 617 per rank | time: data 10% compute 60% comm 20% idle 10% | 10.2s")
    two = epoch_line(Settings(epochs=5, world_size=2), RECORD["train"], RECORD["val"], 2, "DDP, all-reduce")
    assert two == one + " | DDP, all-reduce"
    assert all(len(line) < 100 for line in one.splitlines())   # a notebook wraps longer lines mid-word
    assert epoch_scalars(RECORD) == {
        "Loss/val": 0.5123, "acc1/val": 91.25, "acc5/val": 99.5, "throughput/images_per_s": 1234.4,
        "throughput/images_per_s_rank": 617.2, "time/data_s": 1.0, "time/compute_s": 6.0, "time/comm_s": 2.0,
        "time/idle_s": 1.0}   # TensorBoard's tags: names other parts rely on

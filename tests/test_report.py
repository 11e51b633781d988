"""report.py: the results table and figures students hand in, right numbers and labelled pictures."""
from __future__ import annotations

import datetime
import hashlib
import json
import re
from pathlib import Path

import pytest
from matplotlib.legend import Legend

from ddp_utils import cli, report
from ddp_utils.settings import Settings
from tests.procs import base_env, describe, python, run_all


# -- run folders ---------------------------------------------------------------------------------
def fake_run(folder, world_size, train_time_s, epochs=2, acc1=50.0, images_per_epoch=900_000,
             device_name="Tesla T4", host="node0"):
    """A finished run folder in the format ``fit`` writes, with chosen times (no training)."""
    folder.mkdir(parents=True)
    settings = Settings(dataset="cinic10", arch="resnet18_cifar", epochs=epochs, batch_size=64,
                        world_size=world_size, run_dir=str(folder), wandb="disabled")
    (folder / "settings.json").write_text(settings.to_json() + "\n")
    per_epoch = train_time_s / epochs
    history = [{"epoch": e + 1,
                "train": {"loss": 2.0 - 0.3 * e, "acc1": 30.0 + 10 * e, "acc5": 70.0 + 5 * e,
                          "count": images_per_epoch, "epoch": e, "step": (e + 1) * 16,
                          "wall_s": per_epoch, "data_s": 0.1 * per_epoch, "compute_s": 0.9 * per_epoch,
                          "images_per_s": images_per_epoch / per_epoch,
                          "images_per_s_rank": images_per_epoch / per_epoch / world_size},
                "val": {"loss": 1.9 - 0.3 * e, "acc1": 35.0 + 10 * e, "acc5": 75.0 + 5 * e, "count": 500}}
               for e in range(epochs)]
    results = {"acc1": acc1, "acc5": 90.0, "loss": 1.5, "best_acc1": acc1, "val_images": 500,
               "epochs": epochs, "epochs_run": epochs, "world_size": world_size,
               "global_batch_size": settings.global_batch_size, "lr": settings.effective_lr,
               "wall_time_s": train_time_s + 10.0, "train_time_s": train_time_s,
               "images_per_s": images_per_epoch * epochs / train_time_s, "data_wait_fraction": 0.1,
               "dataset": "cinic10", "arch": "resnet18_cifar", "device": "cuda:0", "device_name": device_name,
               "backend": "nccl" if world_size > 1 else "none", "host": host, "cpus": 8,
               "history": history}
    (folder / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return folder


@pytest.fixture
def runs(tmp_path):
    """A 2-rank run that took half the train time of a 1-rank run (ideal scaling), listed first."""
    return [fake_run(tmp_path / "ddp2", world_size=2, train_time_s=1800.0),
            fake_run(tmp_path / "single", world_size=1, train_time_s=3600.0)]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A real 2-epoch, 2-step run on fake data: the files exactly as the trainer writes them."""
    run_dir = tmp_path_factory.mktemp("real") / "run"
    cmd = python("-m", "ddp_utils", "train", "--dataset", "fake", "--image-size", "32", "--arch", "convnet",
                 "--workers", "0", "--wandb", "disabled", "--epochs", "2", "--max-steps-per-epoch", "2",
                 "--batch-size", "8", "--log-every", "1", "--run-dir", str(run_dir))
    results = run_all([cmd], timeout=120, env=base_env())
    assert results[0].returncode == 0, describe(results)
    return run_dir


def table_rows(table: str) -> dict[str, list[str]]:
    """``{run name: [cells]}`` of a Markdown table."""
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells] for cells in rows[2:]}  # after header and ---


HEADER = ["run", "ranks", "global batch", "epochs", "wall time", "train img/s", "img/s per rank",
          "Acc@1", "Acc@5", "speed-up", "efficiency"]


# -- load_run ------------------------------------------------------------------------------------
def test_load_run_returns_results_settings_and_the_folder_name_of_a_real_run(real_run):
    run = report.load_run(real_run)
    assert run["name"] == "run" and run["world_size"] == 1 and run["dataset"] == "fake"
    assert run["settings"]["batch_size"] == 8 and len(run["history"]) == 2


def test_load_run_on_a_folder_that_is_not_a_run_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(tmp_path))} is not a run folder"):
        report.load_run(tmp_path)


def test_load_run_on_a_missing_folder_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(tmp_path / 'nope'))}: no such folder"):
        report.load_run(tmp_path / "nope")


def test_load_run_on_an_unfinished_run_says_it_has_not_finished(tmp_path):
    (tmp_path / "settings.json").write_text(Settings().to_json())
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(tmp_path))} is a run that has not finished"):
        report.load_run(tmp_path)


# -- the table -----------------------------------------------------------------------------------
def test_table_has_the_course_columns_and_one_row_per_run_named_after_its_folder(runs):
    table = report.results_table(runs)
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert header == HEADER
    assert list(table_rows(table)) == ["ddp2", "single"]


def test_two_ranks_in_half_the_train_time_is_a_2x_speedup_at_100_percent_efficiency(runs):
    row = dict(zip(HEADER, table_rows(report.results_table(runs))["ddp2"]))
    assert row["speed-up"] == "2.00x" and row["efficiency"] == "100 %"
    assert row["ranks"] == "2" and row["global batch"] == "128" and row["epochs"] == "2"


def test_table_shows_wall_time_as_h_mm_ss_and_images_per_second_global_and_per_rank(runs):
    row = dict(zip(HEADER, table_rows(report.results_table(runs))["ddp2"]))
    assert row["wall time"] == "0:30:10"                         # 1800 s of training + 10 s
    assert row["train img/s"] == "1000" and row["img/s per rank"] == "500"   # 1.8 M images in 1800 s
    assert report.format_duration(4487.3) == "1:14:47"


def test_speedup_below_linear_shows_as_efficiency_below_100_percent(tmp_path):
    dirs = [fake_run(tmp_path / "single", 1, 3600.0), fake_run(tmp_path / "ddp4", 4, 1200.0)]
    row = dict(zip(HEADER, table_rows(report.results_table(dirs))["ddp4"]))
    assert row["speed-up"] == "3.00x" and row["efficiency"] == "75 %"


def test_baseline_is_the_first_one_rank_run_unless_one_is_chosen(runs):
    assert table_rows(report.results_table(runs))["single"][9] == "1.00x"
    chosen = table_rows(report.results_table(runs, baseline=runs[0]))
    assert chosen["ddp2"][9] == "1.00x" and chosen["single"][9] == "0.50x"
    assert chosen["single"][10] == "100 %"   # half the speed with half the ranks: linear


def test_speedup_compares_time_per_epoch_so_a_longer_run_is_not_penalised(tmp_path):
    dirs = [fake_run(tmp_path / "single", 1, 3600.0, epochs=2), fake_run(tmp_path / "ddp2", 2, 3600.0, epochs=4)]
    assert table_rows(report.results_table(dirs))["ddp2"][9] == "2.00x"


def test_table_notes_when_runs_trained_unequal_work(tmp_path):
    dirs = [fake_run(tmp_path / "single", 1, 3600.0), fake_run(tmp_path / "ddp2", 2, 1800.0, images_per_epoch=450_000)]
    assert "ddp2 trained 450000 images per epoch, the baseline 900000" in report.results_table(dirs)


def test_choosing_a_baseline_that_is_not_among_the_runs_is_an_error(runs, tmp_path):
    with pytest.raises(ValueError, match="baseline .*other.* is not one of the runs"):
        report.results_table(runs, baseline=tmp_path / "other")


# -- figures: right content and always labelled with the hardware --------------------------------
def test_curves_have_train_and_val_lines_per_run_and_name_the_hardware(runs):
    fig = report.plot_curves(runs)
    text = report.figure_text(fig)
    assert "Tesla T4" in text and "8 CPU cores" in text and "host node0" in text
    assert "cinic10" in text and "resnet18_cifar" in text and "ranks per run: 2, 1" in text
    loss_ax, acc_ax = fig.axes
    labels = [line.get_label() for line in loss_ax.lines]
    assert labels == ["ddp2 (2 ranks) train", "ddp2 (2 ranks) val", "single (1 rank) train", "single (1 rank) val"]
    assert list(acc_ax.lines[1].get_ydata()) == [35.0, 45.0]   # val acc1 per epoch from the history


def test_curves_fall_back_to_tensorboard_when_results_have_no_history(real_run, tmp_path):
    run = report.load_run(real_run)
    from_history = report.epoch_curves(run)
    from_tensorboard = report.epoch_curves({**run, "history": []})
    assert from_tensorboard["Loss/val"][0] == [1.0, 2.0]   # one validation point per epoch
    assert from_tensorboard["Loss/val"][1] == pytest.approx(from_history["Loss/val"][1], rel=1e-5)
    assert from_tensorboard["Loss/train"][0] == [0.5, 1.0, 1.5, 2.0]   # every step, in epochs


def test_throughput_marks_the_ideal_linear_speedup_and_names_the_hardware(runs):
    fig = report.plot_throughput(runs)
    assert "Tesla T4" in report.figure_text(fig) and "host node0" in report.figure_text(fig)
    ips_ax, speed_ax = fig.axes
    assert [bar.get_height() for bar in ips_ax.containers[0]] == pytest.approx([1000, 500])  # global img/s
    ideal, measured = speed_ax.containers
    assert [bar.get_height() for bar in ideal] == [2.0, 1.0]
    assert [bar.get_height() for bar in measured] == pytest.approx([2.0, 1.0])
    assert "ideal (linear) speed-up" in [t.get_text() for t in speed_ax.get_legend().get_texts()]


def test_write_report_writes_valid_pngs_and_the_results_markdown(runs, tmp_path):
    paths = report.write_report(runs, tmp_path / "out")
    assert [p.name for p in paths] == ["curves.png", "throughput.png", "results.md"]
    for png in paths[:2]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    md = paths[2].read_text()
    assert "| ddp2 | 2 | 128 |" in md and "Hardware: Tesla T4" in md
    assert "python -m ddp_utils train --dataset cinic10" in md and "--world-size 2 --rank 0" in md


def test_write_report_on_a_non_run_folder_writes_nothing(runs, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty is not a run folder"):
        report.write_report([*runs, tmp_path / "empty"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- command line --------------------------------------------------------------------------------
def test_cli_report_writes_the_table_and_figures(runs, tmp_path, capsys):
    assert cli.main(["report", *map(str, runs), "--out", str(tmp_path / "out")]) == 0
    assert "| ddp2 | 2 | 128 |" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        ".ddp_utils-report.json", "curves.png", "results.md", "throughput.png"]   # the list of what it wrote


def test_cli_report_on_a_non_run_folder_exits_2_naming_the_folder(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert f"error: {tmp_path} is not a run folder" in capsys.readouterr().err


# -- where the report goes -----------------------------------------------------------------------
REPORT_FILES = ["curves.png", "results.md", "throughput.png"]
PNG = b"\x89PNG\r\n\x1a\n"


def test_cli_report_writes_by_default_into_a_new_folder_under_reports(runs, tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert cli.main(["report", *map(str, runs)]) == 0
    assert cli.main(["report", *map(str, runs)]) == 0   # at once again: still a new folder
    folders = sorted((cwd / "reports").iterdir())
    assert len(folders) == 2 and [p.name for p in cwd.iterdir()] == ["reports"]   # no runs/report any more
    for folder in folders:
        stamp = re.fullmatch(r"(\d{8}-\d{6})(-\d+)?", folder.name).group(1)
        made = datetime.datetime.strptime(stamp, "%Y%m%d-%H%M%S")
        assert abs((datetime.datetime.now() - made).total_seconds()) < 120   # named after the time it was made
        assert REPORT_FILES == sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    assert f"wrote {Path('reports', folders[0].name, 'curves.png')}" in capsys.readouterr().out


def test_a_new_report_folder_gets_a_number_when_its_time_stamp_is_taken(tmp_path):
    now = datetime.datetime(2026, 11, 23, 10, 15, 0)
    assert report.new_report_dir(tmp_path, now) == tmp_path / "20261123-101500"
    (tmp_path / "20261123-101500").mkdir()
    assert report.new_report_dir(tmp_path, now) == tmp_path / "20261123-101500-2"


def test_report_refuses_to_overwrite_files_it_did_not_write_and_writes_nothing(runs, tmp_path, capsys):
    out = tmp_path / "handin"
    out.mkdir()
    (out / "results.md").write_text("my answers\n")
    assert cli.main(["report", *map(str, runs), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"error: {out} already holds results.md, which the report would overwrite" in captured.err
    assert "Nothing was written" in captured.err and "--out DIR" in captured.err
    assert captured.out == ""   # refused before the table, so nobody takes it for a finished report
    assert [p.name for p in out.iterdir()] == ["results.md"] and (out / "results.md").read_text() == "my answers\n"
    with pytest.raises(FileExistsError, match="results.md was not written by"):
        report.write_report(runs, out)
    assert [p.name for p in out.iterdir()] == ["results.md"]


def test_report_refuses_to_overwrite_its_own_file_once_it_was_edited(runs, tmp_path):
    out = tmp_path / "out"
    report.write_report(runs, out)
    pngs = {name: (out / name).read_bytes() for name in ("curves.png", "throughput.png")}
    with open(out / "results.md", "a") as f:
        f.write("\nMy answer to question 1: ...\n")
    with pytest.raises(FileExistsError, match="results.md was changed after the report wrote it"):
        report.write_report(runs, out)
    assert "My answer to question 1" in (out / "results.md").read_text()
    assert pngs == {name: (out / name).read_bytes() for name in pngs}


def test_rerunning_report_into_its_own_folder_replaces_its_files(runs, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["report", *map(str, runs), "--out", str(out)]) == 0
    assert "| ddp2 | 2 | 128 | 2 | 0:30:10 | 1000 | 500 | 50.00 | 90.00 | 2.00x |" in (out / "results.md").read_text()
    assert cli.main(["report", *map(str, runs), "--out", str(out), "--baseline", str(runs[0])]) == 0
    assert "| ddp2 | 2 | 128 | 2 | 0:30:10 | 1000 | 500 | 50.00 | 90.00 | 1.00x |" in (out / "results.md").read_text()
    assert cli.main(["report", *map(str, runs), "--out", str(out)]) == 0   # and again: its list follows its files
    assert "2.00x" in (out / "results.md").read_text()
    assert capsys.readouterr().err == ""


def test_the_kit_images_folder_is_the_repositorys_images_folder():
    assert report.KIT_IMAGES == Path(__file__).resolve().parents[1] / "images"
    assert (report.KIT_IMAGES / "curves.png").read_bytes()[:8] == PNG   # the committed pictures


def test_plain_out_into_the_kits_images_folder_is_refused(runs, monkeypatch, capsys):
    kit = report.KIT_IMAGES
    committed = {p: p.read_bytes() for p in kit.iterdir() if p.is_file()}
    monkeypatch.chdir(kit.parent)   # as the README has it: from the repository root
    try:
        codes = [cli.main(["report", *map(str, runs), "--out", out]) for out in ("images/", str(kit))]
        after = {p: p.read_bytes() for p in kit.iterdir() if p.is_file()}
    finally:   # never leave the kit's pictures changed, even when the refusal is broken
        for p in kit.iterdir():
            if p.name in (*REPORT_FILES, report.MANIFEST) and p not in committed:
                p.unlink()
        for p, data in committed.items():
            if p.read_bytes() != data:
                p.write_bytes(data)
    assert codes == [2, 2] and after == committed
    err = capsys.readouterr().err
    assert "error: images is the kit's own images/ folder" in err and "pass --kit-images instead of --out" in err


def test_kit_images_flag_replaces_the_kits_pictures_where_plain_out_may_not(runs, tmp_path, monkeypatch, capsys):
    kit = tmp_path / "images"   # stands in for the kit's images/ folder
    kit.mkdir()
    for name in REPORT_FILES:
        (kit / name).write_text("committed example")
    (kit / "README.md").write_text("how they were made")
    # Not even the list of an earlier report opens the kit's folder to a plain --out.
    files = {name: hashlib.sha256((kit / name).read_bytes()).hexdigest() for name in REPORT_FILES}
    (kit / report.MANIFEST).write_text(json.dumps({"files": files}))
    monkeypatch.setattr(report, "KIT_IMAGES", kit)
    assert cli.main(["report", *map(str, runs), "--out", str(kit)]) == 2
    assert all((kit / name).read_text() == "committed example" for name in REPORT_FILES)
    assert cli.main(["report", *map(str, runs), "--kit-images"]) == 0
    assert (kit / "curves.png").read_bytes()[:8] == PNG and (kit / "throughput.png").read_bytes()[:8] == PNG
    md = (kit / "results.md").read_text()
    assert "| ddp2 | 2 | 128 |" in md and md.count("--kit-images`") == 1   # how to make it again
    assert (kit / "README.md").read_text() == "how they were made"
    assert f"wrote {kit / 'curves.png'}" in capsys.readouterr().out


def test_kit_images_flag_and_out_cannot_be_combined(runs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", *map(str, runs), "--out", str(tmp_path / "out"), "--kit-images"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_kit_images_flag_without_the_kits_folder_says_so(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "KIT_IMAGES", tmp_path / "site-packages" / "images")
    assert cli.main(["report", *map(str, runs), "--kit-images"]) == 2
    assert "installed, not a checkout of the kit. Use --out DIR" in capsys.readouterr().err


# -- figures: long run names, nothing cut off, nothing on top of anything else -------------------
LONG_NAMES = ["20261123-101500-ddp2", "cinic10-resnet18_cifar-ws2-20261123-101500",
              "cinic10-resnet18_cifar-ws4-20261123-101500", "cinic10-resnet18_cifar-ws1-20261123-101500"]


@pytest.fixture(params=["2 short names", "4 long names", "3 very long names"])
def named_runs(request, runs, tmp_path):
    if request.param == "2 short names":
        return runs
    if request.param == "4 long names":
        return [fake_run(tmp_path / "long" / name, world_size=ws, train_time_s=3600.0 / ws * 1.1, epochs=8)
                for name, ws in zip(LONG_NAMES, (2, 2, 4, 1))]
    stem = "imagenet-resnet50-a-very-long-experiment-name-" + "x" * 70   # longer than a legend line
    return [fake_run(tmp_path / "huge" / f"{stem}-ws{ws}", world_size=ws, train_time_s=3600.0 / ws,
                     host="ip-172-31-44-201.eu-central-1.compute.internal-" + "y" * 60)
            for ws in (1, 2, 4)]


PLOTS = {"curves": report.plot_curves, "throughput": report.plot_throughput}


def shown_texts(fig) -> list:
    """Every text the figure draws: titles, caption, axis and tick labels, bar labels, legends."""
    texts = list(fig.texts)
    for legend in fig.findobj(Legend):
        texts += [*legend.get_texts(), legend.get_title()]
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        for axis, limits in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            low, high = sorted(limits)
            texts += [label for loc, label in zip(axis.get_ticklocs(), axis.get_ticklabels())
                      if low - 1e-9 <= loc <= high + 1e-9]   # ticks outside the view are not drawn
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def overlap(a, b, tolerance=0.5) -> bool:
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > tolerance) and (min(a.y1, b.y1) - max(a.y0, b.y0) > tolerance)


def inside(inner, outer, tolerance=0.5) -> bool:
    return (inner.x0 >= outer.x0 - tolerance and inner.x1 <= outer.x1 + tolerance
            and inner.y0 >= outer.y0 - tolerance and inner.y1 <= outer.y1 + tolerance)


@pytest.mark.parametrize("plot", PLOTS)
def test_no_text_of_a_figure_is_cut_off_at_its_edges(named_runs, plot):
    fig = PLOTS[plot](named_runs)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    outside = [t.get_text() for t in shown_texts(fig) if not inside(t.get_window_extent(renderer), fig.bbox)]
    assert outside == []


@pytest.mark.parametrize("plot", PLOTS)
def test_run_labels_under_the_bars_and_bar_labels_stand_apart_and_inside_their_axes(named_runs, plot):
    fig = PLOTS[plot](named_runs)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        ticks = [t for t in shown_texts(fig) if t in ax.get_xticklabels()]
        for group in (ticks, ax.texts):   # one run's label never runs into another's
            boxes = [t.get_window_extent(renderer) for t in group]
            assert not [(a.get_text(), b.get_text()) for i, a in enumerate(group) for j, b in enumerate(group)
                        if i < j and overlap(boxes[i], boxes[j])]
        # Bar labels (images/s, speed-up, ideal) end inside the axes: the y limits leave room for them.
        assert [t.get_text() for t in ax.texts if not inside(t.get_window_extent(renderer), ax.bbox)] == []


@pytest.mark.parametrize("plot", PLOTS)
def test_legends_cover_no_axes_and_no_other_text(named_runs, plot):
    fig = PLOTS[plot](named_runs)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = fig.findobj(Legend)
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert not [ax.get_title() for ax in fig.axes if overlap(box, ax.bbox)]   # not on the curves or bars
        own = {*legend.get_texts(), legend.get_title()}
        assert not [t.get_text() for t in shown_texts(fig)
                    if t not in own and overlap(box, t.get_window_extent(renderer))]


@pytest.mark.parametrize("plot", PLOTS)
def test_every_runs_full_name_is_on_its_figures(named_runs, plot):
    fig = PLOTS[plot](named_runs)
    text = " ".join(t.get_text().replace("\n", "") for t in shown_texts(fig))
    assert all(run.name in text for run in named_runs)


def test_the_command_in_results_md_rebuilds_the_runs_settings():
    """Made by Settings.to_argv, the one place that turns settings into flags: parse it back and compare."""
    import argparse
    import shlex

    from ddp_utils.settings import add_arguments, from_args
    settings = Settings(dataset="cinic10", data_dir="/data/my cinic", epochs=3, lr=0.05, world_size=2, rank=0,
                        master_addr="10.0.0.1", channels_last=False, wandb="disabled")
    command = report.train_command(settings.to_dict())
    words = shlex.split(command.split("#")[0])
    assert words[:4] == ["python", "-m", "ddp_utils", "train"] and "--rank 1 on the other" in command
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_args(parser.parse_args(words[4:]), environ={}) == settings

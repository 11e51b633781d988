"""report.py: the results table and figures students hand in, right numbers and labelled pictures."""
from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import pytest
from matplotlib.legend import Legend

from ddp_utils.tools import cli
from ddp_utils.tools import report
from ddp_utils.settings import Settings
from tests.helpers.procs import base_env, describe, python, run_all
from tests.helpers.report_runs import fake_run


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


HEADER = ["run", "ranks", "algorithm", "global batch", "epochs", "wall time", "train img/s", "img/s per rank",
          "Acc@1", "Acc@5", "speed-up", "efficiency"]


# -- load_run ------------------------------------------------------------------------------------
@pytest.mark.slow
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


def test_an_unfinished_run_is_told_to_resume_only_from_a_checkpoint_it_has(tmp_path):
    """Issue 55: `report` on a run stopped before its first epoch ended pointed at a last.pt that did not exist."""
    (tmp_path / "settings.json").write_text(Settings().to_json())
    with pytest.raises(FileNotFoundError, match="start it again: no epoch finished, so it has no checkpoint") as err:
        report.load_run(tmp_path)
    assert "last.pt" not in str(err.value)
    (tmp_path / "last.pt").write_bytes(b"a checkpoint")
    with pytest.raises(FileNotFoundError, match=f"continue it with --resume {re.escape(str(tmp_path / 'last.pt'))}"):
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
    assert row["algorithm"] == "DDP"   # what trained: the exact all-reduce (older runs: from their comm)


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
    assert table_rows(report.results_table(runs))["single"][10] == "1.00x"
    chosen = table_rows(report.results_table(runs, baseline=runs[0]))
    assert chosen["ddp2"][10] == "1.00x" and chosen["single"][10] == "0.50x"
    assert chosen["single"][11] == "100 %"   # half the speed with half the ranks: linear


def test_speedup_compares_time_per_epoch_so_a_longer_run_is_not_penalised(tmp_path):
    dirs = [fake_run(tmp_path / "single", 1, 3600.0, epochs=2), fake_run(tmp_path / "ddp2", 2, 3600.0, epochs=4)]
    assert table_rows(report.results_table(dirs))["ddp2"][10] == "2.00x"


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
    loss_ax, acc_ax, lr_ax = fig.axes
    labels = [line.get_label() for line in loss_ax.lines]
    assert labels == ["ddp2 (2 ranks) train", "ddp2 (2 ranks) val", "single (1 rank) train", "single (1 rank) val"]
    assert list(acc_ax.lines[1].get_ydata()) == [35.0, 45.0]   # val acc1 per epoch from the history


@pytest.mark.slow
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
    assert [p.name for p in paths] == ["curves.png", "time.png", "throughput.png", "results.md"]
    for png in paths[:3]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    md = paths[3].read_text()
    assert "| ddp2 | 2 | DDP | 128 |" in md and "Hardware: Tesla T4" in md
    assert "python -m ddp_utils train --dataset cinic10" in md and "--world-size 2 --rank 0" in md


def test_write_report_on_a_non_run_folder_writes_nothing(runs, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty is not a run folder"):
        report.write_report([*runs, tmp_path / "empty"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- command line --------------------------------------------------------------------------------
def test_cli_report_writes_the_table_and_figures(runs, tmp_path, capsys):
    assert cli.main(["report", *map(str, runs), "--out", str(tmp_path / "out")]) == 0
    assert "| ddp2 | 2 | DDP | 128 |" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "curves.png", "results.md", "throughput.png", "time.png"]   # nothing else


def test_cli_report_on_a_non_run_folder_exits_2_naming_the_folder(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert f"error: {tmp_path} is not a run folder" in capsys.readouterr().err


# -- where the report goes -----------------------------------------------------------------------
REPORT_FILES = ["curves.png", "results.md", "throughput.png", "time.png"]
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


def test_report_refuses_a_folder_that_holds_anything_and_writes_nothing(runs, tmp_path, capsys):
    out = tmp_path / "handin"
    out.mkdir()
    (out / "results.md").write_text("my answers\n")
    assert cli.main(["report", *map(str, runs), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"error: {out} already holds results.md: --out takes a new or an empty folder" in captured.err
    assert "Nothing was written" in captured.err and "--out DIR" in captured.err
    assert captured.out == ""   # refused before the table, so nobody takes it for a finished report
    assert [p.name for p in out.iterdir()] == ["results.md"] and (out / "results.md").read_text() == "my answers\n"
    (out / "results.md").unlink()
    (out / "notes.txt").write_text("mine")   # any file, not only one of the report's names
    with pytest.raises(FileExistsError, match="already holds notes.txt"):
        report.write_report(runs, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_report_refuses_to_write_over_an_earlier_report_even_its_own(runs, tmp_path):
    out = tmp_path / "out"
    report.write_report(runs, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with open(out / "results.md", "a") as f:
        f.write("\nMy answer to question 1: ...\n")
    with pytest.raises(FileExistsError, match="a report never replaces a file"):
        report.write_report(runs, out)
    assert "My answer to question 1" in (out / "results.md").read_text()
    assert {name: data for name, data in before.items() if name != "results.md"} == \
        {p.name: p.read_bytes() for p in out.iterdir() if p.name != "results.md"}


def test_an_empty_or_new_out_folder_takes_the_report(runs, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (empty, tmp_path / "new" / "folder"):
        assert cli.main(["report", *map(str, runs), "--out", str(out)]) == 0
        assert "| ddp2 | 2 | DDP | 128 | 2 | 0:30:10 | 1000 | 500 | 50.00 | 90.00 | 2.00x |" in (out / "results.md").read_text()
        assert sorted(p.name for p in out.iterdir()) == REPORT_FILES
    assert capsys.readouterr().err == ""


def test_an_out_folder_that_cannot_be_made_is_named_and_nothing_is_written(runs, tmp_path, capsys):
    """Issue 55: a report folder that could not be written gave a raw traceback (exit 1)."""
    work = tmp_path / "work"   # beside the runs
    work.mkdir()
    (work / "notes.txt").write_text("a student's answers\n")
    assert cli.main(["report", *map(str, runs), "--out", str(work / "notes.txt" / "report")]) == 2
    err = capsys.readouterr()
    assert (f"error: the report folder (--out) {work / 'notes.txt' / 'report'} cannot be made: "
            f"{work / 'notes.txt'} is a file, not a folder.") in err.err and "Traceback" not in err.err
    assert err.out == "" and sorted(p.name for p in work.iterdir()) == ["notes.txt"]   # not even the table


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
            if p.name in REPORT_FILES and p not in committed:
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
    monkeypatch.setattr(report.write, "KIT_IMAGES", kit)
    assert cli.main(["report", *map(str, runs), "--out", str(kit)]) == 2
    assert all((kit / name).read_text() == "committed example" for name in REPORT_FILES)
    assert cli.main(["report", *map(str, runs), "--kit-images"]) == 0
    assert (kit / "curves.png").read_bytes()[:8] == PNG and (kit / "throughput.png").read_bytes()[:8] == PNG
    md = (kit / "results.md").read_text()
    assert "| ddp2 | 2 | DDP | 128 |" in md and md.count("--kit-images`") == 1   # how to make it again
    assert (kit / "README.md").read_text() == "how they were made"
    assert f"wrote {kit / 'curves.png'}" in capsys.readouterr().out


def test_kit_images_flag_and_out_cannot_be_combined(runs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", *map(str, runs), "--out", str(tmp_path / "out"), "--kit-images"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_kit_images_flag_without_the_kits_folder_says_so(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report.write, "KIT_IMAGES", tmp_path / "site-packages" / "images")
    assert cli.main(["report", *map(str, runs), "--kit-images"]) == 2
    assert "installed, not a checkout of the kit. Use --out DIR" in capsys.readouterr().err


# -- figures: long run names, nothing cut off, nothing on top of anything else -------------------
LONG_NAMES = ["20261123-101500-ddp2", "cinic10-resnet18_cifar-ws2-20261123-101500",
              "cinic10-resnet18_cifar-ws4-20261123-101500", "cinic10-resnet18_cifar-ws1-20261123-101500"]


@pytest.fixture(params=["2 short names", "4 long names", "3 very long names", "seeds and ranks"])
def named_runs(request, runs, tmp_path):
    if request.param == "2 short names":
        return runs
    if request.param == "seeds and ranks":   # seed groups (error bars, shaded bands) and per-rank bars
        ranks = [dict(data=0.1, compute=0.55, comm=0.3, idle=0.05), dict(data=0.2, compute=0.5, comm=0.25, idle=0.05)]
        return ([fake_run(tmp_path / "seeds" / f"ddp2-seed{s}", 2, 1900.0 + 100 * s, seed=s, per_rank=ranks,
                          gpu_util=80.0) for s in range(3)]
                + [fake_run(tmp_path / "seeds" / f"single-seed{s}", 1, 3600.0 + 60 * s, seed=s, gpu_util=95.0,
                            shares=dict(data=0.02, compute=0.97, comm=0.0, idle=0.01)) for s in range(2)])
    if request.param == "4 long names":
        return [fake_run(tmp_path / "long" / name, world_size=ws, train_time_s=3600.0 / ws * 1.1, epochs=8)
                for name, ws in zip(LONG_NAMES, (2, 2, 4, 1))]
    stem = "imagenet-resnet50-a-very-long-experiment-name-" + "x" * 70   # longer than a legend line
    return [fake_run(tmp_path / "huge" / f"{stem}-ws{ws}", world_size=ws, train_time_s=3600.0 / ws,
                     host="ip-172-31-44-201.eu-central-1.compute.internal-" + "y" * 60)
            for ws in (1, 2, 4)]


PLOTS = {"curves": report.plot_curves, "throughput": report.plot_throughput, "time": report.plot_time_breakdown}


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


# -- where the time went, what bound each run ----------------------------------------------------
def bar_widths(ax) -> list[list[float]]:
    """The stacked bars' parts, one list per bar: [data, compute, comm, idle] seconds."""
    from matplotlib.container import BarContainer
    parts = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert [c.get_label() for c in parts] == [label for _, label, _, _ in report.TIME_PARTS]
    return [list(bar) for bar in zip(*[[patch.get_width() for patch in c.patches] for c in parts])]


def test_time_breakdown_bars_are_each_ranks_shares_of_the_train_time(tmp_path):
    ranks = [dict(data=0.1, compute=0.5, comm=0.3, idle=0.1), dict(data=0.2, compute=0.5, comm=0.25, idle=0.05)]
    mean = dict(data=0.02, compute=0.9, comm=0.0, idle=0.08)
    dirs = [fake_run(tmp_path / "ddp2", 2, 1800.0, per_rank=ranks), fake_run(tmp_path / "single", 1, 3600.0, shares=mean)]
    fig = report.plot_time_breakdown(dirs)
    [ax] = fig.axes
    bars = bar_widths(ax)
    assert len(bars) == 3   # ddp2's two ranks, single's one bar
    for bar, shares, seconds in zip(bars, [*ranks, mean], (900.0, 900.0, 1800.0)):
        assert sum(bar) == pytest.approx(seconds)   # seconds per epoch
        assert [w / sum(bar) for w in bar] == pytest.approx([shares[k] for k in ("data", "compute", "comm", "idle")])
    # each part wide enough is labelled with its share; the narrow ones are left bare
    assert {"10 %", "50 %", "30 %", "20 %", "25 %", "90 %"} <= {t.get_text() for t in ax.texts}
    text = report.figure_text(fig)
    assert "seconds per epoch" in text and "overlapped with the backward pass counts as compute" in text
    assert "comm_total_s" in text and "Tesla T4" in text and "host node0" in text
    assert [t.get_text() for t in ax.get_yticklabels()][:2] == ["ddp2, rank 0 (node0)\n900 s per epoch",
                                                                  "ddp2, rank 1 (node1)\n900 s per epoch"]


def test_time_breakdown_of_an_older_kits_run_is_one_bar_of_data_and_compute(runs):
    fig = report.plot_time_breakdown(runs)
    bars = bar_widths(fig.axes[0])
    for bar in bars:   # fake_run's history: data 10 %, compute 90 % of each epoch
        assert [w / sum(bar) for w in bar] == pytest.approx([0.1, 0.9, 0.0, 0.0])
    assert [sum(bar) for bar in bars] == pytest.approx([900.0, 1800.0])
    assert "older kits measured no communication" in report.figure_text(fig)
    assert report.time_breakdown(report.load_run(runs[0]))[0]["comm_measured"] is False


def test_time_breakdown_of_seed_groups_is_their_mean_with_an_error_bar(tmp_path):
    import statistics
    times = [1800.0, 2000.0, 2300.0]
    dirs = [fake_run(tmp_path / f"ddp2-s{s}", 2, t, seed=s, shares=dict(data=0.1, compute=0.6, comm=0.2, idle=0.1))
            for s, t in enumerate(times)]
    fig = report.plot_time_breakdown(dirs)
    [ax] = fig.axes
    [bar] = bar_widths(ax)
    assert sum(bar) == pytest.approx(statistics.fmean(times) / 2)
    from matplotlib.container import ErrorbarContainer
    [errorbar] = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    (segments,) = errorbar.lines[2]
    (x0, _), (x1, _) = segments.get_segments()[0]
    assert (x1 - x0) / 2 == pytest.approx(statistics.stdev(t / 2 for t in times))


def sentence(tmp_path, name, baseline=None, **kw):
    kw = {"world_size": 1, "train_time_s": 3600.0, **kw}
    run = report.load_run(fake_run(tmp_path / name, **kw))
    return run, report.bottleneck_sentence(run, baseline)


def test_bottleneck_sentence_names_communication_for_a_comm_heavy_run_with_link_and_speedups(tmp_path):
    single, _ = sentence(tmp_path, "single", shares=dict(data=0.05, compute=0.9, comm=0.0, idle=0.05), gpu_util=93.0)
    ddp2, text = sentence(tmp_path, "ddp2", single, world_size=2, train_time_s=3000.0, link_gbit_s=0.9,
                          predicted_speedup=1.25, gpu_util=48.4,
                          shares=dict(data=0.05, compute=0.3, comm=0.61, idle=0.04))
    measured = table_rows(report.results_table([tmp_path / "single", tmp_path / "ddp2"]))["ddp2"][10]   # "1.20x"
    assert text.startswith("ddp2: communication 61 % of the step (the link measured 0.9 Gbit/s; "
                           f"predicted speed-up 1.25x, measured {measured}")
    assert text.endswith("; GPU use 48 % mean.")
    assert report.bottleneck_sentence(single, single) == "single: compute-bound: 90 % compute; GPU use 93 % mean."


def test_bottleneck_sentence_names_data_loading_for_a_data_heavy_run_and_says_no_gpu(tmp_path):
    _, text = sentence(tmp_path, "single", shares=dict(data=0.48, compute=0.5, comm=0.0, idle=0.02), gpu_util="no GPU")
    assert text == "single: data loading 48 % of the step: raise --workers (now 2) or use --loader memory; no GPU."


def test_bottleneck_sentence_of_an_older_kits_run_says_communication_was_not_measured(runs):
    ddp2, single = map(report.load_run, runs)
    text = report.bottleneck_sentence(ddp2, single)
    assert text.startswith("ddp2: compute-bound: 90 % compute (measured speed-up 2.00x; communication not measured")
    assert "GPU" not in text   # older kits did not record GPU use: nothing said rather than a guess


# -- seeds ---------------------------------------------------------------------------------------
def test_runs_that_differ_only_in_seed_and_launch_details_form_a_group(tmp_path):
    dirs = [fake_run(tmp_path / f"ddp2-s{s}", 2, 1800.0, seed=s) for s in range(3)]
    dirs.append(fake_run(tmp_path / "single", 1, 3600.0))
    dirs.append(fake_run(tmp_path / "ddp2-bigger", 2, 1800.0, batch_size=128))
    settings = json.loads((dirs[1] / "settings.json").read_text())
    settings.update(master_port=29999, workers=8, threads=3, master_addr="10.0.0.9", wandb="offline")
    (dirs[1] / "settings.json").write_text(json.dumps(settings))
    groups = report.group_runs([report.load_run(d) for d in dirs])
    assert [[run["name"] for run in group] for group in groups] == [["ddp2-s0", "ddp2-s1", "ddp2-s2"], ["single"],
                                                                     ["ddp2-bigger"]]
    assert [[run["name"] for run in group] for group in report.group_runs(dirs)] == [[r["name"] for r in g]
                                                                                      for g in groups]


def test_seed_table_gives_mean_and_sample_std_of_each_group(tmp_path):
    import statistics
    times, accs, losses, gpus = [1800.0, 1900.0, 2150.0], [50.0, 51.5, 54.0], [1.40, 1.45, 1.60], [80.0, 84.0, 90.0]
    dirs = [fake_run(tmp_path / f"ddp2-s{s}", 2, t, seed=s, acc1=a, loss=l, gpu_util=g,
                     shares=dict(data=0.1, compute=0.8, comm=0.05, idle=0.05))
            for s, (t, a, l, g) in enumerate(zip(times, accs, losses, gpus))]
    dirs += [fake_run(tmp_path / f"single-s{s}", 1, t, seed=s, gpu_util="no GPU",
                      shares=dict(data=0.1, compute=0.9, comm=0.0, idle=0.0)) for s, t in enumerate((3500.0, 3700.0))]
    md = report.write_report(dirs, tmp_path / "out")[-1].read_text()
    assert "## Seeds: mean ± std" in md
    table = report.seed_table(dirs)
    assert table in md
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    rows = {cells[0]: dict(zip(header, cells)) for cells in table_rows(table).values()}
    ddp, single = rows["ddp2-s0, ddp2-s1, ddp2-s2"], rows["single-s0, single-s1"]
    assert ddp["seeds"] == "0, 1, 2" and single["seeds"] == "0, 1"

    def pm(values, fmt):
        return f"{fmt(statistics.fmean(values))} ± {fmt(statistics.stdev(values))}"
    assert ddp["Acc@1"] == pm(accs, lambda v: f"{v:.2f}")
    assert ddp["test loss"] == pm(losses, lambda v: f"{v:.3f}")
    assert ddp["GPU util"] == pm(gpus, lambda v: f"{v:.0f}") + " %" and single["GPU util"] == "no GPU"
    walls = [t + 10.0 for t in times]
    assert ddp["wall time"] == f"{report.format_duration(statistics.fmean(walls))} ± {statistics.stdev(walls):.0f} s"
    epoch = [t / 2 for t in times]   # 2 epochs
    assert ddp["epoch time"] == pm(epoch, lambda v: f"{v:.0f}") + " s"
    images = 900_000 * 2
    assert ddp["img/s"] == pm([images / t for t in times], lambda v: f"{v:.0f}")
    steps = 2 * (900_000 // 128)
    assert ddp["batch time"] == pm([1000 * t / steps for t in times], lambda v: f"{v:.0f}") + " ms"   # ~0.14 s
    base = statistics.fmean([3500.0 / 2, 3700.0 / 2])   # the baseline group's mean time per epoch
    assert ddp["speed-up"] == pm([base / e for e in epoch], lambda v: f"{v:.2f}") + "x"
    mean, std = report.mean_std(accs)
    assert (mean, std) == (pytest.approx(statistics.fmean(accs)), pytest.approx(statistics.stdev(accs)))


def test_seed_groups_draw_a_mean_curve_with_a_shaded_band_and_error_bars_on_throughput(tmp_path):
    import statistics
    dirs = [fake_run(tmp_path / f"ddp2-s{s}", 2, 1800.0 + 200 * s, seed=s) for s in range(3)]
    shifts = [0.0, 2.0, 7.0]
    for d, shift in zip(dirs, shifts):   # the seeds' val accuracy differs
        results = json.loads((d / "results.json").read_text())
        for h in results["history"]:
            h["val"]["acc1"] += shift
        (d / "results.json").write_text(json.dumps(results))
    fig = report.plot_curves(dirs)
    acc_ax = fig.axes[1]
    val = next(line for line in acc_ax.lines if line.get_label().endswith(" val"))
    assert list(val.get_ydata()) == pytest.approx([35.0 + statistics.fmean(shifts), 45.0 + statistics.fmean(shifts)])
    assert "seeds 0, 1, 2" in val.get_label() and len(acc_ax.collections) == 2   # train and val bands
    band = acc_ax.collections[1].get_paths()[0].vertices[:, 1]
    assert min(band) == pytest.approx(35.0) and max(band) == pytest.approx(45.0 + 7.0)
    assert "seeds: mean line, min-max shaded" in [t.get_text() for t in fig.findobj(Legend)[0].get_texts()]

    ips_ax, speed_ax = report.plot_throughput(dirs).axes
    rates = [1_800_000 / (1800.0 + 200 * s) for s in range(3)]
    assert ips_ax.containers[0][0].get_height() == pytest.approx(statistics.fmean(rates))
    errorbar = ips_ax.containers[1]
    (_, y0), (_, y1) = errorbar.lines[2][0].get_segments()[0]
    assert (y1 - y0) / 2 == pytest.approx(statistics.stdev(rates))


# -- single vs DataParallel vs DDP ---------------------------------------------------------------
def mode_runs(tmp_path):
    """Seeds of three modes, given in mixed order: DDP 3 seeds, single 2, DataParallel 1."""
    shares = dict(data=0.1, compute=0.8, comm=0.05, idle=0.05)
    return ([fake_run(tmp_path / "ddp2-s0", 2, 1900.0, acc1=60.0, seed=0, shares=shares, gpu_util=85.0)]
            + [fake_run(tmp_path / f"single-s{s}", 1, t, acc1=a, seed=s, shares=shares, gpu_util=97.0)
               for s, t, a in ((0, 3500.0, 61.0), (1, 3700.0, 62.0))]
            + [fake_run(tmp_path / "dp-s0", 1, 2600.0, acc1=59.0, seed=0, parallel="dp", shares=shares, gpu_util=70.0)]
            + [fake_run(tmp_path / f"ddp2-s{s}", 2, t, acc1=a, seed=s, shares=shares, gpu_util=85.0)
               for s, t, a in ((1, 2000.0, 61.0), (2, 2100.0, 63.5))])


def test_compare_table_has_one_row_per_parallel_mode_averaged_over_seeds(tmp_path):
    import statistics
    dirs = mode_runs(tmp_path)
    table = report.compare_table(dirs)
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert header == ["method", "ranks/GPUs", "seeds", "wall time", "epoch time", "batch time", "img/s",
                      "GPU util", "test loss", "Acc@1", "Acc@5", "speed-up"]
    rows = {name: dict(zip(header, cells)) for name, cells in table_rows(table).items()}
    assert list(rows) == ["single", "DataParallel", "DDP"]
    assert [rows[m]["seeds"] for m in rows] == ["0, 1", "0", "0, 1, 2"]
    assert rows["DDP"]["ranks/GPUs"] == "2 / 2" and rows["single"]["ranks/GPUs"] == "1 / 1"
    ddp_acc = [60.0, 61.0, 63.5]
    assert rows["DDP"]["Acc@1"] == f"{statistics.fmean(ddp_acc):.2f} ± {statistics.stdev(ddp_acc):.2f}"
    assert rows["DataParallel"]["Acc@1"] == "59.00" and rows["DataParallel"]["GPU util"] == "70 %"
    base = statistics.fmean([3500.0 / 2, 3700.0 / 2])
    speedups = [base / (t / 2) for t in (1900.0, 2000.0, 2100.0)]
    assert rows["DDP"]["speed-up"] == f"{statistics.fmean(speedups):.2f} ± {statistics.stdev(speedups):.2f}x"
    assert rows["DataParallel"]["speed-up"] == f"{base / 1300.0:.2f}x"
    assert "single row (1 rank)" in table


def test_runs_without_a_parallel_key_are_ddp_with_several_ranks_else_single(runs):
    assert [report.parallel_mode(report.load_run(d)) for d in runs] == ["ddp", "none"]
    assert list(table_rows(report.compare_table(runs))) == ["single", "DDP"]


def test_compare_command_prints_the_table_and_the_report_includes_it_when_modes_differ(tmp_path, capsys):
    dirs = mode_runs(tmp_path)
    assert cli.main(["compare", *map(str, dirs)]) == 0
    assert capsys.readouterr().out.strip() == report.compare_table(dirs).strip()
    md = report.write_report(dirs, tmp_path / "out")[-1].read_text()
    assert "## Single vs DataParallel vs DDP" in md and report.compare_table(dirs) in md
    ddp_only = report.write_report(dirs[-2:], tmp_path / "out2")[-1].read_text()
    assert "DataParallel" not in ddp_only


def test_compare_on_a_non_run_folder_exits_2_naming_it(tmp_path, capsys):
    assert cli.main(["compare", str(tmp_path)]) == 2
    assert f"error: {tmp_path} is not a run folder" in capsys.readouterr().err


# -- curves against images seen ------------------------------------------------------------------
def test_curves_put_a_two_rank_and_a_one_rank_runs_points_at_the_same_images_seen(tmp_path):
    dirs = [fake_run(tmp_path / "ddp2", 2, 1800.0, images_per_epoch=12_800, tensorboard=True),
            fake_run(tmp_path / "single", 1, 3600.0, images_per_epoch=12_800, tensorboard=True)]
    fig = report.plot_curves(dirs)
    loss_ax, acc_ax, lr_ax = fig.axes
    assert [ax.get_xlabel() for ax in fig.axes] == ["images seen (thousands)"] * 3
    ddp_train, ddp_val, single_train, single_val = loss_ax.lines
    # TensorBoard training points: step x global batch; 2 ranks take half the steps for the same images
    assert list(ddp_train.get_xdata()) == pytest.approx([s * 128 / 1e3 for s in range(1, 201)])
    assert list(single_train.get_xdata()) == pytest.approx([s * 64 / 1e3 for s in range(1, 401)])
    assert set(ddp_train.get_xdata()) <= set(single_train.get_xdata())
    assert list(ddp_val.get_xdata()) == list(single_val.get_xdata()) == pytest.approx([12.8, 25.6])
    ddp_lr, single_lr = lr_ax.lines
    assert len(ddp_lr.get_xdata()) == 200 and len(single_lr.get_xdata()) == 400   # lr at every step
    assert ddp_lr.get_xdata()[-1] == single_lr.get_xdata()[-1] == pytest.approx(25.6)
    assert list(ddp_lr.get_ydata()[:1]) == pytest.approx([0.1 * (1 - 1 / 200)])
    text = report.figure_text(fig)
    assert "learning rate" in text and "lr" in text and "Acc@1 (%)" in text and "Tesla T4" in text


def test_curves_without_tensorboard_place_each_epoch_at_the_images_trained_so_far(runs):
    fig = report.plot_curves(runs)
    loss_ax = fig.axes[0]
    assert [list(line.get_xdata()) for line in loss_ax.lines] == [[0.9, 1.8]] * 4   # millions, both runs
    assert loss_ax.get_xlabel() == "images seen (millions)"
    assert "no learning rate recorded" in [t.get_text() for t in fig.axes[2].texts][0]   # older kits: no lr


@pytest.mark.slow
def test_curves_of_a_real_run_use_its_tensorboard_steps_and_lr(real_run):
    run = report.load_run(real_run)
    curves = report.image_curves(run)
    assert curves["Loss/train"][0] == [8, 16, 24, 32]   # every step (log_every 1), batch 8
    assert curves["Loss/val"][0] == [16, 32]             # end of each epoch: 2 steps of 8 images
    images, lrs = report.lr_curve(run)
    assert len(images) == len(lrs) >= 4 and all(lr > 0 for lr in lrs)   # lr at every step (or log point)
    assert images == sorted(images) and all(x % 8 == 0 for x in images) and 24 <= images[-1] <= 32
    rows = report.time_breakdown(run)   # the per-rank split, whichever place this kit version keeps it
    assert len(rows) == 1 and rows[0]["total_s"] == pytest.approx(run["train_time_s"] / 2, rel=0.05)


# -- a whole report from older kits' runs, and results.md's new parts -----------------------------
def test_older_kits_results_still_make_a_full_report(runs, tmp_path):
    paths = report.write_report(runs, tmp_path / "out")
    assert [p.name for p in paths] == list(report.REPORT_FILES)
    md = paths[-1].read_text()
    assert "## What bound each run" in md and "- single: compute-bound: 90 % compute." in md
    assert "![where the training time went, per rank](time.png)" in md
    assert "## Seeds" not in md   # no group with several runs
    assert "lr 0.2 at a batch of 256 scaled linearly to 0.1" in md   # ddp2: global batch 128


def test_results_md_says_what_bound_each_run_under_the_table(tmp_path):
    dirs = [fake_run(tmp_path / "single", 1, 3600.0, shares=dict(data=0.48, compute=0.5, comm=0.0, idle=0.02)),
            fake_run(tmp_path / "ddp2", 2, 3000.0, link_gbit_s=0.9, predicted_speedup=1.2,
                     shares=dict(data=0.05, compute=0.3, comm=0.61, idle=0.04), gpu_util=87.0)]
    md = report.write_report(dirs, tmp_path / "out")[-1].read_text()
    table_end, bound = md.index("| ddp2 |"), md.index("## What bound each run")
    assert table_end < bound
    assert "- single: data loading 48 % of the step" in md
    assert "- ddp2: communication 61 % of the step (the link measured 0.9 Gbit/s; predicted speed-up 1.20x, " \
           "measured 1.20x" in md and "GPU use 87 % mean" in md


# -- DataParallel: each GPU's figures; the GPUs a job used ---------------------------------------
def with_results(folder, **keys):
    """A fake run's results.json with ``keys`` added (what a newer kit writes)."""
    path = folder / "results.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **keys}, indent=2, sort_keys=True) + "\n")
    return folder


def test_report_shows_each_gpu_of_a_dataparallel_run_and_nothing_more_for_others(tmp_path):
    """Lab 4's "is GPU 0 busier and fuller than GPU 1?" is answered in results.md, from results.json."""
    shares = dict(data=0.1, compute=0.8, comm=0.0, idle=0.1)
    single = fake_run(tmp_path / "single", 1, 3600.0, shares=shares, gpu_util=90.0)
    dp = with_results(fake_run(tmp_path / "dp", 1, 2600.0, parallel="dp", shares=shares, gpu_util=76.5),
                      gpus=2, job_gpus=2, gpu_util_per_device=[92.0, 61.0], gpu_mem_peak_mb_per_device=[6100.0, 4200.0],
                      torch_mem_peak_mb_per_device=[4800.0, 2900.0])
    line = "per GPU (DataParallel): cuda:0 92 %, 6100 MB; cuda:1 61 %, 4200 MB"
    assert report.bottleneck_sentence(report.load_run(dp)).endswith(f"; GPU use 76 % mean; {line}.")
    assert "per GPU" not in report.bottleneck_sentence(report.load_run(single))
    md = report.report_markdown([single, dp])
    assert md.count(line) == 1 and f"- dp: " in md
    assert table_rows(report.compare_table([single, dp]))["DataParallel"][1] == "1 / 2"
    rows = table_rows(report.results_table([single, dp]))
    assert (rows["single"][2], rows["dp"][2]) == ("one process", "DataParallel")   # both one process; DP says so


def test_compare_counts_a_gpu_that_two_ddp_ranks_shared_once(tmp_path):
    """Lab 4 on a one-GPU node: DDP's two ranks share the GPU (gloo); the row says 2 ranks on 1 GPU. Runs of
    kits that wrote only the per-process ``gpus`` count one GPU per rank."""
    shared = with_results(fake_run(tmp_path / "ddp-shared", 2, 1900.0, shares=dict(data=0.1, compute=0.8, comm=0.05,
                                                                                    idle=0.05)), gpus=1, job_gpus=1)
    assert table_rows(report.compare_table([shared]))["DDP"][1] == "2 / 1"
    older = with_results(fake_run(tmp_path / "ddp-older", 2, 1900.0, shares=dict(data=0.1, compute=0.8, comm=0.05,
                                                                                 idle=0.05)), gpus=1)
    assert table_rows(report.compare_table([older]))["DDP"][1] == "2 / 2"


def test_report_prints_the_checks_all_reduce_sweep_beside_the_runs_link_probe(tmp_path):
    """`check` saved a sweep under runs/check/ before training: results.md shows its largest payload's busbw and the
    smallest one's latency beside the run's own link probe; a 1-rank run gets no such line."""
    from ddp_utils.tools import sweep
    runs = tmp_path / "runs"
    ddp = fake_run(runs / "ddp2", 2, 100.0, link_gbit_s=7.5, shares={"data": 0.1, "compute": 0.8, "comm": 0.1, "idle": 0})
    single = fake_run(runs / "single", 1, 190.0)
    rows = [{"bytes": 4096, "seconds": 0.0002, "algbw_gbit_s": 0.16, "busbw_gbit_s": 0.16},
            {"bytes": 46758048, "seconds": 0.05, "algbw_gbit_s": 7.48, "busbw_gbit_s": 7.48}]
    sweep.save(runs / "check", Settings(world_size=2, master_addr="10.0.0.1"), "nccl", rows)
    sweep.save(runs / "check", Settings(world_size=4, master_addr="10.0.0.1"), "nccl", rows[:1])   # another size
    text = report.report_markdown([ddp, single])
    section = text.split("## The link between the ranks", 1)[1].split("##", 1)[0]
    assert "ddp2: the link probe before training measured 7.5 Gbit/s" in section, section
    assert "moved 46.8 MB in 50.0 ms, busbw 7.48 Gbit/s" in section and "4.1 KB: 0.20 ms, the latency" in section
    assert "single" not in section


def test_without_a_check_sweep_the_report_says_how_to_make_one(tmp_path):
    ddp = fake_run(tmp_path / "runs" / "ddp2", 2, 100.0)
    section = report.report_markdown([ddp]).split("## The link between the ranks", 1)[1]
    assert "no `check` sweep for this many ranks" in section and "python -m ddp_utils check" in section

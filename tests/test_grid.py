"""train --grid NAME=V1,V2 (and launch --grid): short runs that vary one DDP mechanism, gathered by `report` into one
table and grid.png (with a scaling-efficiency panel over world sizes)."""
from __future__ import annotations

import json

import pytest

from ddp_utils.job import grid_axes, grid_settings
from ddp_utils.settings import Settings
from ddp_utils.tools import cli, report
from ddp_utils.tools.report import grid
from tests.helpers.procs import base_env, describe, free_port, python, run_all
from tests.helpers.report_runs import fake_run


def test_grid_values_take_their_settings_types_and_every_combination_gets_its_own_folder():
    axes = grid_axes(["bucket_mb=1,25", "comm=none,fp16", "sync_bn=true,off"])
    assert axes == {"bucket_mb": [1.0, 25.0], "comm": ["none", "fp16"], "sync_bn": [True, False]}
    runs = grid_settings(Settings(run_dir="runs/g"), axes)
    assert len(runs) == 8 and runs[0].run_dir == "runs/g-bucket_mb1-commnone-sync_bnTrue"
    assert [(r.bucket_mb, r.comm, r.sync_bn) for r in runs[:2]] == [(1.0, "none", True), (1.0, "none", False)]
    assert len({r.run_dir for r in runs}) == 8


def test_a_recipe_setting_whose_default_is_none_is_still_parsed_as_its_number():
    """Issue 55, item 5: --grid lr=0.1,0.2 or epochs=2,4 parsed as text (their defaults are None, the preset's recipe),
    and every run then stopped on 'must be a number'."""
    axes = grid_axes(["lr=0.1,0.2", "epochs=2,4", "optimizer=sgd,adamw"])
    assert axes == {"lr": [0.1, 0.2], "epochs": [2, 4], "optimizer": ["sgd", "adamw"]}
    assert [(r.lr, r.epochs) for r in grid_settings(Settings(run_dir="runs/g"), axes)][:2] == [(0.1, 2), (0.1, 2)]
    with pytest.raises(ValueError, match="epochs takes int values"):
        grid_axes(["epochs=2.5"])


@pytest.mark.parametrize("bad,said", [("rank=0,1", "cannot vary within one job"), ("seed=1,2", "--seeds"),
                                      ("nope=1", "NAME a train setting"), ("bucket_mb=big", "takes float values"),
                                      ("sync_bn=maybe", "takes bool values"), ("bucket_mb=", "NAME=V1,V2")])
def test_a_grid_that_cannot_run_is_refused_with_what_to_write(bad, said):
    with pytest.raises(ValueError, match="--grid") as err:
        grid_axes([bad])
    assert said in str(err.value)


def test_a_combination_the_settings_refuse_stops_the_grid_before_any_run():
    with pytest.raises(ValueError, match="static_graph"):
        grid_settings(Settings(static_graph=True), grid_axes(["accumulate=1,2"]))


def test_grid_with_seeds_or_resume_is_refused_on_the_command_line(capsys):
    code = cli.main(["train", "--dataset", "demo", "--grid", "bucket_mb=1,25", "--seeds", "1,2"])
    assert code == 2 and "--grid starts new runs" in capsys.readouterr().err


def _varied(folder, **settings):
    path = folder / "settings.json"
    data = json.loads(path.read_text())
    data.update(settings)
    path.write_text(json.dumps(data))
    return folder


def test_report_tables_the_varied_setting_with_each_runs_step_split_and_draws_grid_png(tmp_path):
    shares = {"data": 0.1, "compute": 0.6, "comm": 0.25, "idle": 0.05}
    runs = [_varied(fake_run(tmp_path / f"b{mb}", 2, t, shares=shares), bucket_mb=mb)
            for mb, t in ((1.0, 120.0), (25.0, 100.0))]
    table = grid.grid_table(runs)
    head, _, first, second = table.splitlines()[:4]
    assert head.startswith("| run | bucket_mb | img/s |") and "comm (ms)" in head
    assert first.startswith("| b1.0 | 1 |") and second.startswith("| b25.0 | 25 |")
    paths = report.write_report(runs, out_dir=tmp_path / "rep")
    assert (tmp_path / "rep" / "grid.png") in paths
    assert "## What changed when a setting changed" in (tmp_path / "rep" / "results.md").read_text()
    fig_text = report.figure_text(grid.plot_grid(runs))
    assert "What changed when bucket_mb changed" in fig_text and "ms per training step" in fig_text


def test_runs_over_three_world_sizes_get_the_scaling_efficiency(tmp_path):
    runs = [fake_run(tmp_path / f"ws{n}", n, t, images_per_epoch=90_000) for n, t in ((1, 400.0), (2, 220.0),
                                                                                       (4, 125.0))]
    eff = grid.efficiencies([report.load_run(r) for r in runs])
    assert eff[1] == pytest.approx(100) and eff[2] == pytest.approx(100 * 400 / 220 / 2)
    assert "Scaling efficiency (images/s per rank against 1 rank): 1 ranks 100 %, 2 ranks 91 %, 4 ranks 80 %" \
        in grid.grid_table(runs)
    assert "scaling efficiency" in report.figure_text(grid.plot_grid(runs))


def test_the_homeworks_ddp_and_single_pair_is_no_grid(tmp_path):
    runs = [fake_run(tmp_path / "ddp2", 2, 100.0), fake_run(tmp_path / "single", 1, 190.0)]
    assert not grid.is_grid([report.load_run(r) for r in runs])
    assert "grid.png" not in [p.name for p in report.write_report(runs, out_dir=tmp_path / "rep")]


@pytest.mark.slow
def test_a_grid_run_on_two_ranks_makes_one_table_and_one_plot(tmp_path):
    port = free_port()
    argv = [python("-m", "ddp_utils", "train", "--dataset", "demo", "--workers", "0", "--wandb", "disabled",
                   "--max-steps-per-epoch", "3", "--epochs", "1", "--no-link-probe", "--backend", "gloo",
                   "--master-port", str(port), "--world-size", "2", "--rank", str(r), "--run-dir", str(tmp_path / "g"),
                   "--grid", "bucket_mb=0.05,25") for r in (0, 1)]
    results = run_all(argv, timeout=240, env=base_env(), stagger=1.0)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    assert "=== grid run 2 of 2: bucket_mb=25.0:" in results[0].output
    runs = sorted(tmp_path.glob("g-bucket_mb*"))
    assert [p.name for p in runs] == ["g-bucket_mb0.05", "g-bucket_mb25"]
    paths = report.write_report(runs, out_dir=tmp_path / "rep")
    assert (tmp_path / "rep" / "grid.png") in paths
    rows = [line for line in grid.grid_table(runs).splitlines() if line.startswith("| g-")]
    assert [row.split(" | ")[1] for row in rows] == ["0.05", "25"]

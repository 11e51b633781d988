"""Issue 46, part 4: the feed check. In a run's first steps the kit compares the images/s its loader delivers with
what the step alone trains; a loader-bound GPU run gets a paragraph with what to do, and results.json keeps the
figures (``feed``). On a CPU the step's own time is the host's clock and the paragraph is said only where
``feed.says`` answers as a GPU run's rank 0 does (emulated here); ``test_gpu.py`` keeps the real one."""
from __future__ import annotations

import time

import pytest
import torch

from ddp_utils.settings import Settings
from ddp_utils.speed import feed


def test_the_verdict_names_the_loader_only_when_it_starved_the_step_and_the_wait_is_where_the_time_went():
    starved = feed.verdict(delivered=300.0, alone=900.0, waited=0.6)
    assert starved["bound"] == "loader" and starved["fed"] == pytest.approx(1 / 3)
    assert feed.verdict(delivered=880.0, alone=900.0, waited=0.02)["bound"] == "compute"     # fed: 98 %
    assert feed.verdict(delivered=700.0, alone=900.0, waited=0.03)["bound"] == "compute"     # slow, not waiting
    assert feed.verdict(delivered=1000.0, alone=900.0, waited=0.0)["fed"] == 1.0              # timer noise: capped


def test_the_paragraph_gives_the_figures_and_three_ways_to_feed_the_gpu_in_short_lines():
    result = {**feed.verdict(312.0, 880.0, 0.61), "steps": 20}
    text = feed.describe(result, workers=2, cpus=8)
    assert "delivered 312 img/s" in text and "trains 880 img/s" in text and "61 %" in text
    assert "resized once, on the local disk" in text and "now 2; this node has 8 CPUs" in text and "--loader dali" in text
    assert all(len(line) < 100 for line in text.splitlines())   # a notebook wraps longer lines mid-word


def test_the_pages_illustration_is_the_kits_paragraph():
    from tests.helpers.procs import REPO
    from pathlib import Path
    page = (Path(REPO) / "docs" / "time-split.md").read_text(encoding="utf-8")
    shown = page.split("<!-- illustrative: GPU node (a T4 fed by two workers) -->\n```text\n", 1)[1].split("\n```", 1)[0]
    assert shown == feed.describe({**feed.verdict(312.0, 880.0, 0.61), "steps": 20}, workers=2, cpus=8)


def run(tmp_path, monkeypatch, per_image_s: float, loader: str) -> tuple[dict, str]:
    """One epoch of 30 steps on the demo data, the GPU's answer emulated: the feed check's paragraph is said."""
    from ddp_utils import datasets
    from ddp_utils.job import prepare
    from ddp_utils.train import fit
    monkeypatch.setattr(feed, "says", lambda ctx: ctx.is_main)
    if per_image_s:
        original = datasets.ImageFolderDataset.__getitem__

        def slow(self, index):   # a loader that decodes too slowly for the step: a T4 fed by two workers
            time.sleep(per_image_s)
            return original(self, index)
        monkeypatch.setattr(datasets.ImageFolderDataset, "__getitem__", slow)
    said = []
    settings = Settings(dataset="demo", loader=loader, workers=0, epochs=1, batch_size=16, max_steps_per_epoch=30,
                        wandb="disabled", progress="off", run_dir=str(tmp_path / "run"), link_probe=False, threads=1)
    with prepare(settings, log=said.append) as job:
        monkeypatch.setattr(job.logger, "info", lambda text, *a, **k: said.append(text))
        results = fit(job)
    return results, "\n".join(map(str, said))


@pytest.mark.slow
def test_a_loader_bound_run_says_so_and_keeps_the_figures(tmp_path, monkeypatch):
    results, said = run(tmp_path, monkeypatch, per_image_s=0.01, loader="workers")
    f = results["feed"]
    assert f["bound"] == "loader" and f["steps"] == feed.STEPS and f["after_batches"] == 1, f
    assert f["wait_share"] > 0.5 and f["delivered_img_s"] < feed.FED * f["step_alone_img_s"], f
    assert "feed check: the data loader bounds this run" in said
    assert f"delivered {f['delivered_img_s']:.0f} img/s" in said


@pytest.mark.slow
def test_a_compute_bound_run_keeps_the_figures_and_says_nothing(tmp_path, monkeypatch):
    results, said = run(tmp_path, monkeypatch, per_image_s=0.0, loader="memory")
    f = results["feed"]
    assert f["bound"] == "compute" and f["wait_share"] < feed.WAITED and f["device"] == "cpu", f
    assert "feed check" not in said


def test_the_batches_made_ahead_are_not_timed():
    """A DataLoader's workers make two batches each before the first step: those come without a wait."""
    assert feed.FeedCheck(workers=6).after == 13 and feed.FeedCheck(workers=0).after == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_step_alone_is_timed_by_cuda_events(tmp_path):
    from tests.helpers.runs import train_on_gpu
    output, results = train_on_gpu(tmp_path, "--max-steps-per-epoch", "40", "--workers", "0")
    f = results["feed"]
    assert f["device"].startswith("cuda") and f["steps"] == feed.STEPS and f["step_alone_img_s"] > 0, f
    assert ("feed check: the data loader bounds this run" in output) == (f["bound"] == "loader")

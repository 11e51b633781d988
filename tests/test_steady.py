"""The loader benchmarks' steady window (benchmarks/steady.py) and the kit's own (TimeSplit's steady images/s):
a figure is timed after the batches the loader made ahead, so the prefetch does not pass for the loader's speed."""
from __future__ import annotations

import importlib.util
import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import steady  # noqa: E402  (benchmarks/steady.py)
from tests.helpers.runs import run_ranks  # noqa: E402

ITEM_S = 0.05   # each item takes this long in a worker: 2 workers make 40 items/s, whatever the CPU


class Slow(Dataset):
    """Items that take ITEM_S each, counting the ones made (a shared counter: the workers are forked)."""

    def __init__(self, n: int):
        self.n, self.made = n, multiprocessing.get_context("fork").Value("i", 0)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(ITEM_S)
        with self.made.get_lock():
            self.made.value += 1
        return torch.zeros(1), i


def prefilled(workers: int) -> tuple[iter, Slow]:
    """A loader's batches after its first one, once its workers have made every batch they make ahead (as during
    a long first training step)."""
    data = Slow(200)
    loader = DataLoader(data, batch_size=1, num_workers=workers, multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)
    deadline = time.monotonic() + 60
    while data.made.value < 1 + workers * steady.PREFETCH_FACTOR and time.monotonic() < deadline:
        time.sleep(0.01)
    return batches, data


@pytest.mark.parametrize("warm, flattered", [(steady.warm_batches(2) - 1, False), (0, True)])
def test_the_window_starts_after_the_prefetched_batches_so_it_measures_the_workers(warm, flattered):
    batches, _ = prefilled(2)
    window = steady.time_steady(batches, warm, 8)
    rate, workers_make = window["images"] / window["seconds"], 2 / ITEM_S
    assert window["steady_steps"] == 8 and window["images"] == 8 and window["steady_after_batches"] == warm
    # timed after the prefetched batches, no faster than the workers make them; timed from the first one, the
    # four made ahead come at once and the rate passes for about twice the workers'
    assert (rate > 1.4 * workers_make) is flattered, (rate, workers_make)


def test_a_window_longer_than_an_epoch_goes_on_into_the_next_epochs():
    class ThreeBatches:
        def __init__(self):
            self.epochs = []

        def epoch(self, e):
            self.epochs.append(e)
            for k in range(3):
                yield torch.zeros(4, 1), [e] * 4   # batches of 4 images

    loader, seen = ThreeBatches(), []
    window = steady.time_steady(steady.stream(loader, first_epoch=10), 2, 5, on_batch=lambda b: seen.append(b[1][0]))
    assert window["images"] == 20 and loader.epochs == [10, 11, 12]
    assert seen == [10, 11, 11, 11, 12]   # two of epoch 10 left out; every timed batch passed to on_batch


def test_warm_batches_are_the_ones_made_ahead_and_one_more():
    assert steady.warm_batches(0) == 1 and steady.warm_batches(15) == 31 and steady.warm_batches(3, 4) == 13


def test_a_kit_run_records_its_steady_images_per_second_after_the_batches_made_ahead(tmp_path):
    run_ranks(tmp_path, "one", 1, "--epochs", "1", "--max-steps-per-epoch", "8", "--batch-size", "8",
              "--workers", "1")
    epoch = json.loads((tmp_path / "one" / "results.json").read_text())["history"][0]["train"]
    assert epoch["steady_after_batches"] == 3 and epoch["steady_steps"] == 5   # 1 worker: 2 ahead and one more
    assert epoch["steady_images_per_s"] > 0


def bench(tmp_path, *argv, timeout=600) -> dict:
    """A benchmark's trial run at toy sizes (any tree: --allow-dirty), its JSON."""
    from tests.helpers.procs import REPO, base_env
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, *argv, "--out", str(out), "--allow-dirty"], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_imagenet_input_times_steady_windows_on_imagenet_like_files_against_the_kits_floor(tmp_path):
    r = bench(tmp_path, "benchmarks/imagenet_input.py", "--images", "48", "--batch-size", "4", "--steps", "3",
              "--rounds", "1", "--data-dir", str(tmp_path / "data"))
    assert r["steady_steps"] == 3 and r["steady_after_batches"] == steady.warm_batches(1)   # DALI's queue of 2
    files = r["figures"]["files"]
    assert files["files"] == 64 and 0.45 <= files["bytes_per_pixel"] <= 0.65   # ImageNet's 0.5-0.6
    per_core = r["figures"]["per_core"]
    assert {"decode only, originals", "crop-resize only", "kit workers", "kit workers, whole decode"} <= set(per_core)
    # the kit's whole-decode path against 1 / (decode + crop-resize), measured in the same round, and the region
    # decode's gain over it
    d, c, k = (per_core[n] for n in ("decode only, originals", "crop-resize only", "kit workers, whole decode"))
    assert r["figures"]["kit_of_floor"] == pytest.approx(k * (1 / d + 1 / c), rel=1e-6)
    assert r["figures"]["of_floor_mark"] == 0.85
    assert r["figures"]["region_gain"] == pytest.approx(per_core["kit workers"] / k, rel=1e-6)
    assert r["libraries"]["nvImageCodec"]
    # the resizes measured beside the kit's, each compared with it on the same crops: the kit's own is itself; the
    # kept one is the fastest within the tolerance (OpenCV's rows only where it is installed, and said so)
    diffs, tol = r["figures"]["resize_differences"], r["figures"]["resize_tolerance"]
    assert diffs["crop-resize only"] == {"mean_abs": 0.0, "share_over": 0.0, "max": 0, "within": True}
    opencv = importlib.util.find_spec("cv2") is not None
    assert ("crop-resize only, OpenCV bilinear" in diffs) == opencv == (r["libraries"]["OpenCV"] is not None)
    assert {"crop-resize only, Pillow", "crop-resize only, Pillow reduce"} <= set(diffs) <= set(per_core)
    for d in diffs.values():
        assert d["within"] == (d["share_over"] <= tol["share_over"] and d["mean_abs"] <= tol["mean_abs"])
    within = [n for n, d in diffs.items() if d["within"]]
    assert r["figures"]["resize_kept"] == max(within, key=lambda n: r["figures"]["vs_course"][n])
    if opencv:   # no antialiasing: shrinking a crop aliases, far from the kit's pixels
        assert not diffs["crop-resize only, OpenCV bilinear"]["within"]


@pytest.mark.slow
def test_data_loading_times_steady_windows_past_the_workers_batches_made_ahead(tmp_path):
    r = bench(tmp_path, "benchmarks/data_loading.py", "--rounds", "1", "--steps", "3", "--data-dir",
              str(tmp_path / "demo"))
    assert r["figures"]["warm"] == {"workers 0": 1, "workers 2": 5, "memory": 1}
    assert r["steady_after_batches"] == 5 and r["steady_steps"] == 3
    assert all(v[0] > 0 for v in r["figures"]["rounds"].values())

"""--build-ddp a|b|c (YOUR_DDP in the notebooks): the DDP written in lab/build_ddp trains in the kit's own loop, and the
epoch's time split shows what each part waits for."""
from __future__ import annotations

import json
import sys

import pytest
from torch import nn

from ddp_utils import own_ddp
from ddp_utils.model import unwrap
from ddp_utils.settings import Settings
from tests.helpers.procs import base_env, describe, free_port, run_all
from tests.helpers.notebook_cells import DDP, MAIN, NOTEBOOKS, WORKER


@pytest.mark.parametrize("changes", [{"comm": "fp16"}, {"accumulate": 2}])
def test_your_ddp_is_refused_with_what_it_lacks(changes):
    with pytest.raises(ValueError, match="no comm hooks, and the kit's loop times its finish_gradient_sync"):
        Settings(build_ddp="b", **changes)


@pytest.mark.parametrize("part", ["a", "f"])
def test_your_ddp_on_one_process_is_refused_before_the_run_opens(part):
    """Issue 55: `--build-ddp a` with one process trained plainly while settings.json said "a"."""
    import torch
    from ddp_utils.distributed import DistContext
    from ddp_utils.model import prepare_model
    one = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    with pytest.raises(ValueError, match=f"build_ddp='{part}' trains with your own DDP .* but this run is one process"):
        prepare_model(nn.Linear(2, 2), Settings(build_ddp=part), one, log=lambda *_: None)


def test_the_kit_finds_your_file_the_solution_or_a_named_file_from_build_ddp(monkeypatch):
    monkeypatch.delenv("BUILD_DDP", raising=False)
    assert own_ddp.which() == "student.py" and own_ddp.implementation().__name__ == "build_ddp_student"
    assert own_ddp.named("b") == "OverlapDDP (yours)"
    monkeypatch.setenv("BUILD_DDP", "reference")
    assert own_ddp.which() == "solution/reference.py" and hasattr(own_ddp.implementation(), "ShardedOptimizer")
    assert own_ddp.named("f") == "ShardedOptimizer (the kit's solution)"
    summed = own_ddp.LAB / "solution" / "mistakes" / "summed.py"   # a TA grading a handed-in file
    monkeypatch.setenv("BUILD_DDP", str(summed))
    assert own_ddp.which() == "solution/mistakes/summed.py" and own_ddp.named("a") == "allreduce_gradients (yours)"


def test_without_the_solution_build_ddp_reference_says_what_to_do(monkeypatch, tmp_path):
    """The handout and the Docker image leave the solution out: BUILD_DDP=reference then says so, not a traceback."""
    import shutil
    lab = tmp_path / "lab" / "build_ddp"
    shutil.copytree(own_ddp.LAB, lab, ignore=shutil.ignore_patterns("solution"))
    # the kit's own lab package, imported by other tests, out of the way of the copy's (put back after)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(own_ddp.LAB.parent)])
    monkeypatch.setattr(own_ddp, "LAB", lab)
    monkeypatch.setenv("BUILD_DDP", "reference")
    for name in [m for m in sys.modules if m == "build_ddp" or m.startswith("build_ddp.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(FileNotFoundError, match="the student handout and the Docker image leave it out"):
        own_ddp.implementation()


def test_without_the_lab_folder_the_kit_says_it_needs_a_checkout(monkeypatch, tmp_path):
    monkeypatch.setattr(own_ddp, "LAB", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="run from a checkout of the kit"):
        own_ddp.implementation()


def test_unwrap_sees_through_your_wrapper_whatever_its_class():
    class Yours(nn.Module):   # the lab's contract: .module and finish_gradient_sync()
        def __init__(self, module):
            super().__init__()
            self.module = module

        def finish_gradient_sync(self):
            pass
    net = nn.Linear(2, 2)
    assert unwrap(Yours(net)) is net and own_ddp.is_own(Yours(net)) and not own_ddp.is_own(net)


@pytest.mark.slow
def test_parts_a_and_c_train_the_demo_in_the_notebooks_alike_and_c_waits_less_for_communication(tmp_path):
    """The kit's reference solution in main.ipynb and worker.ipynb (BUILD_DDP=reference): (a) and (c) compute the same
    gradients, so the same loss; (a) all-reduces after the backward pass, so its step waits for all of it, (c)
    starts its buckets during the backward pass, so it waits for less (the page's claim, measured)."""
    out = {}
    for part in ("a", "c"):
        params = {**DDP, "MAX_STEPS": 25, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(), "YOUR_DDP": part,
                  "RUN_DIR": str(tmp_path / part)}
        results = run_all([[sys.executable, "-m", "tests.helpers.run_cells", str(nb), json.dumps(params), "{}", str(NOTEBOOKS)]
                           for nb in (MAIN, WORKER)], timeout=300, env=base_env(BUILD_DDP="reference"))
        assert all(r.returncode == 0 for r in results), describe(results)
        named = f"{own_ddp.CLASSES[part]} (the kit's solution)"   # what trained, on the parallel line and the epoch's
        assert f"{named} from lab/build_ddp/solution/reference.py, part {part}" in results[0].output, describe(results)
        assert f"s | {named}" in results[0].output, describe(results)
        out[part] = json.loads((tmp_path / part / "results.json").read_text())
        assert out[part]["algorithm"] == named
    assert out["a"]["loss"] == pytest.approx(out["c"]["loss"], rel=1e-4)   # the same training
    share = {part: r["comm_s"] / r["train_time_s"] for part, r in out.items()}
    assert share["a"] > share["c"] > 0, share

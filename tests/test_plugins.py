"""The small core and the options plugged into it (issue 54): a loader, a parallel mode, a gradient communication
and an observer are each one registration in one file; the observers' order is declared and checked when their
module is imported; the loop alone changes its state, applying what the observers ask for."""
from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ddp_utils import loaders, observers
from ddp_utils.distributed import DistContext
from ddp_utils.observers import Loop, Observers
from ddp_utils.optim import build_optimizer, build_scheduler
from ddp_utils.runlog import NullLogger
from ddp_utils.settings import Settings
from ddp_utils.train import train_one_epoch
from tests.helpers.procs import REPO


@pytest.fixture
def tables():
    """The tables as the kit filled them, put back (the same objects, which other modules hold) after the test:
    what a test registers does not outlive it."""
    saved = dict(loaders.LOADERS), dict(observers.REGISTERED), {n: set(i) for n, i in observers._INSIDE.items()}
    yield
    for table, content in zip((loaders.LOADERS, observers.REGISTERED, observers._INSIDE), saved):
        table.clear()
        table.update(content)


def import_file(path: Path, text: str):
    """Write ``text`` as the module ``path`` and import it, as a TA's own file would be."""
    path.write_text(textwrap.dedent(text))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_process_loop(settings: Settings, **chosen) -> Loop:
    """A Loop of one process on the fake data set (no process group): what a lab's loop is."""
    from ddp_utils.data import build_loaders
    from ddp_utils.model import build_model
    data = build_loaders(settings, 0, 1, "cpu")
    model = build_model(settings.arch, data.num_classes, seed=0)
    optimizer = build_optimizer(model, settings)
    scaler = chosen.pop("scaler", torch.amp.GradScaler("cpu", enabled=False))
    return Loop(model, data, optimizer, build_scheduler(optimizer, settings, len(data.train)), scaler, settings,
                DistContext(0, 1, 0, torch.device("cpu"), None), NullLogger(), **chosen)


FAKE = dict(dataset="fake", image_size=16, arch="convnet", batch_size=4, max_steps_per_epoch=3, workers=0,
            progress="off", wandb="disabled", link_probe=False)


# -- loaders ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_loader_added_by_one_registration_in_one_file_trains_a_step(tables, tmp_path):
    import_file(tmp_path / "tensor_loader.py", '''
        """A TA's loader: the fake data set's images made once, as tensors, in this process."""
        import torch
        from ddp_utils.loaders import EvalShardSampler, Loader, TrainLoader, register_loader, train_sampler

        class Tensors(TrainLoader):
            def __init__(self, images, labels, sampler, settings):
                super().__init__(sampler, settings.batch_size, rank=sampler.rank,
                                 max_steps=settings.max_steps_per_epoch)
                self.images, self.labels = images, labels

            def _batches(self, epoch):
                order = list(self.sampler)
                for step in range(len(self)):
                    idx = order[step * self.batch_size:(step + 1) * self.batch_size]
                    yield self.images[idx], self.labels[idx]

        def build(preset, settings, source):
            generator = torch.Generator().manual_seed(0)
            images = torch.randn(64, 3, source.image_size, source.image_size, generator=generator)
            labels = torch.randint(0, len(source.classes), (64,), generator=generator)
            train = Tensors(images, labels, train_sampler(64, source.rank, source.world_size, settings.seed),
                            settings)
            val = [(images[i:i + 8], labels[i:i + 8]) for i in EvalShardSampler(8, source.rank, source.world_size)]
            return source.data(train, val, (64, 64), preset)

        register_loader(Loader("tensors", "random tensors made once, in this process", build))
    ''')
    from ddp_utils.job import prepare
    from ddp_utils.train import fit
    settings = Settings(**{**FAKE, "epochs": 1, "loader": "tensors", "run_dir": str(tmp_path / "run")})
    with prepare(settings, log=lambda *_: None) as job:
        assert type(job.data.train).__name__ == "Tensors"
        results = fit(job)
    assert results["steps"] == 3 and results["epochs_run"] == 1
    assert "tensors" in Settings.__dataclass_fields__["loader"].metadata["choices"]()   # --loader offers it


@pytest.mark.slow   # it starts processes (pytest.ini's slow)
def test_a_misspelt_not_for_key_fails_when_ddp_utils_is_imported_naming_the_loaders(tmp_path):
    """A preset's ``not_for`` names loaders: a typo there made ``--loader auto`` load an 11 GB split into memory,
    silently. Here presets.py itself has the typo, in a copy of the package."""
    shutil.copytree(Path(REPO) / "ddp_utils", tmp_path / "ddp_utils", ignore=shutil.ignore_patterns("__pycache__"))
    presets = tmp_path / "ddp_utils" / "presets.py"
    text = presets.read_text()
    assert 'not_for={"memory": "ImageNet does not fit in memory' in text
    presets.write_text(text.replace('not_for={"memory": "ImageNet', 'not_for={"memroy": "ImageNet', 1))
    done = subprocess.run([sys.executable, "-c", "import ddp_utils"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert ("preset 'imagenet': not_for names 'memroy', which is no loader; the loaders are workers, memory, dali, "
            "nvjpeg") in done.stderr, done.stderr


def test_a_preset_added_later_with_a_misspelt_loader_is_refused_before_its_folders_are_read(monkeypatch):
    import dataclasses

    from ddp_utils.data import build_loaders
    from ddp_utils.presets import PRESETS
    monkeypatch.setitem(PRESETS, "fake2", dataclasses.replace(PRESETS["fake"], name="fake2", not_for={"dal": "x"}))
    with pytest.raises(ValueError, match="preset 'fake2': not_for names 'dal', which is no loader"):
        build_loaders(Settings(**{**FAKE, "dataset": "fake2"}), 0, 1, "cpu")


# -- observers -------------------------------------------------------------------------------------------------------
GRAD_NORM = '''
    """A TA's observer: the gradients' norm before each update, in one file, declared after Gradients."""
    import torch
    from ddp_utils.observers import Observer, register
    from ddp_utils.speed.comm import Gradients

    CALLS = []

    @register(after=(Gradients,))   # the gradients it reads are the ones Gradients finished
    class GradNorm(Observer):
        def before_step(self, loop):
            CALLS.append("GradNorm")

        def before_update(self, loop):
            CALLS.append(float(torch.cat([p.grad.flatten() for p in loop.model.parameters()]).norm()))
'''


def test_an_observer_added_in_one_file_and_declared_after_gradients_runs_after_it(tables, tmp_path, monkeypatch):
    from ddp_utils.speed.comm import Gradients
    grad_norm = import_file(tmp_path / "grad_norm.py", GRAD_NORM)
    monkeypatch.setattr(Gradients, "before_step", lambda self, loop: grad_norm.CALLS.append("Gradients"))
    names = list(observers.REGISTERED)
    assert names.index("GradNorm") > names.index("Gradients")
    loop = one_process_loop(Settings(**FAKE))
    train_one_epoch(loop, 0)
    order = [c for c in grad_norm.CALLS if isinstance(c, str)]
    assert order == ["Gradients", "GradNorm"] * 3, order   # each step: Gradients' hook first (an opening hook)
    assert len([c for c in grad_norm.CALLS if isinstance(c, float)]) == 3


def test_an_observer_sees_the_unscaled_gradients_before_the_update(tables, tmp_path):
    """Issue 54: ``before_update`` was handed fp16's scaled gradients (Lightning and Composer unscale first)."""
    grad_norm = import_file(tmp_path / "grad_norm.py", GRAD_NORM)
    norms = {}
    for scale in (None, 2.0 ** 12):
        grad_norm.CALLS.clear()
        torch.manual_seed(0)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, enabled=scale is not None)
        train_one_epoch(one_process_loop(Settings(**FAKE), scaler=scaler), 0)
        norms[scale] = [c for c in grad_norm.CALLS if isinstance(c, float)]
    assert norms[2.0 ** 12] == pytest.approx(norms[None], rel=1e-4)   # not 4096 times larger


def test_a_declaration_that_contradicts_another_is_refused_when_its_module_is_imported(tables, tmp_path):
    with pytest.raises(ValueError, match=r"observer declarations contradict each other: .*TimeSplit.*LogPoints"):
        import_file(tmp_path / "inside_out.py", '''
            from ddp_utils.concerns import LogPoints, TimeSplit
            from ddp_utils.observers import Observer, register

            @register(after=(LogPoints,), before=(TimeSplit,))   # LogPoints is inside TimeSplit
            class InsideOut(Observer):
                pass
        ''')
    assert "InsideOut" not in observers.REGISTERED   # refused whole: the table is as it was


def test_a_declaration_naming_an_unregistered_observer_is_refused_naming_the_registered_ones(tables, tmp_path):
    with pytest.raises(ValueError, match=r"observer Late: Helper is not a registered observer \(registered: Results, "):
        import_file(tmp_path / "late.py", '''
            from ddp_utils.observers import Observer, register

            class Helper(Observer):   # never registered
                pass

            @register(after=(Helper,))
            class Late(Observer):
                pass
        ''')


def test_the_run_s_observers_are_the_registered_ones_in_the_declared_order():
    """One list, from the table: each registered class that the run needs (the others' for_loop says None)."""
    loop = one_process_loop(Settings(**FAKE))
    made = [type(o).__name__ for o in loop.observers]
    assert made == [name for name in observers.REGISTERED if name in made]
    assert {"TimeSplit", "LogPoints", "Gradients", "Divergence"} <= set(made)
    assert "EarlyStop" not in made and "Profiling" not in made and "CompileTimeout" not in made   # features off
    assert "EarlyStop" in [type(o).__name__ for o in one_process_loop(Settings(**FAKE, patience=2)).observers]
    only = one_process_loop(Settings(**FAKE), only=("TimeSplit", "LogPoints"))
    assert [type(o).__name__ for o in only.observers] == ["TimeSplit", "LogPoints"]
    with pytest.raises(ValueError, match="no registered observer TimeSplits"):
        one_process_loop(Settings(**FAKE), only=("TimeSplits",))


def test_no_observer_assigns_to_the_loop():
    """Observers read the Loop; what they want changed comes back as an Ask, which train.py applies. Checked over
    the package's source: outside train.py (and the Loop's own __post_init__), nothing assigns to a loop's field,
    to an item of one, or calls a mutating method on one."""
    mutators = {"update", "append", "extend", "pop", "clear", "setdefault", "insert", "remove", "popitem"}
    found = []
    for path in sorted((Path(REPO) / "ddp_utils").rglob("*.py")):
        if path.name == "train.py" and path.parent.name == "ddp_utils":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutators:
                targets = [node.func.value]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and node.args:
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and getattr(part.value, "id", None) == "loop":
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not found, "\n".join(found)


def test_the_epoch_record_s_lr_is_the_one_its_last_step_used():
    """Issue 54: the record's lr was read after the epoch's last scheduler step, so every run's last epoch said lr
    0 (the cosine's end) though its last step trained at a positive lr."""
    loop = one_process_loop(Settings(**FAKE, epochs=1, warmup_epochs=0.0))
    stats = train_one_epoch(loop, 0)
    assert stats["lr"] == loop.lr > 0 and loop.scheduler.get_last_lr()[0] == 0.0


def test_the_loop_applies_what_the_observers_ask_in_its_own_lines():
    """An observer's word reaches the loop as a value: an Ask merged over every observer of a hook."""
    class Quiet(observers.Observer):
        def before_step(self, loop):
            return observers.Ask(no_sync=True)

    class Stop(observers.Observer):
        def epoch_end(self, loop, record):
            return observers.Ask(stop="enough", keep={"mine": 1})

    asked = Observers([Quiet(), Stop()])
    assert asked.before_step(None).no_sync and asked.epoch_end(None, {}).stop == "enough"
    assert asked.epoch_end(None, {}).keep == {"mine": 1} and not asked.after_step(None).no_sync

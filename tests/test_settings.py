"""The one settings object: validated, built from kwargs, the CLI and torchrun's environment, saved as JSON."""
from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from ddp_utils.settings import MUST_AGREE, Settings, add_arguments, from_args


def parse(*argv, environ=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(list(argv)), environ=environ or {})


def test_defaults_are_one_process_on_the_demo_data():
    s = Settings()
    assert (s.dataset, s.world_size, s.rank, s.backend) == ("demo", 1, 0, "auto")
    assert not s.distributed and s.url == "tcp://127.0.0.1:29500"


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().batch_size = 3


@pytest.mark.parametrize("kwargs, names", [
    ({"rank": 2, "world_size": 2}, ["rank=2", "0..1"]),
    ({"master_port": 70000}, ["master_port=70000"]),
    ({"dataset": "mnist"}, ["dataset='mnist'", "imagenet"]),
    ({"batch_size": 0}, ["batch_size=0"]),
    ({"master_addr": " "}, ["master_addr"]),
])
def test_inconsistent_settings_are_refused_naming_the_field(kwargs, names):
    with pytest.raises(ValueError) as err:
        Settings(**kwargs)
    for name in names:
        assert name in str(err.value)


def test_cli_flags_become_settings_and_booleans_can_be_switched_off():
    s = parse("--dataset", "cinic10", "--batch-size", "500", "--world-size", "2", "--rank", "1",
              "--no-scale-lr", "--master-addr", "10.0.0.1")
    assert (s.dataset, s.batch_size, s.world_size, s.rank, s.scale_lr) == ("cinic10", 500, 2, 1, False)
    assert s.url == "tcp://10.0.0.1:29500"


def test_torchrun_environment_sets_rank_world_size_and_the_env_init_method():
    env = {"MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "1234", "RANK": "3", "WORLD_SIZE": "4",
           "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "abc"}
    s = parse("--epochs", "5", environ=env)
    assert (s.master_addr, s.master_port, s.rank, s.world_size, s.local_rank) == ("10.1.1.1", 1234, 3, 4, 1)
    assert s.init_method == "env" and s.url == "env://" and s.epochs == 5


def test_explicit_flags_win_over_the_environment():
    assert parse("--rank", "0", environ={"RANK": "1", "WORLD_SIZE": "2"}).rank == 0


def test_a_malformed_environment_variable_is_named():
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        Settings.from_env({"WORLD_SIZE": "two"})


def test_json_round_trip_and_unknown_fields_are_refused():
    s = Settings(dataset="imagenet", batch_size=500, world_size=2, rank=1)
    assert Settings.from_dict(__import__("json").loads(s.to_json())) == s
    with pytest.raises(ValueError, match="bogus"):
        Settings.from_dict({**s.to_dict(), "bogus": 1})


def test_fields_that_must_agree_across_ranks_exist_and_exclude_the_rank():
    names = {f.name for f in dataclasses.fields(Settings)}
    assert set(MUST_AGREE) <= names and "rank" not in MUST_AGREE and "batch_size" in MUST_AGREE



def test_a_new_setting_is_one_declaration_its_bound_checked_and_compared_across_ranks():
    """Issue 54: MUST_AGREE and the bound lists were kept by hand beside 56 fields. A field's section, bound and
    whether the ranks must share it live in its own declaration; the checks read them from there."""
    from ddp_utils.settings import DATA, POSITIVE, _f

    @dataclasses.dataclass(frozen=True)
    class More(Settings):
        crops: int = _f(1, "crops per image", section=DATA, bound=POSITIVE, agree=True)

    with pytest.raises(ValueError, match="crops=0: must be positive"):
        More(crops=0)
    with pytest.raises(ValueError, match=re.escape("crops='2': must be a number")):
        More(crops="2")
    assert More(crops=3).agreed()["crops"] == 3 and "crops" not in Settings().agreed()
    assert Settings(batch_size=7).agreed()["batch_size"] == 7 and "rank" not in Settings().agreed()
    assert tuple(Settings().agreed()) == MUST_AGREE


def test_help_lists_each_flag_under_its_section():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    headings = [text.index(f"{name} settings:") for name in ("data", "model", "optimisation", "speed", "output",
                                                              "distributed")]
    assert headings == sorted(headings)
    listed = {flag: text.index(f"\n  {flag} ") for flag in ("--loader", "--batch-size", "--master-addr")}   # not usage
    assert headings[0] < listed["--loader"] < headings[1] and headings[2] < listed["--batch-size"] < headings[3]
    assert headings[5] < listed["--master-addr"]

# -- recipes: what the settings left out ------------------------------------------------------
def test_unset_training_fields_come_from_the_presets_recipe():
    from ddp_utils.presets import PRESETS
    for name, preset in PRESETS.items():
        s = Settings(dataset=name)
        assert (s.arch, s.batch_size, s.epochs, s.lr, s.warmup_epochs) == (
            preset.recipe.arch, preset.recipe.batch_size, preset.recipe.epochs, preset.recipe.lr,
            preset.recipe.warmup_epochs), name
    assert Settings(dataset="imagenet").arch == "resnet18" and Settings(dataset="cinic10").arch == "resnet18_cifar"


def test_a_given_value_wins_over_the_recipe_and_is_saved_resolved():
    s = Settings(dataset="imagenet", epochs=1, batch_size=500)
    assert (s.epochs, s.batch_size, s.lr) == (1, 500, 0.1)
    assert Settings.from_dict(s.to_dict()) == s
    assert None not in s.to_dict().values()


def test_every_recipe_lr_is_given_at_the_reference_batch_of_256():
    s = Settings(dataset="demo", world_size=2)
    assert s.lr_reference_batch == 256
    assert s.effective_lr == pytest.approx(s.lr * s.batch_size * 2 / 256)


# -- settings -> command line, in one place ---------------------------------------------------
def test_to_argv_parses_back_to_the_same_settings():
    s = Settings(dataset="cinic10", data_dir="/data/cinic 10", batch_size=100, lr=0.05, scale_lr=False,
                 channels_last=False, world_size=2, rank=1, master_addr="10.0.0.1", amp="fp16", threads=3)
    assert parse(*s.to_argv()) == s


def test_to_argv_gives_only_non_default_flags_but_always_the_recipe_and_can_skip_the_rank():
    argv = Settings(world_size=2, rank=1).to_argv(skip=("rank",))
    assert "--rank" not in argv and argv[argv.index("--world-size") + 1] == "2"
    for flag in ("--arch", "--epochs", "--batch-size", "--lr", "--warmup-epochs"):
        assert flag in argv, flag   # a recipe change later must not change what the command reproduces
    assert "--backend" not in argv   # still at its default
    assert "--no-channels-last" in Settings(channels_last=False).to_argv()


def test_no_other_module_builds_train_flags_by_hand():
    """One place turns settings into flags: a hand-written `"--batch-size", str(...)` list drifts."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[1]
    files = [*root.glob("ddp_utils/*.py"), *root.glob("benchmarks/*.py"), *root.glob("lab/*.ipynb"),
             *root.glob("notebooks/*.ipynb")]
    for path in files:
        if path.name == "settings.py":
            continue
        text = path.read_text()
        assert not re.search(r'"--(batch-size|epochs|lr|arch)",\s*\\?"?str\(', text), path.name


@pytest.mark.parametrize("typed", [{"max_steps_per_epoch": None}, {"epochs": "2"}, {"master_port": "29500"}])
def test_a_value_that_is_no_number_is_named_in_a_sentence_not_a_type_error(typed):
    # MAX_STEPS = None in the notebook's parameter cell ended in "TypeError: '<' not supported ..."
    [(name, value)] = typed.items()
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}: must be a number")):
        Settings(**typed)


@pytest.mark.parametrize("typed, said", [({"compile": "no"}, "compile='no': must be True or False"),
                                         ({"static_graph": 1}, "static_graph=1: must be True or False"),
                                         ({"data_dir": 3}, "data_dir=3: must be text (a name, or a path in quotes)"),
                                         ({"epochs": 2.5}, "epochs=2.5: must be a whole number")])
def test_each_setting_is_checked_for_its_type_with_a_sentence_naming_the_value(typed, said):
    """Issue 55, item 5: a truthy string was taken for True (COMPILE = "no" compiled), a number for a path."""
    with pytest.raises(ValueError, match=re.escape(said)):
        Settings(**typed)


def test_a_path_object_is_taken_as_its_text_and_a_whole_float_as_an_integer():
    import pathlib
    settings = Settings(data_dir=pathlib.Path("data") / "demo", epochs=3.0)
    assert settings.data_dir == "data/demo" and settings.epochs == 3 and isinstance(settings.epochs, int)

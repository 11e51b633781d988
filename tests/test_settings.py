"""The one settings object: validated, built from kwargs, the CLI and torchrun's environment, saved as JSON."""
from __future__ import annotations

import argparse
import dataclasses

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

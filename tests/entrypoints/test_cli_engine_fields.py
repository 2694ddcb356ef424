"""Every EngineConfig field is a command-line flag whose default is the config's (None standing
for "the config decides"), and a flag's value reaches the config."""

import argparse
import dataclasses

import pytest

from raypaged.config import EngineConfig
from raypaged.entrypoints.cli import add_engine_args, engine_kwargs
from raypaged.inputs.limits import InputLimits

# fields set from other flags: --served-model-name (per --model) and one flag per InputLimits field
ELSEWHERE = {"served_model_name", "limits"}
ACCEPTED = {f.name for f in dataclasses.fields(EngineConfig) if f.init}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_every_engine_field_is_a_flag_with_the_same_default():
    actions = {action.dest: action for action in parser()._actions}
    for f in dataclasses.fields(EngineConfig):
        if not f.init or f.name in ELSEWHERE:
            continue
        assert f.name in actions, f"EngineConfig.{f.name} has no flag"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert actions[f.name].default in (default, None), (f.name, actions[f.name].default, default)
    for f in dataclasses.fields(InputLimits):
        assert f.name in actions, f"InputLimits.{f.name} has no flag"


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--no-enable-recovery"], "enable_recovery", False),
        ([], "enable_recovery", True),
        (["--placement-strategy", "SPREAD"], "placement_strategy", "SPREAD"),
    ],
)
def test_flags_reach_the_config_fields(argv, field, value):
    kwargs = engine_kwargs(parser().parse_args(argv), ACCEPTED, None)
    assert kwargs[field] == value

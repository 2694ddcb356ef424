"""EngineConfig's fields are the one list of engine knobs: each init field is a command-line flag and an
``LLM`` keyword with the config's default, and a flag's value reaches its field."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
from pathlib import Path

import pytest

from raypaged import LLM
from raypaged.config import EngineConfig, cli_flag
from raypaged.entrypoints.cli import build_parser, engine_configs, engine_kwargs
from raypaged.entrypoints.llm import engine_keywords
from raypaged.entrypoints.switch import negative_forms
from raypaged.inputs.limits import InputLimits
from raypaged.spec_decode.config import SpeculativeConfig

INIT_FIELDS = [f for f in dataclasses.fields(EngineConfig) if f.init]
ACCEPTED = {f.name for f in INIT_FIELDS}
# flags whose default is None, "not given": the field keeps its own default (on; the default object)
NOT_GIVEN = {"enable_prefix_caching", "structured_outputs_config"}
BATCH_GENERATE = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "batch_generate.py"


def default_of(f: dataclasses.Field) -> object:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def subcommand(name: str) -> argparse.ArgumentParser:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


def actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser._actions}


@pytest.mark.parametrize("command", ["serve", "engine", "generate"])
def test_every_init_field_is_a_flag_with_the_config_default(command):
    actions = actions_by_dest(subcommand(command))
    for f in INIT_FIELDS:
        if f.name == "served_model_name" and command == "generate":
            continue  # one model, named by --model
        if f.name == "limits":  # one flag per InputLimits field
            for limit in dataclasses.fields(InputLimits):
                assert actions[limit.name].option_strings == ["--" + limit.name.replace("_", "-")]
                assert actions[limit.name].default == limit.default
            continue
        assert f.name in actions, f"EngineConfig.{f.name} has no flag in raypaged {command}"
        assert actions[f.name].option_strings[0] == "--" + f.name.replace("_", "-")
        expected = None if f.name in NOT_GIVEN else default_of(f)
        assert actions[f.name].default == expected, (f.name, actions[f.name].default, expected)


def test_field_flags_carry_the_fields_metadata():
    actions = actions_by_dest(subcommand("serve"))
    for f in INIT_FIELDS:
        meta = cli_flag(f)
        if meta is None:
            assert f.name in {"model", "served_model_name", "limits"}, f.name
            continue
        action = actions[f.name]
        names = ["--" + f.name.replace("_", "-"), *meta.aliases]  # a switch's negative forms after them
        negatives = [no for name in names if name.startswith("--") for no in negative_forms(name)]
        assert action.option_strings == names + (negatives if action.nargs == 0 else [])
        assert (action.type, action.metavar) == (meta.type, meta.metavar)
        assert action.choices == (None if meta.choices is None else list(meta.choices))
        assert action.help == meta.help
    assert actions["tensor_parallel_size"].option_strings == ["--tensor-parallel-size", "-tp"]
    assert actions["quantization"].option_strings == ["--quantization", "-q"]
    assert actions["enable_recovery"].option_strings == [
        "--enable-recovery",
        "--disable-recovery",
        "--no-enable-recovery",
    ]
    assert actions["gpu_memory_utilization"].option_strings == [
        "--gpu-memory-utilization",
        "--device-memory-utilization",
    ]


def test_every_init_field_is_an_llm_keyword_with_the_config_default():
    keywords = inspect.signature(LLM).parameters
    assert list(keywords) == [f.name for f in INIT_FIELDS] + ["vllm_options"]
    assert list(engine_keywords()) == [f.name for f in INIT_FIELDS]
    for f in INIT_FIELDS:
        assert keywords[f.name].default == default_of(f), f.name
        assert keywords[f.name].kind is (
            inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name == "model" else inspect.Parameter.KEYWORD_ONLY
        )
    assert keywords["vllm_options"].kind is inspect.Parameter.VAR_KEYWORD


def test_flags_reach_the_fields(smollm2_dir):
    args = build_parser().parse_args(
        [
            "serve",
            str(smollm2_dir),
            "--max-num-seqs",
            "8",
            "--gpu-memory-utilization",
            "0.5",
            "--no-enable-prefix-caching",
            "--enforce-eager",
            "--scheduling-policy",
            "priority",
            "--kv-cache-dtype",
            "fp8_e5m2",
            "--default-chat-template-kwargs",
            '{"enable_thinking": false}',
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}',
        ]
    )
    [config] = engine_configs(args)
    assert (config.max_num_seqs, config.gpu_memory_utilization) == (8, 0.5)
    assert (config.enable_prefix_caching, config.enforce_eager) == (False, True)
    assert (config.scheduling_policy, config.kv_cache_dtype) == ("priority", "fp8_e5m2")
    assert config.default_chat_template_kwargs == {"enable_thinking": False}
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)


def test_no_flags_give_the_configs_own_defaults(smollm2_dir):
    [config] = engine_configs(build_parser().parse_args(["serve", str(smollm2_dir)]))
    plain = EngineConfig(model=str(smollm2_dir))
    for f in INIT_FIELDS:
        assert getattr(config, f.name) == getattr(plain, f.name), f.name


def test_a_field_flag_the_target_does_not_take_is_refused_unless_at_its_default():
    args = subcommand("generate").parse_args(["--enforce-eager"])
    with pytest.raises(ValueError) as info:
        engine_kwargs(args, ACCEPTED - {"enforce_eager"}, None)
    assert str(info.value) == "--enforce-eager is not available in this build of the engine"
    assert "enforce_eager" not in engine_kwargs(
        subcommand("generate").parse_args([]), ACCEPTED - {"enforce_eager"}, None
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_num_seq": 4}, "LLM got an unexpected keyword argument 'max_num_seq'; did you mean 'max_num_seqs'?"),
        ({"model_path": "x"}, "LLM got an unexpected keyword argument 'model_path'; did you mean 'model'?"),
    ],
)
def test_an_unknown_llm_keyword_names_the_closest_field(kwargs, message):
    with pytest.raises(TypeError) as info:
        LLM(model="/no/such/model", **kwargs)
    assert str(info.value) == message


def test_batch_generate_takes_the_engine_flags():
    spec = importlib.util.spec_from_file_location("batch_generate", BATCH_GENERATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser = module.build_parser()
    actions = actions_by_dest(parser)
    assert {f.name for f in INIT_FIELDS} - {"served_model_name", "limits"} <= set(actions)
    args = parser.parse_args(["--input", "in.jsonl", "--output", "out.jsonl", "--max-num-seqs", "4", "-tp", "2"])
    kwargs = engine_kwargs(args, ACCEPTED, args.model)
    assert (kwargs["max_num_seqs"], kwargs["tensor_parallel_size"], kwargs["ray_address"]) == (4, 2, "auto")

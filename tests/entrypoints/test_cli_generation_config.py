"""--generation-config and --override-generation-config: parsing and the errors a user sees."""

from __future__ import annotations

import dataclasses

import pytest

from raypaged.config import EngineConfig, GenerationDefaults
from raypaged.entrypoints.cli import build_parser, engine_kwargs, main

ACCEPTED = {f.name for f in dataclasses.fields(EngineConfig) if f.init}


def parsed_kwargs(*flags: str) -> dict:
    args = build_parser().parse_args(["engine", *flags])
    return engine_kwargs(args, ACCEPTED, None)


def test_defaults_are_auto_and_no_override():
    kwargs = parsed_kwargs()
    assert kwargs["generation_config"] == "auto"
    assert "override_generation_config" not in kwargs


def test_flags_reach_the_engine_config(smollm2_dir):
    kwargs = parsed_kwargs(
        "--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 3}'
    )
    assert (kwargs["generation_config"], kwargs["override_generation_config"]) == (
        "vllm",
        {"temperature": 0.5, "max_new_tokens": 3},
    )
    config = EngineConfig(**{**kwargs, "model": str(smollm2_dir)})
    assert config.generation_defaults == GenerationDefaults(temperature=0.5, max_tokens=3)


def test_override_that_is_not_json_names_the_flag():
    with pytest.raises(ValueError, match=r"^--override-generation-config takes a JSON object, got '\{temp' \("):
        parsed_kwargs("--override-generation-config", "{temp")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--generation-config", "hf"],
            "error: --generation-config must be auto, vllm or a folder holding generation_config.json, got 'hf'",
        ),
        (["--override-generation-config", "[1]"], "error: --override-generation-config must be a JSON object, got [1]"),
        (
            ["--override-generation-config", '{"seed": 1}'],
            "error: --override-generation-config: unknown field 'seed'; "
            "allowed: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens",
        ),
    ],
)
def test_bad_values_exit_2_with_the_message(smollm2_dir, capsys, flags, message):
    assert main(["generate", "--model", str(smollm2_dir), "--prompt", "x", *flags]) == 2
    assert capsys.readouterr().err.strip() == message

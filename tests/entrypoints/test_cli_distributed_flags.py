"""The distribution flags reach EngineConfig under their vLLM names."""

import argparse
import dataclasses

from raypaged.config import EngineConfig
from raypaged.entrypoints.cli import add_engine_args, engine_kwargs


def parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    accepted = {f.name for f in dataclasses.fields(EngineConfig) if f.init}
    return engine_kwargs(parser.parse_args(list(argv)), accepted, None)


def test_distribution_flags_pass_through():
    kwargs = parse("--tensor-parallel-size", "3", "--ray-address", "auto", "--placement-strategy", "SPREAD")
    assert (kwargs["tensor_parallel_size"], kwargs["ray_address"], kwargs["placement_strategy"]) == (
        3,
        "auto",
        "SPREAD",
    )


def test_distribution_defaults():
    kwargs = parse()
    assert (kwargs["tensor_parallel_size"], kwargs["placement_strategy"]) == (1, "STRICT_PACK")
    assert "ray_address" not in kwargs  # None: EngineConfig's default, a local Ray only when needed

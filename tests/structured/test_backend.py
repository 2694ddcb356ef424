"""The grammar backend and the bitmask applier, against xgrammar itself."""

from __future__ import annotations

import re

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from raypaged.sampling_params import StructuredOutputsParams
from raypaged.structured.backend import GrammarBackend
from raypaged.structured.config import StructuredOutputsConfig
from raypaged.worker.sampler import apply_token_bitmask


@pytest.fixture(scope="module")
def backend(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return GrammarBackend(tokenizer, 49152, [2], StructuredOutputsConfig(cache_size=2))


def test_apply_token_bitmask_equals_xgrammars_applier():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 32), dtype=torch.int32, generator=generator)
    rows = [4, 0, 2]
    expected = logits.clone()
    full = torch.full((5, 32), -1, dtype=torch.int32)  # xgrammar's rows match the logits': all bits set = all allowed
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full, vocab_size=1000)
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[1]).sum() == 0  # rows without a mask keep every token


def test_the_mask_allows_exactly_the_grammars_next_tokens(backend, smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(choice=["yes", "no"])))
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, 49152)
    apply_token_bitmask(logits, bitmask, [0])
    allowed = {tokenizer.decode([t]) for t in torch.nonzero(logits[0] == 0).flatten().tolist()}
    assert allowed == {"y", "ye", "yes", "n", "no"}


def test_compiled_grammars_are_cached_by_constraint_least_recently_used_dropped(backend):
    first = backend.compile(StructuredOutputsParams(regex="a+"))
    assert backend.compile(StructuredOutputsParams(regex="a+")) is first
    backend.compile(StructuredOutputsParams(regex="b+"))
    backend.compile(StructuredOutputsParams(regex="c+"))  # cache_size=2: "a+" goes
    assert backend.compile(StructuredOutputsParams(regex="a+")) is not first
    assert backend.compile(StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=False)) is not (
        backend.compile(StructuredOutputsParams(json={"type": "object"}))
    )


@pytest.mark.parametrize(("params", "message"), [
    (StructuredOutputsParams(grammar="root ::= ("),
     "structured outputs: the grammar constraint does not compile: EBNF parser error at line 1, column 11: "
     "Expect element, but got"),
    (StructuredOutputsParams(json="{not json"),
     "structured outputs: json is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    (StructuredOutputsParams(structural_tag='{"type": "structural_tag", "format": {"type": "nope"}}'),
     "structured outputs: the structural_tag constraint does not compile: "),
    (StructuredOutputsParams(choice=["\U00040000"]),  # found by fuzzing: every first token masked
     "structured outputs: no token of this model's vocabulary can begin the choice constraint"),
])
def test_compile_errors_name_the_constraint(backend, params, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)) as raised:
        backend.compile(params)
    assert raised.value.param == "structured_outputs"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "structured outputs need exactly one of json, regex, choice, grammar, json_object or structural_tag, got none"),
    ({"regex": "a", "choice": ["b"]},
     "structured outputs need exactly one of json, regex, choice, grammar, json_object or structural_tag, "
     "got ['regex', 'choice']"),
    ({"choice": []}, "structured outputs: choice must be a non-empty list of strings"),
    ({"regex": 5}, "structured outputs: regex must be a string, got int"),
    ({"json": {}, "whitespace_pattern": " "}, "structured outputs: whitespace_pattern is not supported by the xgrammar backend"),
])
def test_structured_outputs_params_are_checked(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(("value", "backend", "message"), [
    ('{"backend": "outlines"}', None,
     "structured outputs backend 'outlines' is not supported (not built into raypaged); supported: xgrammar, auto"),
    (None, "guidance", "structured outputs backend 'guidance' is not supported (not built into raypaged); supported: xgrammar, auto"),
    ('{"backend": "xgrammar", "reasoning": 1}', None,
     "--structured-outputs-config: unknown field 'reasoning'; allowed: backend, cache_size, disable_any_whitespace, "
     "enable_in_reasoning, max_whitespace, reasoning_parser"),
    ('{"reasoning_parser": "o1"}', None, "--reasoning-parser 'o1' is not supported; supported: deepseek_r1, qwen3"),
    ("[1]", None, "--structured-outputs-config must be a JSON object, got [1]"),
    ("{", None, "--structured-outputs-config is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
])
def test_the_servers_config_refuses_what_it_cannot_honour(value, backend, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        StructuredOutputsConfig.parse(value, backend)


def test_the_servers_config_parses_vllm_spellings():
    config = StructuredOutputsConfig.parse('{"backend": "auto", "disable_any_whitespace": false}')
    assert (config.backend, config.disable_any_whitespace, config.max_whitespace) == ("xgrammar", False, 4)
    assert StructuredOutputsConfig.parse(None, "xgrammar") == StructuredOutputsConfig()

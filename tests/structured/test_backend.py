"""The grammar backend and the bitmask applier, against xgrammar itself."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from raypaged.inputs.limits import InputError
from raypaged.sampling_params import StructuredOutputsParams
from raypaged.structured import backend as backend_module
from raypaged.structured import compile_trial
from raypaged.structured.backend import GrammarBackend, grammar_bytes
from raypaged.structured.config import StructuredOutputsConfig
from raypaged.structured.guidance import GuidanceGrammar, unenforced_keyword
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


def _properties(count: int, prefix: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        json={"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(count)}}
    )


def test_the_cache_keeps_at_most_cache_mb_of_grammars_least_recently_used_dropped(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    grammars = GrammarBackend(tokenizer, 49152, [2], StructuredOutputsConfig(cache_mb=1))
    a, b, c = (grammars.compile(_properties(100, name)) for name in "abc")
    sizes = [grammar_bytes(g) for g in (a, b, c)]
    assert all(300_000 < size < 2**19 for size in sizes)  # two fit in 1 MiB, three do not
    assert grammars.cached(_properties(100, "a")) is None  # the least recently used went
    assert grammars.cached(_properties(100, "b")) is b and grammars.cached(_properties(100, "c")) is c
    assert grammars._cache_bytes == sizes[1] + sizes[2]
    big = grammars.compile(_properties(400, "d"))  # larger than the whole cache: used, not kept, nothing dropped
    assert grammar_bytes(big) > 2**20
    assert grammars.cached(_properties(400, "d")) is None
    assert grammars.cached(_properties(100, "b")) is b and grammars.cached(_properties(100, "c")) is c
    assert grammars._cache_bytes == sizes[1] + sizes[2]
    assert grammar_bytes(GuidanceGrammar("start: /[a-z]+/", "grammar")) == 15


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            StructuredOutputsParams(grammar="root ::= ("),
            "structured outputs: the grammar constraint does not compile: EBNF parser error at line 1, column 11: "
            "Expect element, but got",
        ),
        (
            StructuredOutputsParams(json="{not json"),
            "structured outputs: json is not valid JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)",
        ),
        (
            StructuredOutputsParams(structural_tag='{"type": "structural_tag", "format": {"type": "nope"}}'),
            "structured outputs: the structural_tag constraint does not compile: ",
        ),
        (
            StructuredOutputsParams(choice=["\U00040000"]),  # found by fuzzing: every first token masked
            "structured outputs: no token of this model's vocabulary can begin the choice constraint",
        ),
    ],
)
def test_compile_errors_name_the_constraint(backend, params, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)) as raised:
        backend.compile(params)
    assert raised.value.param == "structured_outputs"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {},
            "structured outputs need exactly one of json, regex, choice, grammar, json_object or structural_tag, "
            "got none",
        ),
        (
            {"regex": "a", "choice": ["b"]},
            "structured outputs need exactly one of json, regex, choice, grammar, json_object or structural_tag, "
            "got ['regex', 'choice']",
        ),
        ({"choice": []}, "structured outputs: choice must be a non-empty list of strings"),
        ({"regex": 5}, "structured outputs: regex must be a string, got int"),
        (
            {"json": {}, "whitespace_pattern": " "},
            "structured outputs: whitespace_pattern is not supported by the xgrammar backend",
        ),
    ],
)
def test_structured_outputs_params_are_checked(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    ("value", "backend", "message"),
    [
        (
            '{"backend": "outlines"}',
            None,
            "structured outputs backend 'outlines' is not supported (not built into raypaged); "
            "supported: auto, xgrammar, guidance",
        ),
        (
            None,
            "lm-format-enforcer",
            "structured outputs backend 'lm-format-enforcer' is not supported (not built into "
            "raypaged); supported: auto, xgrammar, guidance",
        ),
        (
            '{"backend": "xgrammar", "reasoning": 1}',
            None,
            "--structured-outputs-config: unknown field 'reasoning'; allowed: backend, cache_mb, "
            "cache_size, disable_any_whitespace, enable_in_reasoning, max_compile_s, max_grammar_ms, "
            "max_whitespace, reasoning_parser",
        ),
        (
            '{"reasoning_parser": "o1"}',
            None,
            "--reasoning-parser 'o1' is not supported; supported: deepseek_r1, deepseek_v3, ernie45, glm45, granite, "
            "minimax_m2, minimax_m2_append_think, mistral, openai_gptoss, qwen3, seed_oss",
        ),
        ('{"cache_mb": 0}', None, "structured outputs cache_mb must be at least 1, got 0"),
        ('{"cache_size": 0}', None, "structured outputs cache_size must be at least 1, got 0"),
        (
            '{"max_grammar_ms": 0}',
            None,
            "structured outputs max_grammar_ms must be a number above 0 (null: no limit), got 0",
        ),
        (
            '{"max_grammar_ms": "50"}',
            None,
            "structured outputs max_grammar_ms must be a number above 0 (null: no limit), got '50'",
        ),
        (
            '{"max_compile_s": -1}',
            None,
            "structured outputs max_compile_s must be a number above 0 (null: no limit), got -1",
        ),
        ("[1]", None, "--structured-outputs-config must be a JSON object, got [1]"),
        (
            "{",
            None,
            "--structured-outputs-config is not valid JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)",
        ),
    ],
)
def test_the_servers_config_refuses_what_it_cannot_honour(value, backend, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        StructuredOutputsConfig.parse(value, backend)


def test_the_servers_config_parses_vllm_spellings():
    config = StructuredOutputsConfig.parse('{"backend": "auto", "disable_any_whitespace": false}')
    assert (config.backend, config.disable_any_whitespace, config.max_whitespace) == ("auto", False, 4)
    assert StructuredOutputsConfig.parse(None, "xgrammar") == StructuredOutputsConfig(backend="xgrammar")
    assert StructuredOutputsConfig().backend == "auto"  # vLLM's default
    assert StructuredOutputsConfig.parse('{"max_grammar_ms": null}').max_grammar_ms is None
    assert StructuredOutputsConfig.parse('{"max_grammar_ms": 2.5}').max_grammar_ms == 2.5
    assert StructuredOutputsConfig().max_grammar_ms == 100
    assert StructuredOutputsConfig().max_compile_s == 10
    assert StructuredOutputsConfig.parse('{"max_compile_s": null}').max_compile_s is None


# a small schema xgrammar takes about 100 s to compile (the nested repetition of its pattern)
SLOW_TO_COMPILE = {"type": "string", "pattern": "^([a-z]{1,60}){1,60}$"}


def test_a_constraint_slower_to_compile_than_max_compile_s_is_refused_and_its_trial_killed(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    backend = GrammarBackend(tokenizer, 49152, [2], StructuredOutputsConfig(max_compile_s=1))
    fast = StructuredOutputsParams(json={"type": "string", "pattern": "^[a-z]{1,3}$"})
    assert backend.compile(fast) is not None  # a child started, tried it and is kept for the next
    child = compile_trial._IDLE[-1]  # the one the next compile takes
    started = time.monotonic()
    with pytest.raises(InputError) as info:
        backend.compile(StructuredOutputsParams(json=SLOW_TO_COMPILE))
    assert time.monotonic() - started < 30  # not the compile's 100 s
    assert (info.value.param, str(info.value)) == (
        "structured_outputs",
        "structured outputs: the json constraint did not compile within 1 s (max_compile_s of "
        "--structured-outputs-config)",
    )
    assert child.process.poll() is not None  # killed
    assert backend.cached(StructuredOutputsParams(json=SLOW_TO_COMPILE)) is None
    assert backend.compile(StructuredOutputsParams(regex="[0-9]+")) is not None  # a new child tries the next one
    unbounded = GrammarBackend(tokenizer, 49152, [2], StructuredOutputsConfig(max_compile_s=None))
    assert unbounded.compile(StructuredOutputsParams(regex="[0-9]{2}")) is not None


def test_a_trial_process_that_cannot_start_is_an_error_naming_the_way_out(monkeypatch):
    monkeypatch.setattr(compile_trial, "_IDLE", [])
    monkeypatch.setattr(compile_trial.sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError) as info:
        compile_trial.try_compile(
            compile_trial.Tokenizer("{}", "k"), StructuredOutputsParams(regex="a"), True, None, None, 1
        )
    assert str(info.value) == (
        "the process that tries grammars before they compile exited with code 1 (its error is in the server's log); "
        "max_compile_s: null in --structured-outputs-config compiles without it"
    )


def test_a_grammar_whose_first_mask_takes_more_than_max_grammar_ms_is_refused_when_it_compiles(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    strict = GrammarBackend(tokenizer, 49152, [2], StructuredOutputsConfig(max_grammar_ms=1e-6))
    with pytest.raises(InputError) as info:
        strict.compile(StructuredOutputsParams(regex="[a-z]+"))
    assert info.value.param == "structured_outputs"
    assert re.fullmatch(
        r"structured outputs: the regex constraint took \d+\.\d ms of CPU for its first token's mask, more than "
        r"the limit of 1e-06 ms \(max_grammar_ms of --structured-outputs-config\)",
        str(info.value),
    ), str(info.value)
    assert strict.cached(StructuredOutputsParams(regex="[a-z]+")) is None
    assert (
        GrammarBackend(tokenizer, 49152, [2], StructuredOutputsConfig()).compile(
            StructuredOutputsParams(regex="[a-z]+")
        )
        is not None
    )


ALL_OF = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}


@pytest.mark.parametrize(
    ("schema", "found"),
    [
        ({"not": {"type": "string"}}, ("not", "#")),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, ("uniqueItems", "#")),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, None),
        ({"type": "object", "properties": {"x": {"if": {"const": 1}, "then": {"const": 1}}}}, ("if", "#/properties/x")),
        ({"anyOf": [{"type": "object", "dependentRequired": {"a": ["b"]}}]}, ("dependentRequired", "#/anyOf/0")),
        (ALL_OF, ("allOf", "#")),
        ({"allOf": [{"type": "integer"}]}, None),
        ({"const": {"not": 1}, "enum": [{"uniqueItems": True}]}, None),  # values, not subschemas
        ({"$defs": {"p": {"dependentSchemas": {}}}, "$ref": "#/$defs/p"}, ("dependentSchemas", "#/$defs/p")),
    ],
)
def test_keywords_xgrammar_would_not_enforce_are_found(schema, found):
    assert unenforced_keyword(schema) == found


def test_auto_sends_what_xgrammar_would_not_enforce_to_guidance(smollm2_dir):
    """xgrammar keeps one subschema of an allOf (``{}`` passes); guidance enforces both; xgrammar
    alone refuses the schema by name."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    auto = GrammarBackend(tokenizer, 49152, [2], StructuredOutputsConfig(backend="auto"))
    xgrammar_only = GrammarBackend(tokenizer, 49152, [2], StructuredOutputsConfig(backend="xgrammar"))
    compiled = auto.compile(StructuredOutputsParams(json=ALL_OF))
    assert isinstance(compiled, GuidanceGrammar)
    matcher = auto.matcher(compiled)
    assert not matcher.accept_token(tokenizer.encode("{}")[0]) or not matcher.accept_token(tokenizer.encode("}")[0])
    raw = xgr.GrammarMatcher(
        xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152)).compile_json_schema(
            json.dumps(ALL_OF), any_whitespace=False
        )
    )
    assert all(raw.accept_token(t) for t in tokenizer.encode("{}")) and raw.is_completed()  # what auto avoids
    assert isinstance(auto.compile(StructuredOutputsParams(json={"type": "integer"})), xgr.CompiledGrammar)
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "structured outputs: the xgrammar backend does not enforce the JSON schema keyword 'allOf' (at #); "
            "the guidance or auto backend may"
        )
        + "$",
    ):
        xgrammar_only.compile(StructuredOutputsParams(json=ALL_OF))
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "structured outputs: no backend enforces the JSON schema keyword 'not' (at #/properties/a): xgrammar "
            'ignores it, and the guidance backend cannot enforce the json constraint: Unimplemented keys: ["not"]'
        )
        + "$",
    ):
        auto.compile(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}))


def test_the_guidance_backend_takes_json_regex_and_choice(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    guidance = GrammarBackend(tokenizer, 49152, [2], StructuredOutputsConfig(backend="guidance"))
    bitmask = guidance.allocate_bitmask(1)
    matcher = guidance.matcher(guidance.compile(StructuredOutputsParams(choice=["yes", "no"])))
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, 49152)
    apply_token_bitmask(logits, bitmask, [0])
    assert {tokenizer.decode([t]) for t in torch.nonzero(logits[0] == 0).flatten().tolist()} == {
        "y",
        "ye",
        "yes",
        "n",
        "no",
    }
    fork = matcher.fork()
    assert matcher.accept_token(tokenizer.encode("yes")[0]) and matcher.is_terminated()
    assert not fork.is_terminated() and fork.accept_token(tokenizer.encode("no")[0])  # the fork kept its own state
    compact = guidance.matcher(guidance.compile(StructuredOutputsParams(json={"type": "object"})))
    assert all(compact.accept_token(t) for t in tokenizer.encode('{"a": [1, 2]}'))
    closed = guidance.matcher(
        guidance.compile(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    )  # no additionalProperties: none, as xgrammar's strict mode
    assert all(closed.accept_token(t) for t in tokenizer.encode('{"a": 1'))
    assert not all(closed.accept_token(t) for t in tokenizer.encode(', "b"'))
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "structured outputs: the guidance backend takes json, json_object, regex, choice constraints; a grammar "
            "constraint needs the xgrammar backend"
        )
        + "$",
    ):
        guidance.compile(StructuredOutputsParams(grammar='root ::= "a"'))


def test_cached_never_compiles_and_finds_what_compile_made(backend):
    params = StructuredOutputsParams(regex="[0-9]{3}-[a-z]")
    assert backend.cached(params) is None
    assert backend.cached(params) is None  # asking compiles nothing
    compiled = backend.compile(params)
    assert backend.cached(params) is compiled


@pytest.mark.parametrize("slots", [1, 2])
def test_at_most_compile_slots_grammars_compile_at_once(smollm2_dir, monkeypatch, slots):
    """A grammar can take a core for a minute: compiles beyond the slots wait, so they never take every core."""
    monkeypatch.setattr(backend_module, "COMPILE_SLOTS", slots)
    grammars = GrammarBackend(AutoTokenizer.from_pretrained(smollm2_dir), 49152, [2], StructuredOutputsConfig())
    inside, most = [0], [0]
    lock = threading.Lock()
    together = threading.Barrier(slots, timeout=10)  # the slots fill up before any compile ends
    real = grammars._check_can_start

    def compiling(compiled, kind):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        together.wait()
        time.sleep(0.1)  # room for a compile past the slots to come in
        with lock:
            inside[0] -= 1
        real(compiled, kind)

    monkeypatch.setattr(grammars, "_check_can_start", compiling)
    threads = [
        threading.Thread(target=grammars.compile, args=(StructuredOutputsParams(regex=f"[a-z]{{{n}}}"),))
        for n in range(1, 5)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert most[0] == slots
    assert all(grammars.cached(StructuredOutputsParams(regex=f"[a-z]{{{n}}}")) is not None for n in range(1, 5))

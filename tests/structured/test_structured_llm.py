"""Structured outputs through ``LLM`` with SmolLM2: every constrained output is valid and ends, and
unconstrained requests in the same batch are untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from raypaged import LLM, SamplingParams
from raypaged.core.beam_search import BeamSearchParams
from raypaged.sampling_params import StructuredOutputsParams
from tests.structured.schemas import SCHEMAS

pytestmark = pytest.mark.slow

ARITHMETIC = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= num (("*" | "/") num)*\nnum ::= [1-9] [0-9]?'


def _ask(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": what}]


def _validate(schema: dict, text: str) -> None:
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    validator.validate(json.loads(text))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_schema_gives_valid_json_that_ends(smollm2_llm, temperature):
    conversations = [_ask(f"Answer in JSON: an example of {name.replace('_', ' ')}.") for name in SCHEMAS]
    params = [
        SamplingParams(
            temperature=temperature, seed=i, max_tokens=256, structured_outputs=StructuredOutputsParams(json=s)
        )
        for i, s in enumerate(SCHEMAS.values())
    ]
    outputs = smollm2_llm.chat(conversations, params, use_tqdm=False)
    for (name, schema), output in zip(SCHEMAS.items(), outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        _validate(schema, completion.text)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_object_regex_choice_and_grammar_outputs_conform(smollm2_llm, temperature):
    kinds = {
        "json_object": (StructuredOutputsParams(json_object=True), "Describe a cat in JSON."),
        "regex": (StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"), "When was the moon landing?"),
        "choice": (StructuredOutputsParams(choice=["yes", "no", 'maybe "later"']), "Is the sky blue?"),
        "grammar": (StructuredOutputsParams(grammar=ARITHMETIC), "Write an arithmetic expression."),
    }
    params = [
        SamplingParams(temperature=temperature, seed=3, n=3, max_tokens=24, structured_outputs=constraint)
        for constraint, _ in kinds.values()
    ]
    outputs = smollm2_llm.chat([_ask(q) for _, q in kinds.values()], params, use_tqdm=False)
    by_kind = dict(zip(kinds, outputs))
    for completion in by_kind["json_object"].outputs:
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
    for completion in by_kind["regex"].outputs:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", completion.text) and completion.finish_reason == "stop"
    for completion in by_kind["choice"].outputs:
        assert completion.text in ("yes", "no", 'maybe "later"') and completion.finish_reason == "stop"
    term = r"[1-9][0-9]?([*/][1-9][0-9]?)*"
    for completion in by_kind["grammar"].outputs:  # a prefix of a derivation when cut at max_tokens
        text = completion.text if completion.finish_reason == "stop" else re.sub(r"[-+*/]$", "", completion.text)
        assert re.fullmatch(rf"{term}([-+]{term})*", text), completion.text
    assert sum(len(o.outputs) for o in outputs) == 12


def test_unconstrained_requests_are_untouched_by_constrained_ones(smollm2_llm):
    plain = [f"Tell me one fact about the number {i}." for i in range(32)]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    alone = smollm2_llm.generate(plain, greedy, use_tqdm=False)
    constrained = SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(json=SCHEMAS["person"])
    )
    mixed = smollm2_llm.generate(
        [p for pair in zip(plain, [f"Person {i} as JSON:" for i in range(32)]) for p in pair],
        [p for _ in range(32) for p in (greedy, constrained)],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == [o.outputs[0].token_ids for o in alone]
    assert all(o.outputs[0].text.startswith('{"name": "') for o in mixed[1::2])


def test_a_grammar_longer_than_max_tokens_ends_with_length(smollm2_llm):
    params = SamplingParams(temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(regex="(ab){40}"))
    completion = smollm2_llm.generate("Letters:", params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length"
    assert completion.text == "ab" * (len(completion.text) // 2) and len(completion.token_ids) == 5


def test_best_of_samples_each_follow_the_grammar(smollm2_llm):
    params = SamplingParams(
        temperature=1.0,
        seed=7,
        n=2,
        best_of=4,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma"]),
    )
    output = smollm2_llm.generate("Pick a Greek letter:", params, use_tqdm=False)[0]
    assert [c.index for c in output.outputs] == [0, 1]
    assert all(c.text in ("alpha", "beta", "gamma") and c.finish_reason == "stop" for c in output.outputs)


def test_beam_search_beams_each_follow_the_grammar(smollm2_llm):
    """Each beam has its own grammar state, forked with it: every hypothesis conforms and ends where
    its grammar accepts EOS, and the unconstrained search (whose beams run past) is unchanged."""
    tokenizer = smollm2_llm.get_tokenizer()
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    cases = [
        (
            StructuredOutputsParams(choice=["yes", "no", "maybe"]),
            "Is the sky blue?",
            lambda text: text in ("yes", "no", "maybe"),
        ),
        (
            StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"),
            "When was the moon landing?",
            lambda text: re.fullmatch(r"\d{4}-\d{2}-\d{2}", text),
        ),
        (
            StructuredOutputsParams(json=person),
            "Describe a person in JSON.",
            lambda text: _validate(person, text) is None,
        ),
    ]
    prompts = [tokenizer.apply_chat_template(_ask(q), tokenize=False, add_generation_prompt=True) for _, q, _ in cases]
    free_before = smollm2_llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=40), use_tqdm=False)
    for (constraint, _, conforms), prompt in zip(cases, prompts):
        [output] = smollm2_llm.beam_search(
            prompt, BeamSearchParams(beam_width=3, max_tokens=40, structured_outputs=constraint), use_tqdm=False
        )
        assert output.error is None and len(output.outputs) == 3
        for beam in output.outputs:
            assert beam.finish_reason == "stop" and conforms(beam.text), beam.text
            assert beam.token_ids[-1] == tokenizer.eos_token_id
    free_after = smollm2_llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=40), use_tqdm=False)
    assert [[b.token_ids for b in o.outputs] for o in free_after] == [
        [b.token_ids for b in o.outputs] for o in free_before
    ]
    assert smollm2_llm.llm_engine.core._matchers == {}  # every beam's grammar state released
    with pytest.raises(ValueError, match="beam search with structured_outputs cannot ignore_eos"):
        BeamSearchParams(ignore_eos=True, structured_outputs=cases[0][0])


def test_preempted_constrained_requests_stay_valid(smollm2_dir):
    llm = LLM(model=str(smollm2_dir), dtype="float32", num_gpu_blocks_override=24, block_size=16, max_model_len=384)
    schema = SCHEMAS["objects_array"]
    params = SamplingParams(
        temperature=0.8, seed=1, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema)
    )
    outputs = llm.chat(
        [_ask(f"List up to three items for trip {i}, as JSON.") for i in range(8)], params, use_tqdm=False
    )
    assert llm.stats()["num_preemptions"] > 0
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        _validate(schema, output.outputs[0].text)
    assert llm.stats()["num_gpu_blocks_free"] == 24


def test_a_constraint_that_does_not_compile_is_refused_by_name(smollm2_llm):
    bad = StructuredOutputsParams(regex="a(")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "structured outputs: the regex constraint does not compile: Regex parsing error at position 3: "
            "The parenthesis is not closed."
        ),
    ):
        smollm2_llm.generate("x", SamplingParams(structured_outputs=bad), use_tqdm=False)
    with pytest.raises(ValueError, match=re.escape('Unsupported type "objec"')):
        smollm2_llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "objec"})))
    assert not smollm2_llm.llm_engine.has_unfinished_requests()


def test_the_guidance_backend_enforces_schemas_regexes_and_choices_with_beams(smollm2_dir):
    temperature = 0.8
    llm = LLM(
        model=str(smollm2_dir),
        dtype="float32",
        num_gpu_blocks_override=512,
        structured_outputs_config={"backend": "guidance"},
    )
    try:
        names = ["person", "objects_array", "any_of", "ref", "enum_array"]
        params = [
            SamplingParams(
                temperature=temperature,
                seed=i,
                max_tokens=160,
                structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]),
            )
            for i, name in enumerate(names)
        ]
        outputs = llm.chat(
            [_ask(f"Answer in JSON: an example of {name.replace('_', ' ')}.") for name in names], params, use_tqdm=False
        )
        for name, output in zip(names, outputs):
            assert output.outputs[0].finish_reason == "stop", (name, output.outputs[0].text)
            _validate(SCHEMAS[name], output.outputs[0].text)
        [dates] = llm.generate(
            "Today's date:",
            SamplingParams(
                temperature=temperature,
                seed=1,
                n=2,
                max_tokens=16,
                structured_outputs=StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"),
            ),
            use_tqdm=False,
        )
        assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", c.text) for c in dates.outputs)
        [beams] = llm.beam_search(
            "Is the sky blue? Answer:",
            BeamSearchParams(
                beam_width=3, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])
            ),
            use_tqdm=False,
        )
        assert all(b.text in ("yes", "no", "maybe") and b.finish_reason == "stop" for b in beams.outputs)
    finally:
        llm.shutdown()


def test_auto_enforces_all_of_through_guidance(smollm2_llm):
    """``allOf`` over two subschemas, which xgrammar alone would not enforce (it keeps one)."""
    schema = {
        "allOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
            },
            {"required": ["name", "age"]},
        ]
    }
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema))
        for i in range(4)
    ]
    for output in smollm2_llm.chat([_ask("Give me a person as JSON.")] * 4, params, use_tqdm=False):
        assert output.outputs[0].finish_reason == "stop"
        _validate(schema, output.outputs[0].text)

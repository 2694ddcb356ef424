"""Constraints with a reasoning parser: the reasoning section is free text, the answer after it
follows the constraint (vLLM's ``reasoning_parser`` in the structured-outputs config), with SmolLM2
shown the format in a one-shot conversation."""

from __future__ import annotations

import json

import jsonschema
import pytest

from raypaged import LLM, SamplingParams
from raypaged.sampling_params import StructuredOutputsParams
from raypaged.structured.reasoning import get_reasoning_parser

pytestmark = pytest.mark.slow

PLACE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "country"],
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
}
ONE_SHOT = [
    {"role": "system", "content": "Think inside <think></think> first, then answer in JSON."},
    {"role": "user", "content": "Where is the Eiffel Tower?"},
    {
        "role": "assistant",
        "content": '<think>The Eiffel Tower is in Paris, in France.</think>\n{"city": "Paris", "country": "France"}',
    },
    {"role": "user", "content": "Where is the Colosseum?"},
]


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def reasoning_llm(request, smollm2_dir):
    llm = LLM(
        model=str(smollm2_dir),
        dtype="float32",
        num_gpu_blocks_override=512,
        max_model_len=1024,
        structured_outputs_config={"reasoning_parser": request.param},
    )
    yield request.param, llm
    llm.shutdown()


def test_the_answer_after_the_reasoning_follows_the_schema(reasoning_llm):
    name, llm = reasoning_llm
    parser = get_reasoning_parser(name)
    constraint = StructuredOutputsParams(json=PLACE)
    [greedy] = llm.chat(
        ONE_SHOT, SamplingParams(temperature=0, max_tokens=120, structured_outputs=constraint), use_tqdm=False
    )
    assert greedy.outputs[0].text == (
        '<think>The Colosseum is in Rome, Italy.</think>\n{"city": "Rome", "country": "Italy"}'
    )
    assert greedy.outputs[0].finish_reason == "stop"
    # at temperature 0.8 SmolLM2 closes about two thirds of deepseek_r1's sections (21 of 32 seeds) and every
    # qwen3 one: 16 seeds, of which at least 6 must close, leave the answers' schema well tested
    sampled = llm.chat(
        [ONE_SHOT] * 16,
        [SamplingParams(temperature=0.8, seed=i, max_tokens=120, structured_outputs=constraint) for i in range(16)],
        use_tqdm=False,
    )
    closed = 0
    for output in sampled:
        completion = output.outputs[0]
        reasoning, content = parser.split(completion.text)
        if content is None:  # the section never closed (written as </thought>, say): all of it is reasoning
            assert completion.finish_reason == "length" and "</think>" not in completion.text
            continue
        closed += 1
        jsonschema.validate(json.loads(content), PLACE)
        assert completion.finish_reason == "stop"
    assert closed >= 6


def test_a_prompt_that_closed_the_section_is_constrained_from_the_first_token(reasoning_llm):
    _, llm = reasoning_llm
    prompt = llm.get_tokenizer().apply_chat_template(ONE_SHOT, tokenize=False, add_generation_prompt=True)
    prompt += "<think>\n\n</think>\n\n"  # Qwen3's template without thinking ends so
    [output] = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=PLACE)),
        use_tqdm=False,
    )
    jsonschema.validate(json.loads(output.outputs[0].text), PLACE)


def test_enable_in_reasoning_applies_the_constraint_from_the_first_token(smollm2_dir):
    llm = LLM(
        model=str(smollm2_dir),
        dtype="float32",
        num_gpu_blocks_override=128,
        max_model_len=1024,
        structured_outputs_config={"reasoning_parser": "qwen3", "enable_in_reasoning": True},
    )
    try:
        [output] = llm.chat(
            ONE_SHOT,
            SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=PLACE)),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    jsonschema.validate(json.loads(output.outputs[0].text), PLACE)

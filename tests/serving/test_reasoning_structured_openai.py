"""A reasoning server (``--reasoning-parser qwen3``) with constraints, through the official ``openai``
client: the reasoning is free and comes back as ``reasoning_content``, whole and streamed; the
answer after it follows ``response_format`` or the required tool's schema. SmolLM2 is shown the
format in a one-shot conversation."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from raypaged.config import EngineConfig
from tests.serving.conftest import Stack
from tests.structured.test_reasoning_structured import ONE_SHOT, PLACE

pytestmark = pytest.mark.slow
LOCATE = {"type": "function", "function": {"name": "locate", "parameters": PLACE}}


@pytest.fixture(scope="module")
def client(smollm2_dir):
    stack = Stack(
        [
            EngineConfig(
                model=str(smollm2_dir),
                served_model_name="smollm2",
                dtype="float32",
                num_gpu_blocks_override=512,
                structured_outputs_config={"reasoning_parser": "qwen3"},
            )
        ],
        reasoning_parser="qwen3",
    )
    yield openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none")
    stack.close()


def test_response_format_applies_after_the_reasoning_whole_and_streamed(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}}
    chat = client.chat.completions.create(
        model="smollm2", messages=ONE_SHOT, max_tokens=120, temperature=0, response_format=response_format
    )
    message = chat.choices[0].message
    assert message.reasoning_content == "The Colosseum is in Rome, Italy."
    assert message.content == '\n{"city": "Rome", "country": "Italy"}'
    jsonschema.validate(json.loads(message.content), PLACE)
    assert chat.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="smollm2", messages=ONE_SHOT, max_tokens=120, temperature=0, response_format=response_format, stream=True
    )
    reasoning = content = ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_a_required_tool_is_called_after_the_reasoning(client):
    chat = client.chat.completions.create(
        model="smollm2",
        messages=ONE_SHOT,
        max_tokens=160,
        temperature=0,
        tools=[LOCATE],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content
    [call] = choice.message.tool_calls
    assert call.function.name == "locate"
    jsonschema.validate(json.loads(call.function.arguments), PLACE)


def test_include_reasoning_false_returns_no_reasoning_and_constrains_from_the_first_token(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}}
    settings = {"model": "smollm2", "messages": ONE_SHOT, "max_tokens": 120, "temperature": 0}
    chat = client.chat.completions.create(
        **settings, response_format=response_format, extra_body={"include_reasoning": False}
    )
    message = chat.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    jsonschema.validate(json.loads(message.content), PLACE)  # JSON from the first token: no <think> section
    assert not message.content.lstrip().startswith("<think>")
    stream = client.chat.completions.create(
        **settings, response_format=response_format, extra_body={"include_reasoning": False}, stream=True
    )
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert all(getattr(delta, "reasoning_content", None) is None for delta in deltas)
    assert "".join(delta.content or "" for delta in deltas) == message.content
    shown = client.chat.completions.create(**settings).choices[0].message
    hidden = client.chat.completions.create(**settings, extra_body={"include_reasoning": False}).choices[0].message
    assert shown.reasoning_content  # unconstrained, the model reasons; without include_reasoning it is not returned
    assert (getattr(hidden, "reasoning_content", None), hidden.content) == (None, shown.content)


def test_a_thinking_budget_ends_the_reasoning_then_the_answer_follows_the_schema(client, smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    free = "The Colosseum is in Rome, Italy."  # the reasoning without a budget (the test above)
    first_three = tokenizer.decode(tokenizer.encode(free, add_special_tokens=False)[:3])
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}}
    settings = {"model": "smollm2", "messages": ONE_SHOT, "max_tokens": 120, "temperature": 0}
    chat = client.chat.completions.create(
        **settings, response_format=response_format, extra_body={"thinking_token_budget": 3}
    )
    message = chat.choices[0].message
    assert message.reasoning_content == first_three  # three tokens of reasoning, then </think> forced
    jsonschema.validate(json.loads(message.content), PLACE)
    stream = client.chat.completions.create(
        **settings, response_format=response_format, extra_body={"thinking_token_budget": 3}, stream=True
    )
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == first_three
    assert "".join(d.content or "" for d in deltas) == message.content
    with pytest.raises(
        openai.BadRequestError, match="thinking_token_budget: Input should be greater than or equal to -1"
    ):
        client.chat.completions.create(**settings, extra_body={"thinking_token_budget": -2})

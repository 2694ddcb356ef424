"""Reasoning parsers split ``<think>`` sections, whole and streamed in pieces."""

from __future__ import annotations

import json

import pytest

from raypaged.serving.gateway.reasoning import get_reasoning_parser
from tests.serving.conftest import Stack, streamed_parts, tiny_config, tiny_model_dir  # noqa: F401  (session fixture)

CASES = [
    ("deepseek_r1", "<think>plan it</think>The answer.", ("plan it", "The answer.")),
    ("deepseek_r1", "plan it</think>The answer.", ("plan it", "The answer.")),
    ("deepseek_r1", "still thinking", ("still thinking", None)),
    ("qwen3", "<think>plan it</think>The answer.", ("plan it", "The answer.")),
    ("qwen3", "The answer.", (None, "The answer.")),
    ("qwen3", "<think>cut off", ("cut off", None)),
]


@pytest.mark.parametrize(("name", "output", "expected"), CASES)
def test_split_whole(name, output, expected):
    assert get_reasoning_parser(name).split(output) == expected


@pytest.mark.parametrize(("name", "output", "expected"), CASES)
@pytest.mark.parametrize("piece", [1, 2, 5])
def test_streamed_in_pieces_gives_the_same_parts(name, output, expected, piece):
    reasoning, content = streamed_parts(name, output, piece)
    assert (reasoning or None, content or None) == expected


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(
        ValueError,
        match=r"^--reasoning-parser 'r2' is not supported; supported: deepseek_r1, deepseek_v3, ernie45, glm45, "
        r"granite, minimax_m2, minimax_m2_append_think, mistral, openai_gptoss, qwen3, seed_oss$",
    ):
        get_reasoning_parser("r2")


def test_a_reasoning_server_answers_with_reasoning_content_whole_and_streamed(tiny_model_dir):
    stack = Stack(
        [tiny_config(tiny_model_dir, "tiny", structured_outputs_config={"reasoning_parser": "deepseek_r1"})],
        reasoning_parser="deepseek_r1",
    )
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    try:
        with stack.client() as http:
            whole = http.post("/v1/chat/completions", json=body).json()
            plain = http.post(
                "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 8, "temperature": 0}
            ).json()
            streamed = [
                line
                for line in http.post("/v1/chat/completions", json={**body, "stream": True}).text.split("\n")
                if line.startswith("data: {")
            ]
            constrained = http.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
    finally:
        stack.close()
    message = whole["choices"][0]["message"]
    assert "</think>" not in message["reasoning_content"] and message["content"] is None  # R1: all is reasoning
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert not any(d.get("content") for d in deltas)
    assert "reasoning_content" not in plain["choices"][0]  # completions are never split
    # the constraint waits for the section's end, which this random model never writes: all is reasoning
    assert constrained.json()["choices"][0]["message"]["reasoning_content"] == message["reasoning_content"]

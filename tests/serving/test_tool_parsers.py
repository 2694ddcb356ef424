"""Tool-call parsers on model outputs in each format, whole and streamed in pieces."""

from __future__ import annotations

import json

import pytest

from raypaged.serving.gateway.tool_parsers import PARSERS, get_parser

WEATHER = {"city": "Paris", "days": 2}
CASES = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        "Let me check.\n",
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; {"name": "get_time", "parameters": {}}',
        None,
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "arguments": {}}]',
        None,
    ),
    "pythonic": ('[get_weather(city="Paris", days=2), get_time()]', None),
}


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_format_gives_its_calls_and_the_content_before(name):
    output, content = CASES[name]
    found_content, calls = get_parser(name).extract(output)
    assert found_content == content
    assert _calls(calls) == [("get_weather", WEATHER), ("get_time", {})]
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_in_pieces_content_comes_first_and_calls_at_the_end(name, piece):
    output, content = CASES[name]
    stream = get_parser(name).stream()
    sent = "".join(stream.feed(output[i : i + piece]) for i in range(0, len(output), piece))
    rest, calls = stream.finish()
    assert sent + rest == (content or "")
    assert _calls(calls) == [("get_weather", WEATHER), ("get_time", {})]


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_text_is_content_and_streams_whole(name):
    text = "The weather in Paris is mild; no tool needed."
    assert get_parser(name).extract(text) == (text, [])
    stream = get_parser(name).stream()
    assert "".join(stream.feed(c) for c in text) + stream.finish()[0] == text


@pytest.mark.parametrize(
    ("name", "output"),
    [
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": '),
        ("llama3_json", '{"name": "get_weather", "parameters": '),
        ("mistral", "[TOOL_CALLS] [{"),
        ("pythonic", "[get_weather(city="),
        ("pythonic", '[get_weather("Paris")]'),
    ],
)
def test_a_section_that_does_not_parse_is_content(name, output):
    assert get_parser(name).extract(output) == (output, [])
    stream = get_parser(name).stream()
    sent = "".join(stream.feed(c) for c in output)
    assert sent + stream.finish()[0] == output


def test_a_marker_split_across_deltas_is_held_back_not_sent():
    stream = get_parser("hermes").stream()
    assert stream.feed("Sure <tool") == "Sure "
    assert stream.feed("_call>") == ""
    assert stream.feed('{"name": "f", "arguments": {"x": 1}}</tool_call>') == ""
    assert _calls(stream.finish()[1]) == [("f", {"x": 1})]
    stream = get_parser("hermes").stream()
    assert stream.feed("a <tool") == "a "
    assert stream.feed("box") == "<toolbox"


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(
        ValueError,
        match=r"^--tool-call-parser 'qwen9' is not supported; supported: deepseek_v3, deepseek_v31, glm45, granite, "
        r"hermes, kimi_k2, llama3_json, llama4_pythonic, mistral, openai, phi4_mini_json, pythonic, qwen3_coder$",
    ):
        get_parser("qwen9")
    assert sorted(PARSERS) == [
        "deepseek_v3",
        "deepseek_v31",
        "glm45",
        "granite",
        "hermes",
        "kimi_k2",
        "llama3_json",
        "llama4_pythonic",
        "mistral",
        "openai",
        "phi4_mini_json",
        "pythonic",
        "qwen3_coder",
    ]

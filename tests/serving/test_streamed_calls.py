"""Tool calls read as their JSON streams in: names once whole, arguments as written, in any chunking."""

from __future__ import annotations

import json
import random

import pytest

from raypaged.serving.gateway.tool_parsers import get_parser
from raypaged.serving.gateway.tool_parsers.streamed import CallScanner
from raypaged.serving.gateway.tools import RequiredCalls, Tool, ToolPlan

CALLS = [
    {"name": "write", "parameters": {"text": 'a "quoted" {brace} [x] \\ back', "n": [1, 2.5, {"k": None}]}},
    {"parameters": {"city": "Zürich \u2603"}, "name": "get_weather"},
    {"name": "empty", "parameters": {}},
]


def _chunks(text: str, rng: random.Random) -> list[str]:
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(1, 6)
        pieces.append(text[at : at + step])
        at += step
    return pieces


@pytest.mark.parametrize("seed", range(20))
def test_every_chunking_gives_the_names_and_the_arguments_text_growing_to_the_whole(seed):
    text = json.dumps(CALLS, ensure_ascii=False)
    scanner = CallScanner(("parameters",), call_depth=1)
    seen: list[str] = []
    for chunk in _chunks(text, random.Random(seed)):
        scanner.feed(chunk)
        now = [scanner.arguments(call) for call in scanner.calls]
        assert all(new.startswith(old) for old, new in zip(seen, now))
        seen = now
    assert [c.name for c in scanner.calls] == ["write", "get_weather", "empty"]
    assert seen == [json.dumps(c["parameters"], ensure_ascii=False) for c in CALLS]
    assert all(c.done for c in scanner.calls)


def test_calls_between_markers_at_the_top_level():
    scanner = CallScanner(("arguments",), call_depth=0)
    scanner.feed('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "argu')
    assert [(c.name, scanner.arguments(c), c.done) for c in scanner.calls] == [
        ("a", '{"x": 1}', True),
        ("b", "", False),
    ]
    scanner.feed('ments": {"y": [')
    assert scanner.arguments(scanner.calls[1]) == '{"y": ['


PLAN = ToolPlan([Tool.model_validate({"type": "function", "function": {"name": "write"}})], "required")


def test_a_required_stream_announces_each_call_once_then_sends_its_arguments():
    calls = RequiredCalls()
    assert calls.feed('[{"name": "wr') == []
    [announce] = calls.feed('ite", "parameters": {"te')
    assert announce["index"] == 0 and announce["type"] == "function" and announce["id"].startswith("chatcmpl-tool-")
    assert announce["function"] == {"name": "write", "arguments": '{"te'}
    assert calls.feed('xt": "hi"}') == [{"index": 0, "function": {"arguments": 'xt": "hi"}'}}]
    assert calls.feed("}]") == []
    last, final = calls.finish(PLAN)
    assert last == {}
    assert [(c.id, c.name, c.arguments) for c in final] == [(announce["id"], "write", '{"text": "hi"}')]


def test_a_required_output_cut_short_keeps_what_was_streamed_and_adds_no_content():
    calls = RequiredCalls()
    calls.feed('[{"name": "write", "parameters": {"text": "h')
    assert calls.finish(PLAN) == ({}, [])
    before_a_name = RequiredCalls()
    before_a_name.feed('[{"na')
    assert before_a_name.finish(PLAN) == ({"content": '[{"na'}, [])


def _hermes_plan(parallel: bool = True) -> ToolPlan:
    tools = [Tool.model_validate({"type": "function", "function": {"name": n}}) for n in ("a", "b")]
    return ToolPlan(tools, "auto", parser=get_parser("hermes"), parallel=parallel)


HERMES = (
    'Let me check.<tool_call>\n{"name": "a", "arguments": {"x": "1 } 2"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
)


def _stream(plan: ToolPlan, text: str, seed: int) -> tuple[str, dict[int, dict], list, list]:
    stream = plan.stream()
    content, calls, pieces = "", {}, []
    deltas = [stream.feed(chunk) for chunk in _chunks(text, random.Random(seed))]
    last, final = stream.finish()
    for delta in (*deltas, last):
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", ()):
            pieces.append(piece)
            call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in piece:
                call["id"], call["name"] = piece["id"], piece["function"]["name"]
            call["arguments"] += piece["function"].get("arguments", "")
    return content, calls, pieces, final


@pytest.mark.parametrize("seed", range(10))
def test_hermes_calls_stream_as_they_are_written_and_settle_to_the_parsed_calls(seed):
    content, calls, pieces, final = _stream(_hermes_plan(), HERMES, seed)
    assert content == "Let me check."
    assert [(c["id"], c["name"], c["arguments"]) for c in calls.values()] == [
        (call.id, call.name, call.arguments) for call in final
    ]
    assert [(c.name, c.arguments) for c in final] == [("a", '{"x": "1 } 2"}'), ("b", "{}")]
    assert [p["index"] for p in pieces if "id" in p] == [0, 1]  # each announced once, in order
    assert [p["index"] for p in pieces] == sorted(p["index"] for p in pieces)  # a call's deltas in a row


def test_hermes_without_parallel_calls_streams_only_the_first():
    content, calls, _, final = _stream(_hermes_plan(parallel=False), HERMES, 0)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("a", '{"x": "1 } 2"}')]
    assert [c.name for c in final] == ["a"]


def test_a_hermes_section_that_does_not_parse_after_a_streamed_call_adds_no_content():
    content, calls, _, final = _stream(_hermes_plan(), 'Hi<tool_call>\n{"name": "a", "arguments": {"x": 1}} oops', 0)
    assert (content, final) == ("Hi", [])
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("a", '{"x": 1}')]


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": "1 } 2"}}; {"name": "b", "parameters": {}}'),
        ("granite", '<|tool_call|>[{"name": "a", "arguments": {"x": "1 } 2"}}, {"name": "b", "arguments": {}}]'),
        ("phi4_mini_json", 'functools[{"name": "a", "arguments": {"x": "1 } 2"}}, {"name": "b", "arguments": {}}]'),
        ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": "1 } 2"}}, {"name": "b", "arguments": {}}]'),
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_every_json_format_streams_its_calls_as_they_are_written(parser, text, seed):
    tools = [Tool.model_validate({"type": "function", "function": {"name": n}}) for n in ("a", "b")]
    content, calls, pieces, final = _stream(ToolPlan(tools, "auto", parser=get_parser(parser)), text, seed)
    assert content == ""
    assert [(c.name, c.arguments) for c in final] == [("a", '{"x": "1 } 2"}'), ("b", "{}")]
    assert [(c["id"], c["name"], c["arguments"]) for c in calls.values()] == [
        (call.id, call.name, call.arguments) for call in final
    ]
    assert [p["index"] for p in pieces if "id" in p] == [0, 1]
    assert len(pieces) > 2  # not whole at the end


def test_a_mistral_call_that_is_no_list_comes_whole_at_the_end():
    plan = ToolPlan(
        [Tool.model_validate({"type": "function", "function": {"name": "a"}})], "auto", parser=get_parser("mistral")
    )
    content, calls, pieces, final = _stream(plan, '[TOOL_CALLS]{"name": "a", "arguments": {"x": 1}}', 0)
    assert [(c.name, c.arguments) for c in final] == [("a", '{"x": 1}')]
    assert pieces == [{"index": 0, **final[0].as_openai()}]

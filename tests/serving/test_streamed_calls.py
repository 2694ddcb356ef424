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


# a long text argument: quotes, a backslash, brackets, markers' characters, a newline and non-ASCII text, with a
# word halfway through that no format escapes (and no whitespace, newline or "<" before it)
TEXT = "def f(x):\n    return \"a\\\\b\" + {'k': [1]}  # <Zürich> \u2603 --HALFWAY-- tail\n    pass"
WRITE = {"path": "a.py", "text": TEXT, "n": 3}
WRITE_JSON = json.dumps(WRITE, ensure_ascii=False)
WRITE_TOOLS = [
    Tool.model_validate({"type": "function", "function": {"name": "write", "parameters": p}})
    for p in [
        {
            "type": "object",
            "properties": {"path": {"type": "string"}, "text": {"type": "string"}, "n": {"type": "integer"}},
        }
    ]
] + [Tool.model_validate({"type": "function", "function": {"name": "empty", "parameters": {"type": "object"}}})]
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI_CALL, KIMI_ARGUMENTS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
WRITTEN = {  # parser -> an output calling write(**WRITE), then empty() (harmony ends at its one call)
    "deepseek_v3": f"<｜tool▁calls▁begin｜>{DS_CALL}function{DS_SEP}write\n```json\n{WRITE_JSON}\n```{DS_CALL_END}"
    f"{DS_CALL}function{DS_SEP}empty\n```json\n{{}}\n```{DS_CALL_END}<｜tool▁calls▁end｜>",
    "deepseek_v31": f"<｜tool▁calls▁begin｜>{DS_CALL}write{DS_SEP}{WRITE_JSON}{DS_CALL_END}"
    f"{DS_CALL}empty{DS_SEP}{{}}{DS_CALL_END}<｜tool▁calls▁end｜>",
    "kimi_k2": f"<|tool_calls_section_begin|>{KIMI_CALL}functions.write:0{KIMI_ARGUMENTS}{WRITE_JSON}{KIMI_CALL_END}"
    f"{KIMI_CALL}functions.empty:1{KIMI_ARGUMENTS}{{}}{KIMI_CALL_END}<|tool_calls_section_end|>",
    "qwen3_coder": "<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=text>\n"
    f"{TEXT}\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=empty>\n</function>\n</tool_call>",
    "glm45": f"<tool_call>write\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n<arg_key>text</arg_key>\n"
    f"<arg_value>{TEXT}</arg_value>\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
    "<tool_call>empty\n</tool_call>",
    "pythonic": f"[write(path='a.py', text={TEXT!r}, n=3), empty()]",
    "llama4_pythonic": f"<|python_start|>[write(path='a.py', text={TEXT!r}, n=3), empty()]<|python_end|>",
    "openai": "<|channel|>analysis<|message|>Write it.<|end|><|start|>assistant<|channel|>commentary "
    f"to=functions.write <|constrain|>json<|message|>{WRITE_JSON}<|call|>",
}


def _write_plan(parser: str) -> ToolPlan:
    plan = ToolPlan.of(WRITE_TOOLS, "auto", True, get_parser(parser))
    assert plan is not None
    return plan


@pytest.mark.parametrize("parser", sorted(WRITTEN))
@pytest.mark.parametrize("seed", range(6))
def test_every_format_streams_its_calls_as_they_are_written_and_settles_to_the_parsed_calls(parser, seed):
    content, calls, pieces, final = _stream(_write_plan(parser), WRITTEN[parser], seed)
    assert content == ""
    expected = [("write", WRITE_JSON)] + ([] if parser == "openai" else [("empty", "{}")])
    assert [(c.name, c.arguments) for c in final] == expected
    assert [(c["id"], c["name"], c["arguments"]) for c in calls.values()] == [
        (call.id, call.name, call.arguments) for call in final
    ]
    assert [p["index"] for p in pieces if "id" in p] == list(range(len(expected)))
    if parser == "kimi_k2":
        assert [c.id for c in final] == ["functions.write:0", "functions.empty:1"]


@pytest.mark.parametrize("parser", sorted(WRITTEN))
def test_a_long_text_argument_streams_before_it_ends(parser):
    """Halfway through the text argument, the call is announced and its arguments are sent as far as they are
    written: the text so far where the format writes it as text or JSON, the arguments before it where each
    argument is a Python literal."""
    output = WRITTEN[parser]
    stream = _write_plan(parser).stream()
    delta = stream.feed(output[: output.index("HALFWAY")])
    [announce] = delta["tool_calls"]
    assert (announce["index"], announce["function"]["name"]) == (0, "write")
    pythonic = parser.endswith("pythonic")
    assert announce["function"]["arguments"] == (
        '{"path": "a.py"' if pythonic else WRITE_JSON[: WRITE_JSON.index("HALFWAY")]
    )


@pytest.mark.parametrize(
    ("parser", "output", "arguments"),
    [
        # a text parameter written "null" is null: nothing of it is sent until it cannot be
        (
            "qwen3_coder",
            "<tool_call>\n<function=write>\n<parameter=text>\nnull\n</parameter>\n</function>",
            '{"text": null}',
        ),
        (
            "qwen3_coder",
            "<tool_call>\n<function=write>\n<parameter=text>\nnullable\n</parameter>\n</function>",
            '{"text": "nullable"}',
        ),
        # a parameter the tool does not have keeps its text; one not typed text comes whole
        (
            "qwen3_coder",
            "<tool_call>\n<function=write>\n<parameter=other>\n[1, 2]\n</parameter>\n"
            "<parameter=n>\n-4\n</parameter>\n</function>",
            '{"other": "[1, 2]", "n": -4}',
        ),
        (
            "glm45",
            "<tool_call>write\n<arg_key>n</arg_key>\n<arg_value>[1, 2]</arg_value>\n"
            "<arg_key>text</arg_key><arg_value> x </arg_value></tool_call>",
            '{"n": [1, 2], "text": "x"}',
        ),
        (
            "pythonic",
            "[write(n=[1, (2, 3)], text='''a'b''', path=None)]",
            '{"n": [1, [2, 3]], "text": "a\'b", "path": null}',
        ),
        ("deepseek_v31", f'<｜tool▁calls▁begin｜>{DS_CALL}write{DS_SEP}  {{"n":1}} {DS_CALL_END}', '{"n": 1}'),
    ],
)
def test_each_value_streams_as_the_parser_types_it(parser, output, arguments):
    for seed in range(6):
        _, calls, _, final = _stream(_write_plan(parser), output, seed)
        assert [(c.name, c.arguments) for c in final] == [("write", arguments)]
        sent = calls[0]["arguments"]
        assert json.loads(sent) == json.loads(arguments)


@pytest.mark.parametrize(
    "output",
    ["[see (below)] for the answer.", "[1, 2, 3]", "[f(1)] is a list.", "[note(a, b=1)]"],
)
def test_a_pythonic_answer_in_brackets_announces_no_call_and_streams_as_content(output):
    for seed in range(3):
        content, calls, _, final = _stream(_write_plan("pythonic"), output, seed)
        assert (content, calls, final) == (output, {}, [])

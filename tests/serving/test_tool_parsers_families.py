"""The tool-call parsers of DeepSeek (V3/R1, V3.1), GLM-4.5, Qwen3-Coder, Kimi K2 and Llama 4 (pythonic), on
outputs in each format: whole, streamed cut anywhere, typed by the request's tools, malformed; and the special
tokens a server keeps in the text for the parsers whose markers are special tokens."""

from __future__ import annotations

import json

import pytest

from raypaged.serving.gateway.responses import ResponseShape
from raypaged.serving.gateway.tool_parsers import PARSERS, ToolParser, get_parser
from raypaged.serving.gateway.tools import Tool, ToolPlan
from tests.serving.conftest import serving, streamed_calls, streamed_chunks, tiny_config

WEATHER = {"city": "Paris", "days": 2}
PARAMETERS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
    "get_time": {"type": "object", "properties": {}},
}
# the DeepSeek and Kimi markers, as their tokenizers write them (full-width bars, lower one-eighth blocks)
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI_SECTION, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGUMENTS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def _ds_v3(name: str, arguments: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"


def _kimi(call_id: str, arguments: str) -> str:
    return f"{KIMI_CALL}{call_id}{KIMI_ARGUMENTS}{arguments}{KIMI_CALL_END}"


CASES = {  # name -> (output, content)
    "deepseek_v3": (
        "Let me check."
        + DS_CALLS
        + _ds_v3("get_weather", '{"city": "Paris", "days": 2}')
        + "\n"
        + _ds_v3("get_time", "{}")
        + DS_CALLS_END,
        "Let me check.",
    ),
    "deepseek_v31": (
        f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris", "days": 2}}{DS_CALL_END}'
        f"{DS_CALL}get_time{DS_SEP}{{}}{DS_CALL_END}{DS_CALLS_END}",
        None,
    ),
    "glm45": (
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>",
        "Let me check.\n",
    ),
    "qwen3_coder": (
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "Sure.\n",
    ),
    "kimi_k2": (
        "On it. "
        + KIMI_SECTION
        + _kimi("functions.get_weather:0", '{"city": "Paris", "days": 2}')
        + _kimi("functions.get_time:1", "{}")
        + KIMI_SECTION_END,
        "On it. ",
    ),
    "llama4_pythonic": ('<|python_start|>[get_weather(city="Paris", days=2), get_time()]<|python_end|>', None),
    "granite": (
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "arguments": {}}]',
        None,
    ),
    "phi4_mini_json": (
        'Checking. functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "parameters": {}}]',
        "Checking. ",
    ),
}
KIMI_IDS = ["functions.get_weather:0", "functions.get_time:1"]


def _parser(name: str) -> ToolParser:
    """The server's parser for ``name`` bound to a request with the two tools."""
    return get_parser(name).for_tools(PARAMETERS)


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list]:
    stream = parser.stream()
    sent = "".join(stream.feed(piece) for piece in pieces)
    rest, calls = stream.finish()
    return sent + rest, calls


def test_the_parsers_whose_markers_are_special_tokens_are_deepseeks_kimis_and_granites():
    assert sorted(n for n, p in PARSERS.items() if p.special_tokens) == [
        "deepseek_v3",
        "deepseek_v31",
        "granite",
        "kimi_k2",
    ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_format_gives_its_calls_and_the_content_before(name):
    output, content = CASES[name]
    found_content, calls = _parser(name).extract(output)
    assert found_content == content
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris", "days": 2}'),
        ("get_time", "{}"),
    ]
    if name == "kimi_k2":
        assert [c.id for c in calls] == KIMI_IDS
    else:
        assert all(c.id.startswith("chatcmpl-tool-") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_in_pieces_content_comes_first_and_calls_at_the_end(name, piece):
    output, content = CASES[name]
    text, calls = _streamed(_parser(name), [output[i : i + piece] for i in range(0, len(output), piece)])
    assert text == (content or "")
    assert _calls(calls) == [("get_weather", WEATHER), ("get_time", {})]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_stream_cut_in_two_anywhere_sends_only_the_content_and_gives_the_calls(name):
    output, content = CASES[name]
    for cut in range(1, len(output)):
        stream = _parser(name).stream()
        first = stream.feed(output[:cut])
        assert (content or "").startswith(first), (cut, first)  # never a piece of a marker
        second = stream.feed(output[cut:])
        rest, calls = stream.finish()
        assert first + second + rest == (content or "")
        assert _calls(calls) == [("get_weather", WEATHER), ("get_time", {})]


@pytest.mark.parametrize(
    ("name", "marker"),
    [
        ("deepseek_v3", DS_CALLS),
        ("deepseek_v31", DS_CALLS),
        ("glm45", "<tool_call>"),
        ("qwen3_coder", "<tool_call>"),
        ("qwen3_coder", "<function="),
        ("kimi_k2", KIMI_SECTION),
        ("kimi_k2", "<|tool_call_section_begin|>"),
    ],
)
def test_a_marker_split_across_deltas_is_held_back_and_a_lookalike_is_content(name, marker):
    for cut in range(1, len(marker)):
        stream = _parser(name).stream()
        assert stream.feed("Sure " + marker[:cut]) == "Sure "
        assert stream.feed(marker[cut:]) == ""
        assert stream.feed("garbage") == ""
        assert stream.finish() == (marker + "garbage", [])  # a section that does not parse is content
        stream = _parser(name).stream()
        assert stream.feed("a " + marker[:cut]) == "a "
        assert stream.feed("\x00") == marker[:cut] + "\x00"


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_text_is_content_and_streams_whole(name):
    text = "The weather in Paris is mild; no tool needed."
    assert _parser(name).extract(text) == (text, [])
    assert _streamed(_parser(name), list(text)) == (text, [])


@pytest.mark.parametrize(
    ("name", "output"),
    [
        ("deepseek_v3", DS_CALLS + DS_CALL + "function" + DS_SEP + 'get_weather\n```json\n{"city": '),  # cut short
        ("deepseek_v3", DS_CALLS + _ds_v3("get_weather", "{city: Paris}")),  # arguments not JSON
        ("deepseek_v3", DS_CALLS + _ds_v3("get_weather", '["Paris"]')),  # arguments not an object
        ("deepseek_v3", DS_CALLS + f'{DS_CALL}get_weather{DS_SEP}{{"city": "Paris"}}{DS_CALL_END}'),  # V3.1's
        ("deepseek_v31", DS_CALLS + _ds_v3("get_weather", '{"city": "Paris"}')),  # V3's
        ("deepseek_v31", f'{DS_CALL}get_weather{DS_SEP}{{"city": "Paris"}}{DS_CALL_END}'),  # no section begins
        ("kimi_k2", KIMI_SECTION + KIMI_CALL + 'functions.get_weather:0{"city": "Paris"}' + KIMI_CALL_END),
        ("kimi_k2", KIMI_SECTION + KIMI_CALL + "functions.get_weather" + KIMI_ARGUMENTS + "{}" + KIMI_CALL_END),
        ("kimi_k2", KIMI_SECTION + KIMI_CALL + "functions.get_weather:0" + KIMI_ARGUMENTS + '{"city": "Pa'),
        ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"),  # not closed
        ("glm45", "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),  # no name
        ("qwen3_coder", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'),  # Hermes' JSON
        ("qwen3_coder", "<tool_call>\n<function=get_weather\n</function>\n</tool_call>"),  # no '>'
        ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city\n</function>\n</tool_call>"),
        ("llama4_pythonic", '<|python_start|>[get_weather("Paris")]<|python_end|>'),  # positional
        ("llama4_pythonic", "<|python_start|>[get_weather(cities={1, 2})]<|python_end|>"),  # a set: not JSON
        ("llama4_pythonic", "<|python_start|>[get_weather(city="),
    ],
)
def test_a_section_that_does_not_parse_is_content(name, output):
    assert _parser(name).extract(output) == (output, [])
    assert _streamed(_parser(name), list(output)) == (output, [])


def test_deepseek_v3_arguments_may_span_lines_and_a_call_cut_short_after_whole_ones_is_left_out():
    pretty = '{\n  "city": "Paris",\n  "days": 2\n}'
    output = DS_CALLS + _ds_v3("get_weather", pretty) + "\n" + DS_CALL + "function" + DS_SEP + "get_time" + DS_CALLS_END
    assert _calls(get_parser("deepseek_v3").extract(output)[1]) == [("get_weather", WEATHER)]


def test_kimi_ids_are_the_models_and_name_the_function_without_its_namespace():
    output = (
        "<|tool_call_section_begin|>"  # the singular variant Kimi also writes
        + _kimi(" functions.get_weather:3 ", ' {"city": "Paris"} ')
        + _kimi("get_time:4", "{}")
        + "<|tool_call_section_end|>"
    )
    content, calls = get_parser("kimi_k2").extract(output)
    assert content is None
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("functions.get_weather:3", "get_weather", '{"city": "Paris"}'),
        ("get_time:4", "get_time", "{}"),
    ]
    assert calls[0].as_openai() == {
        "id": "functions.get_weather:3",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


GLM_VALUES = {  # arg_value -> (typed by a string parameter, typed by an integer one, untyped)
    "123": ("123", 123, 123),
    "Paris": ("Paris", "Paris", "Paris"),
    "true": ("true", True, True),
    "null": ("null", None, None),
    "[1, 2]": ("[1, 2]", [1, 2], [1, 2]),
    "{'a': True}": ("{'a': True}", {"a": True}, {"a": True}),  # a Python literal
    "1e999": ("1e999", "1e999", "1e999"),  # infinite: JSON cannot hold it
    "{1, 2}": ("{1, 2}", "{1, 2}", "{1, 2}"),  # a set: nor that
}


@pytest.mark.parametrize("value", sorted(GLM_VALUES))
def test_glm45_values_are_strings_only_where_the_schema_says_so(value):
    output = (
        f"<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>{value}</arg_value>\n"
        f"<arg_key>n</arg_key>\n<arg_value>{value}</arg_value>\n"
        f"<arg_key>u</arg_key>\n<arg_value> {value} </arg_value>\n</tool_call>"
    )
    schema = {"properties": {"s": {"type": "string"}, "n": {"type": "integer"}}}
    [call] = get_parser("glm45").for_tools({"f": schema}).extract(output)[1]
    as_string, as_integer, untyped = GLM_VALUES[value]
    assert json.loads(call.arguments) == {"s": as_string, "n": as_integer, "u": untyped}
    # the server's parser, for a request with no tools (or a tool it does not have): nothing is a string
    [call] = get_parser("glm45").extract(output)[1]
    assert json.loads(call.arguments) == {"s": untyped, "n": untyped, "u": untyped}


@pytest.mark.parametrize(
    ("schema", "text", "value"),
    [
        ({"type": "string"}, "123", "123"),
        ({"type": "string"}, "null", None),  # null is null whatever the type
        ({"type": "enum"}, "2", "2"),
        ({}, "2", "2"),  # no type: a string
        ({"type": "integer"}, "42", 42),
        ({"type": "integer"}, "4.2", "4.2"),  # not an integer: the text
        ({"type": "int64"}, "-7", -7),
        ({"type": "number"}, "2.5", 2.5),
        ({"type": "number"}, "3.0", 3),  # a whole number is an integer
        ({"type": "number"}, "inf", "inf"),  # JSON cannot hold it
        ({"type": "float"}, "x", "x"),
        ({"type": "boolean"}, "True", True),
        ({"type": "boolean"}, "yes", False),  # only true is true
        ({"type": "object"}, '{"a": [1, null]}', {"a": [1, None]}),
        ({"type": "object"}, "{'a': None}", {"a": None}),  # a Python literal
        ({"type": "array"}, "[1, 2", "[1, 2"),  # neither: the text
        ({"type": "dict"}, '{"a": 1}', {"a": 1}),
        ({"type": ["integer", "null"]}, "5", 5),  # another type: a Python literal
        ({"type": "tuple"}, "true", "true"),  # JSON is not read for those
    ],
)
def test_qwen3_coder_values_are_typed_by_the_parameters_schema(schema, text, value):
    output = f"<tool_call>\n<function=f>\n<parameter=p>\n{text}\n</parameter>\n</function>\n</tool_call>"
    [call] = (
        get_parser("qwen3_coder").for_tools({"f": {"type": "object", "properties": {"p": schema}}}).extract(output)[1]
    )
    assert json.loads(call.arguments) == {"p": value}


def test_qwen3_coder_without_the_tools_schema_keeps_texts_and_reads_what_vllm_reads_of_open_tags():
    output = (
        "<function=get_weather>\n<parameter=city>\nNew\nYork\n<parameter=days>\n2\n</function>\n"
        "<function=get_time>\n<parameter=zone>\nnull"
    )
    content, calls = get_parser("qwen3_coder").extract(output)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "New\\nYork", "days": "2"}'),
        ("get_time", '{"zone": null}'),
    ]
    assert get_parser("qwen3_coder").for_tools({"other": PARAMETERS["get_weather"]}).extract(output)[1][
        0
    ].arguments == ('{"city": "New\\nYork", "days": "2"}')


def test_a_parser_bound_to_a_requests_tools_leaves_the_servers_untyped():
    server = get_parser("qwen3_coder")
    bound = server.for_tools(PARAMETERS)
    assert type(bound) is type(server) and bound is not server
    output = CASES["qwen3_coder"][0]
    assert server.extract(output)[1][0].arguments == '{"city": "Paris", "days": "2"}'
    assert bound.extract(output)[1][0].arguments == '{"city": "Paris", "days": 2}'
    hermes = get_parser("hermes")
    assert hermes.for_tools(PARAMETERS) is hermes  # JSON arguments: nothing to type


def test_llama4_pythonic_reads_calls_with_or_without_the_python_markers():
    parser = get_parser("llama4_pythonic")
    assert _calls(parser.extract('  [get_weather(city="Paris", days=2)]')[1]) == [("get_weather", WEATHER)]
    assert _calls(parser.extract("<|python_start|>[get_time()]<|python_end|><|python_end|>")[1]) == [("get_time", {})]
    stream = parser.stream()
    assert [stream.feed(p) for p in ("<|python", "_st", "Hello")] == ["", "", "<|python_stHello"]


TOOLS = [
    Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p}}) for n, p in PARAMETERS.items()
]


def _shape(name: str) -> ResponseShape:
    plan = ToolPlan.of(TOOLS, "auto", True, _parser(name))
    return ResponseShape(True, "m", 1, False, plan)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_chat_answer_with_calls_finishes_with_tool_calls(name):
    output, content = CASES[name]
    message, finish_reason = _shape(name).message(output, "stop")
    calls = message.pop("tool_calls")
    assert (message, finish_reason) == ({"role": "assistant", "content": content}, "tool_calls")
    assert [(c["type"], c["function"]) for c in calls] == [
        ("function", {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}),
        ("function", {"name": "get_time", "arguments": "{}"}),
    ]
    assert _shape(name).message("No tool needed.", "stop") == (
        {"role": "assistant", "content": "No tool needed."},
        "stop",
    )


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("size", [1, 5])
def test_a_chat_stream_sends_the_content_as_it_comes_and_the_calls_with_no_marker(name, size):
    """Every format streams each call as it is written."""
    output, content = CASES[name]
    pieces = [output[i : i + size] for i in range(0, len(output), size)]
    deltas, finish_reasons = streamed_chunks(_shape(name), pieces)
    assert "".join(d.get("content") or "" for d in deltas) == (content or "")
    calls = streamed_calls(deltas)
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
        {"name": "get_time", "arguments": "{}"},
    ]
    assert all(c["id"] for c in calls)
    assert len([d for d in deltas if "tool_calls" in d]) > 2  # not whole in the last chunk
    if name == "kimi_k2":
        assert [c["id"] for c in calls] == KIMI_IDS
    assert finish_reasons[-1] == "tool_calls"


def test_a_request_s_plan_binds_the_parser_to_its_tools():
    """``ToolPlan.of`` hands the request's own parameter schemas to the server's parser (Qwen3-Coder's values typed
    by them); without ``auto`` the plan has no parser."""
    tools = [
        Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
        for n, p in PARAMETERS.items()
    ]
    plan = ToolPlan.of(tools, "auto", True, get_parser("qwen3_coder"))
    assert plan is not None and plan.parser is not None
    assert plan.parser.extract(CASES["qwen3_coder"][0])[1][0].arguments == '{"city": "Paris", "days": 2}'
    none = ToolPlan.of(tools, "none", True, get_parser("qwen3_coder"))
    assert none is not None and none.parser is None


KIMI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS["get_weather"]}}]


@pytest.fixture(scope="module")
def kimi_http(tiny_model_dir):
    """A real server reading Kimi K2's calls; its answers are forced to the Kimi case's text (a structured-outputs
    choice: SmolLM2's tokenizer writes the markers as plain text)."""
    yield from serving(
        [tiny_config(tiny_model_dir, "tiny", max_model_len=512)],
        enable_auto_tool_choice=True,
        tool_call_parser="kimi_k2",
        enable_scale_out=True,
    )


def _kimi_chat(**extra) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 300,
        "temperature": 0,
        "structured_outputs": {"choice": [CASES["kimi_k2"][0]]},
        **extra,
    }


def test_a_kimi_server_answers_calls_keeps_special_tokens_and_refuses_skipping_them_by_name(kimi_http):
    answer = kimi_http.post("/v1/chat/completions", json=_kimi_chat(tools=KIMI_TOOLS)).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert (choice["message"]["content"], [c["id"] for c in choice["message"]["tool_calls"]]) == ("On it. ", KIMI_IDS)
    text = kimi_http.post("/v1/chat/completions", json=_kimi_chat(tools=KIMI_TOOLS, stream=True)).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "On it. " and "<|" not in text
    assert [c["id"] for c in streamed_calls(deltas)] == KIMI_IDS
    rendered = kimi_http.post("/v1/chat/completions/render", json=_kimi_chat(tools=KIMI_TOOLS)).json()
    assert rendered["sampling_params"]["skip_special_tokens"] is False
    plain = kimi_http.post("/v1/chat/completions/render", json=_kimi_chat(tools=KIMI_TOOLS, tool_choice="none"))
    assert "skip_special_tokens" not in plain.json()["sampling_params"]  # no calls read: the default, true
    refused = kimi_http.post("/v1/chat/completions", json=_kimi_chat(tools=KIMI_TOOLS, skip_special_tokens=True))
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "skip_special_tokens true would erase the markers that --tool-call-parser kimi_k2 reads in the answer; "
        "send the request without it"
    )
    assert refused.json()["error"]["param"] == "skip_special_tokens"


def test_granite_31s_text_marker_starts_the_calls_too():
    content, calls = get_parser("granite").extract('<tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    assert (content, [(c.name, c.arguments) for c in calls]) == (None, [("get_time", '{"zone": "UTC"}')])

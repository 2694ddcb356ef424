"""OpenAI tools through the official client, with SmolLM2 and a Hermes-style tool template."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from raypaged.config import EngineConfig
from tests.serving.conftest import Stack, tiny_config

pytestmark = pytest.mark.slow
TEMPLATE = Path(__file__).with_name("hermes_tool_template.jinja")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# two earlier turns in Hermes format: enough for SmolLM2 to answer the third the same way
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "London"}'}}
        ],
    },
    {"role": "user", "content": "What is the weather in Berlin?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}}
        ],
    },
    *ASK,
]


def hermes_smollm2(smollm2_dir) -> EngineConfig:
    """SmolLM2 fp32 served as "smollm2" with the Hermes-style tool template."""
    return EngineConfig(
        model=str(smollm2_dir),
        served_model_name="smollm2",
        dtype="float32",
        num_gpu_blocks_override=512,
        max_model_len=2048,
        chat_template=str(TEMPLATE),
    )


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    stack = Stack([hermes_smollm2(smollm2_dir)], enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none")


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(stream) -> tuple[str, dict[int, dict], str | None]:
    """(content, tool calls by index as joined from their deltas, finish reason)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            call["name"] += piece.function.name or "" if piece.function else ""
            call["arguments"] += piece.function.arguments or "" if piece.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_required_always_gives_valid_calls(client, temperature):
    chat = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
        temperature=temperature,
        seed=2,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls)


def test_required_streamed(client):
    """Each call's id and name come as soon as its name is whole, then its arguments as they are written (the
    whole calls used to come in the last chunk); joined, they are the calls of the same request unstreamed."""
    asked = {"model": "smollm2", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80}
    whole = client.chat.completions.create(**asked, temperature=0).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(**asked, temperature=0, stream=True))
    content, calls, finish = _streamed_calls(chunks)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert call["id"].startswith("chatcmpl-tool-")
    pieces = [p for chunk in chunks if chunk.choices for p in chunk.choices[0].delta.tool_calls or ()]
    first = pieces[0]
    assert first.id == calls[0]["id"] and first.function.name == whole[0].function.name
    assert all(p.id is None and p.function.name is None for p in pieces if p.index == 0 and p is not first)
    assert len([p for p in pieces if p.index == 0]) > 3  # the arguments came in pieces


def test_parallel_tool_calls_false_makes_one_call(client):
    chat = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0.8,
        seed=4,
    )
    assert len(chat.choices[0].message.tool_calls) == 1


def test_a_named_function_is_called_with_valid_arguments(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    chat = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=40, temperature=0
    )
    [call] = chat.choices[0].message.tool_calls
    assert call.function.name == "get_time" and chat.choices[0].finish_reason == "stop"
    _check_calls([call])
    stream = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=40, temperature=0, stream=True
    )
    content, calls, _ = _streamed_calls(stream)
    assert content == "" and [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_time", call.function.arguments)
    ]


def test_auto_parses_hermes_calls_whole_and_streamed(client):
    chat = client.chat.completions.create(model="smollm2", messages=FEW_SHOT, tools=TOOLS, max_tokens=60, temperature=0)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    chunks = list(
        client.chat.completions.create(
            model="smollm2", messages=FEW_SHOT, tools=TOOLS, max_tokens=60, temperature=0, stream=True
        )
    )
    content, calls, finish = _streamed_calls(chunks)
    assert (content, finish) == ("", "tool_calls")
    # the call's name came once whole, its arguments as written: joined, the model's text of them
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", '{"city": "Paris"}')]
    pieces = [p for chunk in chunks if chunk.choices for p in chunk.choices[0].delta.tool_calls or ()]
    assert pieces[0].id == calls[0]["id"] and pieces[0].function.name == "get_weather"
    assert len(pieces) > 2 and all(p.id is None and p.function.name is None for p in pieces[1:])


def test_auto_answers_plain_text_as_content(client):
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=12,
        temperature=0,
    )
    assert chat.choices[0].message.content and not chat.choices[0].message.tool_calls


def test_the_tool_result_goes_back_through_the_template(stack):
    turns = [*FEW_SHOT[:2], {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]
    with stack.client() as http:
        ids = http.post("/tokenize", json={"model": "smollm2", "messages": turns}).json()["tokens"]
        text = http.post("/detokenize", json={"model": "smollm2", "tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "London"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text


def test_tool_choice_none_shows_the_tools_but_parses_nothing(client):
    chat = client.chat.completions.create(
        model="smollm2", messages=FEW_SHOT, tools=TOOLS, tool_choice="none", max_tokens=60, temperature=0
    )
    assert chat.choices[0].message.content.startswith("<tool_call>") and not chat.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice names function 'nope', which is not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice required or a named function already constrains the output; send response_format or "
            "structured outputs without it",
        ),
        (
            {"tools": [TOOLS[0], TOOLS[0]]},
            "tools must have distinct function names, got ['get_weather', 'get_weather']",
        ),
        (
            {"chat_template": "{{ messages }}"},
            "chat_template in a request is refused: start the server with --trust-request-chat-template to allow it",
        ),
        (
            {"add_generation_prompt": True, "continue_final_message": True},
            "continue_final_message and add_generation_prompt cannot both be true",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400(client, extra, message):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="smollm2",
            messages=ASK,
            max_tokens=4,
            **{k: v for k, v in extra.items() if k in ("tools", "tool_choice", "response_format")},
            extra_body={k: v for k, v in extra.items() if k not in ("tools", "tool_choice", "response_format")},
        )
    assert raised.value.body["message"] == message


def test_auto_needs_the_servers_parser(tiny_model_dir):
    stack = Stack([tiny_config(tiny_model_dir, "tiny")])
    try:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none")
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4)
    finally:
        stack.close()
    assert raised.value.body["message"] == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )

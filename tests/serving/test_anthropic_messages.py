"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the official ``anthropic``
client, against SmolLM2 behind the gateway (Hermes tools, the qwen3 reasoning format, an API key): the answers and
usage of the same chat completions, whole and streamed; stop sequences, tool use, thinking, token counts,
``cache_control`` and the prefix cache's usage, the key in ``x-api-key``, and what is refused, by name, in Anthropic's
error shape."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest

from raypaged.config import EngineConfig
from raypaged.serving.gateway.anthropic import MessagesRequest
from raypaged.serving.gateway.anthropic_events import MessageEvents, stop, usage
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.guard import check_exempt_paths
from raypaged.serving.proto import generate_pb2 as pb
from tests.serving.conftest import Stack, tiny_config
from tests.serving.test_tools_openai import FEW_SHOT, TEMPLATE, TIME, TOOLS, WEATHER
from tests.structured.test_reasoning_structured import ONE_SHOT

pytestmark = pytest.mark.slow
KEY = "sk-messages"
SYSTEM = "Answer in one sentence."
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}  # the SDK sends sampling fields as extra_body
BLOCK_SIZE = 16  # the stack's KV-cache blocks (EngineConfig's default)
EPHEMERAL = {"type": "ephemeral"}
MARK = {"cache_control": EPHEMERAL}
USER = [{"role": "user", "content": "Hi"}]
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "description": "Time in a zone", "input_schema": TIME},
]
# test_tools_openai's FEW_SHOT, its tool calls as tool_use blocks
ASKS_WEATHER = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "London"}}],
    },
    {"role": "user", "content": "What is the weather in Berlin?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "c2", "name": "get_weather", "input": {"city": "Berlin"}}],
    },
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    config = EngineConfig(
        model=str(smollm2_dir),
        served_model_name="smollm2",
        dtype="float32",
        num_gpu_blocks_override=512,
        max_model_len=2048,
        chat_template=str(TEMPLATE),
        structured_outputs_config={"reasoning_parser": "qwen3"},
    )
    stack = Stack(
        [config], api_key=KEY, enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def client(stack):
    return anthropic.Anthropic(base_url=stack.url, api_key=KEY)


@pytest.fixture(scope="module")
def chat_client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY)


@pytest.fixture(scope="module")
def http(stack):
    with stack.client(headers={"x-api-key": KEY}) as http:
        yield http


def without_ids(message: anthropic.types.Message) -> dict:
    """The message without what differs between two sends of one request: its id and its tool_use blocks' (each
    request makes its own), and how its prompt tokens split between the prefix cache and the input (the first send
    writes the blocks the next reads): their sum is kept."""
    dumped = message.model_dump(exclude={"id"})
    for block in dumped["content"]:
        if block["type"] == "tool_use":
            assert re.fullmatch("toolu_[0-9a-f]{32}", block.pop("id"))
    dumped["usage"] = {"prompt_tokens": num_prompt_tokens(message.usage), "output_tokens": message.usage.output_tokens}
    return dumped


def usage_of(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> dict:
    """Anthropic's usage of a prompt whose first ``num_cached_tokens`` were read from the prefix cache: the rest of
    its full blocks are written to the cache, its last partial block's tokens are the input."""
    num_in_full_blocks = num_prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    return {
        "input_tokens": num_prompt_tokens - num_in_full_blocks,
        "cache_creation_input_tokens": num_in_full_blocks - num_cached_tokens,
        "cache_read_input_tokens": num_cached_tokens,
        "output_tokens": num_output_tokens,
    }


def all_cached(num_prompt_tokens: int) -> int:
    """The tokens a prompt sent before reads from the cache: its full blocks, never its last token."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def num_prompt_tokens(usage: anthropic.types.Usage) -> int:
    assert usage.cache_read_input_tokens is not None and usage.cache_creation_input_tokens is not None
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event; the name is the data's type."""
    events = []
    for block in response.text.strip().split("\n\n"):
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(name == data["type"] for name, data in events)
    return events


def test_a_message_is_the_chat_completion_of_its_conversation_whole_and_streamed(client, chat_client, http):
    asked = {
        "model": "smollm2",
        "max_tokens": 24,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    message = client.messages.create(**asked, extra_body=GREEDY)
    chat = chat_client.chat.completions.create(
        model="smollm2",
        max_tokens=24,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    )
    assert chat.choices[0].message.content == "The capital of France is Paris."
    assert message.id.startswith("msg_") and (message.type, message.role, message.model) == (
        "message",
        "assistant",
        "smollm2",
    )
    assert [block.model_dump(exclude_none=True) for block in message.content] == [
        {"type": "text", "text": "The capital of France is Paris."}
    ]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert (num_prompt_tokens(message.usage), message.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    with client.messages.stream(**asked, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.usage.model_dump(exclude_none=True) == usage_of(
        chat.usage.prompt_tokens, all_cached(chat.usage.prompt_tokens), chat.usage.completion_tokens
    )
    assert without_ids(streamed) == without_ids(message)
    raw = http.post("/v1/messages", json={**asked, **GREEDY, "stream": True})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    names = [name for name, _ in events]
    num_deltas = len(names) - 5
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * num_deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start, block_start, *deltas, block_stop, message_delta, message_stop = (data for _, data in events)
    assert start["message"] == {
        "id": start["message"]["id"],
        "type": "message",
        "role": "assistant",
        "model": "smollm2",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage_of(chat.usage.prompt_tokens, all_cached(chat.usage.prompt_tokens), 1),
    }
    assert block_start == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == "The capital of France is Paris."
    assert block_stop == {"type": "content_block_stop", "index": 0}
    assert message_delta == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": usage_of(chat.usage.prompt_tokens, all_cached(chat.usage.prompt_tokens), chat.usage.completion_tokens),
    }
    assert message_stop == {"type": "message_stop"}


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    asked = {
        "model": "smollm2",
        "max_tokens": 24,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
        "stop_sequences": ["never", " Paris"],
    }
    message = client.messages.create(**asked, extra_body=GREEDY)
    assert message.content[0].text == "The capital of France is"
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", " Paris")
    with client.messages.stream(**asked, extra_body=GREEDY) as stream:
        assert without_ids(stream.get_final_message()) == without_ids(message)


def test_a_tool_call_is_a_tool_use_block_whole_and_streamed(client, chat_client):
    message = client.messages.create(
        model="smollm2", max_tokens=60, messages=ASKS_WEATHER, tools=ANTHROPIC_TOOLS, extra_body=GREEDY
    )
    chat = chat_client.chat.completions.create(
        model="smollm2", max_tokens=60, messages=FEW_SHOT, tools=TOOLS, temperature=0
    )
    [call] = chat.choices[0].message.tool_calls
    [block] = message.content
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert json.loads(call.function.arguments) == block.input
    assert (message.stop_reason, message.stop_sequence) == ("tool_use", None)
    assert (num_prompt_tokens(message.usage), message.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    with client.messages.stream(
        model="smollm2", max_tokens=60, messages=ASKS_WEATHER, tools=ANTHROPIC_TOOLS, extra_body=GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert without_ids(streamed) == without_ids(message)


def test_a_named_tool_streams_its_input_as_json_deltas(client, http):
    asked = {
        "model": "smollm2",
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "get_time"},
        "thinking": {"type": "disabled"},  # the call from the first token: no reasoning section before it
    }
    message = client.messages.create(**asked, extra_body=GREEDY)
    [block] = message.content
    assert (block.type, block.name, message.stop_reason) == ("tool_use", "get_time", "tool_use")
    assert block.input == {"zone": "UTC"}
    raw = http.post("/v1/messages", json={**asked, **GREEDY, "stream": True})
    events = [data for _, data in sse_events(raw)]
    assert events[1]["content_block"] == {
        "type": "tool_use",
        "id": events[1]["content_block"]["id"],
        "name": "get_time",
        "input": {},
    }
    parts = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert json.loads("".join(parts)) == {"zone": "UTC"} and len(parts) > 1
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    inputs = []  # cut by max_tokens: the input is what the SDK's stream helper assembles from the same deltas
    for max_tokens in range(2, len(parts) + 1):
        cut = client.messages.create(**asked | {"max_tokens": max_tokens}, extra_body=GREEDY)
        with client.messages.stream(**asked | {"max_tokens": max_tokens}, extra_body=GREEDY) as stream:
            assert without_ids(stream.get_final_message()) == without_ids(cut)
        assert cut.stop_reason == "max_tokens"
        inputs.append(cut.content[0].input)
    assert inputs[-1] == {"zone": "UTC"} and {} in inputs
    any_one = {"type": "any", "disable_parallel_tool_use": True}  # chat's required, without parallel calls
    message = client.messages.create(**asked | {"tool_choice": any_one}, extra_body=GREEDY)
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    assert message.stop_reason == "tool_use"


def test_thinking_is_the_reasoning_with_its_budget(client, chat_client):
    asked = {
        "model": "smollm2",
        "max_tokens": 40,
        "system": ONE_SHOT[0]["content"],
        "messages": ONE_SHOT[1:],
        "thinking": {"type": "enabled", "budget_tokens": 3},
    }
    message = client.messages.create(**asked, extra_body=GREEDY)
    chat = chat_client.chat.completions.create(
        model="smollm2",
        max_tokens=40,
        temperature=0,
        messages=ONE_SHOT,
        extra_body={"thinking_token_budget": 3, "chat_template_kwargs": {"enable_thinking": True}},
    )
    answer = chat.choices[0].message
    assert [block.model_dump(exclude_none=True) for block in message.content] == [
        {"type": "thinking", "thinking": answer.reasoning_content, "signature": ""},
        {"type": "text", "text": answer.content},
    ]
    assert answer.reasoning_content == "The Colosse"  # three tokens, then the budget closed the section
    assert (message.stop_reason, chat.choices[0].finish_reason) == ("end_turn", "stop")
    assert (num_prompt_tokens(message.usage), message.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    with client.messages.stream(**asked, extra_body=GREEDY) as stream:
        assert without_ids(stream.get_final_message()) == without_ids(message)


def test_thinking_needs_the_servers_reasoning_parser():
    request = MessagesRequest.model_validate(
        {
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 8},
        }
    )
    with pytest.raises(APIError) as raised:
        request.chat_body(reasoning=False, prefix_caching=True)
    assert raised.value.message == (
        "thinking is not supported by this server: it needs --reasoning-parser (which finds the reasoning the "
        "thinking blocks hold); send the request without it"
    )
    assert request.chat_body(reasoning=True, prefix_caching=True)["thinking_token_budget"] == 8


def test_count_tokens_is_the_chat_templates_prompt(client, http, chat_client):
    counted = client.messages.count_tokens(model="smollm2", messages=ASKS_WEATHER, tools=ANTHROPIC_TOOLS)
    tokenized = http.post("/tokenize", json={"model": "smollm2", "messages": FEW_SHOT, "tools": TOOLS}).json()
    assert counted.input_tokens == tokenized["count"]
    failed = [
        *ASKS_WEATHER[:2],
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "c1",
                    "content": [{"type": "text", "text": "Unknown city"}],
                    "is_error": True,
                }
            ],
        },
    ]
    as_chat = [*FEW_SHOT[:2], {"role": "tool", "tool_call_id": "c1", "content": "Error: Unknown city"}]
    counted = client.messages.count_tokens(model="smollm2", messages=failed, tools=ANTHROPIC_TOOLS)
    tokenized = http.post("/tokenize", json={"model": "smollm2", "messages": as_chat, "tools": TOOLS}).json()
    assert counted.input_tokens == tokenized["count"]
    text = http.post("/detokenize", json={"model": "smollm2", "tokens": tokenized["tokens"]}).json()["prompt"]
    assert "<tool_response>\nError: Unknown city\n</tool_response>" in text


def chat_body(body: dict) -> dict:
    return MessagesRequest.model_validate(body).chat_body(reasoning=True, prefix_caching=True)


def test_cache_control_marks_change_nothing_but_where_the_prompt_comes_from(client):
    plain = {
        "model": "smollm2",
        "max_tokens": 60,
        "system": [{"type": "text", "text": "Call a tool when it helps."}],
        "messages": ASKS_WEATHER,
        "tools": ANTHROPIC_TOOLS,
    }
    marked = plain | {
        "system": [plain["system"][0] | MARK],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": ASKS_WEATHER[0]["content"], **MARK}]},
            {"role": "assistant", "content": [ASKS_WEATHER[1]["content"][0] | MARK]},
            *ASKS_WEATHER[2:],
        ],
        "tools": [ANTHROPIC_TOOLS[0], ANTHROPIC_TOOLS[1] | MARK],
        "cache_control": EPHEMERAL,  # the request's own: its last part
    }
    assert chat_body(marked) == chat_body(plain)
    result = {"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": "Rain"}]}
    answered = {"max_tokens": 8, "messages": [*ASKS_WEATHER[:2], {"role": "user", "content": [result]}]}
    marked_result = result | MARK | {"content": [result["content"][0] | MARK]}
    assert chat_body(answered | {"messages": [*ASKS_WEATHER[:2], {"role": "user", "content": [marked_result]}]}) == (
        chat_body(answered)
    )
    first, again = (client.messages.create(**body, extra_body=GREEDY) for body in (plain, marked))
    assert [(b.type, b.name, b.input) for b in again.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    assert without_ids(again) == without_ids(first)
    num_tokens = num_prompt_tokens(first.usage)
    assert again.usage.model_dump(exclude_none=True) == usage_of(
        num_tokens, all_cached(num_tokens), first.usage.output_tokens
    )


LONG_SYSTEM = (
    "You are the prefix cache's test assistant. Every request of this test begins with these sentences, so the "
    "server computes their KV blocks once and reads them from its prefix cache for every later request."
)


def test_the_prompt_read_from_the_prefix_cache_is_cache_read_input_tokens(client, chat_client):
    asked = {
        "model": "smollm2",
        "max_tokens": 8,
        "system": [{"type": "text", "text": LONG_SYSTEM, **MARK}],
        "messages": [{"role": "user", "content": QUESTION}],
    }
    first = client.messages.create(**asked, extra_body=GREEDY)
    second = client.messages.create(**asked, extra_body=GREEDY)
    chat = chat_client.chat.completions.create(
        model="smollm2",
        max_tokens=8,
        temperature=0,
        messages=[{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": QUESTION}],
    )
    assert chat.usage.prompt_tokens_details is None  # the chat route answers as the gateway's option says
    assert chat.usage.prompt_tokens == 61  # three full blocks and 13 tokens
    assert first.usage.model_dump(exclude_none=True) == {
        "input_tokens": 13,
        "cache_creation_input_tokens": 48,  # its three full blocks, now in the cache
        "cache_read_input_tokens": 0,
        "output_tokens": chat.usage.completion_tokens,
    }
    assert second.usage.model_dump(exclude_none=True) == {
        "input_tokens": 13,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 48,
        "output_tokens": chat.usage.completion_tokens,
    }
    with client.messages.stream(**asked, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump(exclude={"id"}) == second.model_dump(exclude={"id"})


def test_usage_splits_the_prompt_between_the_prefix_cache_and_the_input():
    def chat_usage(num_prompt_tokens: int, num_cached_tokens: int) -> dict:
        details = {"cached_tokens": num_cached_tokens}
        return {"prompt_tokens": num_prompt_tokens, "completion_tokens": 3, "prompt_tokens_details": details}

    def split(found: dict) -> tuple[int, int, int]:
        return found["input_tokens"], found["cache_creation_input_tokens"], found["cache_read_input_tokens"]

    assert split(usage(chat_usage(61, 0), 16)) == (13, 48, 0)
    assert split(usage(chat_usage(61, 32), 16)) == (13, 16, 32)
    assert split(usage(chat_usage(32, 16), 16)) == (0, 16, 16)  # the last full block, computed again
    assert split(usage(chat_usage(61, 0), None)) == (61, 0, 0)  # no prefix cache: nothing read or written
    assert usage(chat_usage(61, 0), 16)["output_tokens"] == 3


@pytest.mark.parametrize(
    ("mark", "param"),
    [
        ({"type": "ephemeral", "ttl": "5m"}, "system.0.cache_control.ttl"),
        ({"type": "x"}, "system.0.cache_control.type"),
    ],
)
def test_a_refused_mark_is_named_as_the_param(mark, param):
    with pytest.raises(APIError) as raised:
        MessagesRequest.model_validate(
            {"max_tokens": 8, "messages": USER, "system": [{"type": "text", "text": "Hi", "cache_control": mark}]}
        )
    assert (raised.value.status, raised.value.param) == (400, param)


def test_cache_control_is_refused_where_the_model_has_no_prefix_cache(stack, tiny_model_dir):
    assert [info.enable_prefix_caching for info in stack.grpc_stub().Info(pb.InfoRequest()).models] == [True]
    uncached = Stack([tiny_config(tiny_model_dir, "tiny", enable_prefix_caching=False)])
    try:
        [info] = uncached.grpc_stub().Info(pb.InfoRequest()).models
        asked = {"model": "tiny", "max_tokens": 2, "system": LONG_SYSTEM, "messages": USER}
        marked = asked | {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", **MARK}]}]}
        with uncached.client() as http:
            answers = [http.post("/v1/messages", json=asked | GREEDY) for _ in range(2)]
            refused = [
                http.post("/v1/messages", json=marked),
                http.post("/v1/messages/count_tokens", json={k: v for k, v in marked.items() if k != "max_tokens"}),
            ]
    finally:
        uncached.close()
    assert info.enable_prefix_caching is False
    for answer in answers:  # nothing is cached, nothing is read
        assert answer.json()["usage"] == {
            "input_tokens": 55,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 2,
        }
    message = (
        "messages.0.content.0.cache_control is not supported by this server: it runs without its prefix cache "
        "(--no-enable-prefix-caching), so nothing is cached for later requests; send the request without it"
    )
    for answer in refused:
        assert (answer.status_code, answer.json()) == (
            400,
            {"type": "error", "error": {"type": "invalid_request_error", "message": message}},
        )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
            "the model smollm2 reads text only (no images)",
        ),
        (
            {"system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
            "system.0.cache_control.ttl is not supported by this server: its prefix cache frees the least recently "
            "used blocks when it needs room, so it promises no lifetime; send cache_control without it",
        ),
        (
            {"tools": [ANTHROPIC_TOOLS[0] | {"cache_control": {"type": "persistent"}}]},
            "tools.0.cache_control.type 'persistent' is not supported by this server: cache_control takes type "
            "'ephemeral'",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm", **MARK}]}]},
            "messages.1.content.0.cache_control is not supported by this server; send the request without it",
        ),
        ({"service_tier": "auto"}, "service_tier is not supported by this server; send the request without it"),
        ({"container": "c"}, "container is not supported by this server; send the request without it"),
        (
            {"mcp_servers": [{"type": "url"}]},
            "mcp_servers is not supported by this server; send the request without it",
        ),
        ({"top_logprobs": 2}, "top_logprobs is not supported by this server; send the request without it"),
        (
            {"metadata": {"user_id": "u", "tier": "x"}},
            "metadata.tier is not supported by this server; send the request without it",
        ),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools of type 'web_search_20250305' are not supported by this server (it calls no tools itself: give "
            "client tools, with an input_schema)",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
            "messages.1.content.0: assistant messages take content blocks of type text, tool_use, thinking, not "
            "'redacted_thinking'",
        ),
        (
            {"messages": [*USER, ASKS_WEATHER[1]]},
            "the final assistant message is a prefill the answer continues, so it holds text only: a tool_use block "
            "needs its tool_result in a user message after it",
        ),
        ({"thinking": {"type": "adaptive"}}, "thinking.type: Input should be 'enabled' or 'disabled'"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name is given with type tool, and only then"),
        ({"messages": [{"role": "system", "content": "Hi"}]}, "messages.0.role: Input should be 'user' or 'assistant'"),
        ({"max_tokens": None}, "max_tokens: Input should be a valid integer"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(http, body, message):
    answer = http.post("/v1/messages", json={"model": "smollm2", "max_tokens": 8, "messages": USER, **body})
    assert (answer.status_code, answer.json()) == (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": message}},
    )


def test_the_key_comes_in_x_api_key_or_authorization(stack, http):
    body = {"model": "smollm2", "messages": USER}
    with stack.client(headers={"Authorization": f"Bearer {KEY}"}) as bearer:
        assert (
            bearer.post("/v1/messages/count_tokens", json=body).json()
            == http.post("/v1/messages/count_tokens", json=body).json()
        )
    wrong = anthropic.Anthropic(base_url=stack.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as raised:
        wrong.messages.create(model="smollm2", max_tokens=4, messages=USER)
    assert raised.value.status_code == 401 and raised.value.body == {
        "type": "error",
        "error": {
            "type": "authentication_error",
            "message": "Incorrect API key provided; send it as 'Authorization: Bearer KEY'",
        },
    }
    chat = http.post("/v1/chat/completions", json={**body, "max_tokens": 1})  # x-api-key on every route
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 1
    with stack.client() as anonymous:
        missing = anonymous.post("/v1/messages/count_tokens", json=body)
        chat = anonymous.post("/v1/chat/completions", json={**body, "max_tokens": 1}, headers={"x-api-key": "sk-wrong"})
    assert (missing.status_code, missing.json()["error"]) == (
        401,
        {"type": "authentication_error", "message": "Missing API key; send it as 'Authorization: Bearer KEY'"},
    )
    assert chat.json() == {  # the OpenAI routes keep OpenAI's shape
        "error": {
            "message": "Incorrect API key provided; send it as 'Authorization: Bearer KEY'",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    with pytest.raises(ValueError, match="--auth-exempt-paths cannot include /v1/messages"):
        check_exempt_paths(("/v1/messages",))


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="nope", max_tokens=4, messages=USER)
    assert raised.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `nope` does not exist."},
    }


def test_an_error_ends_the_stream_as_an_error_event():
    events = MessageEvents("smollm2", BLOCK_SIZE)
    error = APIError(503, "the engine is unavailable: gone").anthropic_body()
    assert list(events.feed(error)) == [
        {"type": "error", "error": {"type": "overloaded_error", "message": "the engine is unavailable: gone"}}
    ]
    assert list(events.finish()) == []
    with pytest.raises(APIError, match=r"the server ended the request before it finished \(abort\); send it again"):
        stop("abort", None, False)

"""The Responses API's stream built from chat chunks (``ResponseEvents``) and its request mapping, without a model:
reasoning, text and function calls in one answer, an error mid-stream, and input items as chat messages."""

from __future__ import annotations

import re

import pytest

from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.openai_responses import (
    Responder,
    ResponsesRequest,
    ResponseStore,
    Stored,
    input_items,
    input_messages,
)
from raypaged.serving.gateway.response_events import ResponseEvents


def delta(**fields):
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def call(index, arguments, name=None, call_id=None):
    function = {"arguments": arguments} | ({"name": name} if name else {})
    return {"index": index, "function": function} | ({"id": call_id, "type": "function"} if call_id else {})


CHUNKS = [
    delta(role="assistant", content=""),
    delta(reasoning_content="Think"),
    delta(reasoning_content="ing."),
    delta(content="Calling"),
    delta(tool_calls=[call(0, '{"city": ', "get_weather", "call-1")]),
    delta(tool_calls=[call(0, '"Paris"}')]),
    delta(tool_calls=[call(1, "{}", "get_time", "call-2")]),
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}},
]


def run(chunks):
    events = ResponseEvents(Responder(ResponsesRequest(input="hi"), []), "m")
    out = list(events.start())
    for chunk in chunks:
        out += events.feed(chunk)
    return events, out


def test_reasoning_text_and_calls_are_items_in_their_order():
    events, out = run(CHUNKS)
    out += events.finish()
    assert [(e["type"], e.get("output_index")) for e in out] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.output_item.added", 3),
        ("response.function_call_arguments.delta", 3),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.function_call_arguments.done", 3),
        ("response.output_item.done", 3),
        ("response.completed", None),
    ]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    reasoning, message, weather, time = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert message["content"][0]["text"] == "Calling" and message["status"] == "completed"
    assert (weather["call_id"], weather["name"], weather["arguments"]) == ("call-1", "get_weather", '{"city": "Paris"}')
    assert (time["call_id"], time["name"], time["arguments"], time["status"]) == (
        "call-2",
        "get_time",
        "{}",
        "completed",
    )
    assert final["usage"]["input_tokens"] == 7 and final["usage"]["output_tokens"] == 9
    assert final["status"] == "completed" and events.final is final


def test_an_error_chunk_ends_the_stream_with_an_error_event():
    error = APIError(503, "the server is shutting down").body()
    events, out = run([delta(role="assistant", content=""), delta(content="Hel"), error])
    assert out[-1] == {
        "type": "error",
        "sequence_number": len(out) - 1,
        "code": error["error"]["code"],
        "message": "the server is shutting down",
        "param": None,
    }
    assert events.failed and list(events.finish()) == [] and events.final is None


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be terse."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": "{}",
            "id": "fc_1",
            "status": "completed",
        },
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Noon"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny at noon.", "annotations": []}]},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "Noon"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny at noon."}]},
    ]


@pytest.mark.parametrize(
    "items, message",
    [
        (
            [{"role": "critic", "content": "x"}],
            "input[0] role 'critic' is not one of user, system, developer, assistant",
        ),
        ([{"type": "function_call", "name": "f"}], "input[0] function_call needs a call_id"),
        ([{"role": "user", "content": 3}], "input[0] content must be a string or a list of parts"),
    ],
)
def test_bad_input_items_are_named(items, message):
    with pytest.raises(APIError, match="^" + re.escape(message) + "$"):
        input_messages(items)


def test_the_store_keeps_the_newest_per_tenant():
    store = ResponseStore(size=2)
    for name in ("r1", "r2", "r3"):
        store.put("a", Stored({"id": name}, [], []))
    store.put("b", Stored({"id": "r1"}, [{"role": "user", "content": "b's"}], []))
    with pytest.raises(APIError, match="response with id 'r1' not found"):
        store.get("a", "r1")
    assert store.get("a", "r3").response == {"id": "r3"} and store.get("b", "r1").conversation[0]["content"] == "b's"
    store.delete("b", "r1")
    with pytest.raises(APIError) as missing:
        store.get("b", "r1", "previous_response_id")
    assert (missing.value.status, missing.value.param) == (400, "previous_response_id")


def test_the_store_keeps_at_most_max_mb_per_tenant_oldest_dropped():
    store = ResponseStore(size=100, max_mb=1)
    text = "x" * 400_000  # three of these take more than 1 MiB, two do not
    stored = [Stored({"id": f"r{i}"}, [{"role": "user", "content": text}], []) for i in range(3)]
    assert stored[0].size == len('[{"id": "r0"}, [{"role": "user", "content": ""}], []]') + 400_000
    for one in stored:
        store.put("a", one)
    store.put("b", stored[0])  # another tenant's budget is its own
    with pytest.raises(APIError, match=re.escape("the newest 100 stored ones, up to 1 MiB of them")):
        store.get("a", "r0")
    assert store.get("a", "r1") is stored[1] and store.get("a", "r2") is stored[2] and store.get("b", "r0") is stored[0]
    store.delete("a", "r1")
    store.put("a", Stored({"id": "r3"}, [{"role": "user", "content": text}], []))  # fits again: r2 stays
    assert store.get("a", "r2") is stored[2] and store.get("a", "r3").response == {"id": "r3"}
    store.put("a", Stored({"id": "big"}, [{"role": "user", "content": "y" * 2**20}], []))  # over 1 MiB alone
    with pytest.raises(APIError, match="response with id 'big' not found"):
        store.get("a", "big")
    assert store.get("a", "r2") is stored[2]  # nothing dropped for it


def test_input_items_are_listed_as_the_responses_api_lists_them():
    given = [
        {"role": "user", "content": "Hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_given"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    items = input_items(given)
    assert items[0]["content"] == [{"type": "input_text", "text": "Hi"}] and items[0]["status"] == "completed"
    assert items[0]["id"].startswith("msg_") and items[1]["id"] == "fc_given" and items[2]["id"].startswith("fco_")
    stored = Stored({"id": "r"}, [], items)
    newest = stored.input_page("desc", 2, None)
    assert [i["id"] for i in newest["data"]] == [items[2]["id"], "fc_given"] and newest["has_more"]
    rest = stored.input_page("desc", 2, newest["last_id"])
    assert [i["id"] for i in rest["data"]] == [items[0]["id"]] and not rest["has_more"]
    assert [i["id"] for i in stored.input_page("asc", 20, None)["data"]] == [i["id"] for i in items]
    assert input_items("Hello")[0]["content"] == [{"type": "input_text", "text": "Hello"}]
    with pytest.raises(APIError, match="order must be asc or desc, got 'up'"):
        stored.input_page("up", 20, None)


def test_a_request_maps_onto_its_chat_completion_body():
    request = ResponsesRequest(
        model="m",
        instructions="Be brief.",
        input="Weather?",
        max_output_tokens=30,
        temperature=0.2,
        top_p=0.9,
        top_logprobs=3,
        tools=[{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}],
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_object"}},
        stream=True,
        safety_identifier="u1",
    )
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    responder = Responder(request, history)
    assert responder.conversation == [*history, {"role": "user", "content": "Weather?"}]
    assert responder.chat_body() == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, *history, {"role": "user", "content": "Weather?"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 30,
        "temperature": 0.2,
        "top_p": 0.9,
        "user": "u1",
        "logprobs": True,
        "top_logprobs": 3,
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True},
            }
        ],
        "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "json_object"},
    }

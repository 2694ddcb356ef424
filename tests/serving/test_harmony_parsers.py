"""gpt-oss's harmony outputs (``--reasoning-parser openai_gptoss``, ``--tool-call-parser openai``): reasoning,
content and tool calls, whole and streamed in pieces, with no marker left in any of them; the answers of a real
server whose output a constraint makes harmony text."""

from __future__ import annotations

import json

import pytest

from raypaged.serving.gateway.reasoning import get_reasoning_parser
from raypaged.serving.gateway.responses import ResponseShape
from raypaged.serving.gateway.tool_parsers import get_parser
from raypaged.serving.gateway.tools import Tool, ToolPlan
from raypaged.serving.launch import GatewayOptions
from raypaged.structured import harmony
from raypaged.structured.reasoning import ReasoningConfig, closed_in
from tests.serving.conftest import (
    after_section_ends,
    serving,
    streamed_calls,
    streamed_chunks,  # noqa: F401  (tiny_model_dir: a session fixture)
    tiny_config,
)

REASON = "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant"
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
# output -> (reasoning, content, tool calls as (name, arguments))
CASES = {
    "answer": (REASON + "<|channel|>final<|message|>Hello!<|return|>", "The user greets.", "Hello!", []),
    "answer, its stop token not in the text": (
        REASON + "<|channel|>final<|message|>Hello!",
        "The user greets.",
        "Hello!",
        [],
    ),
    "a call": (REASON + CALL, "The user greets.", None, [("get_weather", '{"city": "Paris"}')]),
    "a call, the recipient in the header's role part": (
        REASON + ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        "The user greets.",
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    "a call first, no reasoning": (CALL, None, None, [("get_weather", '{"city": "Paris"}')]),
    "a preamble, then two calls": (
        REASON
        + "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant"
        + CALL
        + "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>",
        "The user greets.",
        "Let me look.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    "two analysis messages and two answers, newline-joined": (
        "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>A<|end|><|start|>assistant<|channel|>final<|message|>B<|return|>",
        "One.\nTwo.",
        "A\nB",
        [],
    ),
    "cut inside the reasoning": ("<|channel|>analysis<|message|>Let me th", "Let me th", None, []),
    "cut inside a header": (REASON + "<|channel|>fin", "The user greets.", None, []),
    "a non-JSON call kept as written": (
        "<|channel|>commentary to=functions.run <|constrain|>python<|message|>print(1)<|call|>",
        None,
        None,
        [("run", "print(1)")],
    ),
    "JSON that does not parse kept as written": (
        '<|channel|>commentary to=functions.f<|message|>{"x": <|call|>',
        None,
        None,
        [("f", '{"x": ')],
    ),
    "a built-in tool's call is neither": (
        '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "x"}<|call|>',
        None,
        None,
        [],
    ),
    "stray markers in a text dropped": (
        "<|channel|>final<|message|>a<|constrain|>b<|message|>c<|endoftext|>",
        None,
        "abc",
        [],
    ),
    "a channel marker with no end opens the next message": (
        "<|channel|>analysis<|message|>hm<|channel|>final<|message|>ok",
        "hm",
        "ok",
        [],
    ),
    "no header: all content (constrained from the first token)": ('{"city": "Paris"}', None, '{"city": "Paris"}', []),
    "text that could have begun a header and did not": ("to", None, "to", []),
    "a literal <| in a text": ("<|channel|>final<|message|>a <|b|> c<|return|>", None, "a <|b|> c", []),
}
NAMES = sorted(CASES)


def _calls(calls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("name", NAMES)
def test_the_reasoning_parser_splits_whole_outputs(name):
    output, reasoning, content, _ = CASES[name]
    assert get_reasoning_parser("openai_gptoss").split(output) == (reasoning, content)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_the_reasoning_parser_streamed_in_pieces_gives_the_same_parts_and_no_marker(name, size):
    output, reasoning, content, _ = CASES[name]
    stream = get_reasoning_parser("openai_gptoss").stream()
    deltas = [stream.feed(piece) for piece in _pieces(output, size)] + [stream.finish()]
    assert ("".join(r for r, _ in deltas) or None, "".join(c for _, c in deltas) or None) == (reasoning, content)
    if name != "a literal <| in a text":
        assert not any("<|" in r or "<|" in c for r, c in deltas)


@pytest.mark.parametrize("name", NAMES)
def test_the_tool_parser_gives_the_calls_and_the_content(name):
    output, _, content, calls = CASES[name]
    found_content, found = get_parser("openai").extract(output)
    assert (found_content, _calls(found)) == (content, calls)
    assert all(c.id.startswith("chatcmpl-tool-") for c in found)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("size", [1, 3, 7])
def test_the_tool_parser_streamed_in_pieces_sends_the_content_as_it_comes_and_the_calls_at_the_end(name, size):
    output, _, content, calls = CASES[name]
    stream = get_parser("openai").stream()
    sent = [stream.feed(piece) for piece in _pieces(output, size)]
    rest, found = stream.finish()
    assert ("".join(sent) + rest or None, _calls(found)) == (content, calls)


def test_a_marker_split_across_deltas_is_held_back_until_whole():
    stream = get_reasoning_parser("openai_gptoss").stream()
    assert stream.feed("<|chan") == ("", "")
    assert stream.feed("nel|>analysis<|mess") == ("", "")
    assert stream.feed("age|>Hm <|") == ("Hm ", "")
    assert stream.feed("en") == ("", "")
    assert stream.feed("d|><|start|>assistant<|channel|>final<|message|>Hi <|") == ("", "Hi ")
    assert stream.feed("x") == ("", "<|x")  # not a marker after all
    assert stream.feed("<|ret") == ("", "")
    assert stream.feed("urn|>") == ("", "")
    assert stream.finish() == ("", "")


def test_an_output_is_held_until_it_shows_whether_it_opens_with_a_header():
    assert [harmony.opening(t) for t in ("", "  ", "<", " to", "<|channel|>", " to=functions.f", "{", "Hi")] == [
        None,
        None,
        None,
        None,
        True,
        True,
        False,
        False,
    ]
    stream = get_reasoning_parser("openai_gptoss").stream()
    assert stream.feed(" ") == ("", "")
    assert stream.feed("Hi") == ("", " Hi")


def test_a_header_in_either_order_names_the_channel_recipient_and_content_type():
    expected = harmony.Header("commentary", "functions.get_weather", "json")
    assert harmony.Header.parse("<|channel|>commentary to=functions.get_weather <|constrain|>json") == expected
    assert harmony.Header.parse("<|start|>assistant to=functions.get_weather<|channel|>commentary json") == expected
    assert harmony.Header.parse("<|channel|>analysis") == harmony.Header("analysis", None, None)


def test_the_reasoning_ends_where_the_final_channel_opens_and_a_budget_forces_the_analysis_end():
    parser = get_reasoning_parser("openai_gptoss")
    assert (parser.start, parser.end, parser.starts_inside, parser.special_tokens) == (
        "<|channel|>analysis<|message|>",
        "<|channel|>final<|message|>",
        True,
        True,
    )
    assert ReasoningConfig().delimiters("openai_gptoss") == ("<|channel|>analysis<|message|>", "<|end|>")
    assert ReasoningConfig().delimiters("qwen3") == ("<think>", "</think>")
    # a prompt that opens the final message itself (continue_final_message) leaves no reasoning to wait for
    assert closed_in("<|start|>assistant<|channel|>final<|message|>", parser.end)
    assert not closed_in("<|start|>assistant<|channel|>analysis<|message|>", parser.end)
    assert not closed_in("<|start|>assistant<|channel|>final<|message|>")  # </think> closes the <think> formats


def test_a_constraint_applies_after_the_final_channel_opens(smollm2_dir):
    ends = after_section_ends(smollm2_dir, "openai_gptoss")

    assert ends(REASON + '<|channel|>final<|message|>{"ok": true}') is True
    assert ends('<|channel|>final<|message|>\n{"ok": false}') is True  # no reasoning at all
    assert ends('<|channel|>analysis<|message|>{"ok": true}') is False  # still reasoning
    assert ends('{"ok": true}') is False
    assert ends(REASON + "<|channel|>final<|message|>Hello") is None


WEATHER_TOOL = Tool.model_validate({"type": "function", "function": {"name": "get_weather"}})
TIME_TOOL = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})
PREAMBLE_AND_CALLS = CASES["a preamble, then two calls"][0]


def _shape(parallel: bool = True, include_reasoning: bool = True) -> ResponseShape:
    plan = ToolPlan.of([WEATHER_TOOL, TIME_TOOL], "auto", parallel, get_parser("openai"))
    reasoning = get_reasoning_parser("openai_gptoss")
    return ResponseShape(True, "m", 1, False, plan, reasoning=reasoning, include_reasoning=include_reasoning)


def test_a_chat_answer_has_the_reasoning_the_preamble_and_the_calls():
    message, finish_reason = _shape().message(PREAMBLE_AND_CALLS, "stop")
    calls = message.pop("tool_calls")
    assert (message, finish_reason) == (
        {"role": "assistant", "reasoning_content": "The user greets.", "content": "Let me look."},
        "tool_calls",
    )
    assert [(c["type"], c["function"]) for c in calls] == [
        ("function", {"name": "get_weather", "arguments": '{"city": "Paris"}'}),
        ("function", {"name": "get_time", "arguments": "{}"}),
    ]
    message, _ = _shape(parallel=False, include_reasoning=False).message(PREAMBLE_AND_CALLS, "stop")
    assert "reasoning_content" not in message and [c["function"]["name"] for c in message["tool_calls"]] == [
        "get_weather"
    ]
    message, finish_reason = _shape().message(CASES["answer"][0], "stop")
    assert (message, finish_reason) == (
        {"role": "assistant", "reasoning_content": "The user greets.", "content": "Hello!"},
        "stop",
    )


@pytest.mark.parametrize("size", [1, 4, 9])
def test_a_chat_stream_sends_reasoning_content_and_calls_as_they_come(size):
    deltas, finish_reasons = streamed_chunks(_shape(), _pieces(PREAMBLE_AND_CALLS, size))
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user greets."
    assert "".join(d.get("content", "") for d in deltas) == "Let me look."
    # the arguments as the model writes them (the whole answer's are written anew: '{"city": "Paris"}')
    assert [c["function"] for c in streamed_calls(deltas)] == [
        {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"name": "get_time", "arguments": "{}"},
    ]
    assert len([d for d in deltas if "tool_calls" in d]) > 2  # not whole in the last chunk
    assert finish_reasons[-1] == "tool_calls"
    assert not any("<|" in json.dumps(d) for d in deltas)


def test_the_openai_tool_parser_refuses_another_reasoning_parser_by_name():
    with pytest.raises(
        ValueError,
        match=r"^--tool-call-parser openai reads the messages of --reasoning-parser openai_gptoss, not qwen3$",
    ):
        GatewayOptions(enable_auto_tool_choice=True, tool_call_parser="openai", reasoning_parser="qwen3")


# the tiny model's output, made harmony text by a constraint; the engine knows no reasoning parser, so the
# constraint applies from the first token (SmolLM2's tokenizer writes the markers as plain text)
FORCED_CALL = REASON + CALL
FORCED_ANSWER = REASON + "<|channel|>final<|message|>Hello!<|return|>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def http(tiny_model_dir):
    # --tool-call-parser openai implies --reasoning-parser openai_gptoss
    yield from serving(
        [tiny_config(tiny_model_dir, "tiny", max_model_len=512)],
        enable_auto_tool_choice=True,
        tool_call_parser="openai",
        enable_scale_out=True,
    )


def _chat(forced: str, **extra) -> dict:
    messages = [{"role": "user", "content": "Hi"}]
    return {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 300,
        "temperature": 0,
        "structured_outputs": {"choice": [forced]},
        **extra,
    }


def _streamed(http, body: dict) -> list[dict]:
    text = http.post("/v1/chat/completions", json={**body, "stream": True}).text
    assert "<|" not in text
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_a_server_answers_a_harmony_call_with_reasoning_and_tool_calls_whole_and_streamed(http):
    body = _chat(FORCED_CALL, tools=TOOLS)
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    calls = choice["message"].pop("tool_calls")
    assert (choice["message"], choice["finish_reason"]) == (
        {"role": "assistant", "reasoning_content": "The user greets.", "content": None},
        "tool_calls",
    )
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    chunks = _streamed(http, body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user greets."
    assert not any(d.get("content") for d in deltas)
    assert [c["function"] for c in streamed_calls(deltas)] == [{"name": "get_weather", "arguments": '{"city":"Paris"}'}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_server_answers_a_harmony_answer_without_tools(http):
    body = _chat(FORCED_ANSWER)
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert (choice["message"], choice["finish_reason"]) == (
        {"role": "assistant", "reasoning_content": "The user greets.", "content": "Hello!"},
        "stop",
    )
    deltas = [c["choices"][0]["delta"] for c in _streamed(http, body) if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"


def test_chat_requests_keep_special_tokens_and_refuse_skipping_them_by_name(http):
    rendered = http.post("/v1/chat/completions/render", json=_chat(FORCED_ANSWER)).json()
    assert rendered["sampling_params"]["skip_special_tokens"] is False
    refused = http.post("/v1/chat/completions", json=_chat(FORCED_ANSWER, skip_special_tokens=True))
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "skip_special_tokens true would erase the markers that --reasoning-parser openai_gptoss reads in the "
        "answer; send the request without it"
    )
    assert refused.json()["error"]["param"] == "skip_special_tokens"
    completion = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}).json()
    assert "reasoning_content" not in completion["choices"][0]  # completions are never parsed

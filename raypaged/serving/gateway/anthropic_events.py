"""A chat completion's answer as Anthropic's ``message`` (``message``), and its stream of chunks as the Messages
stream's events (``MessageEvents``); ``MessagesAnswer`` is both, for the gateway's translated routes.

The content is a ``thinking`` block (the reasoning ``--reasoning-parser`` splits off), a ``text`` block, then a
``tool_use`` block per tool call, each only when there is something in it. A tool call cut by ``max_tokens`` has
as its input what the SDK's stream helper makes of the same arguments streamed (``partial_json``); arguments that
are no JSON object, whole or cut, are the input ``{}``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.partial_json import parse_partial
from raypaged.serving.gateway.response_events import fed_events

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def message_id(chat_id: str) -> str:
    """The message's id: the chat completion's, which the engine's request and the logs carry, as Anthropic's."""
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("chatcmpl-tool-")


def usage(chat_usage: dict[str, Any], cache_block_size: int | None) -> dict[str, int]:
    """Anthropic's usage of a chat answer's (whose ``prompt_tokens_details`` is given); ``cache_block_size``: tokens
    per block of the served model's prefix cache, ``None`` when it runs without one.

    The prompt's tokens are split in three, which add up to them as Anthropic's do: ``cache_read_input_tokens``,
    those read from the prefix cache (a run of full blocks); ``cache_creation_input_tokens``, those this request
    computed into full KV blocks, which the cache keeps for later prompts beginning with the same tokens (the
    prompt's full blocks past the cached ones; none without a prefix cache); ``input_tokens``, the rest (the last,
    partial block's, which no cache keeps). A full block the cache already held is counted as written when the
    request computed it again, though the cache keeps its first copy: the last block of a prompt that ends on a
    block's end (a hit never covers a prompt's last token), or one another request wrote while this one computed
    it.
    """
    num_prompt_tokens = chat_usage["prompt_tokens"]
    num_read = chat_usage["prompt_tokens_details"]["cached_tokens"]
    num_in_full_blocks = num_prompt_tokens // cache_block_size * cache_block_size if cache_block_size else num_read
    return {
        "input_tokens": num_prompt_tokens - num_in_full_blocks,
        "cache_creation_input_tokens": num_in_full_blocks - num_read,
        "cache_read_input_tokens": num_read,
        "output_tokens": chat_usage["completion_tokens"],
    }


def stop(finish_reason: str | None, matched: int | str | None, called: bool) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a chat answer's finish reason and vLLM's ``stop_reason`` (the stop
    string, or token id, it ended on); ``called``: it made tool calls. An answer the server aborted is an error."""
    if finish_reason not in _STOP_REASONS:
        raise APIError(503, f"the server ended the request before it finished ({finish_reason}); send it again")
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return _STOP_REASONS[finish_reason], None


def envelope(
    chat_id: str,
    model: str,
    content: list[dict[str, Any]],
    stop_reason: str | None,
    stop_sequence: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": message_id(chat_id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


def thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}  # nothing here signs it


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def tool_use_block(call_id: str, name: str, tool_input: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": tool_input}


def message(chat: dict[str, Any], cache_block_size: int | None) -> dict[str, Any]:
    """The ``message`` of a whole chat completion (of one choice); ``cache_block_size`` as ``usage``'s."""
    choice = chat["choices"][0]
    answer = choice["message"]
    content = []
    if answer.get("reasoning_content"):
        content.append(thinking_block(answer["reasoning_content"]))
    if answer.get("content"):
        content.append(text_block(answer["content"]))
    calls = answer.get("tool_calls") or []
    for call in calls:
        function = call["function"]
        content.append(tool_use_block(call["id"], function["name"], _input(function["arguments"])))
    stop_reason, stop_sequence = stop(choice["finish_reason"], choice.get("stop_reason"), bool(calls))
    answer_usage = usage(chat["usage"], cache_block_size)
    return envelope(chat["id"], chat["model"], content, stop_reason, stop_sequence, answer_usage)


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        try:
            value = parse_partial(arguments)  # cut by max_tokens
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


class MessageEvents:
    """A chat completion's chunks (with usage in each, ``stream_options.continuous_usage_stats``) as the Messages
    stream's events: ``message_start`` (with the input tokens, so once the first chunk from the engine came);
    per content block ``content_block_start``, its deltas (``thinking_delta``, ``text_delta``,
    ``input_json_delta``), ``content_block_stop``; then ``message_delta`` (the stop reason, the whole usage) and
    ``message_stop``. An error chunk (Anthropic's shape) is an ``error`` event, and the stream's end.
    ``cache_block_size`` as ``usage``'s."""

    def __init__(self, model: str, cache_block_size: int | None) -> None:
        self.model = model
        self.cache_block_size = cache_block_size
        self.started = False
        self.failed = False
        self.num_blocks = 0
        self.open_kind: str | None = None  # the open block's type
        self.called = False  # a tool call began
        self.finish_reason: str | None = None
        self.matched: int | str | None = None
        self.usage: dict[str, Any] = {}

    def feed(self, chunk: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if chunk.get("type") == "error":
            self.failed = True
            yield chunk
            return
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        elif not self.started:
            return  # the role's chunk, sent before the engine answered: nothing to tell yet
        if not self.started:
            self.started = True
            start = envelope(chunk["id"], self.model, [], None, None, usage(self.usage, self.cache_block_size))
            yield {"type": "message_start", "message": start}
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                yield from self._delta("thinking", thinking_block(""), "thinking_delta", delta["reasoning_content"])
            if delta.get("content"):
                yield from self._delta("text", text_block(""), "text_delta", delta["content"])
            for call in delta.get("tool_calls") or ():
                yield from self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason, self.matched = choice["finish_reason"], choice.get("stop_reason")

    def _delta(self, kind: str, block: dict[str, Any], delta_type: str, text: str) -> Iterator[dict[str, Any]]:
        if self.open_kind != kind:
            yield from self._open(block)
        field = "thinking" if kind == "thinking" else "text"
        yield self._block_delta({"type": delta_type, field: text})

    def _call_delta(self, call: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """A call's first delta (with its id) opens its block; the chat stream sends each call's deltas in a row,
        with no other content after the first call began."""
        function = call.get("function") or {}
        if "id" in call:
            self.called = True
            yield from self._open(tool_use_block(call["id"], function["name"], {}))
        if function.get("arguments"):
            yield self._block_delta({"type": "input_json_delta", "partial_json": function["arguments"]})

    def _open(self, block: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self._close()
        self.open_kind = block["type"]
        self.num_blocks += 1
        yield {"type": "content_block_start", "index": self.num_blocks - 1, "content_block": block}

    def _block_delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.num_blocks - 1, "delta": delta}

    def _close(self) -> Iterator[dict[str, Any]]:
        if self.open_kind is not None:
            self.open_kind = None
            yield {"type": "content_block_stop", "index": self.num_blocks - 1}

    def finish(self) -> Iterator[dict[str, Any]]:
        """The closing events once the chat stream ended (none after an error's)."""
        if self.failed:
            return
        try:
            stop_reason, stop_sequence = stop(self.finish_reason, self.matched, self.called)
        except APIError as exc:
            yield exc.anthropic_body()
            return
        yield from self._close()
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield {"type": "message_delta", "delta": delta, "usage": usage(self.usage, self.cache_block_size)}
        yield {"type": "message_stop"}


class MessagesAnswer:
    """A Messages request's answer, whole or streamed, from the chat completion it ran as (whose usage gives
    ``prompt_tokens_details``); ``cache_block_size`` as ``usage``'s."""

    def __init__(self, cache_block_size: int | None) -> None:
        self.cache_block_size = cache_block_size

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        return message(chat, self.cache_block_size)

    async def events(self, chunks: AsyncGenerator[dict[str, Any], None], model: str) -> AsyncIterator[str]:
        """The stream as server-sent events (each named by its type)."""
        async for event in fed_events(chunks, MessageEvents(model, self.cache_block_size)):
            yield event

"""The Responses API's stream: a chat completion's chunks as typed server-sent events (``ResponseEvents``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from raypaged.serving.gateway.response_items import call_item, message_item, new_id, reasoning_item, usage

if TYPE_CHECKING:
    from raypaged.serving.gateway.openai_responses import Responder


@dataclass
class _Open:
    """An output item being streamed: its index in ``output`` and its item so far."""

    index: int
    item: dict[str, Any]


class ResponseEvents:
    """A chat completion's stream of chunks as the Responses stream's events: ``response.created`` and
    ``response.in_progress``; each output item added, its text, reasoning text or call arguments in deltas, done;
    then ``response.completed`` (``response.incomplete`` at the token limit) with the whole response. An error
    chunk ends it with an ``error`` event."""

    def __init__(self, responder: Responder, model: str) -> None:
        self.responder = responder
        self.model = model
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.text: _Open | None = None
        self.reasoning: _Open | None = None
        self.calls: dict[int, _Open] = {}  # by the chat stream's tool call index
        self.closed: set[int] = set()  # the output indices whose items are done
        self.logprobs: list[dict[str, Any]] | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.failed = False  # an error chunk ended the stream: no closing events, nothing stored
        self.final: dict[str, Any] | None = None  # the completed response, once the stream ends well

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> Iterator[dict[str, Any]]:
        response = self.responder.response("in_progress", [], self.model)
        yield self._event("response.created", response=response)
        yield self._event("response.in_progress", response=response)

    def _open(self, item: dict[str, Any]) -> Generator[dict[str, Any], None, _Open]:
        """``response.output_item.added`` for a new item; returns it, open."""
        self.output.append(item)
        opened = _Open(len(self.output) - 1, item)
        yield self._event("response.output_item.added", output_index=opened.index, item=item)
        return opened

    def feed(self, chunk: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of one chat chunk (``{"error": ...}``: the ``error`` event)."""
        if "error" in chunk:
            self.failed = True
            error = chunk["error"]
            yield self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
            return
        if chunk.get("usage"):
            self.usage = usage(chunk["usage"])
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield from self._reasoning_delta(delta["reasoning_content"])
            if delta.get("content"):
                yield from self._text_delta(delta["content"], (choice.get("logprobs") or {}).get("content"))
            for call in delta.get("tool_calls") or ():
                yield from self._call_delta(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def _reasoning_delta(self, text: str) -> Iterator[dict[str, Any]]:
        if self.reasoning is None:
            self.reasoning = yield from self._open(reasoning_item(new_id("rs"), ""))
        self.reasoning.item["content"][0]["text"] += text
        yield self._event(
            "response.reasoning_text.delta",
            item_id=self.reasoning.item["id"],
            output_index=self.reasoning.index,
            content_index=0,
            delta=text,
        )

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]] | None) -> Iterator[dict[str, Any]]:
        yield from self._close_reasoning()
        if self.text is None:
            self.text = yield from self._open(message_item(new_id("msg"), "", "in_progress", None))
            part = {"type": "output_text", "text": "", "annotations": []}
            yield self._event(
                "response.content_part.added",
                item_id=self.text.item["id"],
                output_index=self.text.index,
                content_index=0,
                part=part,
            )
        self.text.item["content"][0]["text"] += text
        if logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(logprobs)
        yield self._event(
            "response.output_text.delta",
            item_id=self.text.item["id"],
            output_index=self.text.index,
            content_index=0,
            delta=text,
            logprobs=logprobs or [],
        )

    def _call_delta(self, call: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self._close_reasoning()
        function = call.get("function") or {}
        opened = self.calls.get(call.get("index", 0))
        if opened is None:
            yield from self._close_text()
            item = call_item(
                new_id("fc"), call.get("id") or new_id("call"), function.get("name", ""), "", "in_progress"
            )
            opened = self.calls[call.get("index", 0)] = yield from self._open(item)
        if arguments := function.get("arguments"):
            opened.item["arguments"] += arguments
            yield self._event(
                "response.function_call_arguments.delta",
                item_id=opened.item["id"],
                output_index=opened.index,
                delta=arguments,
            )

    def _close_reasoning(self) -> Iterator[dict[str, Any]]:
        opened = self.reasoning
        if opened is None or opened.index in self.closed:
            return
        self.closed.add(opened.index)
        item = opened.item
        text = item["content"][0]["text"]
        yield self._event(
            "response.reasoning_text.done", item_id=item["id"], output_index=opened.index, content_index=0, text=text
        )
        yield self._event("response.output_item.done", output_index=opened.index, item=item)

    def _close_text(self) -> Iterator[dict[str, Any]]:
        opened = self.text
        if opened is None or opened.index in self.closed:
            return
        self.closed.add(opened.index)
        part = opened.item["content"][0]
        if self.logprobs is not None:
            part["logprobs"] = self.logprobs
        item_id = opened.item["id"]
        yield self._event(
            "response.output_text.done",
            item_id=item_id,
            output_index=opened.index,
            content_index=0,
            text=part["text"],
            logprobs=self.logprobs or [],
        )
        yield self._event(
            "response.content_part.done", item_id=item_id, output_index=opened.index, content_index=0, part=part
        )
        opened.item["status"] = "completed"
        yield self._event("response.output_item.done", output_index=opened.index, item=opened.item)

    def finish(self) -> Iterator[dict[str, Any]]:
        """The closing events once the chat stream ended (none after an error's)."""
        if self.failed:
            return
        yield from self._close_reasoning()
        yield from self._close_text()
        for opened in self.calls.values():
            item = opened.item
            yield self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=opened.index,
                arguments=item["arguments"],
            )
            item["status"] = "completed"
            yield self._event("response.output_item.done", output_index=opened.index, item=item)
        self.final = self.responder.response("completed", self.output, self.model, self.usage, self.finish_reason)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=self.final)


def sse_event(event: dict[str, Any]) -> str:
    """A Responses stream event as a server-sent event (named by its type; no ``[DONE]`` ends the stream)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class EventFeed(Protocol):
    def feed(self, chunk: dict[str, Any]) -> Iterable[dict[str, Any]]: ...

    def finish(self) -> Iterable[dict[str, Any]]: ...


async def fed_events(chunks: AsyncGenerator[dict[str, Any], None], events: EventFeed) -> AsyncIterator[str]:
    """A chat stream's chunks through ``events`` (a translated API's event builder), as server-sent events;
    ``chunks`` is closed however the stream ends."""
    async with contextlib.aclosing(chunks) as stream:
        async for chunk in stream:
            for event in events.feed(chunk):
                yield sse_event(event)
    for event in events.finish():
        yield sse_event(event)

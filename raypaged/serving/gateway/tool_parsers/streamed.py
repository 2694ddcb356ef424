"""Tool calls written as JSON objects (``{"name": ..., "arguments": {...}}``), read as the text streams in, so
a stream can send each call's name as soon as it is whole and its arguments as they are written (as vLLM and
OpenAI stream them) instead of the whole call once the output ends.

:class:`CallScanner` reads each character once. It follows strings (with their escapes) and how deep the
containers are open; a call is an object opened at ``call_depth`` (0: calls at the top level, as between
Hermes's ``<tool_call>`` markers; 1: the items of a top-level array, as the ``required`` tool choice writes
them). Text between calls that holds no quote or bracket (markers, newlines, commas) is passed over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from raypaged.serving.gateway.tool_parsers.base import ToolCall


@dataclass(slots=True)
class ScannedCall:
    """One call as far as the text goes: its name once whole, where its arguments' value begins and (once it
    is whole) ends in the text."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    done: bool = False


class CallScanner:
    def __init__(self, args_keys: tuple[str, ...], call_depth: int) -> None:
        self.args_keys = args_keys
        self.call_depth = call_depth
        self.text = ""
        self.calls: list[ScannedCall] = []
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._key: str | None = None  # in a call: the key whose value comes next (None: a key comes next)
        self._value_start: int | None = None  # in a call: where the value of ``_key`` begins

    def feed(self, chunk: str) -> None:
        start = len(self.text)
        self.text += chunk
        for i in range(start, len(self.text)):
            self._char(i, self.text[i])

    def arguments(self, call: ScannedCall) -> str:
        """The text of ``call``'s arguments written so far (the whole value once it ended); "" before it began."""
        if call.args_start is None:
            return ""
        return self.text[call.args_start : call.args_end if call.args_end is not None else len(self.text)]

    def _char(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                self._string_end(i)
            return
        inside = self._depth - self.call_depth  # 1: directly in a call object
        if c == '"':
            self._in_string = True
            self._string_start = i
            if inside == 1 and self._key is not None:
                self._value_start = i
        elif c in "{[":
            if inside == 0 and c == "{":
                self.calls.append(ScannedCall())
                self._key = None
            elif inside == 1 and self._key is not None:
                self._value_start = i
                if self._key in self.args_keys and self.calls[-1].args_start is None:
                    self.calls[-1].args_start = i
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            inside = self._depth - self.call_depth
            if inside == 1 and self._key is not None:
                self._value_end(i + 1)
            elif inside == 0 and c == "}" and self.calls:
                self.calls[-1].done = True
        elif inside == 1:
            if c == ":":
                pass
            elif c == ",":
                if self._key is not None and self._value_start is not None:
                    self._value_end(i)
                self._key = None
            elif not c.isspace() and self._key is not None and self._value_start is None:
                self._value_start = i  # a number or a literal

    def _string_end(self, i: int) -> None:
        if self._depth - self.call_depth != 1:
            return
        if self._key is None:
            key = _decoded(self.text[self._string_start : i + 1])
            self._key = key if isinstance(key, str) else ""
            self._value_start = None
        else:
            self._value_end(i + 1)

    def _value_end(self, end: int) -> None:
        """The value of ``_key`` in the current call ended at ``end``."""
        call, start = self.calls[-1], self._value_start
        if start is None:
            return
        if self._key == "name" and call.name is None:
            name = _decoded(self.text[start:end])
            call.name = name if isinstance(name, str) else None
        elif self._key in self.args_keys and call.args_start == start:
            call.args_end = end
        self._key = None
        self._value_start = None


class StreamedCalls:
    """The tool-call deltas of the calls a :class:`CallScanner` reads: each call's id, type and name (with its
    arguments so far) once its name is whole, then its arguments as they grow; at most ``max_calls``."""

    def __init__(self, args_keys: tuple[str, ...], call_depth: int, max_calls: int | None = None) -> None:
        self.scanner = CallScanner(args_keys, call_depth)
        self.max_calls = max_calls
        self._sent: list[tuple[ToolCall, int]] = []  # per call announced: its id and name, argument characters sent

    @property
    def started(self) -> bool:
        """A call was announced."""
        return bool(self._sent)

    def feed(self, text: str) -> list[dict[str, Any]]:
        scanner = self.scanner
        scanner.feed(text)
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(scanner.calls[: self.max_calls]):
            if index == len(self._sent):
                if call.name is None:
                    break
                announced = ToolCall(call.name, "")
                self._sent.append((announced, 0))
                deltas.append({"index": index, **announced.as_openai()})
            announced, num_sent = self._sent[index]
            arguments = scanner.arguments(call)
            if len(arguments) > num_sent:
                self._sent[index] = (announced, len(arguments))
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] = arguments
                else:
                    deltas.append({"index": index, "function": {"arguments": arguments[num_sent:]}})
        return deltas

    def settle(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The last deltas once the output's ``calls`` are parsed: those announced keep their ids, and the end
        of their arguments follows where the parsed text goes on from what was sent (the model's own text of the
        arguments, which the parsed call writes alike unless the model spaced or escaped it otherwise); the
        others come whole."""
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if index >= len(self._sent):
                deltas.append({"index": index, **call.as_openai()})
                continue
            announced, num_sent = self._sent[index]
            call.id = announced.id
            sent = self.scanner.arguments(self.scanner.calls[index])[:num_sent]
            if call.arguments.startswith(sent) and len(call.arguments) > num_sent:
                deltas.append({"index": index, "function": {"arguments": call.arguments[num_sent:]}})
        return deltas


def _decoded(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None

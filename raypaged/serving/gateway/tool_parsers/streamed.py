"""Tool calls read as the text streams in, so a stream can send each call's name as soon as it is whole and its
arguments as they are written (as vLLM and OpenAI stream them) instead of the whole call once the output ends.

A scanner (:class:`Scanner`) reads one format: :class:`CallScanner` calls written as JSON objects
(``{"name": ..., "arguments": {...}}``), :class:`MarkedScanner` calls whose JSON arguments sit between markers
(DeepSeek's, Kimi K2's), and the formats whose arguments are not JSON as written (Qwen3-Coder's and GLM-4.5's
tags, pythonic calls) build theirs with :class:`BuiltArguments`. :class:`StreamedCalls` turns any of them into
tool-call deltas.

:class:`CallScanner` reads each character once. It follows strings (with their escapes) and how deep the
containers are open; a call is an object opened at ``call_depth`` (0: calls at the top level, as between
Hermes's ``<tool_call>`` markers; 1: the items of a top-level array, as the ``required`` tool choice writes
them). Text between calls that holds no quote or bracket (markers, newlines, commas) is passed over.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from raypaged.serving.gateway.tool_parsers.base import ToolCall, TypedArgumentsParser
from raypaged.structured.harmony import held_back


@dataclass(slots=True)
class ScannedCall:
    """One call as far as the text goes: its name once whole (and the id the model gave it, if any), where its
    arguments' value begins and (once it is whole) ends in the text."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    done: bool = False
    id: str | None = None
    built: BuiltArguments | None = None  # its arguments written anew, where the format does not write JSON


class Scanner(Protocol):
    """Reads one format's tool-call section as it grows."""

    calls: list[ScannedCall]

    def feed(self, chunk: str) -> None:
        """Read ``chunk``, the section's next text."""

    def arguments(self, call: ScannedCall) -> str:
        """The JSON text of ``call``'s arguments as far as it is sure: it only grows, and it begins the whole
        call's arguments as the format's parser gives them (or as the model wrote them)."""


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


class MarkedScanner:
    """Calls written ``begin`` HEADER ``opens`` ARGUMENTS ``closes``, their arguments JSON text as the model
    writes it (DeepSeek's, Kimi K2's): ``header`` reads the call's (name, id) from HEADER. The arguments leave
    out the whitespace around them, and hold back what could begin ``closes``."""

    def __init__(
        self, begin: str, opens: str, closes: str, header: Callable[[str], tuple[str | None, str | None]]
    ) -> None:
        self.begin, self.opens, self.closes, self.header = begin, opens, closes, header
        self.text = ""
        self.calls: list[ScannedCall] = []
        self._at = 0  # where the next marker is looked for
        self._header_start: int | None = None  # in a header: where it begins

    def feed(self, chunk: str) -> None:
        self.text += chunk
        while True:
            open_call = self.calls[-1] if self.calls and not self.calls[-1].done else None
            if open_call is not None:
                assert open_call.args_start is not None
                end = self.text.find(self.closes, max(self._at, open_call.args_start))
                if end < 0:
                    self._at = max(open_call.args_start, len(self.text) - len(self.closes) + 1)
                    return
                open_call.args_end, open_call.done = end, True
                self._at = end + len(self.closes)
            elif self._header_start is not None:
                end = self.text.find(self.opens, self._at)
                if end < 0:
                    self._at = max(self._header_start, len(self.text) - len(self.opens) + 1)
                    return
                name, call_id = self.header(self.text[self._header_start : end])
                self.calls.append(ScannedCall(name, args_start=end + len(self.opens), id=call_id))
                self._header_start, self._at = None, end + len(self.opens)
            else:
                begin = self.text.find(self.begin, self._at)
                if begin < 0:
                    self._at = max(self._at, len(self.text) - len(self.begin) + 1)
                    return
                self._header_start = self._at = begin + len(self.begin)

    def arguments(self, call: ScannedCall) -> str:
        assert call.args_start is not None
        if call.args_end is not None:
            return self.text[call.args_start : call.args_end].strip()
        written = self.text[call.args_start :]
        return written[: len(written) - held_back(written, (self.closes,))].strip()


@dataclass(slots=True)
class BuiltArguments:
    """A call's arguments written anew as JSON, as its parser writes them (``json.dumps`` of the object, keys in
    the order written): ``{``, each argument once its value is whole, a text value as it grows (``grow``), ``}``
    once the call ends. A call whose arguments cannot be read (``broken``) sends no more of them. A key written
    twice ends what is sent too: the parsed call keeps the key's first place and its last value."""

    whole: list[str] = field(default_factory=list)  # '"key": value' of each whole argument
    growing: str = ""  # '"key": "text so far' of a text value being written
    closed: bool = False
    broken: bool = False
    _keys: set[str] = field(default_factory=set)

    def add(self, key: str, value: Any) -> None:
        if self.broken or self.closed:
            return
        try:
            piece = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        except (TypeError, ValueError):
            piece = None
        self.growing = ""
        if piece is None or key in self._keys:
            self.broken = True
            return
        self._keys.add(key)
        self.whole.append(piece)

    def grow(self, key: str, text: str) -> None:
        """The text value of ``key`` so far (a string the parser keeps as it is)."""
        if not self.broken and not self.closed and key not in self._keys:
            self.growing = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(text, ensure_ascii=False)[:-1]}"

    def close(self) -> None:
        if not self.broken:
            self.closed = True

    def text(self) -> str:
        pieces = [*self.whole, self.growing] if self.growing else self.whole
        return "{" + ", ".join(pieces) + ("}" if self.closed else "")


class BuiltScanner:
    """A scanner of a format whose arguments are not JSON as written: each call's are built anew."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[ScannedCall] = []

    def arguments(self, call: ScannedCall) -> str:
        assert call.built is not None
        return call.built.text()

    def open_call(self, name: str | None) -> BuiltArguments:
        """A new call named ``name`` (``None``: a name the parser does not read); its arguments."""
        built = BuiltArguments()
        self.calls.append(ScannedCall(name, built=built))
        return built

    def close_call(self) -> None:
        call = self.calls[-1]
        assert call.built is not None
        call.built.close()
        call.done = True


class TagScanner(BuiltScanner):
    """A format of tags (Qwen3-Coder's, GLM-4.5's) that ``parser`` reads, read one marker at a time: the text of
    each ``state`` runs to the first match of ``ends[state]``; the ``out`` state's marker opens a call, whose
    ``name`` follows; :meth:`read` takes the text of the other states (and the marker) and gives the next state.
    A ``value`` state's text so far goes to :meth:`grow` while its end has not come."""

    ends: ClassVar[Mapping[str, re.Pattern[str]]]  # by state ("out" first)

    def __init__(self, parser: TypedArgumentsParser) -> None:
        super().__init__()
        self.properties_of = parser.properties  # a function's parameters' schemas by name
        self.properties: Mapping[str, Any] = {}  # the open call's
        self.built = BuiltArguments()  # the open call's arguments
        self.key = ""  # the argument being read
        self._state = "out"
        self._mark = 0  # where the text of the state begins

    def feed(self, chunk: str) -> None:
        self.text += chunk
        while (found := self.ends[self._state].search(self.text, self._mark)) is not None:
            state, text = self._state, self.text[self._mark : found.start()]
            self._state = "name" if state == "out" else self.read(state, text, found.group())
            self._mark = found.end()
        if self._state == "value":
            self.grow(self.text[self._mark :])

    def read(self, state: str, text: str, marker: str) -> str:
        """The next state, once the ``text`` of ``state`` ended at ``marker``."""
        raise NotImplementedError

    def grow(self, written: str) -> None:
        """A value as far as it is written (its end not come yet)."""

    def open_named(self, name: str) -> None:
        self.built = self.open_call(name or None)
        self.properties = self.properties_of(name)


S = TypeVar("S", bound=Scanner)


class StreamedCalls(Generic[S]):
    """The tool-call deltas of the calls a :class:`Scanner` reads: each call's id, type and name (with its
    arguments so far) once its name is whole, then its arguments as they grow; at most ``max_calls``."""

    def __init__(self, scanner: S, max_calls: int | None = None) -> None:
        self.scanner = scanner
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
                announced = ToolCall(call.name, "") if call.id is None else ToolCall(call.name, "", call.id)
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

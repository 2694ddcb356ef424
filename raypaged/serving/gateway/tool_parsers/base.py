"""What every tool-call parser shares: the call, finding the tool-call section, streaming around it."""

from __future__ import annotations

import ast
import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from raypaged.structured.harmony import held_back

if TYPE_CHECKING:
    from raypaged.serving.gateway.tool_parsers.streamed import Scanner, StreamedCalls


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    @classmethod
    def from_json(cls, value: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
        """``{"name": ..., "arguments": {...}}`` (or another key for the arguments); anything else raises
        ``ValueError``."""
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ValueError(f"not a tool call: {value!r}")
        return cls(value["name"], object_json(next((value[k] for k in arguments_keys if k in value), {})))


def object_json(arguments: Any) -> str:
    """A call's arguments (an object, or JSON text of one) as the JSON text every parser gives; anything else
    raises ``ValueError``."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments are not an object: {arguments!r}")
    return json.dumps(arguments, ensure_ascii=False)


def decoded_value(text: str, json_first: bool = True) -> Any:
    """The value ``text`` writes: JSON (tried first with ``json_first``), else a Python literal, else the text
    itself. Only a value JSON can hold counts (no sets, bytes or non-finite numbers)."""
    readers = (json.loads, ast.literal_eval) if json_first else (ast.literal_eval,)
    for read in readers:
        try:
            value = read(text)
            json.dumps(value, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            continue
        return value
    return text


class ToolParser(ABC):
    """Finds the tool calls in a model's output. An output is content, then (maybe) a tool-call
    section that runs to its end; a section that does not parse is content after all."""

    name: ClassVar[str]
    # the reasoning format whose messages carry this format's calls (harmony's): the server parses reasoning
    # with it, and this parser reads the whole output, reasoning and all, for its content and calls
    reasoning_parser: ClassVar[str | None] = None
    # the markers are special tokens: chat requests whose calls it reads keep special tokens in the output's text
    special_tokens: ClassVar[bool] = False
    # a format whose calls are JSON objects: the keys their arguments may have, and how deep the objects sit in
    # the section (0: at its top level, 1: items of an array)
    json_calls: ClassVar[tuple[tuple[str, ...], int] | None] = None

    @abstractmethod
    def section_start(self, text: str) -> int | None:
        """Where the tool-call section begins in ``text``, or ``None`` (none so far)."""

    @abstractmethod
    def holdback(self, text: str) -> int:
        """How many trailing characters of ``text`` (with no section found) could still begin one."""

    @abstractmethod
    def parse_section(self, section: str) -> list[ToolCall]:
        """The calls of a section; raises ``ValueError`` when it holds none."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole output; content is ``None`` when only calls are there."""
        start = self.section_start(text)
        if start is None:
            return text, []
        try:
            calls = self.parse_section(text[start:])
        except (ValueError, SyntaxError, TypeError):  # TypeError: a literal JSON cannot hold (a set)
            return text, []
        return (text[:start] if text[:start].strip() else None), calls

    def scanner(self) -> Scanner:
        """What reads this format's calls as the section streams in: a format of JSON calls (``json_calls``) is
        read by a ``CallScanner``; the others give their own."""
        if self.json_calls is None:
            raise NotImplementedError(f"the {self.name} tool-call parser gives no scanner")
        from raypaged.serving.gateway.tool_parsers.streamed import CallScanner  # which imports this module

        return CallScanner(*self.json_calls)

    def stream(self) -> StreamingToolCalls:
        """One streamed output through this parser: its calls stream as they are written."""
        from raypaged.serving.gateway.tool_parsers.streamed import StreamedCalls  # which imports this module

        return StreamingToolCalls(self, StreamedCalls(self.scanner()))

    def for_tools(self, parameters: Mapping[str, Mapping[str, Any] | None]) -> ToolParser:
        """This parser for a request whose tools take these ``parameters`` schemas (by function name): a format
        whose argument values are text types them by those schemas; one that writes JSON needs none."""
        return self


class MarkerParser(ToolParser):
    """A format whose tool-call section begins at a marker (the first found of ``marker`` and its
    ``alternatives``) anywhere in the output."""

    marker: ClassVar[str]
    alternatives: ClassVar[tuple[str, ...]] = ()

    def section_start(self, text: str) -> int | None:
        found = [i for i in (text.find(m) for m in (self.marker, *self.alternatives)) if i >= 0]
        return min(found, default=None)

    def holdback(self, text: str) -> int:
        return held_back(text, (self.marker, *self.alternatives))


class TypedArgumentsParser(MarkerParser):
    """A format whose argument values are text, typed by their parameters' schemas in the request's tools."""

    def __init__(self, parameters: Mapping[str, Mapping[str, Any] | None] | None = None) -> None:
        self._parameters = dict(parameters or {})  # function name -> its parameters' JSON schema

    def for_tools(self, parameters: Mapping[str, Mapping[str, Any] | None]) -> ToolParser:
        return type(self)(parameters)

    def properties(self, function: str) -> Mapping[str, Any]:
        """The schemas of ``function``'s parameters by name (none for a function the tools do not have)."""
        properties = (self._parameters.get(function) or {}).get("properties")
        return properties if isinstance(properties, Mapping) else {}


class StreamingToolCalls:
    """One streamed choice through a parser: content before the tool-call section streams as it
    comes (but for what could begin one), the section is parsed when the output ends. The calls
    stream as they are written too (``calls``: their names once whole, then their arguments), and
    the parsed calls then settle what was sent."""

    def __init__(self, parser: ToolParser, calls: StreamedCalls) -> None:
        self.parser = parser
        self.calls = calls
        self.text = ""
        self._sent = 0  # characters of text already sent as content
        self._section: int | None = None
        self._scanned = 0  # characters of text the section's calls have read

    def feed(self, delta: str) -> str:
        """Content to send now."""
        self.text += delta
        if self._section is None:
            self._section = self.parser.section_start(self.text)
        safe = self._section if self._section is not None else len(self.text) - self.parser.holdback(self.text)
        content = self.text[self._sent : safe]
        self._sent = max(self._sent, safe)
        return content

    def call_deltas(self) -> list[dict[str, Any]]:
        """The tool-call deltas of the section's text fed since the last call (none before the section)."""
        if self._section is None:
            return []
        start = max(self._scanned, self._section)
        self._scanned = len(self.text)
        return self.calls.feed(self.text[start:])

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the tool calls) once the output ended. Calls streamed in a section that does
        not parse after all stay as sent, and the section is not sent again as content."""
        content, calls = self.parser.extract(self.text)
        if calls:
            return "", calls
        if self.calls.started:
            return "", []
        rest = self.text[self._sent :]
        self._sent = len(self.text)
        return rest, []

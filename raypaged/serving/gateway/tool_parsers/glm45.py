"""GLM-4.5/4.6: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>`` blocks.
A value is its text where the tool's schema types the parameter ``string``; otherwise what it writes as JSON, else
as a Python literal, else its text (as vLLM)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from raypaged.serving.gateway.tool_parsers.base import ToolCall, TypedArgumentsParser, decoded_value, object_json
from raypaged.serving.gateway.tool_parsers.streamed import TagScanner
from raypaged.structured.harmony import held_back

START, END = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45Parser(TypedArgumentsParser):
    name = "glm45"
    marker = START

    def parse_section(self, section: str) -> list[ToolCall]:
        calls = [self._call(block) for block in _BLOCK.findall(section)]
        if not calls:
            raise ValueError("no tool call")
        return calls

    def _call(self, block: str) -> ToolCall:
        name = block.partition("<arg_key>")[0].partition("\n")[0].strip()
        if not name:
            raise ValueError(f"a tool call without a name: {block!r}")
        properties = self.properties(name)
        arguments: dict[str, Any] = {}
        for key, text in _ARGUMENT.findall(block):
            key, text = key.strip(), text.strip()
            arguments[key] = text if is_string(properties.get(key)) else decoded_value(text)
        return ToolCall(name, object_json(arguments))

    def scanner(self) -> Glm45Scanner:
        return Glm45Scanner(self)


class Glm45Scanner(TagScanner):
    """Reads the calls as they are written: a call's name once its line is whole, each argument once its
    ``</arg_value>`` comes, and the value of a ``string`` parameter as it is written."""

    ends = {
        "out": re.compile(re.escape(START)),
        "name": re.compile(r"\n|<arg_key>|</tool_call>"),
        "body": re.compile(r"<arg_key>|</tool_call>"),
        "key": re.compile(re.escape(KEY_END)),
        "between": re.compile(re.escape(VALUE)),
        "value": re.compile(re.escape(VALUE_END)),
    }

    def read(self, state: str, text: str, marker: str) -> str:
        if state == "name":
            self.open_named(text.strip())
        if state in ("name", "body"):
            if marker == END:
                self.close_call()
                return "out"
            return "key" if marker == KEY else "body"
        if state == "key":
            self.key = text.strip()
            return "between"
        if state == "between":
            self.built.broken = self.built.broken or bool(text.strip())  # the parser reads no such argument
            return "value"
        value = text.strip()
        self.built.add(self.key, value if is_string(self.properties.get(self.key)) else decoded_value(value))
        return "body"

    def grow(self, written: str) -> None:
        """A ``string`` parameter's value as far as it is sure: without the whitespace around it or what may
        begin its ``</arg_value>``."""
        if is_string(self.properties.get(self.key)):
            self.built.grow(self.key, written[: len(written) - held_back(written, (VALUE_END,))].strip())


def is_string(schema: Any) -> bool:
    """A parameter of this ``schema`` keeps its text; the others' values are read as JSON or Python literals."""
    return isinstance(schema, Mapping) and schema.get("type") == "string"

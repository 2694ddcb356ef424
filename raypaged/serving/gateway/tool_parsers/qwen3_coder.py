"""Qwen3-Coder: ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n...</function>\\n</tool_call>``.
A value is typed by its parameter's schema in the request's tools, as vLLM: ``null`` is null; a parameter the
tool does not have, or a string one, keeps its text; integers, numbers and booleans are read as such (an
integer or number that is none stays text); objects and arrays as JSON, else a Python literal; other types as
a Python literal; what does not read stays text. A call or parameter left open at the end of the output counts."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from raypaged.serving.gateway.tool_parsers.base import ToolCall, TypedArgumentsParser, decoded_value, object_json
from raypaged.serving.gateway.tool_parsers.streamed import TagScanner
from raypaged.structured.harmony import held_back

TOOL_CALL, FUNCTION = "<tool_call>", "<function="
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FUNCTION = re.compile(r"<function=(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
_VALUE_ENDS = ("</parameter>", "<parameter=", "</function>")  # what ends a parameter's value
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_TYPES = ("int", "uint", "long", "short", "unsigned")  # prefixes


class Qwen3CoderParser(TypedArgumentsParser):
    name = "qwen3_coder"
    marker = TOOL_CALL
    alternatives = (FUNCTION,)  # calls without the <tool_call> wrapper

    def parse_section(self, section: str) -> list[ToolCall]:
        blocks = _TOOL_CALL.findall(section) or [section]
        calls = [self._call(function) for block in blocks for function in _FUNCTION.findall(block)]
        if not calls:
            raise ValueError("no tool call")
        return calls

    def _call(self, function: str) -> ToolCall:
        name, found, body = function.partition(">")
        if not found:
            raise ValueError(f"a function without its '>': {function!r}")
        properties = self.properties(name)
        arguments: dict[str, Any] = {}
        for parameter in _PARAMETER.findall(body):
            key, found, text = parameter.partition(">")
            if not found:
                raise ValueError(f"a parameter without its '>': {parameter!r}")
            text = text.removeprefix("\n").removesuffix("\n")
            arguments[key] = typed(text, properties.get(key))
        return ToolCall(name, object_json(arguments))

    def scanner(self) -> Qwen3CoderScanner:
        return Qwen3CoderScanner(self)


class Qwen3CoderScanner(TagScanner):
    """Reads the calls as they are written: a call's name once its ``<function=NAME>`` is whole, each parameter
    once its value ends, and the value of a text parameter (typed ``string`` or the like, or one the tool does not
    have) as it is written."""

    ends = {
        "out": re.compile(re.escape(FUNCTION)),
        "name": re.compile(">"),
        "body": re.compile(r"<parameter=|</function>"),
        "key": re.compile(">"),
        "value": re.compile(r"</parameter>|(?=<parameter=)|(?=</function>)"),  # the next marker is the body's
    }

    def read(self, state: str, text: str, marker: str) -> str:
        if state == "name":
            self.open_named(text)
            return "body"
        if state == "body":
            if marker == "</function>":
                self.close_call()
                return "out"
            return "key"
        if state == "key":
            self.key = text
            return "value"
        self.built.add(self.key, typed(text.removeprefix("\n").removesuffix("\n"), self.properties.get(self.key)))
        return "body"

    def grow(self, written: str) -> None:
        """A text parameter's value as far as it is sure: without the newline that may end it or what may begin
        the marker after it, and not while it could still be ``null``."""
        if not written or not is_text(self.properties.get(self.key)):
            return
        written = written.removeprefix("\n")
        written = written[: len(written) - held_back(written, _VALUE_ENDS)].removesuffix("\n")
        if not "null".startswith(written.lower()):
            self.built.grow(self.key, written)


def is_text(schema: Any) -> bool:
    """A parameter of this ``schema`` (``None``: one the tool does not have) keeps its text (but ``null``)."""
    return _kind(schema) in _STRING_TYPES


def _kind(schema: Any) -> str:
    return str(schema["type"]).strip().lower() if isinstance(schema, Mapping) and "type" in schema else "string"


def typed(text: str, schema: Any) -> Any:
    """A parameter's text as the value its ``schema``'s type makes it (``None``: no schema, text)."""
    if text.lower() == "null":
        return None
    kind = _kind(schema)
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(_INTEGER_TYPES):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        return decoded_value(text)
    return decoded_value(text, json_first=False)

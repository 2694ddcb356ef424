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

TOOL_CALL, FUNCTION = "<tool_call>", "<function="
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FUNCTION = re.compile(r"<function=(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
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


def typed(text: str, schema: Any) -> Any:
    """A parameter's text as the value its ``schema``'s type makes it (``None``: no schema, text)."""
    if text.lower() == "null":
        return None
    kind = str(schema["type"]).strip().lower() if isinstance(schema, Mapping) and "type" in schema else "string"
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

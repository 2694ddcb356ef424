"""GLM-4.5/4.6: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>`` blocks.
A value is its text where the tool's schema types the parameter ``string``; otherwise what it writes as JSON, else
as a Python literal, else its text (as vLLM)."""

from __future__ import annotations

import re
from typing import Any

from raypaged.serving.gateway.tool_parsers.base import ToolCall, TypedArgumentsParser, decoded_value, object_json

START = "<tool_call>"
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
            schema = properties.get(key)
            is_string = isinstance(schema, dict) and schema.get("type") == "string"
            arguments[key] = text if is_string else decoded_value(text)
        return ToolCall(name, object_json(arguments))

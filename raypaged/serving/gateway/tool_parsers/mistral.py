"""Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``."""

from __future__ import annotations

import json

from raypaged.serving.gateway.tool_parsers.base import MarkerParser, ToolCall

START = "[TOOL_CALLS]"


class MistralParser(MarkerParser):
    name = "mistral"
    marker = START
    json_calls = (("arguments",), 1)  # past the marker's own brackets (one object, not a list: whole at the end)

    def parse_section(self, section: str) -> list[ToolCall]:
        value = json.loads(section.removeprefix(START).strip())
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ValueError("no tool call")
        return [ToolCall.from_json(v) for v in values]

"""Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``."""

from __future__ import annotations

import json

from raypaged.serving.gateway.tool_parsers.base import ToolCall, ToolParser, marker_holdback

START = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"

    def section_start(self, text: str) -> int | None:
        found = text.find(START)
        return None if found < 0 else found

    def holdback(self, text: str) -> int:
        return marker_holdback(text, START)

    def parse_section(self, section: str) -> list[ToolCall]:
        value = json.loads(section.removeprefix(START).strip())
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ValueError("no tool call")
        return [ToolCall.from_json(v) for v in values]

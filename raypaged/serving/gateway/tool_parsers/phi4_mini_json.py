"""Phi-4-mini: ``functools[...]``, a JSON array of ``{"name": ..., "arguments": {...}}`` (``parameters`` taken as
the arguments too), as vLLM's ``phi4_mini_json`` parser reads it."""

from __future__ import annotations

import json

from raypaged.serving.gateway.tool_parsers.base import MarkerParser, ToolCall

START = "functools["


class Phi4MiniJsonParser(MarkerParser):
    name = "phi4_mini_json"
    marker = START
    json_calls = (("arguments", "parameters"), 1)  # the marker opens the array

    def parse_section(self, section: str) -> list[ToolCall]:
        values = json.loads("[" + section.removeprefix(START))
        if not isinstance(values, list) or not values:
            raise ValueError("no tool call")
        return [ToolCall.from_json(v, ("arguments", "parameters")) for v in values]

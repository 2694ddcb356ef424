"""Hermes / Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

from __future__ import annotations

import json
import re

from raypaged.serving.gateway.tool_parsers.base import MarkerParser, ToolCall

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


class HermesParser(MarkerParser):
    name = "hermes"
    marker = START
    json_calls = (("arguments",), 0)

    def parse_section(self, section: str) -> list[ToolCall]:
        blocks = [b.strip() for b in _BLOCK.findall(section)]
        if not blocks or not all(blocks):
            raise ValueError("no tool call")
        return [ToolCall.from_json(json.loads(block)) for block in blocks]

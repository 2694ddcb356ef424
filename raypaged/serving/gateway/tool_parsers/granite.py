"""IBM Granite 3.x: ``<|tool_call|>`` (Granite 3.1 may write ``<tool_call>``) then a JSON array of
``{"name": ..., "arguments": {...}}``, as vLLM's ``granite`` parser reads it. The marker is a special token of
Granite's tokenizer, so the answer keeps special tokens where this parser reads it."""

from __future__ import annotations

import json

from raypaged.serving.gateway.tool_parsers.base import MarkerParser, ToolCall

START, START_TEXT = "<|tool_call|>", "<tool_call>"


class GraniteParser(MarkerParser):
    name = "granite"
    marker = START
    alternatives = (START_TEXT,)
    special_tokens = True
    json_calls = (("arguments",), 1)

    def parse_section(self, section: str) -> list[ToolCall]:
        body = section.removeprefix(START).removeprefix(START_TEXT).strip()
        values = json.loads(body)
        if not isinstance(values, list) or not values:
            raise ValueError("no tool call")
        return [ToolCall.from_json(v) for v in values]

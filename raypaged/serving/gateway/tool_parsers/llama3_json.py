"""Llama 3.x JSON tool calls: the output is ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``), several separated by ``;``."""

from __future__ import annotations

import json

from raypaged.serving.gateway.tool_parsers.base import ToolCall, ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    json_calls = (("parameters", "arguments"), 0)

    def section_start(self, text: str) -> int | None:
        body = text.lstrip()
        start = len(text) - len(body)
        if body.startswith(PYTHON_TAG) or body.startswith("{"):
            return start
        return None

    def holdback(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if not body or PYTHON_TAG.startswith(body) else 0

    def parse_section(self, section: str) -> list[ToolCall]:
        section = section.strip().removeprefix(PYTHON_TAG).strip()
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(section):
            value, end = decoder.raw_decode(section, position)
            calls.append(ToolCall.from_json(value, ("parameters", "arguments")))
            position = end
            while position < len(section) and section[position] in " \n\t;":
                position += 1
        if not calls:
            raise ValueError("no tool call")
        return calls

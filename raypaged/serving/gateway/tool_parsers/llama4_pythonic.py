"""Llama 4's pythonic tool calls: the pythonic format (``[get_weather(city="Paris")]``), which the model may
wrap in ``<|python_start|>``...``<|python_end|>``."""

from __future__ import annotations

from raypaged.serving.gateway.tool_parsers.base import ToolCall
from raypaged.serving.gateway.tool_parsers.pythonic import PythonicParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class Llama4PythonicParser(PythonicParser):
    name = "llama4_pythonic"

    def section_start(self, text: str) -> int | None:
        body = text.lstrip()
        return len(text) - len(body) if body.startswith(PYTHON_START) else super().section_start(text)

    def holdback(self, text: str) -> int:
        return len(text) if PYTHON_START.startswith(text.lstrip()) else 0

    def parse_section(self, section: str) -> list[ToolCall]:
        return super().parse_section(section.strip().removeprefix(PYTHON_START).replace(PYTHON_END, ""))

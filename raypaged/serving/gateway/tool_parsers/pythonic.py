"""Pythonic tool calls (Llama 3.2/4 style): the output is ``[get_weather(city="Paris"), f()]``,
keyword arguments of Python literals."""

from __future__ import annotations

import ast
import json

from raypaged.serving.gateway.tool_parsers.base import ToolCall, ToolParser


class PythonicParser(ToolParser):
    name = "pythonic"

    def section_start(self, text: str) -> int | None:
        body = text.lstrip()
        return len(text) - len(body) if body.startswith("[") else None

    def holdback(self, text: str) -> int:
        return len(text) if not text.strip() else 0

    def parse_section(self, section: str) -> list[ToolCall]:
        tree = ast.parse(section.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ValueError("no tool call")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise ValueError("a tool call takes keyword arguments only")
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
            calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls

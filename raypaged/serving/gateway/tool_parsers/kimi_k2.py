"""Kimi K2: ``<|tool_calls_section_begin|>``, then each call as
``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>``, then
``<|tool_calls_section_end|>``. A call's id is the model's own ``functions.NAME:INDEX`` (the id Kimi's chat
template writes back), as vLLM. The markers are special tokens."""

from __future__ import annotations

import re

from raypaged.serving.gateway.tool_parsers.base import MarkerParser, ToolCall, object_json
from raypaged.serving.gateway.tool_parsers.streamed import MarkedScanner

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_BEGIN_SINGULAR = "<|tool_call_section_begin|>"  # a variant the model also writes
CALL_BEGIN, ARGUMENTS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_ID = re.compile(r"\s*([^<]+:\d+)\s*")
# (id, JSON arguments) of each whole call
_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*([^<]+:\d+)\s*<\|tool_call_argument_begin\|>\s*"
    r"((?:(?!<\|tool_call_begin\|>).)*?)\s*<\|tool_call_end\|>",
    re.DOTALL,
)


class KimiK2Parser(MarkerParser):
    name = "kimi_k2"
    marker = SECTION_BEGIN
    alternatives = (SECTION_BEGIN_SINGULAR,)
    special_tokens = True

    def parse_section(self, section: str) -> list[ToolCall]:
        calls = [
            ToolCall(_name(call_id), object_json(arguments), call_id.strip())
            for call_id, arguments in _CALL.findall(section)
        ]
        if not calls:
            raise ValueError("no tool call")
        return calls

    def scanner(self) -> MarkedScanner:
        return MarkedScanner(CALL_BEGIN, ARGUMENTS_BEGIN, CALL_END, _header)


def _name(call_id: str) -> str:
    """``functions.get_weather:0`` (or ``get_weather:0``) calls ``get_weather``."""
    return call_id.strip().split(":")[0].split(".")[-1]


def _header(header: str) -> tuple[str | None, str | None]:
    """(name, id) of a call's header; (None, None) for one the parser does not read."""
    found = _ID.fullmatch(header)
    return (None, None) if found is None else (_name(found.group(1)), found.group(1).strip())

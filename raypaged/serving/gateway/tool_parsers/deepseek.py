"""DeepSeek-V3/R1 (``deepseek_v3``): ``<｜tool▁calls▁begin｜>``, then each call as
``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``, then
``<｜tool▁calls▁end｜>``. DeepSeek-V3.1 (``deepseek_v31``) writes each call as
``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``. The markers are special tokens."""

from __future__ import annotations

import re
from typing import ClassVar

from raypaged.serving.gateway.tool_parsers.base import MarkerParser, ToolCall, object_json
from raypaged.serving.gateway.tool_parsers.streamed import MarkedScanner

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_B, _S, _E = (re.escape(m) for m in (CALL_BEGIN, SEP, CALL_END))


class DeepSeekV3Parser(MarkerParser):
    name = "deepseek_v3"
    marker = CALLS_BEGIN
    special_tokens = True
    # (name, JSON arguments) of each whole call; the type before the separator is "function"
    call: ClassVar[re.Pattern[str]] = re.compile(
        _B + r"[^\n]*?" + _S + r"([^\n]*)\n```json\n(.*?)\n```" + _E, re.DOTALL
    )

    def parse_section(self, section: str) -> list[ToolCall]:
        calls = [ToolCall(name.strip(), object_json(arguments)) for name, arguments in self.call.findall(section)]
        if not calls:
            raise ValueError("no tool call")
        return calls

    def scanner(self) -> MarkedScanner:
        return MarkedScanner(CALL_BEGIN, "\n```json\n", "\n```" + CALL_END, _v3_name)


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"
    call = re.compile(_B + r"(.*?)" + _S + r"(.*?)" + _E, re.DOTALL)

    def scanner(self) -> MarkedScanner:
        return MarkedScanner(CALL_BEGIN, SEP, CALL_END, lambda header: (header.strip() or None, None))


def _v3_name(header: str) -> tuple[str | None, None]:
    """A V3 call's name: after the separator, on the header's line (``function<｜tool▁sep｜>NAME``)."""
    _, found, name = header.partition(SEP)
    return (name.strip() or None) if found and "\n" not in header else None, None

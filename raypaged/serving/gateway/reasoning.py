"""Reasoning models (``--reasoning-parser``): an answer's reasoning is ``reasoning_content``, the rest its
``content``, whole (``ReasoningParser.split``) and streamed (``ReasoningParser.stream``). The formats are
``raypaged.structured.reasoning``'s, which constraints and thinking budgets follow too.
"""

from __future__ import annotations

from raypaged.structured.reasoning import PARSERS, ReasoningParser, ReasoningStream, get_reasoning_parser

__all__ = ["PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]

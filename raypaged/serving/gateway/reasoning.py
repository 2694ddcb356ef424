"""Reasoning models (``--reasoning-parser``): an answer's reasoning is ``reasoning_content``, the rest its
``content``, whole (``ReasoningParser.split``) and streamed (``ReasoningParser.stream``), in the format a request's
chat-template variables make of the server's (``ReasoningParser.for_template``: DeepSeek-V3.1 thinks only when they
turn it on). The formats are ``raypaged.structured.reasoning``'s, which constraints and thinking budgets follow too.
"""

from __future__ import annotations

from raypaged.structured.reasoning import PARSERS, ReasoningParser, ReasoningStream, get_reasoning_parser

__all__ = ["PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]

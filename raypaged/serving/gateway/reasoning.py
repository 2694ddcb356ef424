"""Reasoning models (``--reasoning-parser``): an answer's ``<think>...</think>`` section is
``reasoning_content``, the rest its ``content``, whole and streamed (the formats are
``raypaged.structured.reasoning``'s, which constraints follow too).
"""

from __future__ import annotations

from raypaged.serving.gateway.tool_parsers.base import marker_holdback
from raypaged.structured.reasoning import END, PARSERS, START, ReasoningParser, get_reasoning_parser

__all__ = ["PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]


class ReasoningStream:
    """One streamed choice: each text delta becomes (reasoning delta, content delta); a marker split
    across deltas is held back until it is whole."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._text = ""
        self._sent = 0  # characters of _text handled
        self._state = "undecided"  # then "reasoning" or "content"

    def feed(self, delta: str) -> tuple[str, str]:
        self._text += delta
        reasoning, content = "", ""
        if self._state == "undecided":
            body = self._text.lstrip()
            if body.startswith(START):
                self._sent = len(self._text) - len(body) + len(START)
                self._state = "reasoning"
            elif START.startswith(body):  # could still open (or is only whitespace)
                return "", ""
            else:
                self._state = "reasoning" if self.parser.starts_inside else "content"
        if self._state == "reasoning":
            end = self._text.find(END, self._sent)
            if end < 0:
                safe = len(self._text) - marker_holdback(self._text[self._sent :], END)
                reasoning, self._sent = self._text[self._sent : safe], safe
                return reasoning, ""
            reasoning = self._text[self._sent : end]
            self._sent = end + len(END)
            self._state = "content"
        content, self._sent = self._text[self._sent :], len(self._text)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held once the output ended."""
        rest, self._sent = self._text[self._sent :], len(self._text)
        if self._state == "undecided":
            return ("", rest) if not self.parser.starts_inside else (rest, "")
        return (rest, "") if self._state == "reasoning" else ("", rest)

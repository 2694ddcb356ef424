"""Reasoning models (``--reasoning-parser``): an answer's ``<think>...</think>`` section is
``reasoning_content``, the rest its ``content``, whole and streamed.

- ``deepseek_r1``: the chat template opens the section, so the output may start inside it:
  everything up to ``</think>`` is reasoning (all of it, when no ``</think>`` comes).
- ``qwen3``: only an output that opens with ``<think>`` has a section; otherwise all is content.
"""

from __future__ import annotations

from dataclasses import dataclass

from raypaged.serving.gateway.tool_parsers.base import marker_holdback

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # the output may begin inside the section, without START

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; ``None`` for a part that is not there."""
        body = text.lstrip()
        opened = body.startswith(START)
        if not opened and not self.starts_inside:
            return None, text
        inner = body[len(START):] if opened else text
        reasoning, found, content = inner.partition(END)
        if not found:
            return inner, None
        return reasoning, content or None


PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", True), "qwen3": ReasoningParser("qwen3", False)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not supported; supported: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]


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
                safe = len(self._text) - marker_holdback(self._text[self._sent:], END)
                reasoning, self._sent = self._text[self._sent:safe], safe
                return reasoning, ""
            reasoning = self._text[self._sent:end]
            self._sent = end + len(END)
            self._state = "content"
        content, self._sent = self._text[self._sent:], len(self._text)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held once the output ended."""
        rest, self._sent = self._text[self._sent:], len(self._text)
        if self._state == "undecided":
            return ("", rest) if not self.parser.starts_inside else (rest, "")
        return (rest, "") if self._state == "reasoning" else ("", rest)

"""Reasoning formats (``--reasoning-parser``): where an output's reasoning is, for the gateway (which returns it
as ``reasoning_content``), for constraints (which apply after it) and for thinking budgets (which force its end).

- ``deepseek_r1``: a ``<think>...</think>`` section; the chat template opens it, so the output may start
  inside it: everything up to ``</think>`` is reasoning (all of it, when no ``</think>`` comes).
- ``qwen3``: only an output that opens with ``<think>`` has a section; otherwise all is content.
- ``openai_gptoss``: gpt-oss's harmony messages (``raypaged.structured.harmony``): the analysis channel is
  reasoning, the final channel and preambles are content. Its markers are special tokens, which the output's
  text must keep; the reasoning ends where the final channel opens, ``<|channel|>final<|message|>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

from raypaged.flag_json import json_object
from raypaged.structured import harmony

if TYPE_CHECKING:
    import xgrammar

START, END = "<think>", "</think>"
# between the section's end and a constrained answer: the newlines reasoning models write there
_GAP = "[ \\n]{0,2}"


class ReasoningStream(Protocol):
    """One streamed output: each text delta becomes (reasoning delta, content delta)."""

    def feed(self, delta: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]:
        """What is still held once the output ended."""
        ...


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """A ``start``...``end`` section (``<think>`` style) before the answer."""

    name: str
    start: str  # what opens the reasoning (a thinking budget counts the tokens after it)
    end: str  # what closes it: a constraint applies after it
    starts_inside: bool  # the output may begin inside the section, without ``start``
    budget_end: str = ""  # what a thinking budget forces to close the reasoning ("": ``end``)
    special_tokens: bool = False  # the markers are special tokens: outputs are detokenized keeping them

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; ``None`` for a part that is not there."""
        body = text.lstrip()
        opened = body.startswith(self.start)
        if not opened and not self.starts_inside:
            return None, text
        inner = body[len(self.start) :] if opened else text
        reasoning, found, content = inner.partition(self.end)
        if not found:
            return inner, None
        return reasoning, content or None

    def stream(self) -> ReasoningStream:
        return SectionStream(self)

    def after_section(self, grammar: xgrammar.Grammar) -> xgrammar.Grammar:
        """``grammar`` behind this format's reasoning: free text up to ``end`` (the section optional unless
        ``starts_inside``), up to two spaces or newlines, then the constrained answer."""
        import xgrammar as xgr

        begin = "" if self.starts_inside else self.start
        tag = {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": self.end}
        section = xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": tag}))
        reasoned = xgr.Grammar.concat(section, xgr.Grammar.from_regex(_GAP), grammar)
        return reasoned if self.starts_inside else xgr.Grammar.union(reasoned, grammar)


@dataclass(frozen=True, slots=True)
class HarmonyParser(ReasoningParser):
    """gpt-oss's harmony messages: analysis is reasoning, final and preambles content, wherever they come."""

    def split(self, text: str) -> tuple[str | None, str | None]:
        return harmony.split(text)

    def stream(self) -> ReasoningStream:
        return harmony.HarmonySplit()


class SectionStream:
    """One streamed output of a ``<think>``-style format; a marker split across deltas is held back until it is
    whole."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._text = ""
        self._sent = 0  # characters of _text handled
        self._state = "undecided"  # then "reasoning" or "content"

    def feed(self, delta: str) -> tuple[str, str]:
        self._text += delta
        reasoning, content = "", ""
        start, end = self.parser.start, self.parser.end
        if self._state == "undecided":
            body = self._text.lstrip()
            if body.startswith(start):
                self._sent = len(self._text) - len(body) + len(start)
                self._state = "reasoning"
            elif start.startswith(body):  # could still open (or is only whitespace)
                return "", ""
            else:
                self._state = "reasoning" if self.parser.starts_inside else "content"
        if self._state == "reasoning":
            found = self._text.find(end, self._sent)
            if found < 0:
                safe = len(self._text) - harmony.held_back(self._text[self._sent :], (end,))
                reasoning, self._sent = self._text[self._sent : safe], safe
                return reasoning, ""
            reasoning = self._text[self._sent : found]
            self._sent = found + len(end)
            self._state = "content"
        content, self._sent = self._text[self._sent :], len(self._text)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._sent = self._text[self._sent :], len(self._text)
        if self._state == "undecided":
            return ("", rest) if not self.parser.starts_inside else (rest, "")
        return (rest, "") if self._state == "reasoning" else ("", rest)


PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", START, END, starts_inside=True),
    "qwen3": ReasoningParser("qwen3", START, END, starts_inside=False),
    "openai_gptoss": HarmonyParser(
        "openai_gptoss",
        harmony.CHANNEL + "analysis" + harmony.MESSAGE,
        harmony.CHANNEL + "final" + harmony.MESSAGE,
        starts_inside=True,
        budget_end=harmony.END,  # the analysis message's end: the model goes on to its answer or a call
        special_tokens=True,
    ),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not supported; supported: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]


def closed_in(prompt_tail: str, end: str = END) -> bool:
    """The prompt itself closed the section that ``end`` closes (Qwen3's template without thinking ends in
    ``<think>\\n\\n</think>\\n\\n``; a harmony prompt continuing its final message in
    ``<|channel|>final<|message|>``): the answer starts at once."""
    return prompt_tail.rstrip().endswith(end)


@dataclass(frozen=True, slots=True)
class ReasoningConfig:
    """vLLM's ``--reasoning-config``: the strings that open and close a reasoning section, for
    ``thinking_token_budget``. Each left empty comes from ``reasoning_parser`` (or the server's
    ``--reasoning-parser``): ``<think>`` and ``</think>``; for ``openai_gptoss``,
    ``<|channel|>analysis<|message|>`` and ``<|end|>``. A
    ``reasoning_end_str`` may carry words before the end marker (``"\\nOut of time.</think>"``): a budget
    forces all of it."""

    reasoning_parser: str = ""
    reasoning_start_str: str = ""
    reasoning_end_str: str = ""

    def __post_init__(self) -> None:
        if self.reasoning_parser:
            get_reasoning_parser(self.reasoning_parser)

    @classmethod
    def parse(cls, value: str | dict | ReasoningConfig | None) -> ReasoningConfig | None:
        """From ``--reasoning-config``'s JSON object (or its dict); unknown keys are refused by name."""
        if value is None or isinstance(value, ReasoningConfig):
            return value
        value = json_object("--reasoning-config", value)
        known = [f.name for f in fields(cls)]
        for key, item in value.items():
            if key not in known:
                raise ValueError(f"--reasoning-config: unknown field {key!r}; allowed: {', '.join(known)}")
            if not isinstance(item, str):
                raise ValueError(f"--reasoning-config: {key} must be a string, got {item!r}")
        return cls(**value)

    def delimiters(self, server_parser: str = "") -> tuple[str, str] | None:
        """(start, end) of a reasoning section; ``None`` when neither a string nor a parser gives both."""
        name = self.reasoning_parser or server_parser
        parser = get_reasoning_parser(name) if name else None
        start = self.reasoning_start_str or (parser.start if parser else "")
        end = self.reasoning_end_str or ((parser.budget_end or parser.end) if parser else "")
        return (start, end) if start and end else None

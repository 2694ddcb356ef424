"""Reasoning formats (``--reasoning-parser``, vLLM's names): where an output's reasoning is, for the gateway (which
returns it as ``reasoning_content``), for constraints (which apply after it) and for thinking budgets (which count
from its start and force its end).

Most formats are a section, from a start to an end, before the answer; they differ in how an output holds it:

- ``deepseek_r1``, ``minimax_m2`` (``<think>...</think>``), ``seed_oss`` (``<seed:think>...</seed:think>``) and
  ``ernie45``: the chat template opens the section, so the output may start inside it: everything up to the end
  is reasoning (all of it, when no end comes); a start opening the output is dropped. ERNIE-4.5's answer may
  come wrapped, ``</think>\\n\\n<response>\\nThe answer.\\n</response>\\n``: the newlines and ``<response>``
  before it are dropped, and so is the last ``</response>`` with what follows it.
- ``qwen3``, ``glm45`` (``<think>...</think>``) and ``granite`` (``Here is my thought process:`` ... ``Here is
  my response:``, or ``Here's``): only an output that opens with the start has a section; otherwise all is
  content.
- ``mistral`` (Magistral's ``[THINK]...[/THINK]``, special tokens): the first section wherever it opens, the text
  around it content; an end before any start is dropped.
- ``deepseek_v3`` (DeepSeek-V3.1's): per request (``ReasoningParser.for_template``), ``deepseek_r1``'s when the
  request's chat-template variables turn ``thinking`` or ``enable_thinking`` on, as vLLM decides it; otherwise
  no reasoning: all is content, and a constraint applies from the first token.
- ``minimax_m2_append_think``: the reasoning stays in the content, which opens with the ``<think>`` the prompt
  ended in.
- ``openai_gptoss``: gpt-oss's harmony messages (``raypaged.structured.harmony``): the analysis channel is
  reasoning, the final channel and preambles are content. Its markers are special tokens, which the output's
  text must keep; the reasoning ends where the final channel opens, ``<|channel|>final<|message|>``.

Whole and streamed, an output splits alike: a marker split across deltas is held back until it is whole.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

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
    """A ``start``...``end`` section (``<think>`` style) before the answer; the fields after ``special_tokens`` say
    how an output may hold it (see the module's docstring for each format)."""

    name: str
    start: str  # what opens the reasoning (a thinking budget counts the tokens after it)
    end: str  # what closes it: a constraint applies after it
    starts_inside: bool  # the output may begin inside the section, without ``start``
    budget_end: str = ""  # what a thinking budget forces to close the reasoning ("": ``end``)
    special_tokens: bool = False  # the markers are special tokens: outputs are detokenized keeping them
    other_starts: tuple[str, ...] = ()  # other spellings of ``start`` the split reads (Granite's "Here's")
    other_ends: tuple[str, ...] = ()  # and of ``end``
    anywhere: bool = False  # the section may open after content (Mistral's): the text around it is content
    # the answer after the section may come wrapped in these (ERNIE-4.5's <response>...</response>)
    answer_wrapper: tuple[str, str] | None = None
    thinking: bool = True  # False: the answers hold no reasoning: all is content (the gateway constrains it at once)
    # chat-template variables, one truthy turning thinking on for a request (DeepSeek-V3.1's); () none do
    thinking_switches: tuple[str, ...] = ()
    reasoning_in_content: bool = False  # the reasoning stays in the content, which opens with ``start``

    @property
    def starts(self) -> tuple[str, ...]:
        return (self.start, *self.other_starts)

    @property
    def ends(self) -> tuple[str, ...]:
        return (self.end, *self.other_ends)

    def for_template(self, variables: Mapping[str, Any]) -> ReasoningParser:
        """This format for a chat request whose template got ``variables`` (its ``chat_template_kwargs`` over what
        its ``reasoning_effort`` sets): with ``thinking_switches``, it thinks only when one of them is truthy."""
        if not self.thinking_switches:
            return self
        return replace(self, thinking=any(bool(variables.get(name)) for name in self.thinking_switches))

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; ``None`` for a part that is not there."""
        stream = SectionStream(self)
        reasoning, content = stream.feed(text)
        more, rest = stream.finish()
        if not stream.opened:
            return None, content + rest
        return reasoning + more, content + rest or None

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


def _first(text: str, markers: tuple[str, ...], pos: int) -> tuple[int, str] | None:
    """Where the earliest of ``markers`` is in ``text`` from ``pos``, and which; ``None``: none is."""
    found = [(at, marker) for marker in markers if (at := text.find(marker, pos)) >= 0]
    return min(found, default=None)


class SectionStream:
    """One streamed output of a section format; a marker split across deltas is held back until it is whole, and
    so is the start of an output that could still open a section (or an answer its wrapper)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.opened = False  # a section was found, or the output began inside one
        self._text = ""
        self._sent = 0  # characters of _text handled
        self._state: Literal["undecided", "reasoning", "content"] = "undecided"
        self._wrapped: bool | None = None  # the answer is in parser.answer_wrapper (None: not known yet)
        self._prefix = ""  # what the content opens with, not sent yet
        if not parser.thinking or parser.reasoning_in_content:
            self._state = "content"
            self._prefix = parser.start if parser.reasoning_in_content else ""

    def feed(self, delta: str) -> tuple[str, str]:
        self._text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", self._prefix
        self._prefix = ""
        while True:
            if self._state == "undecided":
                before, more = self._open(final)
                content += before
                if not more:
                    break
            elif self._state == "reasoning":
                reasoning += self._reasoning(final)
                if self._state == "reasoning":
                    break
            else:
                content += self._answer(final)
                break
        self._text, self._sent = self._text[self._sent :], 0  # only what is still held
        return reasoning, content

    def _safe(self, markers: tuple[str, ...], final: bool) -> int:
        """Where the text sure not to begin one of ``markers`` ends (all of it once the output ended)."""
        return len(self._text) - (0 if final else harmony.held_back(self._text[self._sent :], markers))

    def _take(self, until: int, skip: int = 0) -> str:
        """The text up to ``until``, then ``skip`` characters more are handled (a marker, dropped)."""
        piece, self._sent = self._text[self._sent : until], until + skip
        return piece

    def _open(self, final: bool) -> tuple[str, bool]:
        """Content before a section, and whether there is more to read now."""
        parser = self.parser
        if parser.anywhere:
            markers = parser.starts + parser.ends
            found = _first(self._text, markers, self._sent)
            if found is None:
                return self._take(self._safe(markers, final)), False
            at, marker = found
            if marker in parser.starts:  # else an end before any start, dropped
                self._state, self.opened = "reasoning", True
            return self._take(at, len(marker)), True
        body = self._text.lstrip()
        opening = next((s for s in parser.starts if body.startswith(s)), None)
        if opening is not None:
            self._sent = len(self._text) - len(body) + len(opening)
            self._state, self.opened = "reasoning", True
            return "", True
        if not final and any(s.startswith(body) for s in parser.starts):
            return "", False  # it could still open (or is only whitespace so far)
        self._state = "reasoning" if parser.starts_inside else "content"
        self.opened = parser.starts_inside
        return "", True

    def _reasoning(self, final: bool) -> str:
        found = _first(self._text, self.parser.ends, self._sent)
        if found is None:
            return self._take(self._safe(self.parser.ends, final))
        at, marker = found
        self._state = "content"
        return self._take(at, len(marker))

    def _answer(self, final: bool) -> str:
        wrapper = self.parser.answer_wrapper
        if wrapper is None or self._wrapped is False:
            return self._take(len(self._text))
        opening, closing = wrapper
        if self._wrapped is None:
            rest = self._text[self._sent :]
            body = rest.lstrip("\n")
            if body.startswith(opening):
                self._sent += len(rest) - len(body) + len(opening)
                self._wrapped = True
            elif not final and opening.startswith(body):
                return ""  # it could still open (or is only newlines so far)
            else:
                self._wrapped = False
                return self._take(len(self._text))
        last = self._text.rfind(closing, self._sent)  # dropped with what follows it, unless another one comes
        if last < 0:
            return self._take(self._safe((closing,), final))
        return self._take(last, len(self._text) - last if final else 0)


PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", START, END, starts_inside=True),
    # vLLM's without the request's template variables: no thinking
    "deepseek_v3": ReasoningParser(
        "deepseek_v3", START, END, starts_inside=True, thinking=False, thinking_switches=("thinking", "enable_thinking")
    ),
    "ernie45": ReasoningParser("ernie45", START, END, starts_inside=True, answer_wrapper=("<response>", "</response>")),
    "glm45": ReasoningParser("glm45", START, END, starts_inside=False),
    "granite": ReasoningParser(
        "granite",
        "Here is my thought process:",
        "Here is my response:",
        starts_inside=False,
        other_starts=("Here's my thought process:",),
        other_ends=("Here's my response:",),
    ),
    "minimax_m2": ReasoningParser("minimax_m2", START, END, starts_inside=True),
    "minimax_m2_append_think": ReasoningParser(
        "minimax_m2_append_think", START, END, starts_inside=True, reasoning_in_content=True
    ),
    "mistral": ReasoningParser(
        "mistral", "[THINK]", "[/THINK]", starts_inside=False, special_tokens=True, anywhere=True
    ),
    "openai_gptoss": HarmonyParser(
        "openai_gptoss",
        harmony.CHANNEL + "analysis" + harmony.MESSAGE,
        harmony.CHANNEL + "final" + harmony.MESSAGE,
        starts_inside=True,
        budget_end=harmony.END,  # the analysis message's end: the model goes on to its answer or a call
        special_tokens=True,
    ),
    "qwen3": ReasoningParser("qwen3", START, END, starts_inside=False),
    "seed_oss": ReasoningParser("seed_oss", "<seed:think>", "</seed:think>", starts_inside=True),
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
    ``--reasoning-parser``): its start and end (``<think>`` and ``</think>``, ``[THINK]`` and ``[/THINK]``, ...);
    for ``openai_gptoss``, ``<|channel|>analysis<|message|>`` and ``<|end|>``. A
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

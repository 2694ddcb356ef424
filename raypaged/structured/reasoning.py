"""Reasoning formats (``--reasoning-parser``): where a ``<think>...</think>`` section is, for the
gateway (which splits it into ``reasoning_content``) and for constraints (which apply after it).

- ``deepseek_r1``: the chat template opens the section, so the output may start inside it:
  everything up to ``</think>`` is reasoning (all of it, when no ``</think>`` comes).
- ``qwen3``: only an output that opens with ``<think>`` has a section; otherwise all is content.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from raypaged.flag_json import json_object

if TYPE_CHECKING:
    import xgrammar

START, END = "<think>", "</think>"
# between the section's end and a constrained answer: the newlines reasoning models write there
_GAP = "[ \\n]{0,2}"


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
        inner = body[len(START) :] if opened else text
        reasoning, found, content = inner.partition(END)
        if not found:
            return inner, None
        return reasoning, content or None

    def after_section(self, grammar: xgrammar.Grammar) -> xgrammar.Grammar:
        """``grammar`` behind this format's reasoning section: free text up to ``</think>`` (the
        section optional for ``qwen3``), up to two spaces or newlines, then the constrained answer."""
        import xgrammar as xgr

        begin = "" if self.starts_inside else START
        section = xgr.Grammar.from_structural_tag(
            f'{{"type": "structural_tag", "format": {{"type": "tag", "begin": "{begin}", '
            f'"content": {{"type": "any_text"}}, "end": "{END}"}}}}'
        )
        reasoned = xgr.Grammar.concat(section, xgr.Grammar.from_regex(_GAP), grammar)
        return reasoned if self.starts_inside else xgr.Grammar.union(reasoned, grammar)


PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", True), "qwen3": ReasoningParser("qwen3", False)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not supported; supported: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]


def closed_in(prompt_tail: str) -> bool:
    """The prompt itself closed the section (Qwen3's template without thinking ends in
    ``<think>\\n\\n</think>\\n\\n``): the answer starts at once."""
    return prompt_tail.rstrip().endswith(END)


@dataclass(frozen=True, slots=True)
class ReasoningConfig:
    """vLLM's ``--reasoning-config``: the strings that open and close a reasoning section, for
    ``thinking_token_budget``. Each left empty comes from ``reasoning_parser`` (or the server's
    ``--reasoning-parser``): ``<think>`` and ``</think>``. A ``reasoning_end_str`` may carry words
    before the end marker (``"\\nOut of time.</think>"``): a budget forces all of it."""

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
        parser = self.reasoning_parser or server_parser
        start = self.reasoning_start_str or (START if parser else "")
        end = self.reasoning_end_str or (END if parser else "")
        return (start, end) if start and end else None

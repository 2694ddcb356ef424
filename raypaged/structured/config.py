"""The server's structured-outputs settings (vLLM's ``--structured-outputs-config``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from raypaged.flag_json import json_object
from raypaged.structured.reasoning import ReasoningParser, get_reasoning_parser

# auto: xgrammar, or llguidance for a JSON schema with keywords xgrammar would not enforce (as vLLM)
BACKENDS = ("auto", "xgrammar", "guidance")
_KNOWN_UNSUPPORTED = ("outlines", "lm-format-enforcer")


@dataclass(slots=True, frozen=True)
class StructuredOutputsConfig:
    """``backend``: the grammar engine: ``xgrammar``, ``guidance`` (llguidance) or ``auto``
    (xgrammar, and guidance for JSON schemas with keywords xgrammar would not enforce).
    ``disable_any_whitespace``: JSON outputs are compact (one space after ``:`` and ``,``), so a
    small model cannot loop on whitespace; ``False`` allows free whitespace, up to
    ``max_whitespace`` characters between two tokens of JSON (``None``: unbounded, as vLLM).
    ``cache_size`` and ``cache_mb``: compiled grammars kept, and the most memory they take (a large
    JSON schema compiles to megabytes), least recently used dropped first; a grammar larger than
    ``cache_mb`` is used by its request and not kept.
    ``max_grammar_ms``: the most CPU time, in milliseconds, one request's grammar may spend on one
    token (filling its mask, or taking the sampled token). An ambiguous EBNF grammar can cost more
    with every token (``s ::= s s | "a"``: 35 ms a mask at 200 tokens, 290 ms at 400), and every
    sequence of the batch waits for the masks; past the limit the request ends alone with an error
    naming it. ``None``: no limit.
    ``max_compile_s``: the most time, in seconds, a new constraint may take to compile (xgrammar's; tried in a
    child process that is killed at the limit, ``compile_trial``): a JSON schema's ``"pattern": "^[a-z]{1,50000}$"``
    took 392 s, and would hold a core and every other new constraint's compile. Past it the request is refused
    with an error naming the limit. ``None``: no limit, and no trial.
    ``reasoning_parser`` (set by ``--reasoning-parser``): constraints apply after the output's
    reasoning section, unless ``enable_in_reasoning``, where they apply from the first token."""

    backend: str = "auto"
    disable_any_whitespace: bool = True
    max_whitespace: int | None = 4
    cache_size: int = 256
    cache_mb: int = 512  # vLLM's VLLM_XGRAMMAR_CACHE_MB default
    max_grammar_ms: float | None = 100.0
    max_compile_s: float | None = 10.0  # as vLLM's grammar compilation timeout
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            extra = " (not built into raypaged)" if self.backend in _KNOWN_UNSUPPORTED else ""
            raise ValueError(
                f"structured outputs backend {self.backend!r} is not supported{extra}; supported: {', '.join(BACKENDS)}"
            )
        if self.max_whitespace is not None and self.max_whitespace < 1:
            raise ValueError(f"structured outputs max_whitespace must be at least 1, got {self.max_whitespace}")
        if self.cache_size < 1:
            raise ValueError(f"structured outputs cache_size must be at least 1, got {self.cache_size}")
        if self.cache_mb < 1:
            raise ValueError(f"structured outputs cache_mb must be at least 1, got {self.cache_mb}")
        for name in ("max_grammar_ms", "max_compile_s"):
            limit = getattr(self, name)
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0):
                raise ValueError(f"structured outputs {name} must be a number above 0 (null: no limit), got {limit!r}")
        if self.reasoning_parser:
            get_reasoning_parser(self.reasoning_parser)

    @property
    def reasoning(self) -> ReasoningParser | None:
        """The format whose reasoning section constraints wait for (``None``: they apply at once)."""
        if not self.reasoning_parser or self.enable_in_reasoning:
            return None
        return get_reasoning_parser(self.reasoning_parser)

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | None, backend: str | None = None, reasoning_parser: str | None = None
    ) -> StructuredOutputsConfig:
        """From ``--structured-outputs-config`` (a JSON object or a dict), the older
        ``--guided-decoding-backend`` (which sets ``backend``) and ``--reasoning-parser``;
        unknown keys are refused by name."""
        values = {} if value is None else json_object("--structured-outputs-config", value)
        known = {f.name for f in fields(cls)}
        unknown = [key for key in values if key not in known]
        if unknown:
            raise ValueError(
                f"--structured-outputs-config: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(known))}"
            )
        if backend is not None:
            values["backend"] = backend
        if reasoning_parser:
            values["reasoning_parser"] = reasoning_parser
        return cls(**values)

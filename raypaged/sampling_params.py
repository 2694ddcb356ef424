"""Sampling and stopping parameters of one request (vLLM-compatible names)."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # a single output, when the request finishes


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's names): exactly one of

    - ``json``: a JSON schema (a dict or its JSON text) the output must validate against;
    - ``regex``: a regular expression the whole output must match;
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: an EBNF (GBNF) grammar whose ``root`` rule the output must derive;
    - ``json_object``: any JSON object;
    - ``structural_tag``: xgrammar's structural tag (JSON text): free text with tagged,
      constrained segments (tool calls).

    ``disable_any_whitespace`` and ``disable_additional_properties`` (JSON only) override the
    server's ``--structured-outputs-config`` for this request when set.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    # from the first token, inside a reasoning section too (a chat request's include_reasoning: false, as vLLM)
    in_reasoning: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, regex, choice, grammar, json_object or "
                f"structural_tag, got {given or 'none'}"
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured outputs: choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, dict) if name == "json" else str):
                raise ValueError(f"structured outputs: {name} must be a string, got {type(value).__name__}")
        if self.whitespace_pattern is not None:
            raise ValueError("structured outputs: whitespace_pattern is not supported by the xgrammar backend")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's JSON, the regex, the grammar, the choices' JSON."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "choice"):
            return value if isinstance(value, str) else json.dumps(value)
        return "" if value is True else value

    @property
    def num_chars(self) -> int:
        return len(self.spec)


@dataclass(slots=True)
class RepetitionDetectionParams:
    """vLLM's repetition detection: a sequence whose output ends in a pattern of ``min_pattern_size`` (0: 1) to
    ``max_pattern_size`` tokens repeated ``min_count`` times in a row stops (``stop_reason``
    ``"repetition_detected"``). ``max_pattern_size`` 0 turns it off."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValueError(
                "repetition_detection: max_pattern_size and min_pattern_size must be at least 0, with "
                f"min_pattern_size <= max_pattern_size, got {self.min_pattern_size} and {self.max_pattern_size}"
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(f"repetition_detection: min_count must be at least 2, got {self.min_count}")

    def repeated_tail(self, token_ids: list[int], end: int) -> bool:
        """Whether ``token_ids[:end]`` ends in a pattern repeated ``min_count`` times in a row."""
        count = self.min_count
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            if size * count > end:
                return False
            pattern = token_ids[end - size : end]
            if all(token_ids[end - (k + 1) * size : end - k * size] == pattern for k in range(1, count)):
                return True
        return False


# vLLM's --logprobs-mode: what the logprobs requests ask for hold (log-softmax or logits, before or after
# penalties, bias, masks, temperature, top-k, top-p and min-p)
RAW_LOGPROBS, RAW_LOGITS, PROCESSED_LOGPROBS, PROCESSED_LOGITS = (
    "raw_logprobs",
    "raw_logits",
    "processed_logprobs",
    "processed_logits",
)
LOGPROBS_MODES = (RAW_LOGPROBS, RAW_LOGITS, PROCESSED_LOGPROBS, PROCESSED_LOGITS)

REPETITION_DETECTED = "repetition_detected"  # the stop_reason of a sequence repetition detection ended


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Invariants after construction: ``temperature >= 0``; ``0 < top_p <= 1``;
    ``top_k`` is ``None`` or ``>= 1``; ``0 <= min_p <= 1``; ``max_tokens`` is
    ``None`` (fill the context) or ``>= 1``; ``0 <= min_tokens <= max_tokens``;
    ``n >= 1`` and ``best_of`` is ``None`` or ``>= n``.
    ``temperature == 0`` means greedy (argmax after penalties).
    """

    n: int = 1
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob (after the first) and this many top alternatives
    # vLLM's: with logprobs, each generated position shows these tokens' logprobs in place of the most likely ones
    logprob_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None  # added to these tokens' logits, in [-100, 100] (OpenAI's)
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # never generated (their token sequences, with and without a leading space)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # set by the engine from bad_words
    skip_special_tokens: bool = True
    # with skip_special_tokens off: False joins consecutive special (added) tokens without the space between
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # a stop string that ended the output stays in its text
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last this many tokens (-1: max_model_len)
    truncation_side: str = "left"  # truncate_prompt_tokens cuts on this side: "right" keeps the first tokens
    stream_interval: int = 1  # DELTA outputs: every this many new tokens (never more often than the engine's)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    repetition_detection: RepetitionDetectionParams | None = None  # vLLM's: stop at a repeating pattern
    # vLLM's: a reasoning section holds at most this many tokens, then its end is forced (None or -1: no budget)
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if isinstance(self.repetition_detection, dict):  # vLLM's JSON form
            self.repetition_detection = RepetitionDetectionParams(**self.repetition_detection)
        if self.repetition_detection is not None and self.repetition_detection.max_pattern_size == 0:
            self.repetition_detection = None  # off
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is not None and self.top_k in (0, -1):
            self.top_k = None  # vLLM spells "no top-k" as 0 or -1
        self._validate()
        if self.temperature < _GREEDY_EPS:
            self.temperature = 0.0

    def _validate(self) -> None:
        for name in ("temperature", "repetition_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            raise ValueError(
                f"thinking_token_budget must be at least 0 (or -1: no budget), got {self.thinking_token_budget}"
            )
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be greater than or equal to n={self.n}, got {self.best_of}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be non-negative, or -1 for the whole vocabulary, got {self.logprobs}")
        if (
            self.truncate_prompt_tokens is not None
            and self.truncate_prompt_tokens < 1
            and self.truncate_prompt_tokens != -1
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be at least 1, or -1 for as many as max_model_len holds, got "
                f"{self.truncate_prompt_tokens}"
            )
        if self.truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(
                f"prompt_logprobs must be non-negative, or -1 for the whole vocabulary, got {self.prompt_logprobs}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            bad = [v for v in self.logit_bias.values() if not -100.0 <= v <= 100.0]
            if bad:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bad[0]}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.bad_words is not None and any(not w for w in self.bad_words):
            raise ValueError("bad_words must not contain empty strings")

    @property
    def num_samples(self) -> int:
        """How many sequences run: ``best_of`` if given, else ``n``."""
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def with_vocabulary_logprobs(self, vocab_size: int) -> SamplingParams:
        """These params with ``logprobs`` / ``prompt_logprobs`` of -1 (vLLM's "the whole
        vocabulary") made ``vocab_size``; the same object when neither is -1."""
        if self.logprobs != -1 and self.prompt_logprobs != -1:
            return self
        return replace(
            self,
            logprobs=vocab_size if self.logprobs == -1 else self.logprobs,
            prompt_logprobs=vocab_size if self.prompt_logprobs == -1 else self.prompt_logprobs,
        )


@dataclass(slots=True)
class BeamSearchParams:
    """``llm.beam_search`` parameters (vLLM's names).

    Scores are ``cumulative_logprob / num_generated_tokens ** length_penalty``.
    ``structured_outputs``: every beam follows the constraint (each beam its own grammar state,
    forked with the beam); a beam ends only where the grammar accepts EOS.
    """

    beam_width: int = 4
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.structured_outputs is not None and self.ignore_eos:
            raise ValueError(
                "beam search with structured_outputs cannot ignore_eos: a beam ends where its grammar does"
            )

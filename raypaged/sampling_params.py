"""Sampling and stopping parameters of one request (vLLM-compatible names)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs holds (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # a single output, when the request finishes


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
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
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
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings")

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

"""``--speculative-config``: vLLM's JSON object, validated once, every key honoured or refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raypaged.flag_json import json_object

METHODS = ("ngram", "draft_model")
# vLLM keys with no effect here unless left at these values (refused by name otherwise)
_DEFAULT_ONLY = {"draft_tensor_parallel_size": (None, 1), "revision": (None,), "quantization": (None,)}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``num_speculative_tokens`` drafts per sequence per step, proposed by ``method``:

    - ``ngram``: the last ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens are looked up
      in the prompt and the output so far; the tokens that followed their latest match are proposed.
    - ``draft_model``: ``model`` (a smaller model with the target's tokenizer) proposes greedily,
      run by the same worker over its own paged KV cache, indexed by the target's block tables.

    Speculation stops for the whole step while more than ``disable_by_batch_size`` sequences run.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                "--speculative-config num_speculative_tokens must be a positive integer, got "
                f"{self.num_speculative_tokens!r}"
            )
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("--speculative-config: method ngram takes no model")
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            # vLLM: either bound alone sets both
            low, high = (low if low is not None else high or 1), (high if high is not None else low or 1)
            if low < 1 or high < low:
                raise ValueError(
                    f"--speculative-config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}"
                )
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        else:
            if not self.model:
                raise ValueError("--speculative-config: method draft_model needs a model (a folder or Hub id)")
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, key) is not None:
                    raise ValueError(f"--speculative-config: {key} belongs to method ngram, not draft_model")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"--speculative-config disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}"
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From ``--speculative-config`` (JSON text) or ``LLM(speculative_config=dict)``; ``None``: off.
        A ``model`` without a ``method`` is a draft model, as in vLLM."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        options = json_object("--speculative-config", value)
        for key, allowed in _DEFAULT_ONLY.items():
            if key in options:
                given = options.pop(key)
                if given not in allowed:
                    raise ValueError(f"--speculative-config {key} {given!r} is not supported")
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "model",
            "disable_by_batch_size",
        }
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown or unsupported key {unknown[0]!r}; supported: "
                f"{', '.join(sorted(known | set(_DEFAULT_ONLY)))}"
            )
        if "num_speculative_tokens" not in options:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        method = options.pop("method", None) or ("draft_model" if options.get("model") else None)
        if method is None:
            raise ValueError("--speculative-config needs a method (ngram or draft_model) or a draft model")
        return cls(method=method, **options)

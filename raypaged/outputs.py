"""What generation returns to users (vLLM-compatible shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per generated token: token id -> logprob
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    finish_message: str | None = None  # set when the engine ended it on its own (it outgrew the KV cache ...)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # tokens sampled for this request so far, over all its sequences (best_of counts every sample once)
    num_generated_tokens: int = 0
    # set when the engine ended this request alone because handling it failed (finished, finish_reason "error")
    error: str | None = None

"""What generation returns to users (vLLM-compatible shapes)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast


class FinishReason(enum.StrEnum):
    """Why a sequence ended, as OpenAI and vLLM name it (a ``str``: equal to, and serialized as, its value)."""

    STOP = "stop"  # EOS, a stop token id, a stop string, or a complete structured output
    LENGTH = "length"  # max_tokens, max_model_len, or the KV cache could not hold it
    ABORT = "abort"  # cancelled by its client or the server
    ERROR = "error"  # handling this request failed: it ended alone (RequestOutput.error says why)


class Logprob(float):
    """One token's log-probability as vLLM's ``Logprob``: ``logprob``, ``rank`` (1: the most likely
    token of its position) and ``decoded_token`` (its text); it is also that float itself, so
    arithmetic and comparisons on it work as on a plain logprob."""

    __slots__ = ("rank", "decoded_token")
    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        entry = super().__new__(cls, logprob)
        entry.rank = rank
        entry.decoded_token = decoded_token
        return entry

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self) -> tuple:
        return Logprob, (float(self), self.rank, self.decoded_token)


def decode_logprobs(entries: list[dict[int, float]] | list[dict[int, float] | None], tokenizer) -> None:
    """Give every ``Logprob`` of ``entries`` (in place) its ``decoded_token`` where it has none."""
    for entry in entries:
        for token_id, value in (entry or {}).items():
            if isinstance(value, Logprob) and value.decoded_token is None:
                value.decoded_token = tokenizer.decode([token_id])


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per generated token: token id -> its Logprob (the sampled first)
    finish_reason: FinishReason | None = None  # None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    finish_message: str | None = None  # set when the engine ended it on its own (it outgrew the KV cache ...)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """A request's timeline and shape as the engine saw them (vLLM's ``RequestOutput.metrics``).

    Times are ``time.monotonic()`` seconds of the engine's process: compare them with
    each other, never with wall-clock time. ``None`` until the stage is reached. Each
    output carries its own copy, true as of that output's step (a streamed ``DELTA``
    request: its final output only)."""

    arrival_time: float  # queued in the engine
    n: int  # completions asked for
    max_tokens: int  # tokens each sequence may generate (resolved against max_model_len)
    first_scheduled_time: float | None = None  # first admitted into a batch
    first_token_time: float | None = None  # its first sampled token (any sequence)
    last_token_time: float | None = None  # its newest sampled token (any sequence)
    max_num_generation_tokens: int = 0  # tokens of its longest sequence so far

    @property
    def queue_time(self) -> float | None:
        """Queued until first scheduled."""
        return _interval(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_time(self) -> float | None:
        """First scheduled until the first token."""
        return _interval(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        """The first token until the newest."""
        return _interval(self.first_token_time, self.last_token_time)

    @property
    def inference_time(self) -> float | None:
        """First scheduled until the newest token: prefill plus decode."""
        return _interval(self.first_scheduled_time, self.last_token_time)


def _interval(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None: the prompt was given as embeddings (vLLM's prompt_embeds)
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # tokens sampled for this request so far, over all its sequences (best_of counts every sample once)
    num_generated_tokens: int = 0
    # set when the engine ended this request alone (finished, finish_reason "error"): handling it failed, or its
    # own fields left nothing to do (error_param names the field)
    error: str | None = None
    metrics: RequestMetrics | None = None  # None for beam searches, and a DELTA stream's outputs before its last
    # with SamplingParams.prompt_logprobs: per prompt token its logprob and the top-N (None for the first)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of computed (vLLM's)
    pooled: Any = None  # an embedding model's request (--runner pooling), finished: its embedding (float32 tensor)
    num_prompt_embeds: int = 0  # a prompt given as embeddings: its rows (prompt_token_ids is None)
    # with ``error``: the request field whose value left nothing to do (the request's own doing, a client
    # error); None when handling it failed
    error_param: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's tokens: its ids, or its embedding rows."""
        return self.num_prompt_embeds if self.prompt_token_ids is None else len(self.prompt_token_ids)


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam as vLLM's: ``tokens`` are the prompt's then the beam's, ``logprobs`` per generated token
    the candidates its step weighed (token id -> ``Logprob``), ``text`` the generated text."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    text: str
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput(RequestOutput):
    """A finished beam search: vLLM's ``sequences`` (best first), and the same beams as ``outputs``."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


_Pooled = TypeVar("_Pooled")
_Other = TypeVar("_Other")


@dataclass(slots=True)
class PoolingOutput:
    """vLLM's: an embedding model's pooled vector (``data``: a float32 tensor)."""

    data: Any


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's: an embedding as floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class PoolingRequestOutput(Generic[_Pooled]):
    """vLLM's output of ``LLM.encode``: one prompt's pooled vector (``outputs.data``); ``EmbeddingRequestOutput``
    (``LLM.embed``) holds it as floats."""

    request_id: str
    outputs: _Pooled
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0

    @classmethod
    def of(cls, output: RequestOutput) -> PoolingRequestOutput[PoolingOutput]:
        """An embedding model's finished ``RequestOutput`` as vLLM returns it."""
        assert output.pooled is not None, "only an embedding model's finished request has a vector"
        assert output.prompt_token_ids is not None, "an embedding model's prompt is token ids"
        return PoolingRequestOutput(
            output.request_id, PoolingOutput(output.pooled), output.prompt_token_ids, True, output.num_cached_tokens
        )

    def with_outputs(self, outputs: _Other, kind: type[PoolingRequestOutput[_Other]]) -> PoolingRequestOutput[_Other]:
        """The same request's output as ``kind`` holding ``outputs`` (an embedding's floats, a classifier's
        probabilities, a pair's score)."""
        return kind(self.request_id, outputs, self.prompt_token_ids, self.finished, self.num_cached_tokens)


@dataclass(slots=True)
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """vLLM's output of ``LLM.embed``: one prompt's embedding (``outputs.embedding``, floats)."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput[PoolingOutput]) -> EmbeddingRequestOutput:
        return cast(EmbeddingRequestOutput, output.with_outputs(EmbeddingOutput(output.outputs.data.tolist()), cls))


@dataclass(slots=True)
class ClassificationOutput:
    """vLLM's: a classifier's class probabilities (its head's logits through softmax, or sigmoid for one label)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """vLLM's output of ``LLM.classify``: one prompt's class probabilities (``outputs.probs``)."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput[PoolingOutput]) -> ClassificationRequestOutput:
        probs = ClassificationOutput(output.outputs.data.tolist())
        return cast(ClassificationRequestOutput, output.with_outputs(probs, cls))


@dataclass(slots=True)
class ScoringOutput:
    """vLLM's: one pair's score (a cross-encoder's probability, or two embeddings' cosine similarity)."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """vLLM's output of ``LLM.score``: one pair's score (``outputs.score``)."""

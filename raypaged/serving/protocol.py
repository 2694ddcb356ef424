"""Conversions between the gRPC messages and the engine's types."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raypaged.config import GenerationDefaults
from raypaged.inputs.limits import InputError, InputLimits, check_count, check_stop_counts
from raypaged.outputs import CompletionOutput, FinishReason, RequestOutput
from raypaged.pooling_params import PoolingParams
from raypaged.sampling_params import (
    BeamSearchParams,
    RepetitionDetectionParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from raypaged.serving.messages import AnyDelta, AnyPromptLogprobs, AnyResponse, AnyUsage, StreamMessages
from raypaged.serving.proto import generate_pb2 as pb

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def sampling_params_from_proto(
    request: pb.GenerateRequest, limits: InputLimits, defaults: GenerationDefaults = GenerationDefaults()
) -> SamplingParams:
    """The request's ``SamplingParams``; bad values raise ``ValueError`` naming the field.

    The stop lists' sizes are checked before they are copied out of the message. ``defaults`` (the
    model's generation config) fill the optional fields the request leaves unset: temperature,
    top_p, repetition_penalty and max_tokens (top_k and min_p have no "unset" in the message).
    """
    sampling, stopping = request.sampling, request.stopping
    check_stop_counts(len(stopping.stop_sequences), len(stopping.stop_token_ids), limits)
    check_count("bad_words", len(sampling.bad_words), limits.max_stop_strings, "max_stop_strings", "words")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
    kwargs: dict = dict(
        n=sampling.n or 1,
        temperature=_set_or(sampling, "temperature", defaults.temperature, 1.0),
        top_p=_set_or(sampling, "top_p", defaults.top_p, 1.0),
        top_k=sampling.top_k or None,
        min_p=sampling.min_p,
        repetition_penalty=_set_or(sampling, "repetition_penalty", defaults.repetition_penalty, 1.0),
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        seed=sampling.seed if sampling.HasField("seed") else None,
        max_tokens=_set_or(stopping, "max_tokens", defaults.max_tokens, None),
        min_tokens=stopping.min_tokens,
        stop=list(stopping.stop_sequences),
        stop_token_ids=list(stopping.stop_token_ids),
        ignore_eos=stopping.ignore_eos,
        logprobs=_count(request.logprobs) if request.HasField("logprobs") else None,
        prompt_logprobs=_count(request.prompt_logprobs) if request.HasField("prompt_logprobs") else None,
        logit_bias=dict(sampling.logit_bias) or None,
        allowed_token_ids=list(sampling.allowed_token_ids) or None,
        logprob_token_ids=list(sampling.logprob_token_ids) or None,
        bad_words=list(sampling.bad_words) or None,
        skip_special_tokens=stopping.skip_special_tokens if stopping.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(
            stopping.spaces_between_special_tokens if stopping.HasField("spaces_between_special_tokens") else True
        ),
        include_stop_str_in_output=stopping.include_stop_str_in_output,
        truncate_prompt_tokens=(
            _count(request.truncate_prompt_tokens) if request.HasField("truncate_prompt_tokens") else None
        ),
        truncation_side=request.truncation_side or "left",
        stream_interval=request.stream_interval or 1,
        output_kind=RequestOutputKind.DELTA,  # a stream: each response carries what is new
    )
    if sampling.HasField("best_of"):
        kwargs["best_of"] = sampling.best_of
    if sampling.HasField("thinking_token_budget"):
        kwargs["thinking_token_budget"] = sampling.thinking_token_budget
    if request.HasField("structured"):
        kwargs["structured_outputs"] = structured_from_proto(request.structured)
    if stopping.HasField("repetition_detection"):
        found = stopping.repetition_detection
        kwargs["repetition_detection"] = RepetitionDetectionParams(
            found.max_pattern_size, found.min_pattern_size, found.min_count
        )
    try:
        return SamplingParams(**kwargs)
    except TypeError as exc:  # a field this engine build does not know
        raise ValueError(str(exc)) from None


ALL_LOGPROBS = 0xFFFFFFFF  # logprobs / prompt_logprobs on the wire: the whole vocabulary (-1 over HTTP, as vLLM)
WHOLE_CONTEXT = 0xFFFFFFFF  # truncate_prompt_tokens on the wire: as many as max_model_len holds (-1, as vLLM)


def _count(value: int) -> int:
    """A count as the wire carries it, its -1 (``ALL_LOGPROBS``, ``WHOLE_CONTEXT``) as -1."""
    return -1 if value in (ALL_LOGPROBS, WHOLE_CONTEXT) else value


def beam_search_from_proto(request: pb.GenerateRequest, max_model_len: int) -> BeamSearchParams | None:
    """The request's beam search (``None``: it samples). What beam search cannot honour is refused by
    name: it ranks beams by the model's own log-probabilities, with no stop strings or logprobs."""
    if not request.HasField("beam_search"):
        return None
    sampling, stopping = request.sampling, request.stopping
    refused = {
        "temperature": sampling.HasField("temperature") and sampling.temperature not in (0.0, 1.0),
        "top_p": sampling.HasField("top_p") and sampling.top_p != 1.0,
        "top_k": sampling.top_k not in (0, -1),
        "min_p": sampling.min_p != 0.0,
        "presence_penalty": sampling.presence_penalty != 0.0,
        "frequency_penalty": sampling.frequency_penalty != 0.0,
        "repetition_penalty": sampling.HasField("repetition_penalty") and sampling.repetition_penalty != 1.0,
        "seed": sampling.HasField("seed"),
        "best_of": sampling.HasField("best_of") and sampling.best_of != (sampling.n or 1),
        "logit_bias": bool(sampling.logit_bias),
        "allowed_token_ids": bool(sampling.allowed_token_ids),
        "bad_words": bool(sampling.bad_words),
        "thinking_token_budget": sampling.HasField("thinking_token_budget"),
        "logprob_token_ids": bool(sampling.logprob_token_ids),
        "stop": bool(stopping.stop_sequences),
        "stop_token_ids": bool(stopping.stop_token_ids),
        "min_tokens": stopping.min_tokens != 0,
        "skip_special_tokens": stopping.HasField("skip_special_tokens") and not stopping.skip_special_tokens,
        "logprobs": request.HasField("logprobs"),
        "prompt_logprobs": request.HasField("prompt_logprobs"),
        "echo": request.echo,
    }
    for name, asked in refused.items():
        if asked:
            raise InputError(
                name,
                f"{name} is not supported with use_beam_search (beams are ranked by the "
                "model's log-probabilities at temperature 1)",
            )
    length_penalty = request.beam_search.length_penalty
    if not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty}")
    max_tokens = stopping.max_tokens if stopping.HasField("max_tokens") else max_model_len
    structured = structured_from_proto(request.structured) if request.HasField("structured") else None
    return BeamSearchParams(
        beam_width=sampling.n or 1,
        max_tokens=max(max_tokens, 1),
        ignore_eos=stopping.ignore_eos,
        length_penalty=length_penalty,
        structured_outputs=structured,
    )


def pooling_params_from_proto(request: pb.EmbedRequest) -> PoolingParams:
    """An ``Embed`` request's ``PoolingParams``; bad values raise ``ValueError`` naming the field."""
    fields = ("truncate_prompt_tokens", "dimensions", "normalize", "task")
    return PoolingParams(**{name: _set_or(request, name, None, None) for name in fields})


def structured_from_proto(message: pb.StructuredOutput) -> StructuredOutputsParams:
    """The request's constraint; one with no kind set raises ``ValueError``."""
    kind = message.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured: set one of json_schema, regex, choice, grammar, json_object, structural_tag")
    value = list(message.choice.choices) if kind == "choice" else getattr(message, kind)
    whitespace = message.disable_any_whitespace if message.HasField("disable_any_whitespace") else None
    constraint: dict[str, Any] = {"json" if kind == "json_schema" else kind: value}  # the oneof's field, by name
    return StructuredOutputsParams(**constraint, disable_any_whitespace=whitespace, in_reasoning=message.in_reasoning)


def _set_or(message: Any, name: str, default: float | None, fallback: float | None) -> Any:
    """An optional field's value if the client set it, else the model's default, else the engine's."""
    if message.HasField(name):
        return getattr(message, name)
    return fallback if default is None else default


@dataclass
class DeltaTracker:
    """Turns a request's ``DELTA`` outputs into ``GenerateResponse`` messages of ``messages``:
    ``generate_pb2`` for gRPC, or the plain objects of ``messages.py`` for the in-process link.

    The engine already holds back text that could begin a stop string, so each
    output converts as it is; the tracker remembers which completions ended.
    """

    request_id: str
    params: SamplingParams
    tokenizer: PreTrainedTokenizerBase
    messages: StreamMessages
    echo: bool = False  # send the prompt's text with the first tokens
    return_token_ids: bool = False  # send the prompt's token ids with the first tokens
    _done: set[int] = field(default_factory=set)
    _usage: AnyUsage = field(init=False)

    def __post_init__(self) -> None:
        self._usage = self.messages.Usage()

    def response(self, output: RequestOutput) -> AnyResponse:
        messages = self.messages
        deltas = [self._delta(c) for c in output.outputs if c.index not in self._done]
        self._usage = messages.Usage(
            prompt_tokens=output.num_prompt_tokens,
            completion_tokens=output.num_generated_tokens,
            cached_tokens=output.num_cached_tokens,
        )
        prompt = None
        if output.prompt_logprobs is not None:
            ids = output.prompt_token_ids or []  # (refused for a prompt given as embeddings)
            prompt = messages.PromptLogprobs(token_ids=ids, token_texts=[self.tokenizer.decode([t]) for t in ids])
            logprobs = []
            for entry in output.prompt_logprobs[1:]:
                assert entry is not None  # only the first prompt token has none
                logprobs.append(entry)
            add_logprobs(prompt, ids[1:], logprobs, self.params.prompt_logprobs or 0, self.tokenizer, messages)
        prompt_text = ""
        if self.echo and deltas:
            prompt_text = output.prompt if output.prompt is not None else self.tokenizer.decode(output.prompt_token_ids)
            self.echo = False
        prompt_token_ids: list[int] = []
        if self.return_token_ids and deltas:
            prompt_token_ids = output.prompt_token_ids or []  # none for a prompt given as embeddings
            self.return_token_ids = False
        return messages.GenerateResponse(
            request_id=self.request_id,
            outputs=deltas,
            finished=output.finished,
            usage=self._usage,
            prompt_logprobs=prompt,
            prompt_text=prompt_text,
            prompt_token_ids=prompt_token_ids,
        )

    def aborted(self) -> AnyResponse:
        """The last message of a request aborted by someone else: every unfinished completion ends."""
        indices = [i for i in range(self.params.n) if i not in self._done]
        deltas = [self.messages.CompletionDelta(index=i, finish_reason=pb.FINISH_REASON_ABORT) for i in indices]
        return self.messages.GenerateResponse(
            request_id=self.request_id, outputs=deltas, finished=True, usage=self._usage
        )

    def _delta(self, completion: CompletionOutput) -> AnyDelta:
        delta = self.messages.CompletionDelta(
            index=completion.index, token_ids=completion.token_ids, text=completion.text
        )
        if completion.logprobs is not None:
            add_logprobs(
                delta,
                completion.token_ids,
                completion.logprobs,
                len(asked) + 1 if (asked := self.params.logprob_token_ids) else self.params.logprobs or 0,
                self.tokenizer,
                self.messages,
            )
            delta.token_texts.extend(self.tokenizer.decode([t]) for t in completion.token_ids)
        if completion.finish_reason is not None:
            delta.finish_reason = FINISH_REASONS[completion.finish_reason]
            if isinstance(completion.stop_reason, int):
                delta.stop_token_id = completion.stop_reason
            elif completion.stop_reason is not None:
                delta.stop_reason = completion.stop_reason
            if completion.finish_message is not None:
                delta.finish_message = completion.finish_message
            self._done.add(completion.index)
        return delta


def add_logprobs(
    target: AnyDelta | AnyPromptLogprobs,
    token_ids: Sequence[int],
    logprobs: Sequence[Mapping[int, float]],
    num_top: int,
    tokenizer: PreTrainedTokenizerBase,
    messages: StreamMessages,
) -> None:
    """Each token's logprob and its ``num_top`` most likely alternatives (``messages.TopLogprobs``), into ``target``."""
    for token_id, candidates in zip(token_ids, logprobs):
        target.logprobs.append(candidates[token_id])
        top = sorted(candidates.items(), key=lambda item: -item[1])[:num_top]
        target.top_logprobs.append(
            messages.TopLogprobs(
                token_ids=[t for t, _ in top],
                logprobs=[lp for _, lp in top],
                token_texts=[tokenizer.decode([t]) for t, _ in top],
            )
        )

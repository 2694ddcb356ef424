"""The bodies of vLLM's derender endpoints (``POST /v1/chat/completions/derender`` and
``/v1/completions/derender``): ``/inference/v1/generate``'s answers in output mode ``tokens`` (whole, or one
stream chunk with the client-carried ``stream_state``), with the request they answer, and what the engine's
``Derender`` takes of them (``pb.GeneratedCompletion``).

What the OpenAI answers have no place for (multimodal placeholders, routed experts, transfer parameters,
per-request metrics, the prompt's logprobs) is refused by name when it is set, not dropped.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.schemas import ChatCompletionRequest, CompletionRequest, Unsigned, _check_extra_fields
from raypaged.serving.proto import generate_pb2 as pb

_WIRE_FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
# a generate answer's fields that no OpenAI answer carries: taken only when they hold nothing
_NOT_CARRIED: dict[str, tuple[object, ...]] = {
    name: ()
    for name in (
        "routed_experts",
        "sampling_mask",
        "weight_versions",
        "mm_placeholders",
        "metrics",
        "prompt_logprobs",
        "prompt_token_id_logprobs",
        "kv_transfer_params",
        "ec_transfer_params",
    )
}


class _Carried(BaseModel):
    """A part of a generate answer: ``_NOT_CARRIED`` fields set are a 400 naming them; others are ignored, as the
    OpenAI bodies' unknown fields are."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _not_carried(self) -> _Carried:
        _check_extra_fields(self.model_extra, _NOT_CARRIED)
        return self


class LogprobBody(BaseModel):
    token_id: Unsigned
    logprob: float
    rank: int | None = None


class LogprobsContentBody(LogprobBody):
    top_logprobs: list[LogprobBody] = Field(default_factory=list)


class LogprobsBody(BaseModel):
    content: list[LogprobsContentBody] | None = None


class TokensChoiceBody(_Carried):
    """A choice of output mode ``tokens``, whole (``finish_reason`` defaults to ``stop``) or a chunk's."""

    index: Unsigned
    finish_reason: Literal["stop", "length", "abort"] | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[Unsigned] | None = None
    logprobs: LogprobsBody | None = None

    def completion(self, with_logprobs: bool) -> pb.GeneratedCompletion:
        """The choice as the engine's ``Derender`` takes it (``with_logprobs``: each token's candidates)."""
        token_ids = self.token_ids or []
        found = pb.GeneratedCompletion(token_ids=token_ids, finish_reason=_WIRE_FINISH_REASONS[self.finish_reason])
        if isinstance(self.stop_reason, int):
            found.stop_token_id = self.stop_reason
        elif self.stop_reason is not None:
            found.stop_reason = self.stop_reason
        content = self.logprobs.content if self.logprobs is not None else None
        if not with_logprobs:
            if content:
                raise APIError(400, f"choice {self.index} has logprobs, which its request does not ask for", "logprobs")
            return found
        if content is None or [e.token_id for e in content] != token_ids:
            raise APIError(400, f"choice {self.index} needs logprobs for each of its tokens: its request asks for them")
        for entry in content:
            others = [t for t in entry.top_logprobs if t.token_id != entry.token_id]
            found.candidates.append(
                pb.TopLogprobs(
                    token_ids=[entry.token_id, *(t.token_id for t in others)],
                    logprobs=[entry.logprob, *(t.logprob for t in others)],
                )
            )
        return found


class TokensChunkChoiceBody(TokensChoiceBody):
    """A stream chunk's choice: it ends only where it says so."""

    finish_reason: Literal["stop", "length", "abort"] | None = None


class PromptDetailsBody(BaseModel):
    cached_tokens: Unsigned = 0


class UsageBody(BaseModel):
    prompt_tokens: Unsigned = 0
    completion_tokens: Unsigned = 0
    total_tokens: Unsigned = 0
    prompt_tokens_details: PromptDetailsBody | None = None


class TokensResponseBody(_Carried):
    """vLLM's ``GenerateResponse`` of output mode ``tokens``, whole (``output_mode`` ``text`` and ``derender``
    answers are detokenized already: derendering their tokens again would lose their stop strings' cut)."""

    request_id: str
    model: str | None = None
    created: int | None = None
    usage: UsageBody | None = None
    prompt_token_ids: list[Unsigned] | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[TokensChoiceBody]


class TokensChunkBody(_Carried):
    """One chunk of ``/inference/v1/generate``'s stream, output mode ``tokens``."""

    request_id: str
    usage: UsageBody | None = None
    prompt_token_ids: list[Unsigned] | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[TokensChunkChoiceBody] = Field(max_length=1)  # a stream chunk has one


# vLLM's stream state fields this server keeps nothing in (its state is the tokens so far, re-derendered each
# chunk): taken at their defaults, which it answers with
_UNUSED_STATE: dict[str, tuple[object, ...]] = {
    "prev_token_ids": (),
    "prefix_offset": (0,),
    "read_offset": (0,),
    "logprob_context_token_ids": (),
    "logprob_text_offset": (0,),
    "tools_streamed": (False,),
    "last_tool_call_ids": (),
}


class StreamStateBody(BaseModel):
    """vLLM's ``DerenderStreamState``: this server's is a choice's tokens so far (``output_token_ids``, in the
    chunks that brought them, ``output_chunk_lens``) and whether its role went out."""

    model_config = ConfigDict(extra="allow")

    output_token_ids: list[Unsigned] = Field(default_factory=list)
    output_chunk_lens: list[Annotated[int, Field(gt=0)]] = Field(default_factory=list)
    role_sent: bool = False

    @model_validator(mode="after")
    def _checked(self) -> StreamStateBody:
        for name, value in (self.model_extra or {}).items():
            if name not in _UNUSED_STATE or value not in (None, [], *_UNUSED_STATE[name]):
                raise APIError(
                    400,
                    f"stream_state.{name} is not used by this server: send back the stream_state it answered",
                    f"stream_state.{name}",
                )
        if sum(self.output_chunk_lens) != len(self.output_token_ids):
            raise APIError(400, "stream_state.output_chunk_lens must sum to its output_token_ids' length")
        return self

    def answer(self) -> dict:
        return {
            "prev_token_ids": [],
            "prefix_offset": 0,
            "read_offset": 0,
            "role_sent": self.role_sent,
            "logprob_context_token_ids": [],
            "logprob_text_offset": 0,
            "output_token_ids": self.output_token_ids,
            "output_chunk_lens": self.output_chunk_lens,
            "tools_streamed": False,
            "last_tool_call_ids": [],
        }


class _DerenderBody(BaseModel):
    """What both derender endpoints take besides the request: ``stream`` false a whole answer, true one chunk."""

    model_config = ConfigDict(extra="allow")

    stream: bool = False
    model: str | None = None
    generate_chunk: TokensChunkBody | None = None
    stream_state: StreamStateBody | None = None

    @model_validator(mode="after")
    def _extra_fields(self) -> _DerenderBody:
        _check_extra_fields(self.model_extra)
        whole = self.whole_answers
        if self.stream and (self.generate_chunk is None or whole):
            raise APIError(400, "stream true derenders one chunk: send generate_chunk (and no whole answer)")
        if not self.stream and (not whole or self.generate_chunk is not None or self.stream_state is not None):
            raise APIError(400, "stream false derenders whole answers: send no generate_chunk or stream_state")
        return self

    @property
    def whole_answers(self) -> list[TokensResponseBody]:
        raise NotImplementedError


class DerenderChatBody(_DerenderBody):
    """vLLM's ``DerenderChatRequest`` (``stream`` false) and ``DerenderChatStreamRequest`` (true)."""

    generate_response: TokensResponseBody | None = None
    prompt_tokens: Unsigned | None = None
    prompt_token_ids: list[Unsigned] | None = None
    chat_request: ChatCompletionRequest | None = None

    @property
    def whole_answers(self) -> list[TokensResponseBody]:
        return [self.generate_response] if self.generate_response is not None else []


class DerenderCompletionBody(_DerenderBody):
    """vLLM's ``DerenderCompletionRequest`` (``stream`` false: one answer per prompt, as render made one request
    per prompt) and ``DerenderCompletionStreamRequest`` (true)."""

    generate_responses: list[TokensResponseBody] | None = None
    # stream false: one per answer (null: its usage's, or none); true: the chunk's
    prompt_tokens: list[Unsigned | None] | Unsigned | None = None
    prompt_token_ids: list[list[Unsigned] | None] | list[Unsigned] | None = None
    completion_request: CompletionRequest | None = None

    @property
    def whole_answers(self) -> list[TokensResponseBody]:
        return self.generate_responses or []

    def answer_prompts(self) -> tuple[list[int | None], list[list[int] | None]]:
        """Stream false: each answer's prompt token count and ids (``None``: not given)."""
        num_answers = len(self.whole_answers)
        counts: list[int | None] = [None] * num_answers
        if isinstance(self.prompt_tokens, list):
            counts = self.prompt_tokens
        ids = self.prompt_token_ids or [None] * num_answers
        return counts, [i if isinstance(i, list) else None for i in ids]

    def chunk_prompt(self) -> tuple[int | None, list[int] | None]:
        """Stream true: the chunk's prompt token count and ids (``None``: not given)."""
        count = None if isinstance(self.prompt_tokens, list) else self.prompt_tokens
        ids = self.prompt_token_ids
        return count, [i for i in ids if isinstance(i, int)] if ids is not None else None

    @model_validator(mode="after")
    def _per_answer(self) -> DerenderCompletionBody:
        """Stream false: a prompt's token count and ids per answer, when given; true: the chunk's own."""
        counts, ids = self.prompt_tokens, self.prompt_token_ids
        if self.stream:
            if isinstance(counts, list) or (ids and isinstance(ids[0], list)):
                raise APIError(400, "stream true takes the chunk's prompt_tokens (a count) and prompt_token_ids")
            return self
        num_answers = len(self.whole_answers)
        for name, given in (("prompt_tokens", counts), ("prompt_token_ids", ids)):
            if given is not None and (not isinstance(given, list) or len(given) != num_answers):
                raise APIError(400, f"{name} must hold one entry per generate_responses entry ({num_answers})", name)
            if given and name == "prompt_token_ids" and not all(i is None or isinstance(i, list) for i in given):
                raise APIError(400, "prompt_token_ids must hold a list of token ids (or null) per answer", name)
        return self

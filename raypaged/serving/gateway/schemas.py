"""OpenAI request bodies (plus vLLM's sampling extras) and their gRPC ``GenerateRequest``."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from raypaged.serving.proto import generate_pb2 as pb

from raypaged.serving.gateway.errors import APIError

# integer bounds of the gRPC fields the values travel in
_UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
Unsigned = Annotated[int, Field(ge=0, le=_UINT32_MAX)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationBody(BaseModel):
    """Fields shared by completions and chat completions; unknown fields are ignored (as vLLM does).

    Numbers must be finite and fit the gRPC fields they travel in.
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=_UINT32_MAX)  # the engine caps n and best_of (--max-num-samples)
    best_of: int | None = Field(None, ge=1, le=_UINT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: Unsigned | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-_INT64_MAX - 1, le=_INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=_INT32_MAX)
    min_p: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Unsigned = 0
    stop_token_ids: list[Unsigned] | None = None
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-_INT32_MAX - 1, le=_INT32_MAX)

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def generate_request(
        self, model: str, prompt: dict, num_logprobs: int | None, max_tokens: int | None, priority: int
    ) -> pb.GenerateRequest:
        """``prompt`` is one of ``{"text": ...}``, ``{"token_ids": ...}``, ``{"messages": ...}``.

        The engine checks the values (and answers a ``best_of`` request, streamed or not, with
        its ``n`` best samples only once they are finished).
        """
        sampling = pb.SamplingParameters(
            n=self.n,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        for name in ("best_of", "temperature", "top_p", "repetition_penalty", "seed"):
            if (value := getattr(self, name)) is not None:
                setattr(sampling, name, value)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stopping = pb.StoppingCriteria(
            min_tokens=self.min_tokens,
            stop_sequences=stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
        )
        if max_tokens is not None:
            stopping.max_tokens = max_tokens
        request = pb.GenerateRequest(model=model, sampling=sampling, stopping=stopping, priority=priority, **prompt)
        if num_logprobs is not None:
            request.logprobs = num_logprobs
        return request


class CompletionRequest(_GenerationBody):
    prompt: str | list[str] | list[Unsigned] | list[list[Unsigned]]
    logprobs: Unsigned | None = None  # the engine caps it (--max-logprobs)
    echo: bool = False

    @property
    def num_prompts(self) -> int:
        """Prompts in the body (one engine request each), known without building them."""
        prompt = self.prompt
        return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)

    def prompts(self) -> list[dict]:
        """One ``GenerateRequest`` prompt per prompt of the body."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [{"text": prompt}]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [{"token_ids": pb.TokenIds(ids=prompt)}]
        if isinstance(prompt[0], str):
            return [{"text": p} for p in prompt]
        return [{"token_ids": pb.TokenIds(ids=p)} for p in prompt]

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def resolved_max_tokens(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens


class TextPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        unsupported = [p.type for p in self.content if p.type != "text"]
        if unsupported:
            raise APIError(400, f"only text content parts are supported, got {unsupported[0]!r}", "messages")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_GenerationBody):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Unsigned | None = None  # the engine caps it (--max-logprobs)
    max_completion_tokens: Unsigned | None = None

    @property
    def num_prompts(self) -> int:
        return 1  # a conversation is one prompt

    def prompts(self) -> list[dict]:
        if not self.messages:
            raise APIError(400, "messages must not be empty", "messages")
        turns = [pb.ChatMessage(role=m.role, content=m.text()) for m in self.messages]
        return [{"messages": pb.ChatMessages(messages=turns)}]

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Unsigned]

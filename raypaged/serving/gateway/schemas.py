"""OpenAI request bodies (plus vLLM's sampling extras) and their gRPC ``GenerateRequest``."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raypaged.serving.proto import generate_pb2 as pb

from raypaged.serving.gateway.errors import APIError

logger = logging.getLogger("raypaged")

# integer bounds of the gRPC fields the values travel in
_UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
Unsigned = Annotated[int, Field(ge=0, le=_UINT32_MAX)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # usage only in the last chunk


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class LegacyStructure(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    begin: str
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    end: str


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``, plus vLLM's ``structural_tag`` (xgrammar's ``format``, or the
    older ``structures`` and ``triggers``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[LegacyStructure] | None = None
    triggers: list[str] | None = None

    def structured(self) -> pb.StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return pb.StructuredOutput(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
            return pb.StructuredOutput(json_schema=json.dumps(self.json_schema.json_schema))
        if self.format is not None:
            return pb.StructuredOutput(structural_tag=json.dumps({"type": "structural_tag", "format": self.format}))
        if self.structures is None or self.triggers is None:
            raise APIError(400, "response_format structural_tag needs format, or structures and triggers", "response_format")
        tags = [
            {"begin": s.begin, "content": {"type": "json_schema", "json_schema": s.json_schema or {}}, "end": s.end}
            for s in self.structures
        ]
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": self.triggers, "tags": tags}}
        return pb.StructuredOutput(structural_tag=json.dumps(tag))


class StructuredOutputsBody(BaseModel):
    """vLLM's ``structured_outputs``: one kind of constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool | None = None
    disable_fallback: bool = False  # there is no fallback backend: honoured either way

    def structured(self) -> pb.StructuredOutput:
        if self.whitespace_pattern is not None:
            raise APIError(400, "structured_outputs.whitespace_pattern is not supported by the xgrammar backend",
                           "structured_outputs")
        kinds = {
            "json_schema": self.json_ if isinstance(self.json_, str) or self.json_ is None else json.dumps(self.json_),
            "regex": self.regex,
            "choice": None if self.choice is None else pb.StructuredChoices(choices=self.choice),
            "grammar": self.grammar,
            "json_object": self.json_object or None,
            "structural_tag": self.structural_tag,
        }
        given = {k: v for k, v in kinds.items() if v is not None}
        if len(given) != 1:
            names = [("json" if k == "json_schema" else k) for k in given] or "none"
            raise APIError(
                400,
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object or "
                f"structural_tag, got {names}",
                "structured_outputs",
            )
        message = pb.StructuredOutput(**given)
        if self.disable_any_whitespace is not None:
            message.disable_any_whitespace = self.disable_any_whitespace
        return message


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")

# Request fields of vLLM's (and OpenAI's) API that this server does not implement yet: a request may
# send them only with a value that asks for nothing (these, null, or an empty list or object).
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": (),
    "prompt_logprobs": (),
    "allowed_token_ids": (),
    "bad_words": (),
    "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "return_tokens_as_token_ids": (False,),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "logits_processors": (),
    "prompt_embeds": (),
    "tools": (),
    "tool_choice": ("none", "auto"),
    "functions": (),
    "function_call": ("none", "auto"),
    "chat_template": (),
    "chat_template_kwargs": (),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "documents": (),
    "mm_processor_kwargs": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "request_id": (),
    "cache_salt": (),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
    "reasoning_effort": (),
}
_MAX_LOGGED_FIELDS = 256  # distinct unknown field names logged; a flood of made-up names logs no more
_logged_fields: set[str] = set()


def _check_extra_fields(extra: dict[str, Any] | None) -> None:
    """Fields the body model does not declare: a known one this server cannot honour is a 400
    naming it; an unknown one is logged once per name and ignored (as vLLM does)."""
    for name, value in (extra or {}).items():
        if name in _UNSUPPORTED:
            if value is None or value in ({}, []) or value in _UNSUPPORTED[name]:
                continue
            raise APIError(400, f"{name} is not supported by this server; send the request without it", name)
        if name not in _logged_fields and len(_logged_fields) < _MAX_LOGGED_FIELDS:
            _logged_fields.add(name)
            logger.warning("request field %r is not part of the API and is ignored", name[:64])


class _GenerationBody(BaseModel):
    """Fields shared by completions and chat completions; unknown fields are ignored (as vLLM does).

    Numbers must be finite and fit the gRPC fields they travel in.
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

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
    # structured outputs: OpenAI's, vLLM's, and vLLM's older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    def structured(self) -> pb.StructuredOutput | None:
        """The body's constraint (at most one of the ways to give one), or ``None``."""
        guided = {name: getattr(self, name) for name in _GUIDED if getattr(self, name) is not None}
        given = [name for name in ("response_format", "structured_outputs") if getattr(self, name) is not None]
        given += list(guided)
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")
        if len(given) > 1:
            raise APIError(400, f"give one structured output constraint, got {', '.join(given)}", given[1])
        if self.guided_whitespace_pattern is not None:
            raise APIError(400, "guided_whitespace_pattern is not supported by the xgrammar backend",
                           "guided_whitespace_pattern")
        if self.guided_decoding_backend not in (None, "xgrammar", "auto"):
            raise APIError(
                400,
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not supported; this server "
                "decodes structured outputs with xgrammar",
                "guided_decoding_backend",
            )
        if self.response_format is not None and given:
            return self.response_format.structured()
        if self.structured_outputs is not None:
            return self.structured_outputs.structured()
        if not guided:
            return None
        kind, value = next(iter(guided.items()))
        return StructuredOutputsBody.model_validate({kind.removeprefix("guided_"): value}).structured()

    @model_validator(mode="after")
    def _extra_fields(self) -> _GenerationBody:
        _check_extra_fields(self.model_extra)
        return self

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
        if (structured := self.structured()) is not None:
            request.structured.CopyFrom(structured)
        if num_logprobs is not None:
            request.logprobs = num_logprobs
        return request


class CompletionRequest(_GenerationBody):
    prompt: str | list[str] | list[Unsigned] | list[list[Unsigned]]
    logprobs: Unsigned | None = None  # the engine caps it (--max-logprobs)
    add_special_tokens: Literal[True] = True  # prompts are tokenized with the BOS (as vLLM's default)

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


_UNSUPPORTED_IN_MESSAGES = ("name", "tool_calls", "tool_call_id", "function_call")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None

    @model_validator(mode="after")
    def _extra_fields(self) -> ChatMessage:
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED_IN_MESSAGES and value not in (None, "", [], {}):
                raise APIError(400, f"messages: {name} is not supported by this server; send messages without it",
                               "messages")
        return self

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
    add_special_tokens: Literal[False] = False  # the chat template writes the special tokens (as vLLM's default)

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

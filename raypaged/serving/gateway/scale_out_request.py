"""vLLM's ``GenerateRequest`` (the body of ``POST /inference/v1/generate``, and what the render endpoints answer)
with its ``sampling_params`` (vLLM's ``SamplingParams`` fields), as the gRPC ``GenerateRequest`` the engine runs,
and back.

One table (``_SAMPLING``) says where each sampling parameter travels in the gRPC request; both directions read it.
A parameter left out takes vLLM's ``SamplingParams`` default (temperature 1.0, not the model's generation config:
the render endpoints resolve those), except ``max_tokens``: left out or null, the model's default, else up to the
end of the context. The render endpoints write only what differs from vLLM's defaults (as vLLM serializes
``SamplingParams``), and ``max_tokens`` always.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.schemas import (
    CacheSalt,
    ChatCompletionRequest,
    Int32,
    Int64,
    LogprobCount,
    RepetitionDetection,
    RequestId,
    StreamOptions,
    Unsigned,
    _check_extra_fields,
)
from raypaged.serving.gateway.structured import StructuredOutputsBody
from raypaged.serving.gateway.tool_parsers import ToolParser
from raypaged.serving.gateway.tools import Tool, ToolChoice, ToolPlan
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.protocol import ALL_LOGPROBS, WHOLE_CONTEXT

Count = Annotated[Unsigned, Field(ge=1)]

# sampling parameter -> (the gRPC message it travels in: "" for GenerateRequest itself, the field there)
_SAMPLING: dict[str, tuple[str, str]] = {
    "n": ("sampling", "n"),
    "best_of": ("sampling", "best_of"),
    "presence_penalty": ("sampling", "presence_penalty"),
    "frequency_penalty": ("sampling", "frequency_penalty"),
    "repetition_penalty": ("sampling", "repetition_penalty"),
    "temperature": ("sampling", "temperature"),
    "top_p": ("sampling", "top_p"),
    "top_k": ("sampling", "top_k"),
    "min_p": ("sampling", "min_p"),
    "seed": ("sampling", "seed"),
    "allowed_token_ids": ("sampling", "allowed_token_ids"),
    "bad_words": ("sampling", "bad_words"),
    "logprob_token_ids": ("sampling", "logprob_token_ids"),
    "thinking_token_budget": ("sampling", "thinking_token_budget"),
    "stop": ("stopping", "stop_sequences"),
    "stop_token_ids": ("stopping", "stop_token_ids"),
    "ignore_eos": ("stopping", "ignore_eos"),
    "max_tokens": ("stopping", "max_tokens"),
    "min_tokens": ("stopping", "min_tokens"),
    "skip_special_tokens": ("stopping", "skip_special_tokens"),
    "spaces_between_special_tokens": ("stopping", "spaces_between_special_tokens"),
    "include_stop_str_in_output": ("stopping", "include_stop_str_in_output"),
    "stream_interval": ("", "stream_interval"),
    "truncate_prompt_tokens": ("", "truncate_prompt_tokens"),
    "logprobs": ("", "logprobs"),
    "prompt_logprobs": ("", "prompt_logprobs"),
}
# counts whose -1 (vLLM's: the whole vocabulary, the whole context) travels as a uint32 value of its own
_MINUS_ONE = {"logprobs": ALL_LOGPROBS, "prompt_logprobs": ALL_LOGPROBS, "truncate_prompt_tokens": WHOLE_CONTEXT}
_WRITTEN_ALWAYS = ("max_tokens",)  # what the engine resolved for it, even at vLLM's default (16)

# vLLM's other SamplingParams fields: taken at the values that ask for nothing (null and empty ones too)
_DEFAULT_ONLY: dict[str, tuple[object, ...]] = {
    "prompt_logprob_token_ids": (),
    "prompt_logprob_start": (),
    "flat_logprobs": (False,),  # vLLM's internal layout of logprobs
    "detokenize": (True,),  # the engine always detokenizes
    "extra_args": (),
    "skip_reading_prefix_cache": (False,),
    "routed_experts_prompt_start": (0,),
    "trace_decode_token_ids": (),
    "output_text_buffer_length": (0,),
    "watermarking": (False,),  # no watermark: as the OpenAI routes, a request that asks for one is refused
}

# vLLM's GenerateRequest fields this server cannot honour: taken only when they ask for nothing
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "token_offsets": (),
    "features": (),  # multimodal inputs: the served models read text only
    "content_parts": (),
    "assistant_tokens_mask": (),
    "kv_transfer_params": (),  # prefill and decode run in the same engine
    "ec_transfer_params": (),
    "reasoning_parser_kwargs": ({"chat_template_kwargs": {}},),
    "return_token_logprobs": (False,),
    "return_top_k_logprobs": (False,),
}


class SamplingParamsBody(BaseModel):
    """vLLM's ``SamplingParams`` as JSON, with its defaults; ``best_of`` and ``truncate_prompt_tokens`` are
    vLLM's older ones. ``output_kind`` and ``skip_clone`` are vLLM's engine-internal fields, which its own
    render endpoints write: taken, and as in vLLM the endpoint decides (a stream gets deltas)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    n: Count = 1
    best_of: Count | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(default=0, ge=-1, le=2**31 - 1)
    min_p: float = 0.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Unsigned] | None = None
    ignore_eos: bool = False
    max_tokens: Unsigned | None = None
    min_tokens: Unsigned = 0
    logprobs: LogprobCount | None = None
    prompt_logprobs: LogprobCount | None = None
    logprob_token_ids: list[Unsigned] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream_interval: Count | None = None
    structured_outputs: StructuredOutputsBody | None = None
    logit_bias: dict[Unsigned, float] | None = None
    allowed_token_ids: list[Unsigned] | None = None
    bad_words: list[str] | None = None
    thinking_token_budget: int | None = Field(default=None, ge=-1, le=2**32 - 1)  # -1: no budget
    repetition_detection: RepetitionDetection | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**32 - 2)] | None = None  # -1: max_model_len
    output_kind: Literal[0, 1, 2] | None = None
    skip_clone: bool | None = None

    @model_validator(mode="after")
    def _extra_fields(self) -> SamplingParamsBody:
        for name, value in (self.model_extra or {}).items():
            allowed = _DEFAULT_ONLY.get(name)
            if allowed is None or not (value is None or value in ({}, []) or value in allowed):
                raise APIError(
                    400,
                    f"sampling_params.{name} is not supported by this server; send the request without it",
                    f"sampling_params.{name}",
                )
        return self

    def apply(self, request: pb.GenerateRequest, reasoning_ended: bool) -> None:
        """Sets the parameters on ``request`` (``reasoning_ended``: the constraint applies from the first token)."""
        for name, (message, field) in _SAMPLING.items():
            value = getattr(self, name)
            if name in _MINUS_ONE and value == -1:
                value = _MINUS_ONE[name]
            elif name == "thinking_token_budget" and value == -1:
                value = None
            elif name == "stop" and isinstance(value, str):
                value = [value]
            if value is None:
                continue
            target = getattr(request, message) if message else request
            if isinstance(value, list):
                getattr(target, field).extend(value)
            else:
                setattr(target, field, value)
        request.sampling.logit_bias.update(self.logit_bias or {})
        if self.repetition_detection is not None:
            request.stopping.repetition_detection.CopyFrom(
                pb.RepetitionDetection(**self.repetition_detection.model_dump())
            )
        if self.structured_outputs is not None:
            request.structured.CopyFrom(self.structured_outputs.structured())
            request.structured.in_reasoning = reasoning_ended


def sampling_json(request: pb.GenerateRequest) -> dict[str, Any]:
    """``request``'s sampling parameters as vLLM's ``sampling_params``: those that differ from vLLM's defaults."""
    defaults = SamplingParamsBody()
    out: dict[str, Any] = {}
    for name, (message, field) in _SAMPLING.items():
        source = getattr(request, message) if message else request
        if isinstance(getattr(source, field), (str, int, float)):  # a scalar: optional ones unset are absent
            if source.DESCRIPTOR.fields_by_name[field].has_presence and not source.HasField(field):
                continue
            value = getattr(source, field)
        else:
            value = list(getattr(source, field))
        if name in _MINUS_ONE and value == _MINUS_ONE[name]:
            value = -1
        if name == "stream_interval" and value == 0:  # the server's
            continue
        if value in (getattr(defaults, name), []) and name not in _WRITTEN_ALWAYS:
            continue
        out[name] = value
    if request.sampling.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in sorted(request.sampling.logit_bias.items())}
    if request.stopping.HasField("repetition_detection"):
        found = request.stopping.repetition_detection
        out["repetition_detection"] = {
            "max_pattern_size": found.max_pattern_size,
            "min_pattern_size": found.min_pattern_size,
            "min_count": found.min_count,
        }
    if request.HasField("structured"):
        out["structured_outputs"] = _structured_json(request.structured)
    return out


def _structured_json(structured: pb.StructuredOutput) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` of a constraint (``in_reasoning`` is the request's ``reasoning_ended``)."""
    kind = structured.WhichOneof("kind")
    value: Any = getattr(structured, kind) if kind is not None else None
    if kind == "json_schema":
        kind, value = "json", json.loads(value)
    elif kind == "choice":
        value = list(structured.choice.choices)
    out: dict[str, Any] = {kind or "json": value}
    if structured.HasField("disable_any_whitespace"):
        out["disable_any_whitespace"] = structured.disable_any_whitespace
    return out


class ParseContextBody(BaseModel):
    """vLLM's ``parse_context``: what output mode ``derender`` parses a chat answer with, as render writes it
    of a chat request. ``chat_template_kwargs`` (which render writes over what the request's reasoning effort set)
    say whether a ``deepseek_v3`` answer thinks; ``history_tool_call_cnt`` is taken at any value (this server's tool
    call ids are random, not numbered after the conversation's). Fields it does not know are refused where they would be
    read (output mode ``derender``), as vLLM does."""

    model_config = ConfigDict(extra="allow")

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    return_tokens_as_token_ids: bool | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    history_tool_call_cnt: int = Field(0, ge=0)

    def tool_plan(self, parser: ToolParser | None) -> ToolPlan | None:
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls is not False, parser)


def parse_context_json(body: ChatCompletionRequest) -> dict[str, Any]:
    """vLLM's ``parse_context`` of a chat request (a tool choice left out is ``auto`` with tools, else ``none``)."""
    choice: Any = body.tool_choice if body.tool_choice is not None else "auto" if body.tools else "none"
    context: dict[str, Any] = {
        "tools": [tool.model_dump() for tool in body.tools] if body.tools is not None else None,
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "parallel_tool_calls": body.parallel_tool_calls,
        "include_reasoning": body.include_reasoning,
    }
    if "return_tokens_as_token_ids" in body.model_fields_set:
        context["return_tokens_as_token_ids"] = body.return_tokens_as_token_ids
    num_calls = sum(len(m.tool_calls or ()) for m in body.messages if m.role == "assistant")
    return context | {"chat_template_kwargs": body.template_variables(), "history_tool_call_cnt": num_calls}


class GenerateBody(BaseModel):
    """vLLM's ``GenerateRequest``: token ids in, token ids out. ``request_id`` (default: a random one; an
    ``X-Request-Id`` header takes its place, as vLLM) becomes ``generate-tokens-{request_id}``;
    ``output_mode`` ``text`` adds each choice's text and decoded logprobs, ``derender`` each choice's chat
    message (parsed as the chat route parses it, with ``parse_context``, which only that mode reads)."""

    model_config = ConfigDict(extra="allow")

    request_id: RequestId | None = None
    token_ids: list[Unsigned] = Field(min_length=1)
    sampling_params: SamplingParamsBody
    model: str | None = None
    reasoning_ended: bool | None = None  # true: a structured output applies from the first token
    return_token_ids: bool | None = None  # the answer carries the prompt's token ids
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    parse_context: ParseContextBody | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: CacheSalt | None = None
    priority: Int32 = 0

    @model_validator(mode="after")
    def _extra_fields(self) -> GenerateBody:
        _check_extra_fields(self.model_extra, _UNSUPPORTED)
        unknown = sorted(self.parse_context.model_extra or ()) if self.parse_context is not None else []
        if unknown and self.output_mode == "derender":
            raise APIError(
                400,
                f"parse_context.{unknown[0]} is not supported by this server (the render server is newer); send "
                "the request without it",
                f"parse_context.{unknown[0]}",
            )
        if self.parse_context is not None:  # read in no other mode: its unknown fields are logged, as vLLM does
            _check_extra_fields(self.parse_context.model_extra, {})
        return self

    def engine_request(self, model: str, request_id: str) -> pb.GenerateRequest:
        request = pb.GenerateRequest(
            request_id=request_id,
            model=model,
            token_ids=pb.TokenIds(ids=self.token_ids),
            priority=self.priority,
            return_token_ids=bool(self.return_token_ids),
            cache_salt=self.cache_salt or "",
        )
        request.sampling.SetInParent()
        request.stopping.SetInParent()
        self.sampling_params.apply(request, bool(self.reasoning_ended))
        return request


def generate_request_json(
    request: pb.GenerateRequest,
    stream: bool,
    stream_options: StreamOptions | None,
    parse_context: dict[str, Any] | None = None,
) -> dict:
    """An engine-ready ``request`` (``Render``'s: its prompt is token ids) as vLLM's ``GenerateRequest``, every
    field of vLLM's present (null where this server has nothing to say); ``parse_context``: a chat request's."""
    return {
        "request_id": request.request_id,
        "token_ids": list(request.token_ids.ids),
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sampling_json(request),
        "model": request.model,
        "reasoning_ended": True if request.structured.in_reasoning else None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": request.return_token_ids or None,
        "output_mode": "tokens",
        "parse_context": parse_context,
        "stream": stream,
        "stream_options": stream_options.model_dump() if stream and stream_options is not None else None,
        "cache_salt": request.cache_salt or None,
        "priority": request.priority,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }

"""OpenAI request bodies (plus vLLM's sampling extras) and their gRPC ``GenerateRequest``."""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Awaitable, Mapping
from typing import Annotated, Any, Literal, Protocol, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import models_json_schema

from raypaged.serving.gateway.efforts import ReasoningEffort
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.structured import ResponseFormat, StructuredOutputsBody
from raypaged.serving.gateway.tool_parsers import ToolParser
from raypaged.serving.gateway.tools import NamedToolChoice, Tool, ToolPlan, tools_json
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.protocol import ALL_LOGPROBS, WHOLE_CONTEXT

logger = logging.getLogger("raypaged")
Body = TypeVar("Body", bound=BaseModel)

# integer bounds of the gRPC fields the values travel in
UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
Unsigned = Annotated[int, Field(ge=0, le=UINT32_MAX)]
Int32 = Annotated[int, Field(ge=-_INT32_MAX - 1, le=_INT32_MAX)]
Int64 = Annotated[int, Field(ge=-_INT64_MAX - 1, le=_INT64_MAX)]
LogprobCount = Annotated[int, Field(ge=-1, le=UINT32_MAX - 1)]  # -1: the whole vocabulary (vLLM's)
RequestId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]  # vLLM's request_id
CacheSalt = Annotated[str, Field(min_length=1, max_length=1024)]  # vLLM's: prefix-cache blocks shared per salt
Prompts = str | list[str] | list[Unsigned] | list[list[Unsigned]]  # a text, texts, token ids, lists of token ids


class RepetitionDetection(BaseModel):
    """vLLM's ``repetition_detection``: end an output that ends in a pattern repeated ``min_count`` times."""

    model_config = ConfigDict(extra="forbid")

    max_pattern_size: Unsigned = 0  # 0: off
    min_pattern_size: Unsigned = 0  # 0: 1
    min_count: Unsigned = 0


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # with include_usage: every chunk carries the usage so far


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")

# Request fields of vLLM's (and OpenAI's) API that this server does not implement yet: a request may
# send them only with a value that asks for nothing (these, null, or an empty list or object).
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "suffix": ("",),
    "logits_processors": (),
    "prompt_embeds": (),  # a completion's are taken (CompletionRequest.prompt_embeds); a chat body has none
    "functions": (),
    "function_call": ("none", "auto"),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
    "reasoning_effort": (),
    "watermarking": (False,),
    "routed_experts_prompt_start": (0,),
    "return_token_offsets": (False,),
    "return_mm_kwargs": (True, False),  # the /render endpoints' only
    "ec_transfer_params": (),
    "media_io_kwargs": (),
    "return_prompt_text": (False,),
}
_MAX_LOGGED_FIELDS = 256  # distinct unknown field names logged; a flood of made-up names logs no more
_logged_fields: set[str] = set()


def _check_extra_fields(
    extra: dict[str, Any] | None, unsupported: dict[str, tuple[object, ...]] = _UNSUPPORTED
) -> None:
    """Fields the body model does not declare: a known one this server cannot honour (``unsupported``: with
    the values that ask for nothing, besides null and empty ones) is a 400 naming it; an unknown one is logged
    once per name and ignored (as vLLM does)."""
    for name, value in (extra or {}).items():
        if name in unsupported:
            if value is None or value in ({}, []) or value in unsupported[name]:
                continue
            raise unsupported_field(name)
        if name not in _logged_fields and len(_logged_fields) < _MAX_LOGGED_FIELDS:
            _logged_fields.add(name)
            logger.warning("request field %r is not part of the API and is ignored", name[:64])


def unsupported_field(name: str) -> APIError:
    """The 400 of a request field this server does not honour."""
    return APIError(400, f"{name} is not supported by this server; send the request without it", name)


# fields whose null asks for their default: OpenAI's nullable ones (clients that write every field send them as
# null) and vLLM's optional ones
NULL_MEANS_DEFAULT = frozenset(
    {
        "n",
        "stream",
        "store",
        "echo",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "parallel_tool_calls",
        "min_p",
        "return_tokens_as_token_ids",
    }
)


def defaults_for_nulls(data: Any) -> Any:
    """A body's JSON with the ``NULL_MEANS_DEFAULT`` fields that are null left out (so they take their default)."""
    if isinstance(data, dict) and any(data.get(name, 0) is None for name in NULL_MEANS_DEFAULT):
        return {name: value for name, value in data.items() if value is not None or name not in NULL_MEANS_DEFAULT}
    return data


class _GenerationBody(BaseModel):
    """Fields shared by completions and chat completions; unknown fields are ignored (as vLLM does).

    Numbers must be finite and fit the gRPC fields they travel in; a null asks for the default where OpenAI's
    field is nullable (``NULL_MEANS_DEFAULT``).
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return defaults_for_nulls(data)

    model: str | None = None
    n: int = Field(1, ge=1, le=UINT32_MAX)  # the engine caps n and best_of (--max-num-samples)
    best_of: int | None = Field(None, ge=1, le=UINT32_MAX)
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
    spaces_between_special_tokens: bool = True  # special tokens kept in the text are set apart by spaces
    priority: int = Field(0, ge=-_INT32_MAX - 1, le=_INT32_MAX)
    prompt_logprobs: LogprobCount | None = None  # the engine caps it (--max-logprobs)
    echo: bool = False  # completions: the prompt first in the text (and its tokens first in the logprobs)
    return_tokens_as_token_ids: bool = False  # logprobs name each token "token_id:{id}" (vLLM's)
    return_token_ids: bool | None = None  # the answer carries the prompt's and each choice's token ids (vLLM's)
    session_id: str | None = Field(None, min_length=1, max_length=256)  # a conversation's id, in request log lines
    repetition_detection: RepetitionDetection | None = None
    use_beam_search: bool = False  # vLLM's: n beams instead of n samples, answered once finished
    length_penalty: float = 1.0  # with use_beam_search: scores are cumulative logprob / length ** this
    request_id: RequestId | None = None
    include_stop_str_in_output: bool = False
    add_special_tokens: bool = True  # (each API's default: its subclass's)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=UINT32_MAX - 1)  # the prompt's last N (-1: the context)
    truncation_side: Literal["left", "right"] | None = None  # "right": truncate_prompt_tokens keeps the first N
    stream_interval: int | None = Field(None, ge=1, le=UINT32_MAX)  # tokens per chunk, at least --stream-interval
    logit_bias: dict[str, float] | None = None  # token id (as OpenAI's string key) -> bias in [-100, 100]
    allowed_token_ids: list[Unsigned] | None = None
    bad_words: list[str] | None = None
    # vLLM's: a reasoning section holds at most this many tokens, then its end is forced (-1: no budget)
    thinking_token_budget: int | None = Field(None, ge=-1, le=UINT32_MAX)
    # vLLM's: with logprobs, these tokens' logprobs at each generated position in place of the most likely ones
    logprob_token_ids: list[Unsigned] | None = None
    cache_salt: CacheSalt | None = None
    # vLLM's: the image processor's options for this request's images (--mm-processor-kwargs' keys)
    mm_processor_kwargs: dict[str, Any] | None = None
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
            raise APIError(
                400, "guided_whitespace_pattern is not supported by the xgrammar backend", "guided_whitespace_pattern"
            )
        if self.guided_decoding_backend not in (None, "xgrammar", "auto"):
            raise APIError(
                400,
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not supported; this server "
                "decodes structured outputs with xgrammar",
                "guided_decoding_backend",
            )
        if self.response_format is not None and "response_format" in given:
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

    @model_validator(mode="after")
    def _asked_logprobs_of_generated_tokens(self) -> _GenerationBody:
        if self.logprob_token_ids and self.echo_only:
            raise APIError(
                400,
                "logprob_token_ids applies to generated tokens, and an echo with max_tokens 0 generates none",
                "logprob_token_ids",
            )
        return self

    @model_validator(mode="after")
    def _some_allowed_token(self) -> _GenerationBody:
        if self.allowed_token_ids == []:  # the wire's empty list means "any token"
            raise APIError(400, "allowed_token_ids must not be empty", "allowed_token_ids")
        return self

    def token_logit_bias(self) -> dict[int, float]:
        """``logit_bias`` by token id; a key that is not one is a 400."""
        bias = {_token_id(k): v for k, v in (self.logit_bias or {}).items()}
        if None in bias:
            raise APIError(400, "logit_bias keys must be token ids", "logit_bias")
        return bias  # type: ignore[return-value]  # no None key left

    @property
    def echo_only(self) -> bool:
        """Echo with max_tokens 0: the answer is the prompt (the engine still makes one token, unsent)."""
        return self.echo and self.max_tokens == 0

    @property
    def resolved_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats`` (only with ``include_usage``): usage in every chunk."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    def constraint(self, tools: ToolPlan | None) -> pb.StructuredOutput | None:
        """The output's constraint: the body's structured output, or the one ``tool_choice`` required
        or named implies (both at once is a 400)."""
        structured = self.structured()
        implied = tools.constraint() if tools is not None else None
        if implied is not None and structured is not None:
            raise APIError(
                400,
                "tool_choice required or a named function already constrains the output; "
                "send response_format or structured outputs without it",
                "tool_choice",
            )
        return implied or structured

    def generate_request(
        self,
        model: str,
        prompt: dict,
        num_logprobs: int | None,
        max_tokens: int | None,
        priority: int,
        constraint: pb.StructuredOutput | None,
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
            logit_bias=self.token_logit_bias(),
            allowed_token_ids=self.allowed_token_ids or [],
            bad_words=self.bad_words or [],
            logprob_token_ids=self.logprob_token_ids or [],
        )
        for name in ("best_of", "temperature", "top_p", "repetition_penalty", "seed"):
            if (value := getattr(self, name)) is not None:
                setattr(sampling, name, value)
        if self.thinking_token_budget is not None and self.thinking_token_budget >= 0:
            sampling.thinking_token_budget = self.thinking_token_budget
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stopping = pb.StoppingCriteria(
            min_tokens=self.min_tokens,
            stop_sequences=stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        if max_tokens is not None:
            stopping.max_tokens = max(max_tokens, 1) if self.echo_only else max_tokens
        if self.repetition_detection is not None:
            stopping.repetition_detection.CopyFrom(pb.RepetitionDetection(**self.repetition_detection.model_dump()))
        request = pb.GenerateRequest(
            model=model,
            sampling=sampling,
            stopping=stopping,
            priority=priority,
            echo=self.echo,
            return_token_ids=bool(self.return_token_ids),
            **prompt,
        )
        if (prompt_logprobs := self.resolved_prompt_logprobs) is not None:
            request.prompt_logprobs = ALL_LOGPROBS if prompt_logprobs == -1 else prompt_logprobs
        if self.add_special_tokens != type(self).model_fields["add_special_tokens"].default:
            request.add_special_tokens = self.add_special_tokens  # (the defaults are the engine's: a text's, messages')
        if (truncate := self.truncate_prompt_tokens) is not None:
            request.truncate_prompt_tokens = WHOLE_CONTEXT if truncate == -1 else truncate
        if self.truncation_side is not None:
            request.truncation_side = self.truncation_side
        if self.stream_interval is not None:
            request.stream_interval = self.stream_interval
        if self.cache_salt is not None:
            request.cache_salt = self.cache_salt
        if self.mm_processor_kwargs:
            request.mm_processor_kwargs_json = json.dumps(self.mm_processor_kwargs)
        if constraint is not None:
            request.structured.CopyFrom(constraint)
        if num_logprobs is not None:
            request.logprobs = ALL_LOGPROBS if num_logprobs == -1 else num_logprobs
        if self.use_beam_search:
            if self.stream:
                raise APIError(400, "use_beam_search does not stream: the beams come once they are finished", "stream")
            request.beam_search.CopyFrom(pb.BeamSearch(length_penalty=self.length_penalty))
        elif self.length_penalty != 1.0:
            raise APIError(400, "length_penalty applies to use_beam_search only", "length_penalty")
        return request


def _token_id(key: str) -> int | None:
    """A ``logit_bias`` key as a token id the wire can hold, or ``None``."""
    try:
        value = int(key)
    except ValueError:
        return None
    return value if 0 <= value <= UINT32_MAX else None


class CompletionRequest(_GenerationBody):
    prompt: Prompts | None = None  # "" or none with prompt_embeds: only those (as vLLM)
    # vLLM's: base64 of the bytes torch.save writes for a [num_tokens, hidden_size] float tensor, or a list of
    # them; each is a prompt of its own, before the body's text prompts (--enable-prompt-embeds)
    prompt_embeds: str | list[str] | None = None
    logprobs: LogprobCount | None = None  # the engine caps it (--max-logprobs)

    @property
    def resolved_prompt_logprobs(self) -> int | None:
        """Echo with logprobs needs the prompt's: as many top alternatives as the output's."""
        if self.echo and self.logprobs is not None:
            if -1 in (self.logprobs, self.prompt_logprobs):
                return -1
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    add_special_tokens: bool = True  # a text prompt is tokenized with the BOS (vLLM's default); ids as they are

    @property
    def num_prompts(self) -> int:
        """Prompts in the body (one engine request each), known without building them."""
        embeds = self.prompt_embeds
        num_embeds = 0 if embeds is None else 1 if isinstance(embeds, str) else len(embeds)
        text = self._text_prompt()
        return num_embeds + (0 if text is None else count_prompts(text))

    def prompts(self) -> list[dict]:
        """One ``GenerateRequest`` prompt per prompt of the body: its ``prompt_embeds`` first, then its texts or
        token ids (as vLLM orders them)."""
        embeds = self.prompt_embeds
        if embeds is None or embeds == []:
            if self.prompt is None:
                raise APIError(400, "prompt is required (or prompt_embeds)", "prompt")
            return split_prompts(self.prompt, "prompt")
        if self.echo:
            raise APIError(400, "echo needs the prompt's text: prompt_embeds have none", "echo")
        found = [{"prompt_embeds": _base64_bytes(e)} for e in ([embeds] if isinstance(embeds, str) else embeds)]
        text = self._text_prompt()
        return found + ([] if text is None else split_prompts(text, "prompt"))

    def _text_prompt(self) -> Prompts | None:
        """The body's text or token-id prompts; None: none ("" beside prompt_embeds is none)."""
        prompt = self.prompt
        return None if prompt is None or (prompt == "" and self.prompt_embeds) else prompt

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def resolved_max_tokens(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens


def _base64_bytes(text: str) -> bytes:
    """A ``prompt_embeds`` entry's bytes (strict base64: padded, no whitespace)."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "prompt_embeds must be base64 of the bytes torch.save writes", "prompt_embeds") from None


def count_prompts(prompts: Prompts) -> int:
    """How many prompts ``prompts`` holds, known without building them."""
    return 1 if isinstance(prompts, str) or not prompts or isinstance(prompts[0], int) else len(prompts)


def split_prompts(prompts: Prompts, param: str) -> list[dict]:
    """Each prompt of ``prompts`` (the body's field ``param``) as a request's ``{"text": ...}`` or
    ``{"token_ids": ...}``."""
    if isinstance(prompts, str):
        return [{"text": prompts}]
    if not prompts:
        raise APIError(400, f"{param} must not be empty", param)
    if isinstance(prompts[0], int):
        return [{"token_ids": pb.TokenIds(ids=prompts)}]
    if isinstance(prompts[0], str):
        return [{"text": p} for p in prompts]
    return [{"token_ids": pb.TokenIds(ids=p)} for p in prompts]


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    detail: str | None = None  # OpenAI's resolution hint: only "auto" (the model's own resolution) is taken


class TextPart(BaseModel):
    """A message content part: ``text``, or ``image_url`` (an image-text model's image)."""

    type: str
    text: str | None = None
    image_url: ImageUrl | str | None = None

    def url(self) -> str:
        """An ``image_url`` part's URL; a 400 naming what is missing or refused."""
        image = self.image_url
        url = image.url if isinstance(image, ImageUrl) else image
        if not url:
            raise APIError(400, "an image_url content part needs image_url.url", "messages")
        if isinstance(image, ImageUrl) and image.detail not in (None, "auto"):
            raise APIError(
                400,
                f"image_url.detail {image.detail!r} is not supported: images are read at the model's own resolution "
                "(detail 'auto')",
                "messages",
            )
        return url


_UNSUPPORTED_IN_MESSAGES = ("function_call",)


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    def to_proto(self) -> pb.ChatMessage:
        message = pb.ChatMessage(
            role=self.role,
            name=self.name or "",
            tool_call_id=self.tool_call_id or "",
            tool_calls=[
                pb.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                for c in self.tool_calls or ()
            ],
        )
        if isinstance(self.content, list):  # the parts in order: the engine renders them in the template's format
            self._check_part_types()
            message.parts.extend(
                pb.ContentPart(text=p.text or "") if p.type == "text" else pb.ContentPart(image_url=p.url())
                for p in self.content
            )
        elif self.content is not None or not self.tool_calls:  # none at all: an assistant turn only calling tools
            message.content = self.content or ""
        return message

    @model_validator(mode="after")
    def _extra_fields(self) -> ChatMessage:
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED_IN_MESSAGES and value not in (None, "", [], {}):
                raise APIError(
                    400, f"messages: {name} is not supported by this server; send messages without it", "messages"
                )
        return self

    def text(self) -> str:
        """The content as text: its text parts joined by newlines (vLLM's ``string`` content format)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        self._check_part_types()
        return "\n".join(p.text or "" for p in self.content if p.type == "text")

    def _check_part_types(self) -> None:
        assert isinstance(self.content, list)
        unsupported = [p.type for p in self.content if p.type not in ("text", "image_url")]
        if unsupported:
            raise APIError(
                400, f"only text and image_url content parts are supported, got {unsupported[0]!r}", "messages"
            )


class ChatCompletionRequest(_GenerationBody):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None  # the engine caps it (--max-logprobs)
    max_completion_tokens: Unsigned | None = None
    add_special_tokens: bool = False  # the chat template writes the special tokens (vLLM's default); true adds a BOS
    echo: bool = False  # the last message's content opens the answer when its role is the answer's (vLLM's)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # false: no reasoning_content, and constraints apply from the first token
    # vLLM's: a chat template variable (and enable_thinking: false for "none", true for the others)
    reasoning_effort: ReasoningEffort | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None

    @property
    def num_prompts(self) -> int:
        return 1  # a conversation is one prompt

    @property
    def echo_only(self) -> bool:
        return False  # chat echo repeats the last message; it never replaces the answer

    def echoed(self, role: str) -> str:
        """What echo puts before each answer: the last message's text, when it is the answer's role."""
        last = self.messages[-1] if self.echo and self.messages else None
        return last.text() if last is not None and last.role == role else ""

    def tool_plan(self, parser: ToolParser | None) -> ToolPlan | None:
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls, parser)

    def prompts(self, tools: ToolPlan | None = None, effort_map: Mapping[str, str] | None = None) -> list[dict]:
        """The conversation as the chat template takes it (``effort_map``: see ``template_variables``)."""
        if not self.messages:
            raise APIError(400, "messages must not be empty", "messages")
        conversation = chat_messages(
            self.messages,
            tools.tools_json() if tools is not None else "",
            self.chat_template,
            self.template_variables(effort_map),
            self.add_generation_prompt,
            self.continue_final_message,
            self.documents,
        )
        return [{"messages": conversation}]

    def template_variables(self, effort_map: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``chat_template_kwargs`` over what ``reasoning_effort`` sets (as vLLM: the effort itself, and
        ``enable_thinking`` false for ``none``, true for the others); ``effort_map`` (``--reasoning-effort-map``)
        rewrites the effort first, where it names it."""
        effort: str | None = self.reasoning_effort
        if effort is not None and effort_map:
            effort = effort_map.get(effort, effort)
        from_effort = {} if effort is None else {"reasoning_effort": effort, "enable_thinking": effort != "none"}
        return from_effort | (self.chat_template_kwargs or {})

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeBody(BaseModel):
    """vLLM's ``POST /tokenize``: a ``prompt``, or ``messages`` through the chat template (with vLLM's chat
    fields); ``return_token_strs`` adds each token's string. Unknown fields are handled as a generation
    request's are."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # unset: true for a prompt, false for messages (their template writes them)
    return_token_strs: bool = False
    # with messages only
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _extra_fields(self) -> TokenizeBody:
        _check_extra_fields(self.model_extra)
        check_chat_fields(self, self.prompt is not None, "a prompt", _CHAT_TOKENIZE_FIELDS)
        return self

    def conversation(self) -> pb.ChatMessages:
        """``messages`` and the chat fields, as the engine's chat template takes them."""
        assert self.messages is not None
        return chat_messages(
            self.messages,
            tools_json(self.tools) if self.tools else "",
            self.chat_template,
            self.chat_template_kwargs,
            True if self.add_generation_prompt is None else self.add_generation_prompt,
            bool(self.continue_final_message),
        )


def chat_messages(
    messages: list[ChatMessage],
    tools: str,
    chat_template: str | None,
    template_variables: dict[str, Any] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    documents: list[dict[str, Any]] | None = None,
) -> pb.ChatMessages:
    """A conversation as the engine's chat template takes it (``tools``: their JSON, or empty)."""
    return pb.ChatMessages(
        messages=[m.to_proto() for m in messages],
        tools_json=tools,
        chat_template=chat_template or "",
        chat_template_kwargs_json=json.dumps(template_variables) if template_variables else "",
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        documents_json=json.dumps(documents) if documents else "",
    )


def check_chat_fields(body: Any, text_given: bool, text: str, chat_fields: tuple[str, ...]) -> None:
    """A body of a text (``text`` says which) or ``messages``: ``chat_fields`` are the conversation's; a 400 names
    the field given wrongly."""
    if text_given:
        for name in chat_fields:
            if getattr(body, name) is not None:
                raise APIError(400, f"{name} applies to messages, not to {text}", name)


_CHAT_TOKENIZE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[Unsigned]

    @model_validator(mode="after")
    def _extra_fields(self) -> DetokenizeBody:
        _check_extra_fields(self.model_extra)
        return self


class LoadLoRAAdapterBody(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter``; ``base_model_name`` picks the model where several serve."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = None
    load_inplace: Literal[False] = False  # replacing a loaded adapter's weights under its name is refused


class UnloadLoRAAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name says which


class Parse(Protocol):
    """The gateway's body parser: a request's JSON body as a ``body_type``, or the 400 (413) that refuses it."""

    def __call__(self, http: Request, body_type: type[Body]) -> Awaitable[Body]: ...


def body_doc(body_type: type[BaseModel]) -> dict:
    """OpenAPI text for a route that parses its JSON body itself (so the size limit comes first)."""
    ref = {"$ref": f"#/components/schemas/{body_type.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def add_body_schemas(app: FastAPI, body_types: list[type[BaseModel]]) -> None:
    """Adds the request bodies' JSON schemas to the app's OpenAPI components."""
    _, top = models_json_schema([(t, "validation") for t in body_types], ref_template="#/components/schemas/{model}")
    plain_openapi = app.openapi

    def openapi() -> dict:
        document = plain_openapi()
        document.setdefault("components", {}).setdefault("schemas", {}).update(top["$defs"])
        return document

    app.openapi = openapi

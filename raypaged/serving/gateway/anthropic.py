"""Anthropic's Messages API (``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, as vLLM serves them) on
top of chat completions.

A Messages request becomes one chat completion request (``MessagesRequest.chat_body``): ``system`` a system
message; ``messages`` chat messages, where ``text`` blocks are a message's text parts, an assistant's ``tool_use``
blocks its tool calls and a user's ``tool_result`` blocks tool messages (one marked ``is_error`` reads
``Error: `` before its content); ``tools`` function tools and ``tool_choice`` the chat's (``any`` is ``required``,
``disable_parallel_tool_use`` is ``parallel_tool_calls: false``); ``stop_sequences`` stop strings;
``metadata.user_id`` the ``user``; ``thinking`` enabled the chat template's ``enable_thinking`` and a
``thinking_token_budget`` (only where the server splits reasoning off, ``--reasoning-parser``), disabled the
``reasoning_effort`` of ``--anthropic-disabled-thinking-effort`` (``efforts.py``) and ``include_reasoning: false``
(no thinking block; a constraint, as a named tool's, holds from the first token).
A final assistant message is a prefill: the answer continues it. The chat path then validates and generates as
for ``/v1/chat/completions``, and its answer becomes a ``message`` (``anthropic_events``). ``count_tokens``
renders the same conversation. ``cache_control`` marks (``CacheControl``) on system text blocks, content blocks,
tools or the request (its last part) ask the prefix cache for what it does to every prompt: they are taken where
the served model has one, refused where it runs without. Whatever else the server cannot honour (images,
documents, server tools, ``service_tier``, any field not declared here) is a 400 naming it: nothing sent is
ignored. The headers ``anthropic-version`` and ``anthropic-beta`` are read by no route: every version since
2023-06-01 has the shapes served here, and a beta's features come as body fields, refused by name when not served.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.schemas import UINT32_MAX

_INT32_MAX = 2**31 - 1


class _Part(BaseModel):
    """A part of a Messages request. A field it does not declare is kept (``model_extra``) for ``refuse_unhonoured``
    to name: nothing sent is accepted and ignored."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def check(self, where: str) -> None:
        """A 400 naming what of this part's own fields the server cannot honour (``where``: the part's path)."""

    def cache_marks(self, where: str) -> Iterator[str]:
        """The paths of the ``cache_control`` marks on this part (none: it cannot carry one)."""
        return iter(())


def refuse_unhonoured(part: _Part, where: str = "") -> None:
    """A 400 naming the first field ``part`` (or a part inside it) does not declare or cannot honour; a null one
    asks for nothing."""
    for name, value in (part.model_extra or {}).items():
        if value is not None:
            param = f"{where}{name}"
            raise APIError(400, f"{param} is not supported by this server; send the request without it", param)
    part.check(where)
    for name in type(part).model_fields:
        value = getattr(part, name)
        if isinstance(value, _Part):
            refuse_unhonoured(value, f"{where}{name}.")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, _Part):
                    refuse_unhonoured(item, f"{where}{name}.{index}.")


class CacheControl(_Part):
    """A mark asking to cache the prompt up to the part that carries it. The prefix cache keeps every prompt's full
    KV blocks for later prompts that begin with the same tokens, which is what the mark asks for, so a mark changes
    nothing in how the request runs; it is taken only where the served model has a prefix cache. A ``ttl`` is
    refused: the cache frees its least recently used blocks when it needs room, so it promises no lifetime."""

    type: str
    ttl: str | None = None

    def check(self, where: str) -> None:
        if self.type != "ephemeral":
            raise APIError(
                400,
                f"{where}type {self.type!r} is not supported by this server: cache_control takes type 'ephemeral'",
                f"{where}type",
            )
        if self.ttl is not None:
            raise APIError(
                400,
                f"{where}ttl is not supported by this server: its prefix cache frees the least recently used blocks "
                "when it needs room, so it promises no lifetime; send cache_control without it",
                f"{where}ttl",
            )


class _Cacheable(_Part):
    """A part Anthropic lets carry a ``cache_control`` mark."""

    cache_control: CacheControl | None = None

    def cache_marks(self, where: str) -> Iterator[str]:
        if self.cache_control is not None:
            yield f"{where}cache_control"


class TextBlock(_Cacheable):
    type: Literal["text"]
    text: str


class ImageSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["base64", "url"]
    media_type: str | None = None  # base64: image/png, image/jpeg, image/gif, image/webp
    data: str | None = None
    url: str | None = None

    def chat_url(self, at: str) -> str:
        """The image as the chat API's ``image_url``: a data URL of the base64 data, or the URL."""
        if self.type == "url":
            if not self.url:
                raise APIError(400, f"{at}.source: a url source needs its url", at)
            return self.url
        if not self.data or not self.media_type:
            raise APIError(400, f"{at}.source: a base64 source needs media_type and data", at)
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(_Cacheable):
    """A user's image: it becomes a chat ``image_url`` part (an image-text model reads it)."""

    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Cacheable):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Cacheable):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def cache_marks(self, where: str) -> Iterator[str]:
        yield from super().cache_marks(where)
        for index, block in enumerate(self.content if isinstance(self.content, list) else ()):
            yield from block.cache_marks(f"{where}content.{index}.")


class ThinkingBlock(_Part):
    """An earlier answer's thinking, sent back with its turn; chat templates drop earlier turns' reasoning, so the
    conversation goes to the template without it (as the Responses API's reasoning items)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # this server's thinking blocks carry no signature


_BLOCKS: dict[str, dict[str, type[_Part]]] = {
    "user": {"text": TextBlock, "image": ImageBlock, "tool_result": ToolResultBlock},
    "assistant": {"text": TextBlock, "tool_use": ToolUseBlock, "thinking": ThinkingBlock},
}


class InputMessage(_Part):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]  # blocks: read by ``blocks`` (their kinds depend on the role)

    def blocks(self, where: str) -> list[_Part]:
        """The content as blocks (a string is one text block); a kind the role cannot send is a 400 naming it."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        kinds = _BLOCKS[self.role]
        blocks: list[_Part] = []
        for index, given in enumerate(self.content):
            at = f"{where}.content.{index}"
            kind = given.get("type")
            if kind not in kinds:
                raise APIError(
                    400,
                    f"{at}: {self.role} messages take content blocks of type {', '.join(kinds)}, not {kind!r}",
                    at,
                )
            blocks.append(_validated_block(kinds[kind], given, at))
        return blocks


def _validated_block(block_type: type[_Part], given: dict[str, Any], at: str) -> _Part:
    try:
        block = block_type.model_validate(given)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join([at, *(str(p) for p in first["loc"])])
        raise APIError(400, f"{param}: {first['msg']}", at) from None
    refuse_unhonoured(block, f"{at}.")
    return block


class ToolDefinition(_Cacheable):
    """A client tool (Anthropic's ``custom`` type); server tools (web search, code execution, ...) are refused."""

    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, given: Any) -> Any:
        kind = given.get("type") if isinstance(given, dict) else None
        if kind not in (None, "custom"):
            raise APIError(
                400,
                f"tools of type {kind!r} are not supported by this server (it calls no tools itself: give client "
                "tools, with an input_schema)",
                "tools",
            )
        return given


class ToolChoice(_Part):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named_when_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise APIError(400, "tool_choice.name is given with type tool, and only then", "tool_choice")
        return self

    def chat(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(_Part):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)  # tokens of thinking at most (enabled only)

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> Thinking:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise APIError(400, "thinking.budget_tokens is given with type enabled, and only then", "thinking")
        return self


class Metadata(_Part):
    user_id: str | None = None


class CountTokensRequest(_Cacheable):
    """The body of ``POST /v1/messages/count_tokens``: the conversation of a Messages request (its own
    ``cache_control`` marks the prompt's last part, as Anthropic's)."""

    model: str | None = None
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="after")
    def _checked(self) -> CountTokensRequest:
        refuse_unhonoured(self)
        return self

    def cache_marks(self, where: str = "") -> Iterator[str]:
        """The paths of the request's ``cache_control`` marks: its own, then the prompt's in order (tools, system,
        messages)."""
        yield from super().cache_marks(where)
        for index, tool in enumerate(self.tools or ()):
            yield from tool.cache_marks(f"{where}tools.{index}.")
        for index, block in enumerate(self.system if isinstance(self.system, list) else ()):
            yield from block.cache_marks(f"{where}system.{index}.")
        for index, message in enumerate(self.messages):
            at = f"{where}messages.{index}"
            for block_index, part in enumerate(message.blocks(at)):
                yield from part.cache_marks(f"{at}.content.{block_index}.")

    def chat_body(self, reasoning: bool, prefix_caching: bool, disabled_effort: str = "none") -> dict[str, Any]:
        """The chat completion request this conversation runs as (``reasoning``: the server splits reasoning off,
        which ``thinking`` enabled needs; ``prefix_caching``: the served model has a prefix cache, which
        ``cache_control`` marks need; ``disabled_effort``: the ``reasoning_effort`` of ``thinking`` disabled).
        The marks change nothing else in it."""
        if not prefix_caching and (mark := next(self.cache_marks(), None)) is not None:
            raise APIError(
                400,
                f"{mark} is not supported by this server: it runs without its prefix cache "
                "(--no-enable-prefix-caching), so nothing is cached for later requests; send the request without it",
                mark,
            )
        messages = [{"role": "system", "content": _text_parts(self.system)}] if self.system else []
        for index, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages.{index}")
        body: dict[str, Any] = {"messages": messages}
        if self.model is not None:
            body["model"] = self.model
        if self.tools:
            body["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice.chat()
            body["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        if self.thinking is not None:
            if self.thinking.type == "enabled" and not reasoning:
                raise APIError(
                    400,
                    "thinking is not supported by this server: it needs --reasoning-parser (which finds the "
                    "reasoning the thinking blocks hold); send the request without it",
                    "thinking",
                )
            if self.thinking.type == "enabled":
                body["chat_template_kwargs"] = {"enable_thinking": True}
                body["thinking_token_budget"] = self.thinking.budget_tokens
            else:  # no thinking block, and a tool's (or any) constraint holds from the first token
                body["reasoning_effort"] = disabled_effort  # enable_thinking false with none, true with the others
                body["include_reasoning"] = False
        if self.messages and self.messages[-1].role == "assistant":  # a prefill: the answer continues it
            if "tool_calls" in messages[-1]:
                raise APIError(
                    400,
                    "the final assistant message is a prefill the answer continues, so it holds text only: a "
                    "tool_use block needs its tool_result in a user message after it",
                    "messages",
                )
            body["add_generation_prompt"], body["continue_final_message"] = False, True
        return body


class MessagesRequest(CountTokensRequest):
    """The body of ``POST /v1/messages``."""

    max_tokens: int = Field(ge=1, le=UINT32_MAX)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=0, le=_INT32_MAX)
    stream: bool = False
    metadata: Metadata | None = None

    def chat_body(self, reasoning: bool, prefix_caching: bool, disabled_effort: str = "none") -> dict[str, Any]:
        body = super().chat_body(reasoning, prefix_caching, disabled_effort)
        body.update(max_tokens=self.max_tokens, stream=self.stream)
        optional = {
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "user": self.metadata.user_id if self.metadata is not None else None,
        }
        body.update({name: value for name, value in optional.items() if value is not None})
        if self.stream:  # message_start tells the input tokens: every chunk carries the usage so far
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return body


def _chat_messages(message: InputMessage, where: str) -> list[dict[str, Any]]:
    """One message as chat messages: a user's tool results are tool messages (its text between them user
    messages); an assistant's text and tool calls are one message."""
    blocks = message.blocks(where)
    if message.role == "assistant":
        calls = [_chat_call(block) for block in blocks if isinstance(block, ToolUseBlock)]
        texts = [block for block in blocks if isinstance(block, TextBlock)]
        assistant: dict[str, Any] = {"role": "assistant", "content": _text_parts(texts) if texts else None}
        if calls:
            assistant["tool_calls"] = calls
        return [assistant]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []  # the user's text and images since the last tool result
    for index, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
            continue
        if isinstance(block, ImageBlock):
            url = block.source.chat_url(f"{where}.content.{index}")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        assert isinstance(block, ToolResultBlock)  # the user's kinds: text, image and tool_result
        if parts:
            out.append({"role": "user", "content": parts})
            parts = []
        out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_parts(block)})
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _text_parts(given: str | list[TextBlock] | None) -> str | list[dict[str, str]]:
    """Text as chat content: a string as it is, blocks as text parts (which chat joins as it joins any)."""
    if given is None or isinstance(given, str):
        return given or ""
    return [{"type": "text", "text": block.text} for block in given]


def _result_parts(result: ToolResultBlock) -> str | list[dict[str, str]]:
    content = _text_parts(result.content)
    if not result.is_error:
        return content
    if isinstance(content, str):  # the error's text opens the result's first text
        return "Error: " + content
    if not content:
        return "Error: "
    first, *rest = content
    return [{**first, "text": "Error: " + first["text"]}, *rest]


def _chat_call(block: ToolUseBlock) -> dict[str, Any]:
    arguments = json.dumps(block.input, ensure_ascii=False)  # as the chat path writes a call's arguments
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}


def _chat_tool(tool: ToolDefinition) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}

"""OpenAI's Responses API (``POST /v1/responses``, as vLLM serves it) on top of chat completions.

A Responses request becomes one chat completion request (``ResponsesRequest.chat_body``): ``instructions`` a
system message, ``input`` messages and function-call items chat messages and tool calls, function ``tools``,
``tool_choice``, ``text.format`` the structured output, ``max_output_tokens`` the token limit. The chat
path then validates, generates and parses tools as for ``/v1/chat/completions``; its answer becomes a
``response`` object (``response_body``) and its stream of chunks the Responses stream's typed events
(``response_events.ResponseEvents``; the output items both build: ``response_items``). Stored responses
(``store``, OpenAI's default) live in memory, per tenant, up to ``STORE_SIZE`` of them taking up to ``STORE_MB``
(the oldest go first):
``previous_response_id`` continues one, ``GET`` and ``DELETE /v1/responses/{id}`` read and drop one. Fields the
server cannot honour (hosted tools, images, background runs, conversations, prompt templates, truncation) are a
400 naming them.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.response_items import call_item, message_item, new_id, reasoning_item, usage
from raypaged.serving.gateway.schemas import _check_extra_fields, defaults_for_nulls

STORE_SIZE = 4096  # stored responses kept per tenant
STORE_MB = 256  # ... and the most their JSON may take, per tenant: a long-context model's prompt can be megabytes
_INPUT_TEXT = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``; unknown fields are logged and ignored, as for chat completions."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return defaults_for_nulls(data)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=2**32 - 1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint: the prefix cache serves every request alike
    include: list[str] | None = None
    service_tier: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    stream_options: dict[str, Any] | None = None
    # vLLM's extensions, passed on to the chat completion this request runs as (which checks them)
    cache_salt: str | None = None
    thinking_token_budget: int | None = None
    logprob_token_ids: list[int] | None = None

    @model_validator(mode="after")
    def _checked(self) -> ResponsesRequest:
        _check_extra_fields(self.model_extra)
        refused = {
            "background": self.background,
            "conversation": self.conversation,
            "prompt": self.prompt,
            "max_tool_calls": self.max_tool_calls,
        }
        for name, value in refused.items():
            if value not in (None, False):
                raise APIError(400, f"{name} is not supported by this server; send the request without it", name)
        if self.truncation not in (None, "disabled"):
            raise APIError(
                400, f"truncation {self.truncation!r} is not supported (only disabled: a prompt too long is a 400)"
            )
        if self.service_tier not in (None, "auto", "default"):
            raise APIError(
                400, f"service_tier {self.service_tier!r} is not supported (auto or default)", "service_tier"
            )
        unknown = sorted(k for k, v in (self.reasoning or {}).items() if k != "effort" and v is not None)
        if unknown:
            raise APIError(
                400,
                f"reasoning.{unknown[0]} is not supported by this server (reasoning.effort is); send the request "
                "without it",
                "reasoning",
            )
        if (self.stream_options or {}).get("include_obfuscation"):
            raise APIError(400, "stream_options include_obfuscation is not supported", "stream_options")
        unknown = sorted(set(self.include or ()) - {_LOGPROBS})
        if unknown:
            raise APIError(400, f"include {unknown[0]!r} is not supported (only {_LOGPROBS!r})", "include")
        if self.text is not None and set(self.text) - {"format", "verbosity"}:
            raise APIError(400, f"text {sorted(set(self.text) - {'format', 'verbosity'})[0]!r} is not supported")
        if (self.text or {}).get("verbosity") not in (None, "medium"):
            raise APIError(400, "text verbosity is not supported (only medium)", "text")
        return self

    def chat_body(self, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion request this one runs as: ``conversation`` (``Responder.conversation``: the previous
        response's, then this input) after the instructions."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += conversation
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "user": self.user or self.safety_identifier,
        }
        body.update({name: value for name, value in optional.items() if value is not None})
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if _LOGPROBS in (self.include or ()) or self.top_logprobs:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        if self.tools:
            body["tools"] = [_chat_tool(tool) for tool in self.tools]
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if (effort := (self.reasoning or {}).get("effort")) is not None:
            body["reasoning_effort"] = effort
        for name in ("cache_salt", "thinking_token_budget", "logprob_token_ids"):
            if (value := getattr(self, name)) is not None:
                body[name] = value
        if (response_format := _response_format((self.text or {}).get("format"))) is not None:
            body["response_format"] = response_format
        return body


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: text for a user message; input items: messages, the function calls an
    assistant made (consecutive ones one turn) and their outputs; reasoning items of earlier turns are dropped,
    as the chat templates of reasoning models drop them."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError(400, f"input[{index}] role {role!r} is not one of {', '.join(_ROLES)}", "input")
            messages.append({"role": _ROLES[role], "content": _content_of(item.get("content"), index)})
        elif kind == "function_call":
            call = {
                "id": _required(item, "call_id", index),
                "type": "function",
                "function": {"name": _required(item, "name", index), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else _text_of(output, index)
            messages.append({"role": "tool", "tool_call_id": _required(item, "call_id", index), "content": text})
        elif kind != "reasoning":
            raise APIError(400, f"input[{index}] items of type {kind!r} are not supported", "input")
    return messages


def _required(item: dict[str, Any], name: str, index: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"input[{index}] {item.get('type')} needs a {name}", "input")
    return value


def _content_of(content: Any, index: int) -> str | list[dict[str, Any]]:
    """A message's content for the chat API: a string as it is, a list as the chat API's parts in order (its texts,
    and its ``input_image`` parts as ``image_url`` parts for an image-text model), which the chat template reads as
    any chat message's."""
    if not isinstance(content, list):
        return _text_of(content, index)
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                given = "file_id" if part.get("file_id") else "no image_url"
                raise APIError(400, f"input[{index}] input_image needs an image_url (a URL; got {given})", "input")
            image: dict[str, Any] = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": _text_of([part], index)})
    return parts


def _text_of(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{index}] content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _INPUT_TEXT:
            raise APIError(
                400,
                f"input[{index}] content of type {kind!r} is not supported (text and input_image parts)",
                "input",
            )
        texts.append(part.get("text", ""))
    return "".join(texts)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise APIError(400, f"tools of type {tool.get('type')!r} are not supported (function tools only)", "tools")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # none, auto, required: the chat path checks them
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice {json.dumps(choice)} is not supported (none, auto, required or a function)")


def _response_format(given: dict[str, Any] | None) -> dict[str, Any] | None:
    if given is None or given.get("type") == "text":
        return None
    if given.get("type") == "json_object":
        return {"type": "json_object"}
    if given.get("type") == "json_schema":
        schema = {key: given[key] for key in ("name", "schema", "strict", "description") if key in given}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, f"text format {given.get('type')!r} is not supported (text, json_object, json_schema)", "text")


@dataclass
class Responder:
    """One Responses request's answer: its ids and the parts of ``response`` objects that echo the request."""

    request: ResponsesRequest
    history: list[dict[str, Any]]  # the previous response's conversation (previous_response_id), or none
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    # the history and this input as chat messages, not the instructions (OpenAI does not carry them over)
    conversation: list[dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        self.conversation = self.history + input_messages(self.request.input)

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request this one runs as."""
        return self.request.chat_body(self.conversation)

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        model: str,
        usage: dict[str, Any] | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        request = self.request
        incomplete = status == "completed" and finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete else status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": (request.reasoning or {}).get("effort"), "summary": None},
            "store": request.store,
            "temperature": request.temperature,
            "text": {"format": (request.text or {}).get("format") or {"type": "text"}},
            "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
            "tools": request.tools or [],
            "top_logprobs": request.top_logprobs,
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": request.user,
            "metadata": request.metadata or {},
        }

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The ``response`` object of a chat completion's answer."""
        choice = chat["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
        if message.get("content") is not None and (message["content"] or not message.get("tool_calls")):
            logprobs = (choice.get("logprobs") or {}).get("content")
            output.append(message_item(new_id("msg"), message["content"], "completed", logprobs))
        for call in message.get("tool_calls") or ():
            function = call["function"]
            output.append(call_item(new_id("fc"), call["id"], function["name"], function["arguments"], "completed"))
        return self.response("completed", output, chat["model"], usage(chat.get("usage")), choice["finish_reason"])

    def stored(self, response: dict[str, Any]) -> Stored:
        """What the store keeps of this request's ``response``: it, the conversation a later request continues
        with ``previous_response_id`` (this one's and its output), and this request's input items."""
        conversation = self.conversation + input_messages(
            [item for item in response["output"] if item["type"] != "reasoning"]
        )
        return Stored(response, conversation, input_items(self.request.input))


_ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as the Responses API lists it (``GET /v1/responses/{id}/input_items``): items with their type and
    an id (one made where the request gave none), a message's text as an ``input_text`` part."""
    items = []
    for given_item in [{"role": "user", "content": given}] if isinstance(given, str) else given:
        item: dict[str, Any] = {"type": "message", **given_item}
        if item["type"] == "message":
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": "input_text", "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", new_id(_ITEM_PREFIXES.get(item["type"], "item")))
        items.append(item)
    return items


@dataclass(frozen=True, slots=True)
class Stored:
    """A stored response: the ``response`` object, the conversation as chat messages, the input items."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    input_items: list[dict[str, Any]]

    @property
    def size(self) -> int:
        """The characters of its JSON: what the store counts against ``STORE_MB`` (a conversation continued
        from another counts whole, though it shares its messages: the bound holds whichever goes first)."""
        return len(json.dumps([self.response, self.conversation, self.input_items], ensure_ascii=False))

    def input_page(self, order: str, limit: int, after: str | None) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: OpenAI's list, newest first (``order`` desc) or oldest first."""
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be asc or desc, got {order!r}", "order")
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be between 1 and 100, got {limit}", "limit")
        items = self.input_items if order == "asc" else self.input_items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"no input item {after!r} in this response", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }


class ResponseStore:
    """Stored responses in memory, per tenant: the newest ``size`` of each, taking at most ``max_mb``
    (``Stored.size``)."""

    def __init__(self, size: int = STORE_SIZE, max_mb: int = STORE_MB) -> None:
        self.size = size
        self.max_chars = max_mb << 20
        self._kept: dict[str, OrderedDict[str, tuple[Stored, int]]] = {}
        self._chars: dict[str, int] = {}

    def keep(self, tenant: str, responder: Responder, response: dict[str, Any]) -> None:
        """``response`` stored where its request asks for it (``store``, true unless sent false)."""
        if responder.request.store:
            self.put(tenant, responder.stored(response))

    def put(self, tenant: str, stored: Stored) -> None:
        """``stored`` kept, the tenant's oldest dropped while it has more than ``size`` or they take more than
        ``max_mb``; one larger than ``max_mb`` alone is not kept (reading it is a 404, as for one dropped)."""
        chars = stored.size
        if chars > self.max_chars:
            return
        kept = self._kept.setdefault(tenant, OrderedDict())
        replaced = kept.pop(stored.response["id"], None)
        self._chars[tenant] = self._chars.get(tenant, 0) + chars - (replaced[1] if replaced else 0)
        kept[stored.response["id"]] = (stored, chars)
        while len(kept) > self.size or self._chars[tenant] > self.max_chars:
            self._chars[tenant] -= kept.popitem(last=False)[1][1]

    def get(self, tenant: str, response_id: str, param: str | None = None) -> Stored:
        kept = self._kept.get(tenant)
        found = None if kept is None else kept.get(response_id)
        if found is None:
            raise APIError(
                404 if param is None else 400,
                f"response with id {response_id!r} not found (responses are kept in memory: the newest "
                f"{self.size} stored ones, up to {self.max_chars >> 20} MiB of them)",
                param,
                code="response_not_found",
            )
        return found[0]

    def delete(self, tenant: str, response_id: str) -> None:
        self.get(tenant, response_id)
        self._chars[tenant] -= self._kept[tenant].pop(response_id)[1]

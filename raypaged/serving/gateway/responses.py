"""OpenAI response bodies and stream chunks built from the engine's ``GenerateResponse`` deltas.

The responses are ``pb.GenerateResponse`` messages from an engine over gRPC and the plain
``messages.GenerateResponse`` objects from one in process; both read alike. Choice ``index`` =
prompt index × n + completion index, as OpenAI numbers them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from raypaged.outputs import FinishReason
from raypaged.serving.gateway.reasoning import ReasoningParser, ReasoningStream
from raypaged.serving.gateway.tools import ToolPlan, ToolStream
from raypaged.serving.messages import (
    AnyDelta,
    AnyPromptLogprobs,
    AnyResponse,
    AnyTopLogprobs,
    AnyUsage,
    CompletionDelta,
    PromptLogprobs,
    Usage,
)
from raypaged.serving.proto import generate_pb2 as pb

# by the wire's FinishReason value (an int on either link)
FINISH_REASONS: dict[int, FinishReason | None] = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_ABORT: FinishReason.ABORT,
}


def response_id(chat: bool, request_id: str | None) -> str:
    """A completion's (``cmpl-``) or chat completion's (``chatcmpl-``) id: the client's request id, or a new one."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex}"


def engine_request_ids(response_id: str, num_requests: int) -> list[str]:
    """The engine's ids of a response's requests (one per prompt): the response's id, and its prompt's index
    after it when there are several."""
    return [response_id] if num_requests == 1 else [f"{response_id}-{index}" for index in range(num_requests)]


@dataclass
class ResponseShape:
    """What differs between completions and chat completions."""

    chat: bool
    model: str
    n: int
    wants_logprobs: bool
    tools: ToolPlan | None = None  # chat: how the request uses its tools
    role: str = "assistant"  # chat: the answers' role (--response-role)
    echo: bool = False  # completions: the prompt comes first in the text (and the logprobs)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone
    chat_echo: str = ""  # chat with echo: the last message's content, which opens each answer
    prompt_logprobs: bool = False  # the prompt's logprobs, vLLM's field
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details)
    request_id: str | None = None  # the client's (X-Request-Id or request_id): the response id is made of it
    reasoning: ReasoningParser | None = None  # chat: the reasoning becomes reasoning_content (--reasoning-parser)
    include_reasoning: bool = True  # False: the reasoning section is split off and not returned (vLLM's)
    token_ids_as_text: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:{id}"
    token_ids: bool = False  # vLLM's return_token_ids: prompt_token_ids and each choice's token_ids
    fingerprint: str | None = None  # the answers' system_fingerprint (gateway/fingerprint.py)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = response_id(self.chat, self.request_id)

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def envelope(self, choices: list[dict], usage: dict | None, chunk: bool) -> dict:
        obj = "chat.completion.chunk" if chunk and self.chat else self.object
        body = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if usage is not None or not chunk:
            body["usage"] = usage
        return body

    def logprobs(self, delta: AnyDelta, text_offset: int, prompt: PromptParts | None = None) -> dict | None:
        """The delta's logprobs in the endpoint's format (``None`` when not asked for); completions
        that echo put the ``prompt``'s tokens first (the first has no logprob, as OpenAI's)."""
        if not self.wants_logprobs:
            return None
        return self._logprobs(delta, text_offset, prompt)

    def _logprobs(self, delta: AnyDelta, text_offset: int, prompt: PromptParts | None = None) -> dict:
        as_ids = self.token_ids_as_text
        if prompt is not None and not self.chat:
            echoed = prompt.completion_logprobs(as_ids)
            generated = self._logprobs(delta, text_offset + len(prompt.text))
            return {key: echoed[key] + generated[key] for key in echoed}
        names = _token_names(delta.token_texts, delta.token_ids, as_ids)
        if self.chat:
            return {
                "content": [
                    {
                        "token": name,
                        "logprob": finite_logprob(logprob),
                        "bytes": list(name.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": finite_logprob(lp), "bytes": list(t.encode())}
                            for t, lp in zip(_token_names(top.token_texts, top.token_ids, as_ids), top.logprobs)
                        ],
                    }
                    for name, logprob, top in zip(names, delta.logprobs, delta.top_logprobs)
                ]
            }
        offsets = []
        for text in delta.token_texts:
            offsets.append(text_offset)
            text_offset += len(text)
        return {
            "tokens": names,
            "token_logprobs": [finite_logprob(lp) for lp in delta.logprobs],
            "top_logprobs": [
                dict(zip(_token_names(top.token_texts, top.token_ids, as_ids), map(finite_logprob, top.logprobs)))
                for top in delta.top_logprobs
            ],
            "text_offset": offsets,
        }

    def message(self, output: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A whole chat answer as its message (reasoning split off, then tool calls) and its finish reason."""
        message: dict = {"role": self.role}
        text = output
        if self.reasoning is not None:
            thought, content = self.reasoning.split(output)
            if self.include_reasoning:
                message["reasoning_content"] = thought
            text = content or ""
        else:
            content = output
        if self.tools is not None:
            content, calls = self.tools.extract(output if self.tools.reads_whole_output else text)
            if calls:
                message["tool_calls"] = [call.as_openai() for call in calls]
            finish_reason = self.tools.finish_reason(calls, finish_reason)
        message["content"] = self.chat_echo + (content or "") if self.chat_echo else content
        return message, finish_reason

    def usage(self, usages: list[AnyUsage]) -> dict:
        """The requests' token counts together (with vLLM's ``prompt_tokens_details`` when enabled)."""
        prompt_tokens = sum(u.prompt_tokens for u in usages)
        completion_tokens = 0 if self.echo_only else sum(u.completion_tokens for u in usages)
        body: dict = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if self.prompt_tokens_details:
            body["prompt_tokens_details"] = {"cached_tokens": sum(u.cached_tokens for u in usages)}
        return body


def stop_reason_of(delta: AnyDelta) -> int | str | None:
    """vLLM's ``stop_reason``: the stop token id as an int, the stop string as a string."""
    return delta.stop_token_id if delta.HasField("stop_token_id") else delta.stop_reason or None


def _without_tokens(delta: AnyDelta) -> CompletionDelta:
    """The delta without its tokens, text and logprobs: which completion, and how it ended."""
    return CompletionDelta(
        index=delta.index,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
        finish_message=delta.finish_message,
        stop_token_id=delta.stop_token_id if delta.HasField("stop_token_id") else None,
    )


class _TokenValues(Protocol):
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def top_logprobs(self) -> Sequence[AnyTopLogprobs]: ...


def _values(tokens: _TokenValues) -> int:
    """Tokens and their top logprobs' ids: about how many values they put in an answer's body."""
    return len(tokens.token_ids) + sum(len(top.token_ids) for top in tokens.top_logprobs)


@dataclass
class PromptParts:
    """What the engine sent once about one prompt: its text (echo) and its logprobs."""

    text: str = ""
    logprobs: AnyPromptLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids

    def take(self, response: AnyResponse) -> None:
        if response.prompt_text:
            self.text = response.prompt_text
        if response.prompt_token_ids:
            self.token_ids = list(response.prompt_token_ids)
        if response.HasField("prompt_logprobs"):
            self.logprobs = response.prompt_logprobs

    def size(self) -> int:
        """About how many values its logprobs hold."""
        return 0 if self.logprobs is None else _values(self.logprobs)

    def completion_logprobs(self, as_ids: bool = False) -> dict:
        """The prompt's tokens in completions' logprobs format: the first without a logprob."""
        found = self.logprobs or PromptLogprobs()
        offsets, offset = [], 0
        for text in found.token_texts:
            offsets.append(offset)
            offset += len(text)
        tops = [
            dict(zip(_token_names(top.token_texts, top.token_ids, as_ids), map(finite_logprob, top.logprobs)))
            for top in found.top_logprobs
        ]
        return {
            "tokens": _token_names(found.token_texts, found.token_ids, as_ids),
            "token_logprobs": [None, *(finite_logprob(lp) for lp in found.logprobs)][: len(found.token_texts)],
            "top_logprobs": [None, *tops][: len(found.token_texts)],
            "text_offset": offsets,
        }

    def vllm_logprobs(self) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token ``{token_id: {"logprob", "rank", "decoded_token"}}``
        with the token itself and its top alternatives (rank: place among them), ``None`` first."""
        if self.logprobs is None:
            return None
        found = self.logprobs
        out: list[dict | None] = [None]
        for token_id, text, logprob, top in zip(
            found.token_ids[1:], found.token_texts[1:], found.logprobs, found.top_logprobs
        ):
            ranks = {t: rank for rank, t in enumerate(top.token_ids, start=1)}
            entry = {
                str(token_id): {"logprob": finite_logprob(logprob), "rank": ranks.get(token_id), "decoded_token": text}
            }
            for t, t_text, lp in zip(top.token_ids, top.token_texts, top.logprobs):
                entry.setdefault(str(t), {"logprob": finite_logprob(lp), "rank": ranks[t], "decoded_token": t_text})
            out.append(entry)
        return out


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[AnyTopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def no_pause() -> None:
    """Write on without a pause (an answer written on the event loop)."""


# an answer of more values than this (``Accumulator.size``) is built and written off the gateway's event loop:
# n=32 x 500 tokens x 20 top logprobs (24 MB of JSON) held the loop, and every stream with it, for 1.6 s
LARGE_ANSWER = 20_000


def answer_json(body: dict, pause: Callable[[], None] = no_pause) -> bytes:
    """``body`` as ``JSONResponse`` writes it (compact UTF-8 JSON, no NaN), each item of a top-level list written by
    a call of its own with ``pause`` after it (one ``json.dumps`` holds the interpreter lock to its end; a thread
    writing a large answer lets the event loop run between them)."""
    parts = []
    for key, value in body.items():
        if isinstance(value, list):
            items = []
            for item in value:
                items.append(_json(item))
                pause()
            encoded = "[" + ",".join(items) + "]"
        else:
            encoded = _json(value)
        parts.append(f"{_json(key)}:{encoded}")
    return ("{" + ",".join(parts) + "}").encode()


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class Accumulator:
    """Collects every delta of every prompt into one non-streaming response body."""

    def __init__(self, shape: ResponseShape, num_prompts: int) -> None:
        self.shape = shape
        self.choices = [_Choice() for _ in range(num_prompts * shape.n)]
        self.usages: list[AnyUsage] = [Usage() for _ in range(num_prompts)]
        self.prompts = [PromptParts() for _ in range(num_prompts)]

    def add(self, prompt_index: int, response: AnyResponse) -> None:
        self.usages[prompt_index] = response.usage
        self.prompts[prompt_index].take(response)
        for delta in response.outputs:
            choice = self.choices[prompt_index * self.shape.n + delta.index]
            choice.text += delta.text
            choice.token_ids.extend(delta.token_ids)
            choice.token_texts.extend(delta.token_texts)
            choice.logprobs.extend(delta.logprobs)
            choice.top_logprobs.extend(delta.top_logprobs)
            if delta.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                choice.finish_reason = FINISH_REASONS[delta.finish_reason]
                choice.stop_reason = stop_reason_of(delta)

    def size(self) -> int:
        """About how many values the body will hold: its tokens, their top logprobs and the prompts' logprobs."""
        return sum(_values(c) for c in self.choices) + sum(prompt.size() for prompt in self.prompts)

    def body(self, pause: Callable[[], None] = no_pause) -> dict:
        """The response body, with ``pause`` after each choice is built (see ``answer_json``)."""
        choices = []
        for index, choice in enumerate(self.choices):
            merged = CompletionDelta(
                token_ids=choice.token_ids,
                token_texts=choice.token_texts,
                logprobs=choice.logprobs,
                top_logprobs=choice.top_logprobs,
            )
            entry: dict = {"index": index}
            finish_reason = choice.finish_reason
            prompt = self.prompts[index // self.shape.n]
            if self.shape.echo_only:
                choice.text, merged = "", CompletionDelta()
            if self.shape.chat:
                entry["message"], finish_reason = self.shape.message(choice.text, finish_reason)
            else:
                entry["text"] = prompt.text + choice.text if self.shape.echo else choice.text
            entry["logprobs"] = self.shape.logprobs(merged, 0, prompt if self.shape.echo else None)
            if self.shape.prompt_logprobs and not self.shape.chat:
                entry["prompt_logprobs"] = prompt.vllm_logprobs()
            entry["finish_reason"] = finish_reason
            entry["stop_reason"] = choice.stop_reason
            if self.shape.token_ids:  # vLLM's places: the prompt's per completions choice, once per chat answer
                if not self.shape.chat:
                    entry["prompt_token_ids"] = prompt.token_ids
                entry["token_ids"] = list(choice.token_ids)
            choices.append(entry)
            pause()
        body = self.shape.envelope(choices, self.shape.usage(self.usages), chunk=False)
        if self.shape.prompt_logprobs and self.shape.chat:
            body["prompt_logprobs"] = self.prompts[0].vllm_logprobs()
        if self.shape.token_ids and self.shape.chat:
            body["prompt_token_ids"] = self.prompts[0].token_ids
        return body


class ChunkWriter:
    """Turns deltas into stream chunks (``None`` for a delta with nothing to tell)."""

    def __init__(
        self, shape: ResponseShape, num_prompts: int, include_usage: bool, continuous_usage: bool = False
    ) -> None:
        self.shape = shape
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # every chunk carries its prompt's usage so far
        self._text_offsets = [0] * (num_prompts * shape.n)
        self._usages: list[AnyUsage] = [Usage() for _ in range(num_prompts)]
        tools = shape.tools
        self._tool_streams: list[ToolStream] | None = (
            None if tools is None else [tools.stream() for _ in range(num_prompts * shape.n)]
        )
        self._prompts = [PromptParts() for _ in range(num_prompts)]
        self._echoed: set[int] = set()  # choices whose stream already began with the prompt
        self._ids_sent: set[int] = set()  # return_token_ids: choices whose prompt token ids went out
        reasoning = shape.reasoning
        self._reasoning_streams: list[ReasoningStream] | None = (
            None if reasoning is None else [reasoning.stream() for _ in range(num_prompts * shape.n)]
        )

    def role_chunks(self) -> list[dict]:
        """Chat streams open every choice with the assistant role."""
        if not self.shape.chat:
            return []
        choices = [
            {"index": i, "delta": {"role": self.shape.role, "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(len(self._text_offsets))
        ]
        if self.shape.chat_echo:  # then, as vLLM, the echoed message in a chunk of its own
            choices += [
                {"index": i, "delta": {"content": self.shape.chat_echo}, "logprobs": None, "finish_reason": None}
                for i in range(len(self._text_offsets))
            ]
        return [self.shape.envelope([c], None, chunk=True) | self._null_usage() for c in choices]

    def chunks(self, prompt_index: int, response: AnyResponse) -> list[dict]:
        self._usages[prompt_index] = response.usage
        prompt = self._prompts[prompt_index]
        prompt.take(response)
        out = []
        for delta in response.outputs:
            finish_reason: str | None = FINISH_REASONS[delta.finish_reason]
            index = prompt_index * self.shape.n + delta.index
            if self.shape.echo_only:  # the prompt alone: the token made to get there is not shown
                delta = _without_tokens(delta)
            echo = prompt if self.shape.echo and index not in self._echoed else None
            if echo is not None:
                self._echoed.add(index)
            fields: dict = {}
            if self.shape.chat:
                fields, finish_reason = self._chat_delta(index, delta.text, finish_reason)
            shown = fields if self.shape.chat else delta.text or echo is not None
            tokens_asked = self.shape.wants_logprobs or self.shape.token_ids
            if not shown and finish_reason is None and not (tokens_asked and delta.token_ids):
                continue
            choice: dict = {"index": index}
            if self.shape.chat:
                choice["delta"] = fields
            else:
                choice["text"] = echo.text + delta.text if echo is not None else delta.text
            has_tokens = bool(delta.token_ids) or echo is not None
            choice["logprobs"] = self.shape.logprobs(delta, self._text_offsets[index], echo) if has_tokens else None
            if echo is not None and self.shape.prompt_logprobs:
                choice["prompt_logprobs"] = echo.vllm_logprobs()
            choice["finish_reason"] = finish_reason
            if finish_reason is not None:
                choice["stop_reason"] = stop_reason_of(delta)
            first = self.shape.token_ids and index not in self._ids_sent
            if self.shape.token_ids:
                self._ids_sent.add(index)
                if first and not self.shape.chat:
                    choice["prompt_token_ids"] = prompt.token_ids
                choice["token_ids"] = list(delta.token_ids)
            self._text_offsets[index] += len(delta.text) + (len(echo.text) if echo is not None else 0)
            usage = {"usage": self.shape.usage([response.usage])} if self.continuous_usage else self._null_usage()
            chunk = self.shape.envelope([choice], None, chunk=True) | usage
            if first and self.shape.chat:
                chunk["prompt_token_ids"] = prompt.token_ids
            out.append(chunk)
        return out

    def _chat_delta(self, index: int, output: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A chat chunk's ``delta`` (the output's text, or its reasoning, content and tool-call deltas) and
        its finish reason (``tool_calls`` when the last one ends with calls)."""
        fields: dict = {}
        text = output
        if self._reasoning_streams is not None:
            thought, text = self._reasoning_streams[index].feed(output)
            if finish_reason is not None:
                more, rest = self._reasoning_streams[index].finish()
                thought, text = thought + more, text + rest
            if thought and self.shape.include_reasoning:
                fields["reasoning_content"] = thought
        if self._tool_streams is None or self.shape.tools is None:
            return fields | ({"content": text} if text else {}), finish_reason
        stream = self._tool_streams[index]
        fields |= stream.feed(output if self.shape.tools.reads_whole_output else text)
        if finish_reason is None:
            return fields, None
        last, calls = stream.finish()
        if "content" in last:
            fields["content"] = fields.get("content", "") + last["content"]
        if "tool_calls" in last:
            fields["tool_calls"] = fields.get("tool_calls", []) + last["tool_calls"]
        return fields, self.shape.tools.finish_reason(calls, finish_reason)

    def usage_chunk(self) -> dict | None:
        if not self.include_usage:
            return None
        return self.shape.envelope([], self.shape.usage(self._usages), chunk=True)

    def _null_usage(self) -> dict:
        return {"usage": None} if self.include_usage else {}


_MIN_LOGPROB = -9999.0  # JSON has no -Infinity: a token the grammar (or a mask) ruled out reports this, as vLLM


def _token_names(texts: Sequence[str], token_ids: Sequence[int], as_ids: bool) -> list[str]:
    """How logprobs name tokens: their text, or ``token_id:{id}`` (vLLM's return_tokens_as_token_ids)."""
    return [f"token_id:{token_id}" for token_id in token_ids] if as_ids else list(texts)


def finite_logprob(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)

"""OpenAI response bodies and stream chunks built from the engine's ``GenerateResponse`` deltas.

Choice ``index`` = prompt index × n + completion index, as OpenAI numbers them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from raypaged.serving.gateway.tools import ToolPlan, ToolStream
from raypaged.serving.proto import generate_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass
class ResponseShape:
    """What differs between completions and chat completions."""

    chat: bool
    model: str
    n: int
    wants_logprobs: bool
    tools: ToolPlan | None = None  # chat: how the request uses its tools
    role: str = "assistant"  # chat: the answers' role (--response-role)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def envelope(self, choices: list[dict], usage: dict | None, chunk: bool) -> dict:
        obj = "chat.completion.chunk" if chunk and self.chat else self.object
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or not chunk:
            body["usage"] = usage
        return body

    def logprobs(self, delta: pb.CompletionDelta, text_offset: int) -> dict | None:
        """The delta's logprobs in the endpoint's format (``None`` when not asked for)."""
        if not self.wants_logprobs:
            return None
        if self.chat:
            return {"content": [
                {
                    "token": text,
                    "logprob": _finite(logprob),
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": _finite(lp), "bytes": list(t.encode())}
                        for t, lp in zip(top.token_texts, top.logprobs)
                    ],
                }
                for text, logprob, top in zip(delta.token_texts, delta.logprobs, delta.top_logprobs)
            ]}
        offsets = []
        for text in delta.token_texts:
            offsets.append(text_offset)
            text_offset += len(text)
        return {
            "tokens": list(delta.token_texts),
            "token_logprobs": [_finite(lp) for lp in delta.logprobs],
            "top_logprobs": [
                {t: _finite(lp) for t, lp in zip(top.token_texts, top.logprobs)} for top in delta.top_logprobs
            ],
            "text_offset": offsets,
        }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class _Choice:
    text: str = ""
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[pb.TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None


class Accumulator:
    """Collects every delta of every prompt into one non-streaming response body."""

    def __init__(self, shape: ResponseShape, num_prompts: int) -> None:
        self.shape = shape
        self.choices = [_Choice() for _ in range(num_prompts * shape.n)]
        self.usages = [pb.Usage() for _ in range(num_prompts)]

    def add(self, prompt_index: int, response: pb.GenerateResponse) -> None:
        self.usages[prompt_index] = response.usage
        for delta in response.outputs:
            choice = self.choices[prompt_index * self.shape.n + delta.index]
            choice.text += delta.text
            choice.token_texts.extend(delta.token_texts)
            choice.logprobs.extend(delta.logprobs)
            choice.top_logprobs.extend(delta.top_logprobs)
            if delta.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                choice.finish_reason = FINISH_REASONS[delta.finish_reason]
                choice.stop_reason = delta.stop_reason or None

    def body(self) -> dict:
        choices = []
        for index, choice in enumerate(self.choices):
            merged = pb.CompletionDelta(
                token_texts=choice.token_texts, logprobs=choice.logprobs, top_logprobs=choice.top_logprobs
            )
            entry: dict = {"index": index}
            finish_reason = choice.finish_reason
            if self.shape.chat:
                entry["message"] = {"role": self.shape.role, "content": choice.text}
                if (tools := self.shape.tools) is not None:
                    content, calls = tools.extract(choice.text)
                    entry["message"]["content"] = content
                    if calls:
                        entry["message"]["tool_calls"] = [call.as_openai() for call in calls]
                    finish_reason = tools.finish_reason(calls, finish_reason)
            else:
                entry["text"] = choice.text
            entry["logprobs"] = self.shape.logprobs(merged, 0)
            entry["finish_reason"] = finish_reason
            entry["stop_reason"] = choice.stop_reason
            choices.append(entry)
        prompt_tokens = sum(u.prompt_tokens for u in self.usages)
        completion_tokens = sum(u.completion_tokens for u in self.usages)
        return self.shape.envelope(choices, usage(prompt_tokens, completion_tokens), chunk=False)


class ChunkWriter:
    """Turns deltas into stream chunks (``None`` for a delta with nothing to tell)."""

    def __init__(self, shape: ResponseShape, num_prompts: int, include_usage: bool) -> None:
        self.shape = shape
        self.include_usage = include_usage
        self._text_offsets = [0] * (num_prompts * shape.n)
        self._usages = [pb.Usage() for _ in range(num_prompts)]
        tools = shape.tools
        self._tool_streams: list[ToolStream] | None = (
            None if tools is None else [tools.stream() for _ in range(num_prompts * shape.n)]
        )

    def role_chunks(self) -> list[dict]:
        """Chat streams open every choice with the assistant role."""
        if not self.shape.chat:
            return []
        choices = [
            {"index": i, "delta": {"role": self.shape.role, "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(len(self._text_offsets))
        ]
        return [self.shape.envelope([c], None, chunk=True) | self._null_usage() for c in choices]

    def chunks(self, prompt_index: int, response: pb.GenerateResponse) -> list[dict]:
        self._usages[prompt_index] = response.usage
        out = []
        for delta in response.outputs:
            finish_reason = FINISH_REASONS[delta.finish_reason]
            index = prompt_index * self.shape.n + delta.index
            fields = self._chat_fields(index, delta.text, finish_reason) if self.shape.chat else {}
            if self.shape.chat and finish_reason is not None and self._tool_streams is not None:
                finish_reason = self.shape.tools.finish_reason(fields.pop("_calls"), finish_reason)
            shown = fields if self.shape.chat else delta.text
            if not shown and finish_reason is None and not (self.shape.wants_logprobs and delta.token_ids):
                continue
            choice: dict = {"index": index}
            if self.shape.chat:
                choice["delta"] = fields
            else:
                choice["text"] = delta.text
            choice["logprobs"] = self.shape.logprobs(delta, self._text_offsets[index]) if delta.token_ids else None
            choice["finish_reason"] = finish_reason
            if finish_reason is not None:
                choice["stop_reason"] = delta.stop_reason or None
            self._text_offsets[index] += len(delta.text)
            out.append(self.shape.envelope([choice], None, chunk=True) | self._null_usage())
        return out

    def _chat_fields(self, index: int, text: str, finish_reason: str | None) -> dict:
        """A chat chunk's ``delta``: the text, or with tools its content and tool-call deltas
        (``_calls``: the calls made, on the last one)."""
        if self._tool_streams is None:
            return {"content": text} if text else {}
        stream = self._tool_streams[index]
        fields = stream.feed(text)
        if finish_reason is None:
            return fields
        last, calls = stream.finish()
        if "content" in last:
            fields["content"] = fields.get("content", "") + last["content"]
        if "tool_calls" in last:
            fields["tool_calls"] = fields.get("tool_calls", []) + last["tool_calls"]
        return {**fields, "_calls": calls}

    def usage_chunk(self) -> dict | None:
        if not self.include_usage:
            return None
        prompt_tokens = sum(u.prompt_tokens for u in self._usages)
        completion_tokens = sum(u.completion_tokens for u in self._usages)
        return self.shape.envelope([], usage(prompt_tokens, completion_tokens), chunk=True)

    def _null_usage(self) -> dict:
        return {"usage": None} if self.include_usage else {}


_MIN_LOGPROB = -9999.0  # JSON has no -Infinity: a token the grammar (or a mask) ruled out reports this, as vLLM


def _finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)

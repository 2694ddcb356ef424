"""vLLM's ``GenerateResponse`` (``POST /inference/v1/generate``'s answer) and its stream's chunks, in each output
mode: ``tokens`` (token ids, logprobs by id), ``text`` (the text too, logprobs decoded) and ``derender`` (each
choice's chat message, made by the chat route's own answer builders: ``Accumulator`` and ``ChunkWriter``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Literal

import grpc

from raypaged.serving.client import StreamCall
from raypaged.serving.gateway.calls import Slot, cancel, merged_responses
from raypaged.serving.gateway.drain import Drain
from raypaged.serving.gateway.errors import APIError, from_grpc
from raypaged.serving.gateway.output_log import OutputLog
from raypaged.serving.gateway.responses import (
    FINISH_REASONS,
    Accumulator,
    ChunkWriter,
    PromptParts,
    ResponseShape,
    finite_logprob,
    stop_reason_of,
)
from raypaged.serving.gateway.sse import sse_data
from raypaged.serving.messages import AnyDelta, AnyResponse, AnyUsage, Usage
from raypaged.serving.proto import generate_pb2 as pb

OutputMode = Literal["tokens", "text", "derender"]


@dataclass
class _Choice:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class GenerateAnswer:
    """vLLM's ``GenerateResponse`` for one engine request (``add`` each response, then ``body()``), or its
    stream's chunks (``chunks`` of each response, then ``usage_chunk()``).

    Logprobs (``tokens`` and ``text``) are vLLM's: per generated token its id (``text``: its string and UTF-8
    bytes), logprob and rank, and ``top_logprobs`` with every candidate the engine returned: the sampled token
    first, then the most likely others (as many as the request's ``logprobs``; one more when the sampled token
    is not among them). A rank is the token's place among the most likely ones the engine returned (1: the
    most likely); null when it is not among them, or when ``logprob_token_ids`` chose them. ``derender``'s
    message, finish reason and logprobs are the chat route's for the same tokens (``chat``: its shape).
    """

    def __init__(
        self,
        request_id: str,
        model: str,
        request: pb.GenerateRequest,
        mode: OutputMode,
        tokens_as_ids: bool,
        prompt_tokens_details: bool,
        include_usage: bool,
        continuous_usage: bool,
        chat: ResponseShape | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.mode = mode
        self.tokens_as_ids = tokens_as_ids and mode == "text"
        self.prompt_tokens_details = prompt_tokens_details
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        self.wants_logprobs = request.HasField("logprobs")
        self.ranked = not request.sampling.logprob_token_ids
        self.return_token_ids = request.return_token_ids
        self.choices = [_Choice() for _ in range(request.sampling.n or 1)]
        self.prompt = PromptParts()
        self.usage: AnyUsage = Usage()
        self.created = int(time.time())
        self._chat = Accumulator(chat, 1) if chat is not None else None
        self._chat_stream = ChunkWriter(chat, 1, include_usage=False) if chat is not None else None
        self._role = chat.role if chat is not None else ""
        self._roled: set[int] = set()  # derender stream: choices whose role went out

    def add(self, response: AnyResponse) -> None:
        self.usage = response.usage
        self.prompt.take(response)
        for delta in response.outputs:
            self._take(delta)
        if self._chat is not None:
            self._chat.add(0, response)

    def body(self) -> dict:
        chat = self._chat.body()["choices"] if self._chat is not None else []
        choices = []
        for index, c in enumerate(self.choices):
            choice = _choice(index, c.finish_reason or "stop", c.stop_reason, c.token_ids)
            if self.mode == "derender":
                message = chat[index]
                choice |= {"finish_reason": message["finish_reason"], "message": message["message"]}
                choice["logprobs"] = message["logprobs"]
            else:
                if self.mode == "text":
                    choice["text"] = c.text
                choice["logprobs"] = {"content": c.logprobs} if self.wants_logprobs else None
            choices.append(choice)
        return {
            "request_id": self.request_id,
            "model": self.model,
            "created": self.created,
            "usage": self._usage(),
            "prompt_logprobs": self.prompt.vllm_logprobs(),
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": self.prompt.token_ids if self.return_token_ids else None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": self.mode,
            "choices": choices,
        }

    def chunks(self, response: AnyResponse) -> list[dict]:
        self.usage = response.usage
        prompt_token_ids = list(response.prompt_token_ids) if self.return_token_ids else []  # sent once
        found: list[tuple[int, dict]] = []  # (choice index, the chunk's choice)
        for delta in response.outputs:
            logprobs = self._take(delta)
            c = self.choices[delta.index]
            if self.mode == "derender" or not (
                delta.token_ids or c.finish_reason or (self.mode == "text" and delta.text)
            ):
                continue
            choice = _choice(delta.index, c.finish_reason, stop_reason_of(delta) if c.finish_reason else None)
            choice["token_ids"] = list(delta.token_ids)
            if self.mode == "text":
                choice["text"] = delta.text
            choice["logprobs"] = {"content": logprobs} if self.wants_logprobs else None
            found.append((delta.index, choice))
        if self._chat_stream is not None:
            found += [self._derender_choice(chunk["choices"][0]) for chunk in self._chat_stream.chunks(0, response)]
        out = []
        for index, choice in found:
            chunk: dict = {"request_id": self.request_id, "usage": None}
            if self.continuous_usage:
                chunk["usage"] = self._usage(len(self.choices[index].token_ids))
            if prompt_token_ids:
                chunk["prompt_token_ids"], prompt_token_ids = prompt_token_ids, []
            chunk |= {"output_mode": self.mode, "choices": [choice]}
            out.append(chunk)
        return out

    def usage_chunk(self) -> dict | None:
        if not self.include_usage:
            return None
        usage = {k: v for k, v in self._usage().items() if v is not None}
        return {"request_id": self.request_id, "usage": usage, "output_mode": self.mode, "choices": []}

    def _derender_choice(self, chat: dict) -> tuple[int, dict]:
        """A chat chunk's choice as a ``derender`` chunk's: its delta (the role in a choice's first), logprobs."""
        index = chat["index"]
        delta = chat["delta"]
        if index not in self._roled:
            self._roled.add(index)
            delta = {"role": self._role, **delta}
        choice = _choice(index, chat["finish_reason"], chat.get("stop_reason"), chat["token_ids"])
        return index, choice | {"delta": delta, "logprobs": chat["logprobs"]}

    def _take(self, delta: AnyDelta) -> list[dict]:
        """Adds ``delta`` to its choice; its logprob entries (``tokens`` and ``text``)."""
        choice = self.choices[delta.index]
        logprobs = self._logprobs(delta) if self.mode != "derender" else []
        choice.token_ids.extend(delta.token_ids)
        choice.text += delta.text
        choice.logprobs.extend(logprobs)
        reason = FINISH_REASONS[delta.finish_reason]
        if reason is not None:
            choice.finish_reason = reason.value
            choice.stop_reason = stop_reason_of(delta)
        return logprobs

    def _usage(self, completion_tokens: int | None = None) -> dict:
        """The request's token counts (``completion_tokens``: one choice's so far, in a continuous-usage chunk)."""
        usage = self.usage
        generated = usage.completion_tokens if completion_tokens is None else completion_tokens
        return {
            "prompt_tokens": usage.prompt_tokens,
            "total_tokens": usage.prompt_tokens + generated,
            "completion_tokens": generated,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens} if self.prompt_tokens_details else None,
        }

    def _logprobs(self, delta: AnyDelta) -> list[dict]:
        out = []
        for token_id, text, logprob, top in zip(delta.token_ids, delta.token_texts, delta.logprobs, delta.top_logprobs):
            ranks = {t: rank for rank, t in enumerate(top.token_ids, start=1)} if self.ranked else {}
            sampled = self._entry(token_id, text, logprob, ranks.get(token_id))
            others = [
                self._entry(t, t_text, lp, ranks.get(t))
                for t, t_text, lp in zip(top.token_ids, top.token_texts, top.logprobs)
                if t != token_id
            ]
            out.append(sampled | {"top_logprobs": [sampled, *others]})
        return out

    def _entry(self, token_id: int, text: str, logprob: float, rank: int | None) -> dict:
        if self.mode == "tokens":
            return {"token_id": token_id, "logprob": finite_logprob(logprob), "rank": rank}
        if self.tokens_as_ids:
            return {"token": f"token_id:{token_id}", "logprob": finite_logprob(logprob), "bytes": None}
        return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode())}


def _choice(
    index: int, finish_reason: str | None, stop_reason: int | str | None, token_ids: list[int] | None = None
) -> dict:
    """The fields every output mode's choice has, in vLLM's order."""
    return {
        "index": index,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": None,
    }


async def collect(calls: list[StreamCall], answer: GenerateAnswer, drain: Drain, log: OutputLog | None) -> dict:
    async with contextlib.aclosing(merged_responses(calls, drain)) as responses:
        async for _, response in responses:
            answer.add(response)
            if log is not None:
                log.feed(0, response)
    if log is not None:
        log.finish()
    return answer.body()


async def events(
    calls: list[StreamCall], answer: GenerateAnswer, slot: Slot, drain: Drain, log: OutputLog | None
) -> AsyncGenerator[str, None]:
    """The stream's server-sent events: a chunk per choice that changed, the usage chunk when asked, an error's
    body if one ends it, then ``data: [DONE]``; leaving it early aborts the request."""
    try:
        async with contextlib.aclosing(merged_responses(calls, drain)) as responses:
            async for _, response in responses:
                if log is not None:
                    log.feed(0, response)
                for chunk in answer.chunks(response):
                    yield sse_data(chunk)
        if log is not None:
            log.finish()
        if (usage_chunk := answer.usage_chunk()) is not None:
            yield sse_data(usage_chunk)
    except grpc.aio.AioRpcError as exc:
        yield sse_data(from_grpc(exc).body())
    except APIError as exc:
        yield sse_data(exc.body())
    finally:
        cancel(calls)
        slot.release()
    yield sse_data("[DONE]")

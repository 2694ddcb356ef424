"""vLLM's scale-out endpoints (``--enable-scale-out``): render, then tokens in, tokens out.

``POST /v1/completions/render`` and ``POST /v1/chat/completions/render`` take the bodies of ``/v1/completions`` and
``/v1/chat/completions``, run what those run before generating (the same checks and chat template, then the engine's
``Render``: its input processor, as ``Generate``'s), and answer vLLM's ``GenerateRequest`` (completions: one per
prompt, in a list). ``POST /inference/v1/generate`` runs a ``GenerateRequest`` and answers vLLM's
``GenerateResponse``, or its stream. A rendered request generates exactly what its body does on the OpenAI route.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from raypaged.serving.client import EngineClient, StreamCall
from raypaged.serving.gateway.calls import (
    Slot,
    cancel,
    header_request_id,
    merged_responses,
    metadata,
    start,
    unless_disconnected,
)
from raypaged.serving.gateway.drain import Drain
from raypaged.serving.gateway.engines import EngineRoutes
from raypaged.serving.gateway.errors import APIError, from_grpc
from raypaged.serving.gateway.output_log import OutputLog, OutputLogging
from raypaged.serving.gateway.responses import (
    FINISH_REASONS,
    PromptParts,
    engine_request_ids,
    finite_logprob,
    response_id,
)
from raypaged.serving.gateway.scale_out_request import GenerateBody, generate_request_json
from raypaged.serving.gateway.schemas import ChatCompletionRequest, CompletionRequest
from raypaged.serving.gateway.sse import EventStream, sse_data
from raypaged.serving.gateway.tools import ToolPlan
from raypaged.serving.messages import AnyDelta, AnyResponse, AnyUsage, Usage
from raypaged.serving.proto import generate_pb2 as pb

logger = logging.getLogger("raypaged")

GENERATE_PATH = "/inference/v1/generate"
Body = TypeVar("Body", bound=BaseModel)


class Parse(Protocol):
    """The gateway's body parser: a request's JSON body as a ``body_type``, or the 400 (413) that refuses it."""

    def __call__(self, http: Request, body_type: type[Body]) -> Awaitable[Body]: ...


EngineRequests = Callable[
    [CompletionRequest | ChatCompletionRequest],
    Awaitable[tuple[str, EngineClient, ToolPlan | None, list[pb.GenerateRequest]]],
]


@dataclass(frozen=True, slots=True)
class GatewayParts:
    """What the scale-out routes use of the gateway's (``app.build_app``): its engines, drain, body parser, the
    OpenAI routes' engine requests of a body, and the flags that shape answers."""

    routes: EngineRoutes
    drain: Drain
    parse: Parse
    engine_requests: EngineRequests
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details (--enable-prompt-tokens-details)
    tokens_as_ids: bool = False  # output_mode text: logprobs name tokens "token_id:{id}"
    sse_keep_alive_s: float = 0.0
    log_requests: bool = False
    output_logging: OutputLogging | None = None


def add_scale_out_routes(app: FastAPI, parts: GatewayParts) -> None:
    async def render(http: Request, body: CompletionRequest | ChatCompletionRequest) -> list[dict]:
        for name, asked in (("echo", body.echo), ("use_beam_search", body.use_beam_search)):
            if asked:
                raise APIError(
                    400, f"{name} is not supported by the render endpoints: a GenerateRequest cannot carry it", name
                )
        _, stub, _, requests = await parts.engine_requests(body)
        chat = isinstance(body, ChatCompletionRequest)
        ids = engine_request_ids(response_id(chat, body.request_id or header_request_id(http)), len(requests))
        for request, request_id in zip(requests, ids):
            request.request_id = request_id
        engine_metadata = metadata(http)
        rendered = await asyncio.gather(*(stub.Render(r, metadata=engine_metadata) for r in requests))
        return [generate_request_json(r.request, body.stream, body.stream_options) for r in rendered]

    @app.post("/v1/completions/render")
    async def render_completion(http: Request) -> list[dict]:
        return await render(http, await parts.parse(http, CompletionRequest))

    @app.post("/v1/chat/completions/render")
    async def render_chat_completion(http: Request) -> dict:
        [rendered] = await render(http, await parts.parse(http, ChatCompletionRequest))
        return rendered

    @app.post(GENERATE_PATH)
    async def generate(http: Request) -> Response:
        slot = Slot(http.state.tenant_gate, parts.drain)
        try:
            body = await parts.parse(http, GenerateBody)
            if body.stream and body.sampling_params.prompt_logprobs is not None:
                raise APIError(
                    400, "prompt_logprobs are not available when stream is true", "sampling_params.prompt_logprobs"
                )
            model, stub = await parts.routes.find(body.model)
            request_id = f"generate-tokens-{header_request_id(http) or body.request_id or uuid.uuid4().hex}"
            try:
                request = body.engine_request(model, request_id)
            except (ValueError, TypeError) as exc:  # a value the wire format cannot hold
                raise APIError(400, str(exc)) from None
            calls = await start(slot, http, stub, [request], parts.drain)
        except BaseException:
            slot.release()
            raise
        answer = GenerateAnswer(
            request_id,
            model,
            request,
            body.output_mode == "text",
            parts.tokens_as_ids,
            parts.prompt_tokens_details,
            bool(body.stream and body.stream_options and body.stream_options.include_usage),
            bool(body.stream and body.stream_options and body.stream_options.continuous_usage_stats),
        )
        n = request.sampling.n or 1
        if parts.log_requests:
            logger.info(
                "request %s: model=%s tenant=%s prompt_tokens=%d n=%d stream=%s",
                request_id,
                model,
                slot.gate.tenant.name,
                len(body.token_ids),
                n,
                bool(body.stream),
            )
        log = None
        if parts.log_requests and parts.output_logging is not None:
            log = OutputLog(parts.output_logging, request_id, n, bool(body.stream))
        if body.stream:

            def cleanup() -> None:
                cancel(calls)
                slot.release()

            return EventStream(_events(calls, answer, slot, parts.drain, log), cleanup, None, parts.sse_keep_alive_s)
        try:
            whole = await unless_disconnected(http, _collect(calls, answer, parts.drain, log))
        finally:
            cancel(calls)
            slot.release()
        return JSONResponse(whole)


@dataclass
class _Choice:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None


class GenerateAnswer:
    """vLLM's ``GenerateResponse`` for one engine request (``add`` each response, then ``body()``), or its
    stream's chunks (``chunks`` of each response, then ``usage_chunk()``).

    Logprobs are vLLM's: per generated token its id (``output_mode`` text: its string and UTF-8 bytes), logprob
    and rank, and ``top_logprobs`` with the sampled token first, then the most likely others, as many in all as
    the request's ``logprobs`` (at least one). A rank is the token's place among the most likely ones the engine
    returned (1: the most likely); null when it is not among them, or when ``logprob_token_ids`` chose them.
    """

    def __init__(
        self,
        request_id: str,
        model: str,
        request: pb.GenerateRequest,
        text_mode: bool,
        tokens_as_ids: bool,
        prompt_tokens_details: bool,
        include_usage: bool,
        continuous_usage: bool,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.text_mode = text_mode
        self.tokens_as_ids = tokens_as_ids and text_mode
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

    def add(self, response: AnyResponse) -> None:
        self.usage = response.usage
        self.prompt.take(response)
        for delta in response.outputs:
            self._take(delta)

    def body(self) -> dict:
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
            "output_mode": self._mode,
            "choices": [
                self._choice(index, c.token_ids, c.text, c.logprobs, c.finish_reason or "stop")
                for index, c in enumerate(self.choices)
            ],
        }

    def chunks(self, response: AnyResponse) -> list[dict]:
        self.usage = response.usage
        prompt_token_ids = list(response.prompt_token_ids) if self.return_token_ids else []  # sent once
        out = []
        for delta in response.outputs:
            logprobs = self._take(delta)
            finish_reason = self.choices[delta.index].finish_reason
            if not (delta.token_ids or finish_reason is not None or (self.text_mode and delta.text)):
                continue
            choice = self._choice(delta.index, list(delta.token_ids), delta.text, logprobs, finish_reason)
            chunk: dict = {"request_id": self.request_id, "usage": None}
            if self.continuous_usage:
                chunk["usage"] = self._usage(len(self.choices[delta.index].token_ids))
            if prompt_token_ids:
                chunk["prompt_token_ids"], prompt_token_ids = prompt_token_ids, []
            chunk |= {"output_mode": self._mode, "choices": [choice]}
            out.append(chunk)
        return out

    def usage_chunk(self) -> dict | None:
        if not self.include_usage:
            return None
        usage = {k: v for k, v in self._usage().items() if v is not None}
        return {"request_id": self.request_id, "usage": usage, "output_mode": self._mode, "choices": []}

    @property
    def _mode(self) -> str:
        return "text" if self.text_mode else "tokens"

    def _take(self, delta: AnyDelta) -> list[dict]:
        """Adds ``delta`` to its choice; its logprob entries."""
        choice = self.choices[delta.index]
        logprobs = self._logprobs(delta)
        choice.token_ids.extend(delta.token_ids)
        choice.text += delta.text
        choice.logprobs.extend(logprobs)
        reason = FINISH_REASONS[delta.finish_reason]
        if reason is not None:
            choice.finish_reason = reason.value
        return logprobs

    def _choice(
        self, index: int, token_ids: list[int], text: str, logprobs: list[dict], finish_reason: str | None
    ) -> dict:
        choice: dict = {
            "index": index,
            "finish_reason": finish_reason,
            "token_ids": token_ids,
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": None,
        }
        if self.text_mode:
            choice["text"] = text
        choice["logprobs"] = {"content": logprobs} if self.wants_logprobs else None
        return choice

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
            out.append(sampled | {"top_logprobs": [sampled, *others][: max(len(top.token_ids), 1)]})
        return out

    def _entry(self, token_id: int, text: str, logprob: float, rank: int | None) -> dict:
        if not self.text_mode:
            return {"token_id": token_id, "logprob": finite_logprob(logprob), "rank": rank}
        if self.tokens_as_ids:
            return {"token": f"token_id:{token_id}", "logprob": finite_logprob(logprob), "bytes": None}
        return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode())}


async def _collect(calls: list[StreamCall], answer: GenerateAnswer, drain: Drain, log: OutputLog | None) -> dict:
    async with contextlib.aclosing(merged_responses(calls, drain)) as responses:
        async for _, response in responses:
            answer.add(response)
            if log is not None:
                log.feed(0, response)
    if log is not None:
        log.finish()
    return answer.body()


async def _events(
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

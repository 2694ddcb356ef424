"""The OpenAI-compatible routes: completions, chat completions, models, health, metrics, tokenize."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError

from raypaged.serving.gateway.engines import EngineRoutes
from raypaged.serving.gateway.errors import APIError, from_grpc, install_handlers
from raypaged.serving.gateway.responses import Accumulator, ChunkWriter, ResponseShape
from raypaged.serving.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    TokenizeBody,
)
from raypaged.serving.gateway.tenants import TenantGate, Tenants
from raypaged.serving.proto import generate_pb2 as pb

logger = logging.getLogger("raypaged")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
_DISCONNECT_POLL_S = 0.2
Body = TypeVar("Body", bound=BaseModel)


def build_app(
    routes: EngineRoutes,
    tenants: Tenants,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_requests: bool = True,
) -> FastAPI:
    app = FastAPI(title="raypaged", docs_url=None, redoc_url=None)
    install_handlers(app)

    async def parse(http: Request, body_type: type[Body]) -> Body:
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_body_bytes} bytes")
        raw = await http.body()
        if len(raw) > max_body_bytes:
            raise APIError(413, f"request body of {len(raw)} bytes exceeds the limit of {max_body_bytes} bytes")
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}") from None
        try:
            return body_type.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param) from None

    async def generate(http: Request, body_type: type[CompletionRequest] | type[ChatCompletionRequest]) -> Response:
        gate = tenants.authenticate(http.headers.get("authorization"))
        body = await parse(http, body_type)
        chat = body_type is ChatCompletionRequest
        if not chat and body.echo:
            raise APIError(400, "echo is not supported", "echo")
        model, stub = routes.resolve(body.model)
        prompts = body.prompts()
        num_logprobs = body.num_logprobs
        priority = gate.tenant.priority + body.priority
        try:
            requests = [
                body.generate_request(model, p, num_logprobs, body.resolved_max_tokens, priority) for p in prompts
            ]
        except (ValueError, TypeError) as exc:  # a value the wire format cannot hold
            raise APIError(400, str(exc)) from None
        shape = ResponseShape(chat, model, body.n, num_logprobs is not None)
        await gate.admit()
        calls = [stub.Generate(r) for r in requests]
        try:
            for call in calls:  # the first message says the engine accepted the request
                await call.read()
        except BaseException:
            _cancel(calls)
            gate.release()
            raise
        if log_requests:
            logger.info("request %s: model=%s tenant=%s prompts=%d n=%d stream=%s", shape.id, model,
                        gate.tenant.name, len(prompts), body.n, body.stream)
        if body.stream:
            writer = ChunkWriter(shape, len(prompts), body.include_usage)
            return StreamingResponse(_sse(calls, writer, gate), media_type="text/event-stream")
        try:
            return JSONResponse(await _unless_disconnected(http, _collect(calls, Accumulator(shape, len(prompts)))))
        finally:
            _cancel(calls)
            gate.release()

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        return await generate(http, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        return await generate(http, ChatCompletionRequest)

    @app.get("/v1/models")
    async def models(http: Request) -> dict:
        tenants.authenticate(http.headers.get("authorization"))
        cards = []
        for name in routes.targets:
            info = await routes.model_info(name)
            card = {"id": name, "object": "model", "created": 0, "owned_by": "raypaged", "root": name}
            if info is not None:
                card["max_model_len"] = info.max_model_len
            cards.append(card)
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health() -> Response:
        problem = await routes.health()
        if problem is not None:
            return APIError(503, problem).response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        families = await routes.metric_families()
        registry = CollectorRegistry()
        registry.register(_Families(families))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(http: Request) -> dict:
        tenants.authenticate(http.headers.get("authorization"))
        body = await parse(http, TokenizeBody)
        model, stub = routes.resolve(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        request = pb.TokenizeRequest(model=model, add_special_tokens=body.add_special_tokens)
        if body.messages is not None:
            turns = [pb.ChatMessage(role=m.role, content=m.text()) for m in body.messages]
            request.messages.CopyFrom(pb.ChatMessages(messages=turns))
        else:
            request.text = body.prompt
        response = await stub.Tokenize(request)
        return {"count": len(response.token_ids), "max_model_len": response.max_model_len,
                "tokens": list(response.token_ids)}

    @app.post("/detokenize")
    async def detokenize(http: Request) -> dict:
        tenants.authenticate(http.headers.get("authorization"))
        body = await parse(http, DetokenizeBody)
        model, stub = routes.resolve(body.model)
        response = await stub.Detokenize(pb.DetokenizeRequest(model=model, token_ids=body.tokens))
        return {"prompt": response.text}

    return app


class _Families:
    """A one-shot collector of already-gathered metric families."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self) -> list:
        return self._families


def _cancel(calls: list[grpc.aio.UnaryStreamCall]) -> None:
    for call in calls:
        call.cancel()


async def _responses(calls: list[grpc.aio.UnaryStreamCall]) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """Every call's responses as they come, tagged with the call's index; cancels them all when left."""
    queue: asyncio.Queue[tuple[int, pb.GenerateResponse | grpc.aio.AioRpcError | None]] = asyncio.Queue()

    async def pump(index: int, call: grpc.aio.UnaryStreamCall) -> None:
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                queue.put_nowait((index, response))
        except grpc.aio.AioRpcError as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(calls)]
    try:
        remaining = len(calls)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, grpc.aio.AioRpcError):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        _cancel(calls)


async def _collect(calls: list[grpc.aio.UnaryStreamCall], accumulator: Accumulator) -> dict:
    async with contextlib.aclosing(_responses(calls)) as responses:
        async for index, response in responses:
            accumulator.add(index, response)
    return accumulator.body()


async def _unless_disconnected(http: Request, work: asyncio.Future | object) -> dict:
    """Await ``work``; if the client goes away first, cancel it (which aborts the requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http.is_disconnected():
                raise APIError(400, "client disconnected")
    finally:
        task.cancel()


def _event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def _sse(calls: list[grpc.aio.UnaryStreamCall], writer: ChunkWriter, gate: TenantGate) -> AsyncIterator[str]:
    """The stream's server-sent events, ending in ``data: [DONE]``; leaving it early aborts the requests."""
    try:
        for chunk in writer.role_chunks():
            yield _event(chunk)
        async with contextlib.aclosing(_responses(calls)) as responses:
            async for index, response in responses:
                for chunk in writer.chunks(index, response):
                    yield _event(chunk)
        if (usage_chunk := writer.usage_chunk()) is not None:
            yield _event(usage_chunk)
    except grpc.aio.AioRpcError as exc:
        yield _event(from_grpc(exc).body())
    finally:
        _cancel(calls)
        gate.release()
    yield _event("[DONE]")

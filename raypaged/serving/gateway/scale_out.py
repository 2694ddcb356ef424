"""vLLM's scale-out endpoints (``--enable-scale-out``): render, generate tokens in and tokens out, derender, abort.

``POST /v1/completions/render``, ``/v1/chat/completions/render``, ``/v1/messages/render`` and
``/v1/responses/render`` take the bodies of ``/v1/completions``, ``/v1/chat/completions``, ``/v1/messages`` and
``/v1/responses`` (the last two as the chat request those routes run them as), run what those run before
generating (the same checks and chat template, then the engine's ``Render``: its input processor, as
``Generate``'s) and answer vLLM's ``GenerateRequest`` (completions: one per prompt, in a list).
``POST /inference/v1/generate`` runs a ``GenerateRequest`` and answers vLLM's ``GenerateResponse``, or its
stream; ``POST /inference/v1/abort_requests`` aborts the requests it started, by their ids. The derender
endpoints (``scale_out_derender.py``) turn its tokens back into the OpenAI routes' answers. A rendered request
generates exactly what its body does on the OpenAI route, and derendered, answers what that route does.

Without the flag every one of these paths answers 403, as vLLM's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from raypaged.serving.client import EngineClient
from raypaged.serving.gateway.anthropic import MessagesRequest
from raypaged.serving.gateway.calls import Slot, cancel, header_request_id, metadata, start, unless_disconnected
from raypaged.serving.gateway.drain import Drain
from raypaged.serving.gateway.engines import EngineRoutes
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.openai_responses import Responder, ResponsesRequest
from raypaged.serving.gateway.output_log import OutputLog, OutputLogging
from raypaged.serving.gateway.reasoning import ReasoningParser
from raypaged.serving.gateway.responses import ResponseShape, engine_request_ids, response_id
from raypaged.serving.gateway.scale_out_answer import GenerateAnswer, collect, events
from raypaged.serving.gateway.scale_out_derender import add_derender_routes
from raypaged.serving.gateway.scale_out_derender_body import DerenderChatBody, DerenderCompletionBody
from raypaged.serving.gateway.scale_out_request import GenerateBody, generate_request_json, parse_context_json
from raypaged.serving.gateway.schemas import ChatCompletionRequest, CompletionRequest, Parse, body_doc
from raypaged.serving.gateway.sse import EventStream
from raypaged.serving.gateway.tool_parsers import ToolParser
from raypaged.serving.gateway.tools import ToolPlan
from raypaged.serving.proto import generate_pb2 as pb

logger = logging.getLogger("raypaged")

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
SCALE_OUT_PATHS = (
    "/v1/completions/render",
    "/v1/chat/completions/render",
    "/v1/messages/render",
    "/v1/responses/render",
    "/v1/completions/derender",
    "/v1/chat/completions/derender",
    GENERATE_PATH,
    ABORT_PATH,
)
DISABLED_MESSAGE = (
    "Scale-out endpoints are disabled. Restart raypaged serve (or raypaged gateway) with --enable-scale-out to "
    "enable them."
)
_aborting: set[asyncio.Task[None]] = set()  # aborts under way (a task is only weakly held by the loop)
_LOGGED_IDS = 8  # an abort's log line names at most this many of its ids


EngineRequests = Callable[
    [CompletionRequest | ChatCompletionRequest],
    Awaitable[tuple[str, EngineClient, ToolPlan | None, list[pb.GenerateRequest]]],
]
ShapeOf = Callable[[Request, CompletionRequest | ChatCompletionRequest, str, ToolPlan | None], Awaitable[ResponseShape]]


@dataclass(frozen=True, slots=True)
class GatewayParts:
    """What the scale-out routes use of the gateway's (``app.build_app``): its engines, drain, body parser, the
    OpenAI routes' engine requests and answer shape of a body, the chat request a Messages request runs as and
    a chat request of a dict (checked as the Responses route checks its own), and the flags that shape answers."""

    routes: EngineRoutes
    drain: Drain
    parse: Parse
    engine_requests: EngineRequests
    response_shape: ShapeOf
    messages_chat: Callable[[Request, MessagesRequest], Awaitable[tuple[ChatCompletionRequest, int | None]]]
    chat_request: Callable[[dict], ChatCompletionRequest]
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None
    response_role: str = "assistant"
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details (--enable-prompt-tokens-details)
    tokens_as_ids: bool = False  # output_mode text: logprobs name tokens "token_id:{id}"
    sse_keep_alive_s: float = 0.0
    log_requests: bool = False
    output_logging: OutputLogging | None = None
    # the reasoning format of an answer whose chat template got these variables (the server's defaults under them)
    reasoning_for: Callable[[Mapping[str, Any]], ReasoningParser | None] = lambda variables: None


class AbortRequestsBody(BaseModel):
    """vLLM's ``AbortRequestsRequest``: the ids ``/inference/v1/generate`` answered with (``generate-tokens-...``)."""

    model_config = ConfigDict(extra="forbid")

    request_ids: str | list[str]


# the request bodies of the scale-out routes that are not the OpenAI routes' own (add_scale_out_routes)
SCALE_OUT_BODIES = (GenerateBody, AbortRequestsBody, DerenderChatBody, DerenderCompletionBody)


def add_disabled_scale_out_routes(app: FastAPI) -> None:
    """Every scale-out path answers 403 with vLLM's message (in this server's words)."""

    async def disabled() -> JSONResponse:
        error = {"message": DISABLED_MESSAGE, "type": "PermissionDeniedError", "param": None, "code": 403}
        return JSONResponse({"error": error}, status_code=403)

    for path in SCALE_OUT_PATHS:
        app.add_api_route(path, disabled, methods=["POST"], include_in_schema=False)


def add_scale_out_routes(app: FastAPI, parts: GatewayParts) -> None:
    """The scale-out routes, each documenting its body (``SCALE_OUT_BODIES``: the schemas that are not the OpenAI
    routes' own) in the app's OpenAPI document."""

    async def rendered(
        http: Request, body: CompletionRequest | ChatCompletionRequest, request_id: str | None = None
    ) -> list[pb.GenerateRequest]:
        """The body's engine requests, engine-ready (``request_id``: their id, else the OpenAI route's)."""
        for name, asked in (
            ("echo", body.echo),
            ("use_beam_search", body.use_beam_search),
            ("mm_processor_kwargs", bool(body.mm_processor_kwargs)),  # for images, which render refuses
        ):
            if asked:
                raise APIError(
                    400, f"{name} is not supported by the render endpoints: a GenerateRequest cannot carry it", name
                )
        _, stub, _, requests = await parts.engine_requests(body)
        chat = isinstance(body, ChatCompletionRequest)
        base = request_id or response_id(chat, body.request_id or header_request_id(http))
        for request, engine_request_id in zip(requests, engine_request_ids(base, len(requests))):
            request.request_id = engine_request_id
        engine_metadata = metadata(http)
        answers = await asyncio.gather(*(stub.Render(r, metadata=engine_metadata) for r in requests))
        return [answer.request for answer in answers]

    async def render_chat(http: Request, body: ChatCompletionRequest) -> dict:
        [request] = await rendered(http, body)
        return generate_request_json(request, body.stream, body.stream_options, parse_context_json(body))

    @app.post("/v1/completions/render", openapi_extra=body_doc(CompletionRequest))
    async def render_completion(http: Request) -> list[dict]:
        body = await parts.parse(http, CompletionRequest)
        return [generate_request_json(r, body.stream, body.stream_options) for r in await rendered(http, body)]

    @app.post("/v1/chat/completions/render", openapi_extra=body_doc(ChatCompletionRequest))
    async def render_chat_completion(http: Request) -> dict:
        return await render_chat(http, await parts.parse(http, ChatCompletionRequest))

    @app.post("/v1/messages/render", openapi_extra=body_doc(MessagesRequest))
    async def render_messages(http: Request) -> dict:
        chat, _ = await parts.messages_chat(http, await parts.parse(http, MessagesRequest))
        return await render_chat(http, chat)

    @app.post("/v1/responses/render", openapi_extra=body_doc(ResponsesRequest))
    async def render_responses(http: Request) -> dict:
        """A Responses request's chat request, rendered under the response's id (vLLM's: no parse context)."""
        body = await parts.parse(http, ResponsesRequest)
        if body.previous_response_id is not None:
            raise APIError(
                400,
                "previous_response_id is not supported by the stateless render endpoint.",
                "previous_response_id",
            )
        responder = Responder(body, [])
        [request] = await rendered(http, parts.chat_request(responder.chat_body()), responder.id)
        return generate_request_json(request, body.stream, None)

    @app.post(GENERATE_PATH, openapi_extra=body_doc(GenerateBody))
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
            chat = _derender_shape(body, model, request, parts) if body.output_mode == "derender" else None
            calls = await start(slot, http, stub, [request], parts.drain)
        except BaseException:
            slot.release()
            raise
        stream_options = body.stream_options if body.stream else None
        answer = GenerateAnswer(
            request_id,
            model,
            request,
            body.output_mode,
            parts.tokens_as_ids,
            parts.prompt_tokens_details,
            bool(stream_options and stream_options.include_usage),
            bool(stream_options and stream_options.continuous_usage_stats),
            chat,
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

            return EventStream(events(calls, answer, slot, parts.drain, log), cleanup, None, parts.sse_keep_alive_s)
        try:
            whole = await unless_disconnected(http, collect(calls, answer, parts.drain, log))
        finally:
            cancel(calls)
            slot.release()
        return JSONResponse(whole)

    @app.post(ABORT_PATH, openapi_extra=body_doc(AbortRequestsBody))
    async def abort_requests(http: Request) -> Response:
        """Aborts, in the background, the requests ``/inference/v1/generate`` started under these ids (each
        engine finds a tenant's own only); answers 200 at once, with no body."""
        body = await parts.parse(http, AbortRequestsBody)
        ids = [body.request_ids] if isinstance(body.request_ids, str) else body.request_ids
        task = asyncio.create_task(_abort(parts.routes.engines(), ids, metadata(http)))
        _aborting.add(task)
        task.add_done_callback(_aborting.discard)
        return Response(status_code=200)

    add_derender_routes(app, parts)


def _derender_shape(body: GenerateBody, model: str, request: pb.GenerateRequest, parts: GatewayParts) -> ResponseShape:
    """Output mode ``derender``: the chat answer's shape, as the chat route makes it of the rendered chat request
    (its ``parse_context``; without one, on a server with no parser, a plain message)."""
    context = body.parse_context
    if context is None:
        if parts.tool_parser is not None or parts.reasoning_parser is not None:
            raise APIError(
                400,
                "output_mode derender needs parse_context on this server, which parses answers "
                "(--tool-call-parser or --reasoning-parser); send the one /v1/chat/completions/render wrote",
                "parse_context",
            )
        tools = None
        include_reasoning, as_ids = True, False
    else:
        tools = context.tool_plan(parts.tool_parser)
        include_reasoning, as_ids = context.include_reasoning, bool(context.return_tokens_as_token_ids)
    # deepseek_v3's thinking: as the rendered request's template variables (and the server's defaults) say
    reasoning = parts.reasoning_parser if context is None else parts.reasoning_for(context.chat_template_kwargs)
    return ResponseShape(
        True,
        model,
        request.sampling.n or 1,
        request.HasField("logprobs"),
        tools=tools,
        role=parts.response_role,
        reasoning=reasoning,
        include_reasoning=include_reasoning,
        token_ids_as_text=as_ids or parts.tokens_as_ids,
        token_ids=True,  # each stream chunk's
    )


async def _abort(engines: list[EngineClient], request_ids: list[str], engine_metadata: tuple | None) -> None:
    """Every engine aborts the caller's requests of these ids; one log line says how many were running."""
    request = pb.AbortRequest(request_ids=request_ids)
    answers = await asyncio.gather(
        *(engine.Abort(request, metadata=engine_metadata) for engine in engines), return_exceptions=True
    )
    shown = ",".join(request_ids[:_LOGGED_IDS]) + (
        f" (+{len(request_ids) - _LOGGED_IDS})" if len(request_ids) > _LOGGED_IDS else ""
    )
    for failed in (a for a in answers if isinstance(a, BaseException)):
        logger.warning("abort of %s failed on an engine: %s", shown, failed)
    num_aborted = sum(a.num_aborted for a in answers if not isinstance(a, BaseException))
    logger.info("abort of %s: %d running or queued, aborted", shown, num_aborted)

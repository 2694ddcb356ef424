"""The OpenAI-compatible routes (completions, chat completions, responses, models, health, metrics, tokenize; the
embeddings in ``embeddings.py``, classification, scores and reranking in ``scoring.py``) and Anthropic's Messages
API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.middleware.cors import CORSMiddleware

from raypaged import __version__
from raypaged.inputs.limits import check_count
from raypaged.serving.client import EngineClient, StreamCall
from raypaged.serving.gateway.anthropic import CountTokensRequest, MessagesRequest
from raypaged.serving.gateway.anthropic_events import MessagesAnswer
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
from raypaged.serving.gateway.efforts import AUTO, DisabledThinking
from raypaged.serving.gateway.embeddings import EmbeddingBody, PoolingBody, add_embedding_routes
from raypaged.serving.gateway.engines import EngineRoutes
from raypaged.serving.gateway.errors import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    APIError,
    from_grpc,
    install_handlers,
    route_path,
)
from raypaged.serving.gateway.fingerprint import Fingerprints
from raypaged.serving.gateway.guard import DEFAULT_AUTH_EXEMPT_PATHS, Guard, HostCheck, host_check_needed
from raypaged.serving.gateway.openai_responses import Responder, ResponsesRequest, ResponseStore
from raypaged.serving.gateway.output_log import OutputLog, OutputLogging
from raypaged.serving.gateway.pooled import PoolingRunner, check_serves
from raypaged.serving.gateway.reasoning import ReasoningParser
from raypaged.serving.gateway.response_events import ResponseEvents, fed_events, sse_event
from raypaged.serving.gateway.responses import (
    LARGE_ANSWER,
    Accumulator,
    ChunkWriter,
    ResponseShape,
    answer_json,
    engine_request_ids,
    no_pause,
)
from raypaged.serving.gateway.scale_out import (
    SCALE_OUT_BODIES,
    GatewayParts,
    add_disabled_scale_out_routes,
    add_scale_out_routes,
)
from raypaged.serving.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    LoadLoRAAdapterBody,
    TokenizeBody,
    UnloadLoRAAdapterBody,
    add_body_schemas,
    body_doc,
)
from raypaged.serving.gateway.scoring import ClassifyBody, RerankBody, ScoreBody, add_scoring_routes
from raypaged.serving.gateway.sse import EventStream, sse_data
from raypaged.serving.gateway.tenants import Tenants
from raypaged.serving.gateway.tool_parsers import ToolParser
from raypaged.serving.gateway.tools import ToolPlan
from raypaged.serving.proto import generate_pb2 as pb

logger = logging.getLogger("raypaged")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024
_DISCONNECT_POLL_S = 0.2
Body = TypeVar("Body", bound=BaseModel)
Event = TypeVar("Event")


def build_app(
    routes: EngineRoutes,
    tenants: Tenants,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_requests: bool = True,
    drain: Drain | None = None,
    auth_exempt_paths: tuple[str, ...] = DEFAULT_AUTH_EXEMPT_PATHS,
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
    bind_host: str = "127.0.0.1",
    allowed_hosts: tuple[str, ...] | None = None,
    allowed_origins: tuple[str, ...] = (),
    allowed_methods: tuple[str, ...] = ("*",),
    allowed_headers: tuple[str, ...] = ("*",),
    allow_credentials: bool = False,
    tool_parser: ToolParser | None = None,
    response_role: str = "assistant",
    prompt_tokens_details: bool = False,
    force_include_usage: bool = False,
    request_id_headers: bool = False,
    reasoning_parser: ReasoningParser | None = None,
    openapi_docs: bool = True,
    return_tokens_as_token_ids: bool = False,
    tokenizer_info_endpoint: bool = False,
    exclude_tools_when_tool_choice_none: bool = False,
    fingerprint_mode: str = "full",
    fingerprint_value: str | None = None,
    log_error_stack: bool = False,
    sse_keep_alive_s: float = 0.0,
    output_logging: OutputLogging | None = None,
    scale_out: bool = False,
    reasoning_effort_map: Mapping[str, str] | None = None,
    default_chat_template_kwargs: Mapping[str, Any] | None = None,
    disabled_thinking_effort: str = AUTO,
) -> FastAPI:
    """The gateway's routes; ``drain`` (one per gateway) refuses and ends requests at shutdown.

    Middleware, outermost first: the ``Host`` check (see ``guard.py``; ``bind_host`` is the
    listening address), CORS (only with ``allowed_origins``), then the ``Guard``. ``tool_parser``
    finds the tool calls of ``tool_choice: "auto"`` (``None``: such requests are refused; one whose markers are
    special tokens, DeepSeek's or Kimi's, has those requests keep them in the text, as harmony's below);
    ``response_role`` is the role of chat answers; ``prompt_tokens_details`` adds usage's cached
    tokens, ``force_include_usage`` a usage chunk to every stream, ``request_id_headers`` the
    ``X-Request-Id`` response header (vLLM's flags of those names); ``reasoning_parser`` splits
    chat answers' reasoning into ``reasoning_content``, as each request's template variables shape it (DeepSeek-V3.1's
    thinks only when they say so); one whose markers are special tokens (harmony's, Mistral's) has chat requests
    keep them in the text, and refuse ``skip_special_tokens: true``; ``openapi_docs`` False (vLLM's
    ``--disable-fastapi-docs``): no ``/openapi.json`` (the Swagger and ReDoc pages are never served);
    ``return_tokens_as_token_ids``: every request's logprobs name tokens ``token_id:{id}``;
    ``tokenizer_info_endpoint``: ``GET /tokenizer_info`` is served (vLLM's ``--enable-tokenizer-info-endpoint``);
    ``exclude_tools_when_tool_choice_none``: a chat request with ``tool_choice: "none"`` renders without its tools;
    ``fingerprint_mode`` and ``fingerprint_value``: the answers' ``system_fingerprint`` (``fingerprint.py``);
    ``log_error_stack``: error responses are logged with their exception's stack; ``sse_keep_alive_s``: a
    stream idle that long gets a keep-alive comment (0: none); ``output_logging`` (with ``log_requests``): what
    each request generated is logged too; ``scale_out`` (vLLM's ``--enable-scale-out``): the render endpoints and
    ``/inference/v1/generate`` are served (``scale_out.py``); ``reasoning_effort_map`` and
    ``disabled_thinking_effort``: vLLM's ``--reasoning-effort-map`` and ``--anthropic-disabled-thinking-effort``
    (``efforts.py``).
    """
    if max_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be at least 1, got {max_body_bytes}")
    if max_prompts_per_request < 1:
        raise ValueError(f"--max-prompts-per-request must be at least 1, got {max_prompts_per_request}")
    drain = drain or Drain(0)
    fingerprints = Fingerprints(routes, fingerprint_mode, fingerprint_value)
    disabled_thinking = DisabledThinking(disabled_thinking_effort)
    responses_store = ResponseStore()
    started = int(time.time())  # the models' "created"
    app = FastAPI(
        title="raypaged", docs_url=None, redoc_url=None, openapi_url="/openapi.json" if openapi_docs else None
    )
    install_handlers(app, log_error_stack)
    app.add_middleware(
        Guard, tenants=tenants, drain=drain, exempt_paths=auth_exempt_paths, allowed_origins=allowed_origins
    )
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=allowed_methods,
            allow_headers=allowed_headers,
            allow_credentials=allow_credentials,
        )
    if host_check_needed(bind_host, allowed_hosts):
        app.add_middleware(HostCheck, allowed_hosts=allowed_hosts or ())

    async def read_body(http: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed ``max_body_bytes``."""
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(http: Request, body_type: type[Body], raw: bytes | None = None) -> Body:
        """The request's body (``raw``: already read) as a ``body_type``."""
        raw = await read_body(http) if raw is None else raw
        try:
            return _parse_json(raw, body_type)
        except RecursionError:  # json and pydantic recurse once per level of nesting
            raise APIError(400, "request body is not valid JSON: it nests too deeply") from None

    async def generate(
        http: Request,
        body_type: type[CompletionRequest]
        | type[ChatCompletionRequest]
        | type[ResponsesRequest]
        | type[MessagesRequest],
        raw: bytes | None = None,
    ) -> Response:
        slot = Slot(http.state.tenant_gate, drain)
        try:
            parsed = await parse(http, body_type, raw)
            if isinstance(parsed, MessagesRequest):
                chat_body, cache_block_size = await messages_chat(http, parsed)
                answer = MessagesAnswer(cache_block_size)
                return await generate_in(slot, http, chat_body, answer, cached_tokens=True)
            if not isinstance(parsed, ResponsesRequest):
                return await generate_in(slot, http, parsed)
            tenant = slot.gate.tenant.name
            history: list[dict] = []
            if parsed.previous_response_id is not None:
                history = responses_store.get(tenant, parsed.previous_response_id, "previous_response_id").conversation
            responder = Responder(parsed, history)
            stored = _StoredResponse(responder, responses_store, tenant)
            return await generate_in(slot, http, _validated(responder.chat_body(), ChatCompletionRequest), stored)
        except BaseException:
            slot.release()
            raise

    async def prefix_cache_block_size(model: str | None) -> int | None:
        """Tokens per block of the prefix cache of the model a Messages request names; ``None``: it runs without
        one."""
        name, _ = await routes.find(model)
        info = await routes.answered_info(name)
        return info.block_size if info.enable_prefix_caching else None

    async def messages_chat(http: Request, body: MessagesRequest) -> tuple[ChatCompletionRequest, int | None]:
        """The chat request a Messages request runs as, and its model's prefix-cache block size (``None``: none)."""
        cache_block_size = await prefix_cache_block_size(body.model)
        effort = await disabled_effort(http, body)
        chat = _validated(
            body.chat_body(reasoning_parser is not None, cache_block_size is not None, effort), ChatCompletionRequest
        )
        return chat, cache_block_size

    def rendered(body: ChatCompletionRequest) -> tuple[ToolPlan | None, list[dict]]:
        """A chat request's tool plan, and its prompt as the chat template takes it."""
        tools = body.tool_plan(tool_parser)
        hidden = exclude_tools_when_tool_choice_none and tools is not None and tools.mode == "none"
        return tools, body.prompts(None if hidden else tools, reasoning_effort_map)

    async def disabled_effort(http: Request, body: CountTokensRequest) -> str:
        """The ``reasoning_effort`` of a Messages request whose thinking is disabled (``efforts.DisabledThinking``:
        with ``auto``, its model's chat template is probed with a one-turn conversation, once)."""
        if body.thinking is None or body.thinking.type != "disabled":
            return "none"  # not read
        name, stub = await routes.find(body.model)

        async def render(effort: str) -> list[int] | None:
            turn = {"role": "user", "content": "Hi"}
            probe = _validated({"model": name, "messages": [turn], "reasoning_effort": effort}, ChatCompletionRequest)
            _, [prompt] = rendered(probe)
            try:
                request = pb.TokenizeRequest(model=name, messages=prompt["messages"])
                answer = await stub.Tokenize(request, metadata=metadata(http))
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                return None  # the template refuses the effort
            return list(answer.token_ids)

        return await disabled_thinking.effort_for(name, render)

    def reasoning_for(variables: Mapping[str, Any]) -> ReasoningParser | None:
        """The reasoning format of an answer whose chat template got ``variables`` over the server's defaults
        (DeepSeek-V3.1's thinks only when they say so)."""
        if reasoning_parser is None:
            return None
        return reasoning_parser.for_template({**(default_chat_template_kwargs or {}), **variables})

    def request_reasoning(body: ChatCompletionRequest) -> ReasoningParser | None:
        """The reasoning format of a chat request's answers."""
        return reasoning_for(body.template_variables(reasoning_effort_map))

    def special_tokens_reader(tools: ToolPlan | None) -> str | None:
        """The parser (as its flag names it) that reads markers which are special tokens in a chat answer with
        ``tools``, so the answer's text keeps special tokens; ``None``: none does."""
        if reasoning_parser is not None and reasoning_parser.special_tokens:
            return f"--reasoning-parser {reasoning_parser.name}"
        if tools is not None and tools.mode == "auto" and tools.parser is not None and tools.parser.special_tokens:
            return f"--tool-call-parser {tools.parser.name}"
        return None

    async def engine_requests(
        body: CompletionRequest | ChatCompletionRequest,
    ) -> tuple[str, EngineClient, ToolPlan | None, list[pb.GenerateRequest]]:
        """The model that answers ``body``, its engine, the body's tool plan, and one engine request per prompt."""
        model, stub = await routes.find(body.model)
        await check_serves(routes, model, None)
        check_count("prompt", body.num_prompts, max_prompts_per_request, "max_prompts_per_request", "prompts")
        tools, prompts = rendered(body) if isinstance(body, ChatCompletionRequest) else (None, body.prompts())
        num_logprobs = body.num_logprobs
        constraint = body.constraint(tools)
        if constraint is not None and isinstance(body, ChatCompletionRequest):
            reasoning = request_reasoning(body)
            if not body.include_reasoning or (reasoning is not None and not reasoning.thinking):
                constraint.in_reasoning = True  # from the first token
        try:
            requests = [
                body.generate_request(model, p, num_logprobs, body.resolved_max_tokens, body.priority, constraint)
                for p in prompts
            ]
        except (ValueError, TypeError) as exc:  # a value the wire format cannot hold
            raise APIError(400, str(exc)) from None
        reader = special_tokens_reader(tools) if isinstance(body, ChatCompletionRequest) else None
        if reader is not None:
            if body.skip_special_tokens and "skip_special_tokens" in body.model_fields_set:
                raise APIError(
                    400,
                    f"skip_special_tokens true would erase the markers that {reader} reads in the answer; "
                    "send the request without it",
                    "skip_special_tokens",
                )
            for request in requests:
                request.stopping.skip_special_tokens = False
        return model, stub, tools, requests

    async def response_shape(
        http: Request,
        body: CompletionRequest | ChatCompletionRequest,
        model: str,
        tools: ToolPlan | None,
        cached_tokens: bool = False,
    ) -> ResponseShape:
        """The OpenAI answer's shape for ``body``, answered by ``model`` with the body's ``tools``
        (``cached_tokens``: see ``generate_in``)."""
        chat = isinstance(body, ChatCompletionRequest)
        return ResponseShape(
            chat,
            model,
            body.n,
            body.num_logprobs is not None,
            tools=tools,
            role=response_role,
            echo=body.echo and not chat,
            echo_only=body.echo_only,
            chat_echo=body.echoed(response_role) if isinstance(body, ChatCompletionRequest) else "",
            prompt_logprobs=body.prompt_logprobs is not None,
            prompt_tokens_details=prompt_tokens_details or cached_tokens,
            request_id=body.request_id or header_request_id(http),
            reasoning=request_reasoning(body) if isinstance(body, ChatCompletionRequest) else None,
            include_reasoning=body.include_reasoning if isinstance(body, ChatCompletionRequest) else True,
            token_ids_as_text=body.return_tokens_as_token_ids or return_tokens_as_token_ids,
            token_ids=bool(body.return_token_ids),
            fingerprint=await fingerprints.of(model),
        )

    async def generate_in(
        slot: Slot,
        http: Request,
        body: CompletionRequest | ChatCompletionRequest,
        translation: _Translation | None = None,
        cached_tokens: bool = False,
    ) -> Response:
        """Answers the request (``translation``: another API's, run as this chat request); ``slot`` is released
        when the response (or its stream) ends. ``cached_tokens``: usage gives ``prompt_tokens_details`` whatever
        the gateway's ``prompt_tokens_details`` says (the translation reads them)."""
        gate = slot.gate
        model, stub, tools, requests = await engine_requests(body)
        shape = await response_shape(http, body, model, tools, cached_tokens)
        for request, request_id in zip(requests, engine_request_ids(shape.id, len(requests))):
            request.request_id = request_id
            if len(requests) > 1:  # its prompts share the batch as one request (the scheduler's FCFS fairness)
                request.parent_request_id = shape.id
        calls = await start(slot, http, stub, requests, drain)
        if log_requests:
            logger.info(
                "request %s: model=%s tenant=%s prompts=%d n=%d stream=%s%s",
                shape.id,
                model,
                gate.tenant.name,
                len(requests),
                body.n,
                body.stream,
                f" session={body.session_id}" if body.session_id is not None else "",
            )
        headers = {"X-Request-Id": shape.request_id or shape.id} if request_id_headers else None
        log = OutputLog(output_logging, shape.id, body.n, body.stream) if log_requests and output_logging else None
        if body.stream:
            writer = ChunkWriter(shape, len(requests), body.include_usage or force_include_usage, body.continuous_usage)
            path = route_path(http.scope)

            def cleanup() -> None:
                cancel(calls)
                slot.release()

            if translation is not None:
                events = translation.events(_chunks(calls, writer, slot, drain, log, path, _as_is), model)
                return EventStream(events, cleanup, headers, sse_keep_alive_s)
            return EventStream(_sse(calls, writer, slot, drain, log, path), cleanup, headers, sse_keep_alive_s)
        try:
            work = _collect(calls, Accumulator(shape, len(requests)), drain, log)
            accumulator = await unless_disconnected(http, work)
        finally:
            cancel(calls)
            slot.release()
        if accumulator.size() < LARGE_ANSWER:
            content = _answer_json(accumulator, translation, no_pause)
        else:  # off the event loop, which every other stream's chunks wait on, letting it run after each choice
            content = await asyncio.to_thread(_answer_json, accumulator, translation, _let_the_loop_run)
        return Response(content, media_type="application/json", headers=headers)

    @app.post("/v1/responses", openapi_extra=body_doc(ResponsesRequest))
    async def responses(http: Request) -> Response:
        return await generate(http, ResponsesRequest)

    @app.post(MESSAGES_PATH, openapi_extra=body_doc(MessagesRequest))
    async def messages(http: Request) -> Response:
        """Anthropic's Messages API, run as a chat completion (``anthropic.py``)."""
        return await generate(http, MessagesRequest)

    @app.post(COUNT_TOKENS_PATH, openapi_extra=body_doc(CountTokensRequest))
    async def count_tokens(http: Request) -> dict:
        """The input tokens of a Messages request: its chat request's prompt, as the chat template renders it."""
        body = await parse(http, CountTokensRequest)
        prefix_caching = await prefix_cache_block_size(body.model) is not None
        effort = await disabled_effort(http, body)
        chat = _validated(body.chat_body(reasoning_parser is not None, prefix_caching, effort), ChatCompletionRequest)
        model, stub = await routes.find(chat.model)
        _, [prompt] = rendered(chat)
        request = pb.TokenizeRequest(model=model, messages=prompt["messages"])
        response = await stub.Tokenize(request, metadata=metadata(http))
        return {"input_tokens": len(response.token_ids)}

    @app.get("/v1/responses/{response_id}")
    async def stored_response(http: Request, response_id: str) -> dict:
        return responses_store.get(http.state.tenant_gate.tenant.name, response_id).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        http: Request, response_id: str, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> dict:
        return responses_store.get(http.state.tenant_gate.tenant.name, response_id).input_page(order, limit, after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(http: Request, response_id: str) -> dict:
        responses_store.delete(http.state.tenant_gate.tenant.name, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/completions", openapi_extra=body_doc(CompletionRequest))
    async def completions(http: Request) -> Response:
        return await generate(http, CompletionRequest)

    @app.post("/v1/chat/completions", openapi_extra=body_doc(ChatCompletionRequest))
    async def chat_completions(http: Request) -> Response:
        return await generate(http, ChatCompletionRequest)

    @app.post("/invocations")  # vLLM's (SageMaker's): a chat completion or a completion, by its body
    async def invocations(http: Request) -> Response:
        raw = await read_body(http)
        return await generate(http, _invocation_type(raw), raw)

    async def card(name: str) -> dict:
        """A served model as OpenAI's (and vLLM's) model object."""
        info = await routes.model_info(name)
        card = {
            "id": name,
            "object": "model",
            "created": started,
            "owned_by": "raypaged",
            "root": info.root if info is not None and info.root else name,
            "parent": info.parent if info is not None and info.parent else None,
        }
        if info is not None:
            card["max_model_len"] = info.max_model_len
        card["permission"] = [
            {
                "id": f"modelperm-{name}",
                "object": "model_permission",
                "created": started,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ]
        return card

    @app.get("/v1/models")
    async def models() -> dict:
        await routes.refresh_adapters()
        return {"object": "list", "data": [await card(name) for name in [*routes.targets, *routes.adapters]]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        await routes.find(model)  # a 404 for a name no engine serves
        return await card(model)

    @app.post("/v1/load_lora_adapter", openapi_extra=body_doc(LoadLoRAAdapterBody))
    async def load_lora_adapter(http: Request) -> Response:
        """vLLM's runtime adapter loading (behind the API key, as every path but the probes)."""
        body = await parse(http, LoadLoRAAdapterBody)
        engines = routes.engines_for_base(body.base_model_name)
        await routes.client(engines).LoadLoRAAdapter(
            pb.LoadLoRAAdapterRequest(
                lora_name=body.lora_name, lora_path=body.lora_path, base_model_name=body.base_model_name or ""
            ),
            metadata=metadata(http),
        )
        routes.adapters[body.lora_name] = engines
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=body_doc(UnloadLoRAAdapterBody))
    async def unload_lora_adapter(http: Request) -> Response:
        body = await parse(http, UnloadLoRAAdapterBody)
        if body.lora_name not in routes.adapters:
            await routes.refresh_adapters()
        engines = routes.adapters.get(body.lora_name)
        if engines is None:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name")
        await routes.client(engines).UnloadLoRAAdapter(
            pb.UnloadLoRAAdapterRequest(lora_name=body.lora_name), metadata=metadata(http)
        )
        del routes.adapters[body.lora_name]
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/sleep")
    async def sleep(http: Request) -> Response:
        """vLLM's sleep mode: every engine frees its weights and KV cache (``?level=1`` or ``2``); its running requests
        wait for the wake-up, new ones get 503."""
        level = http.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise APIError(400, f"level must be 1 or 2, got {level!r}", "level")
        for engine in routes.engines():
            await engine.Sleep(pb.SleepRequest(level=int(level)), metadata=metadata(http))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(http: Request) -> Response:
        """Every engine brings back the ``?tags=`` (``weights``, then ``kv_cache``; none: both)."""
        tags = http.query_params.getlist("tags")
        for engine in routes.engines():
            await engine.WakeUp(pb.WakeUpRequest(tags=tags), metadata=metadata(http))
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping(http: Request) -> dict:
        answers = [await e.IsSleeping(pb.IsSleepingRequest(), metadata=metadata(http)) for e in routes.engines()]
        return {"is_sleeping": any(answer.is_sleeping for answer in answers)}

    @app.get("/health")
    @app.get("/ping")  # vLLM's (and SageMaker's) name for the same probe
    async def health() -> Response:
        if drain.draining:
            return drain.refusal().response()
        problem = await routes.health()
        if problem is not None:
            return APIError(503, problem).response()
        return Response(status_code=200)

    @app.get("/load")  # vLLM's: the generation requests in flight (every one is tracked here)
    async def load() -> dict:
        return {"server_load": drain.num_in_flight}

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        families = await routes.metric_families()
        registry = CollectorRegistry()
        registry.register(_Families(families))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", openapi_extra=body_doc(TokenizeBody))
    async def tokenize(http: Request) -> dict:
        body = await parse(http, TokenizeBody)
        model, stub = await routes.find(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        request = pb.TokenizeRequest(model=model, return_token_strs=body.return_token_strs)
        if body.add_special_tokens is not None:
            request.add_special_tokens = body.add_special_tokens
        if body.messages is not None:
            request.messages.CopyFrom(body.conversation())
        else:
            assert body.prompt is not None  # exactly one of prompt and messages is given
            request.text = body.prompt
        response = await stub.Tokenize(request, metadata=metadata(http))
        return {
            "count": len(response.token_ids),
            "max_model_len": response.max_model_len,
            "tokens": list(response.token_ids),
            "token_strs": list(response.token_strs) if body.return_token_strs else None,
        }

    if tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info(http: Request, model: str | None = None) -> dict:
            name, stub = await routes.find(model)
            request = pb.TokenizerInfoRequest(model=name)
            response = await stub.TokenizerInfo(request, metadata=metadata(http))
            return json.loads(response.config_json)

    @app.post("/detokenize", openapi_extra=body_doc(DetokenizeBody))
    async def detokenize(http: Request) -> dict:
        body = await parse(http, DetokenizeBody)
        model, stub = await routes.find(body.model)
        request = pb.DetokenizeRequest(model=model, token_ids=body.tokens)
        response = await stub.Detokenize(request, metadata=metadata(http))
        return {"prompt": response.text}

    pooling = PoolingRunner(routes, drain, parse, max_prompts_per_request, log_requests, request_id_headers)
    add_embedding_routes(app, pooling)
    add_scoring_routes(app, pooling)
    if scale_out:
        parts = GatewayParts(
            routes,
            drain,
            parse,
            engine_requests,
            response_shape,
            messages_chat,
            lambda given: _validated(given, ChatCompletionRequest),
            tool_parser,
            reasoning_parser,
            response_role,
            prompt_tokens_details,
            return_tokens_as_token_ids,
            sse_keep_alive_s,
            log_requests,
            output_logging,
            reasoning_for,
        )
        add_scale_out_routes(app, parts)
    else:
        add_disabled_scale_out_routes(app)

    add_body_schemas(
        app,
        [
            CompletionRequest,
            ChatCompletionRequest,
            ResponsesRequest,
            MessagesRequest,
            CountTokensRequest,
            EmbeddingBody,
            PoolingBody,
            ClassifyBody,
            ScoreBody,
            RerankBody,
            TokenizeBody,
            DetokenizeBody,
            LoadLoRAAdapterBody,
            UnloadLoRAAdapterBody,
            *(SCALE_OUT_BODIES if scale_out else ()),
        ],
    )
    return app


def _invocation_type(raw: bytes) -> type[CompletionRequest] | type[ChatCompletionRequest]:
    """What an ``/invocations`` body is: a chat completion (it has ``messages``) or a completion (``prompt``);
    a body that is no JSON is left to the completion's parse to refuse."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return CompletionRequest
    if isinstance(data, dict) and "messages" in data:
        return ChatCompletionRequest
    if isinstance(data, dict) and "prompt" in data:
        return CompletionRequest
    raise APIError(
        400, "/invocations takes a chat completion request (with messages) or a completion request (with prompt)"
    )


def _parse_json(raw: bytes, body_type: type[Body]) -> Body:
    """``raw`` as a ``body_type``; anything else is a 400 naming what is wrong."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    try:  # "\ud800" escapes parse, but no UTF-8 text (nor the engine) can hold them
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise APIError(400, "request body is not valid JSON: a string holds an unpaired UTF-16 surrogate") from None
    return _validated(data, body_type)


def _validated(data: object, body_type: type[Body]) -> Body:
    """Parsed JSON as a ``body_type``; anything else is a 400 naming what is wrong."""
    try:
        return body_type.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param) from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


class _Families:
    """A one-shot collector of already-gathered metric families."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self) -> list:
        return self._families


async def _collect(
    calls: list[StreamCall], accumulator: Accumulator, drain: Drain, log: OutputLog | None
) -> Accumulator:
    async with contextlib.aclosing(merged_responses(calls, drain)) as responses:
        async for index, response in responses:
            accumulator.add(index, response)
            if log is not None:
                log.feed(index, response)
    if log is not None:
        log.finish()
    return accumulator


def _answer_json(accumulator: Accumulator, translation: _Translation | None, pause: Callable[[], None]) -> bytes:
    """The non-streaming answer's JSON (another API's, with ``translation``), with ``pause`` after each choice."""
    answer = accumulator.body(pause)
    return answer_json(translation.body(answer) if translation is not None else answer, pause)


def _let_the_loop_run() -> None:
    time.sleep(0)  # gives up the interpreter lock: the event loop runs until it waits for I/O again


async def _chunks(
    calls: list[StreamCall],
    writer: ChunkWriter,
    slot: Slot,
    drain: Drain,
    log: OutputLog | None,
    path: str,
    encode: Callable[[dict], Event],
    last: Event | None = None,
) -> AsyncGenerator[Event, None]:
    """The stream's chunks, each as ``encode`` makes it, an error's body (as the route at ``path`` answers) last
    if one ends it, then ``last`` if given; leaving it early aborts the requests."""
    try:
        for chunk in writer.role_chunks():
            yield encode(chunk)
        async with contextlib.aclosing(merged_responses(calls, drain)) as responses:
            async for index, response in responses:
                if log is not None:
                    log.feed(index, response)
                for chunk in writer.chunks(index, response):
                    yield encode(chunk)
        if log is not None:
            log.finish()
        if (usage_chunk := writer.usage_chunk()) is not None:
            yield encode(usage_chunk)
    except grpc.aio.AioRpcError as exc:
        yield encode(from_grpc(exc).body_at(path))
    except APIError as exc:
        yield encode(exc.body_at(path))
    finally:
        cancel(calls)
        slot.release()
    if last is not None:
        yield last


def _as_is(chunk: dict) -> dict:
    return chunk


def _sse(
    calls: list[StreamCall], writer: ChunkWriter, slot: Slot, drain: Drain, log: OutputLog | None, path: str
) -> AsyncGenerator[str, None]:
    """The stream's server-sent events, ending in ``data: [DONE]``; leaving it early aborts the requests."""
    return _chunks(calls, writer, slot, drain, log, path, sse_data, sse_data("[DONE]"))


class _Translation(Protocol):
    """Another API's request, run as a chat completion request: its answer made of the chat answer (``body``), its
    stream of the chat stream's chunks (``events``, server-sent events; ``model``: the model that answers)."""

    def body(self, chat: dict) -> dict: ...

    def events(self, chunks: AsyncGenerator[dict, None], model: str) -> AsyncIterator[str]: ...


@dataclass(slots=True)
class _StoredResponse:
    """A Responses API request (``Responder``); its response is stored, per tenant, once it completes."""

    responder: Responder
    store: ResponseStore
    tenant: str

    def body(self, chat: dict) -> dict:
        answer = self.responder.body(chat)
        self.store.keep(self.tenant, self.responder, answer)
        return answer

    async def events(self, chunks: AsyncGenerator[dict, None], model: str) -> AsyncIterator[str]:
        events = ResponseEvents(self.responder, model)
        for event in events.start():
            yield sse_event(event)
        async for sse in fed_events(chunks, events):
            yield sse
        if events.final is not None:
            self.store.keep(self.tenant, self.responder, events.final)

"""vLLM's embeddings API: ``POST /v1/embeddings`` (OpenAI's) and ``POST /pooling``, served by embedding models.

A body's ``input`` (a text, texts, token ids, or lists of them) or ``messages`` (one conversation, through the chat
template) becomes one engine ``Embed`` call per input, all running at once; the first to fail fails the request
and cancels the others. The request holds one tenant slot per input, counts in the drain and ends when the client
goes away, as a completion does. Every field but the ones below is refused by name.
"""

from __future__ import annotations

import base64
import logging
import struct
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from raypaged.inputs.limits import check_count
from raypaged.pooling_params import PoolingParams
from raypaged.serving.gateway.calls import Slot, admit, all_answered, header_request_id, unless_disconnected
from raypaged.serving.gateway.drain import Drain
from raypaged.serving.gateway.engines import EngineRoutes
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.responses import engine_request_ids
from raypaged.serving.gateway.schemas import (
    CacheSalt,
    ChatMessage,
    Int32,
    Parse,
    Prompts,
    RequestId,
    Unsigned,
    body_doc,
    chat_messages,
    check_chat_fields,
    count_prompts,
    split_prompts,
    unsupported_field,
)
from raypaged.serving.proto import generate_pb2 as pb

logger = logging.getLogger("raypaged")

_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs")


class EmbeddingBody(BaseModel):
    """vLLM's ``EmbeddingCompletionRequest`` (``input``) and ``EmbeddingChatRequest`` (``messages``) in one body."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: Prompts | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes, as OpenAI's
    dimensions: Annotated[Unsigned, Field(ge=1)] | None = None  # matryoshka models only
    user: str | None = None  # OpenAI's: the end user, for the client's own records
    # vLLM's extras
    truncate_prompt_tokens: Annotated[Int32, Field(ge=-1)] | None = None  # -1: as many as the context holds
    normalize: bool | None = None  # L2-normalize; None: the model's pooler's choice
    use_activation: bool | None = None  # vLLM's newer name of normalize
    priority: Int32 = 0
    request_id: RequestId | None = None
    cache_salt: CacheSalt | None = None
    add_special_tokens: bool | None = None  # input: unset = true; messages: only false (the template writes them)
    # with messages only
    add_generation_prompt: bool | None = None  # unset = false, as vLLM's EmbeddingChatRequest
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _fields(self) -> EmbeddingBody:
        for name in self.model_extra or ():
            raise unsupported_field(name)
        if (self.input is None) == (self.messages is None):
            raise APIError(400, "give exactly one of input or messages", "input")
        check_chat_fields(self, self.input is not None, "input", _CHAT_FIELDS)
        return self

    @property
    def num_inputs(self) -> int:
        """Inputs in the body (one engine request each), known without building them."""
        return 1 if self.input is None else count_prompts(self.input)

    def embed_requests(self, model: str) -> list[pb.EmbedRequest]:
        """One ``EmbedRequest`` for ``model`` per input (a conversation is one)."""
        try:
            params = PoolingParams(self.truncate_prompt_tokens, self.dimensions, self.normalize, self.use_activation)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        pooling: dict[str, Any] = {
            "truncate_prompt_tokens": params.truncate_prompt_tokens,
            "dimensions": params.dimensions,
            "normalize": params.wants_normalize,
        }
        common = {name: value for name, value in pooling.items() if value is not None}
        return [
            pb.EmbedRequest(model=model, priority=self.priority, cache_salt=self.cache_salt or "", **common, **one)
            for one in self._inputs()
        ]

    def _inputs(self) -> list[dict]:
        if self.messages is not None:
            conversation = chat_messages(
                self.messages,
                "",
                self.chat_template,
                self.chat_template_kwargs,
                bool(self.add_generation_prompt),
                bool(self.continue_final_message),
            )
            return [{"messages": conversation}]
        assert self.input is not None  # exactly one of input and messages is given
        special = {} if self.add_special_tokens is None else {"add_special_tokens": self.add_special_tokens}
        return [{**one, **special} if "text" in one else one for one in split_prompts(self.input, "input")]


class PoolingBody(EmbeddingBody):
    """vLLM's ``PoolingCompletionRequest`` and ``PoolingChatRequest``: an embedding body with its ``task``."""

    task: Literal["embed", "encode"] | None = None  # both the model's vector: it is an embedding model


async def check_serves(routes: EngineRoutes, model: str, embeddings: bool) -> None:
    """A 400 naming ``model`` when it does not serve the request's kind: ``embeddings`` from a generative model,
    generation from an embedding model (as its engine's ``Info`` says; an engine that does not answer decides)."""
    info = await routes.model_info(model)
    if info is None or info.embedding == embeddings:
        return
    if embeddings:
        raise APIError(
            400,
            f"The model `{model}` does not support the Embeddings API: it generates text; embeddings need an "
            "embedding model (--runner pooling)",
            "model",
        )
    raise APIError(
        400,
        f"The model `{model}` is an embedding model (--runner pooling): it serves /v1/embeddings and /pooling, "
        "not generation",
        "model",
    )


def add_embedding_routes(
    app: FastAPI,
    routes: EngineRoutes,
    drain: Drain,
    parse: Parse,
    max_prompts_per_request: int,
    log_requests: bool,
    request_id_headers: bool,
) -> None:
    """``/v1/embeddings`` and ``/pooling``; ``parse``, ``max_prompts_per_request``, ``log_requests`` and
    ``request_id_headers`` are the gateway's (``app.build_app``)."""

    async def pool(http: Request, body_type: type[EmbeddingBody], prefix: str, kind: str, key: str) -> Response:
        """The answer ``{prefix}-...`` of a ``body_type`` body: its vectors as ``{"object": kind, key: ...}``."""
        slot = Slot(http.state.tenant_gate, drain)
        try:
            body = await parse(http, body_type)
            model, stub = await routes.find(body.model)
            await check_serves(routes, model, embeddings=True)
            check_count("input", body.num_inputs, max_prompts_per_request, "max_prompts_per_request", "inputs")
            request_id = body.request_id or header_request_id(http)
            answer_id = f"{prefix}-{request_id or uuid.uuid4().hex}"
            requests = body.embed_requests(model)
            for request, engine_id in zip(requests, engine_request_ids(answer_id, len(requests))):
                request.request_id = engine_id
            engine_metadata = await admit(slot, http, len(requests), drain)
            if log_requests:
                tenant = slot.gate.tenant.name
                logger.info("request %s: model=%s tenant=%s inputs=%d", answer_id, model, tenant, len(requests))
            calls = [stub.Embed(request, metadata=engine_metadata) for request in requests]
            answers = await unless_disconnected(http, all_answered(calls, drain))
        finally:
            slot.release()
        num_tokens = sum(one.prompt_tokens for one in answers)
        data = [
            {"index": index, "object": kind, key: _encoded(one.embedding, body.encoding_format)}
            for index, one in enumerate(answers)
        ]
        answer = {
            "id": answer_id,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {
                "prompt_tokens": num_tokens,
                "total_tokens": num_tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }
        headers = {"X-Request-Id": request_id or answer_id} if request_id_headers else None
        return JSONResponse(answer, headers=headers)

    @app.post("/v1/embeddings", openapi_extra=body_doc(EmbeddingBody))
    async def embeddings(http: Request) -> Response:
        return await pool(http, EmbeddingBody, "embd", "embedding", "embedding")

    @app.post("/pooling", openapi_extra=body_doc(PoolingBody))
    async def pooling(http: Request) -> Response:
        return await pool(http, PoolingBody, "pool", "pooling", "data")


def _encoded(vector: Any, encoding_format: str) -> list[float] | str:
    """A vector as JSON carries it: its floats, or their little-endian float32 bytes in base64 (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return list(vector)

"""vLLM's embeddings API: ``POST /v1/embeddings`` (OpenAI's) and ``POST /pooling``, served by embedding models.

A body's ``input`` (a text, texts, token ids, or lists of them) or ``messages`` (one conversation, through the chat
template) becomes one engine ``Embed`` call per input (``pooled.py`` runs them). Every field but the ones below is
refused by name.
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, model_validator

from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.pooled import EMBEDDINGS, PoolingFields, PoolingRunner
from raypaged.serving.gateway.schemas import (
    ChatMessage,
    Prompts,
    Unsigned,
    body_doc,
    chat_messages,
    check_chat_fields,
    count_prompts,
    split_prompts,
)
from raypaged.serving.proto import generate_pb2 as pb

_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs")


class InputBody(PoolingFields):
    """A pooling body of ``input`` (vLLM's ``CompletionRequestMixin``) or ``messages`` (its ``ChatRequestMixin``)."""

    input: Prompts | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # unset: true for input, false for messages (their template writes them)
    # with messages only
    add_generation_prompt: bool | None = None  # unset = false, as vLLM's pooling chat requests
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> InputBody:
        if (self.input is None) == (self.messages is None):
            raise APIError(400, "give exactly one of input or messages", "input")
        check_chat_fields(self, self.input is not None, "input", _CHAT_FIELDS)
        return self

    def counted(self) -> tuple[str, int]:
        return "input", 1 if self.input is None else count_prompts(self.input)

    def inputs(self) -> list[dict]:
        """Each input as an ``EmbedRequest``'s ``input`` (a conversation is one)."""
        special = {} if self.add_special_tokens is None else {"add_special_tokens": self.add_special_tokens}
        if self.messages is not None:
            conversation = chat_messages(
                self.messages,
                "",
                self.chat_template,
                self.chat_template_kwargs,
                bool(self.add_generation_prompt),
                bool(self.continue_final_message),
            )
            return [{"messages": conversation, **special}]
        assert self.input is not None  # exactly one of input and messages is given
        # token ids are used as they are: true, vLLM's default, asks nothing of them (as on completions)
        return [
            {**one, **special} if "text" in one or not self.add_special_tokens else one
            for one in split_prompts(self.input, "input")
        ]


class EmbeddingBody(InputBody):
    """vLLM's ``EmbeddingCompletionRequest`` (``input``) and ``EmbeddingChatRequest`` (``messages``) in one body."""

    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes, as OpenAI's
    dimensions: Annotated[Unsigned, Field(ge=1)] | None = None  # matryoshka models only
    normalize: bool | None = None  # vLLM's older name of use_activation; None: the model's pooler's choice

    @property
    def pooling_task(self) -> str:
        return "embed"

    def embed_requests(self, model: str, info: pb.ModelInfo | None) -> list[pb.EmbedRequest]:
        return self.pooled(model, self.pooling_task, self.inputs(), self.dimensions, self.normalize)


class PoolingBody(EmbeddingBody):
    """vLLM's ``PoolingCompletionRequest`` and ``PoolingChatRequest``: an embedding body with its ``task``."""

    task: Literal["embed", "encode"] | None = None  # both the model's vector: it is an embedding model

    @property
    def pooling_task(self) -> str:
        return self.task or "embed"


def add_embedding_routes(app: FastAPI, runner: PoolingRunner) -> None:
    """``/v1/embeddings`` and ``/pooling``."""

    async def pool(http: Request, body_type: type[EmbeddingBody], prefix: str, kind: str, key: str) -> Response:
        """The answer ``{prefix}-...`` of a ``body_type`` body: its vectors as ``{"object": kind, key: ...}``."""
        pooled = await runner.run(http, body_type, EMBEDDINGS, prefix)
        encoding = pooled.body.encoding_format
        data = [
            {"index": index, "object": kind, key: _encoded(one.embedding, encoding)}
            for index, one in enumerate(pooled.answers)
        ]
        return pooled.listed(data, sum(one.prompt_tokens for one in pooled.answers))

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

"""vLLM's pooling APIs at the gateway (embeddings, classification, scores, reranking): which model serves which, and
how a body runs.

A body becomes one engine ``Embed`` call per input, all running at once; the first to fail fails the request and
cancels the others. The request holds one tenant slot per call, counts in the drain and ends when the client goes
away, as a completion does.
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from raypaged.inputs.limits import check_count
from raypaged.pooling_params import PoolingParams
from raypaged.serving.gateway.calls import Slot, admit, all_answered, header_request_id, unless_disconnected
from raypaged.serving.gateway.drain import Drain
from raypaged.serving.gateway.engines import EngineRoutes
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.responses import engine_request_ids
from raypaged.serving.gateway.schemas import CacheSalt, Int32, Parse, RequestId, unsupported_field
from raypaged.serving.proto import generate_pb2 as pb

logger = logging.getLogger("raypaged")


def _scores_pairs(info: pb.ModelInfo) -> bool:
    """A cross-encoder (a classifier of one label) or an embedding model (the cosine similarity of two vectors)."""
    return info.pooling_task == "embed" or (info.pooling_task == "classify" and len(info.labels) == 1)


@dataclass(frozen=True, slots=True)
class PoolingApi:
    """One of vLLM's pooling APIs: its name and paths as refusals say them, what serves it, and whether a request
    needs its model's ``Info`` (``False``: an engine that does not answer decides)."""

    name: str
    paths: tuple[str, ...]
    needs: str
    serves: Callable[[pb.ModelInfo], bool]
    needs_info: bool = True


EMBEDDINGS = PoolingApi(
    "Embeddings API",
    ("/v1/embeddings", "/pooling"),
    "embeddings need an embedding model",
    lambda info: info.pooling_task == "embed",
    needs_info=False,
)
CLASSIFICATION = PoolingApi(
    "Classification API",
    ("/classify",),
    "classification needs a classifier",
    lambda info: info.pooling_task == "classify",
)
_PAIRS = "scores need a cross-encoder (a classifier of one label) or an embedding model"
SCORE = PoolingApi("Score API", ("/score",), _PAIRS, _scores_pairs)
RERANK = PoolingApi("Rerank API", ("/rerank",), _PAIRS, _scores_pairs)
_APIS = (EMBEDDINGS, CLASSIFICATION, SCORE, RERANK)


async def check_serves(routes: EngineRoutes, model: str, api: PoolingApi | None) -> pb.ModelInfo | None:
    """``model``'s ``Info`` (``None``: its engine did not answer), or a 400 naming ``model`` when it does not serve
    ``api`` (``None``: generation)."""
    info = await routes.model_info(model)
    if info is None or (info.pooling_task == "" if api is None else api.serves(info)):
        return info
    if api is None:
        paths = [path for one in _APIS if one.serves(info) for path in one.paths]
        listed = f"{', '.join(paths[:-1])} and {paths[-1]}" if len(paths) > 1 else paths[0]
        kind = "an embedding model" if info.pooling_task == "embed" else "a classifier"
        raise APIError(
            400, f"The model `{model}` is {kind} (--runner pooling): it serves {listed}, not generation", "model"
        )
    if info.pooling_task == "":
        kind = "it generates text"
    elif info.pooling_task == "embed":
        kind = "it is an embedding model"
    else:
        kind = f"it is a classifier of {len(info.labels)} label{'s' if len(info.labels) > 1 else ''}"
    raise APIError(
        400, f"The model `{model}` does not support the {api.name}: {kind}; {api.needs} (--runner pooling)", "model"
    )


class PoolingFields(BaseModel):
    """The fields of every pooling body (vLLM's ``PoolingBasicRequestMixin`` and ``use_activation``, those raypaged
    honours); any other field a body does not declare is refused by name."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    user: str | None = None  # OpenAI's: the end user, for the client's own records
    truncate_prompt_tokens: Annotated[Int32, Field(ge=-1)] | None = None  # -1: as many as the context holds
    use_activation: bool | None = None  # embeddings: L2-normalize; a classifier: softmax (sigmoid for one label)
    priority: Int32 = 0
    request_id: RequestId | None = None
    cache_salt: CacheSalt | None = None

    @model_validator(mode="after")
    def _known_fields(self) -> PoolingFields:
        for name in self.model_extra or ():
            raise unsupported_field(name)
        return self

    @abstractmethod
    def counted(self) -> tuple[str, int]:
        """The field holding the body's inputs and how many it holds, known without building them."""

    @abstractmethod
    def embed_requests(self, model: str, info: pb.ModelInfo | None) -> list[pb.EmbedRequest]:
        """The body's engine calls to ``model`` (``info``: its ``Info``, when the engine answered)."""

    def pooled(
        self,
        model: str,
        task: str,
        inputs: list[dict[str, Any]],
        dimensions: int | None = None,
        normalize: bool | None = None,
    ) -> list[pb.EmbedRequest]:
        """An ``EmbedRequest`` for ``model`` and ``task`` per input (its ``input`` oneof's field and value)."""
        try:
            params = PoolingParams(self.truncate_prompt_tokens, dimensions, normalize, self.use_activation, task)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        pooling: dict[str, Any] = {
            "truncate_prompt_tokens": params.truncate_prompt_tokens,
            "dimensions": params.dimensions,
            "normalize": params.wants_normalize,
        }
        common = {name: value for name, value in pooling.items() if value is not None}
        return [
            pb.EmbedRequest(
                model=model, task=task, priority=self.priority, cache_salt=self.cache_salt or "", **common, **one
            )
            for one in inputs
        ]


B = TypeVar("B", bound=PoolingFields)


@dataclass(frozen=True, slots=True)
class Pooled(Generic[B]):
    """A pooling request answered: its body, model (and its ``Info``), answer id and each call's answer, in order."""

    body: B
    model: str
    info: pb.ModelInfo | None
    answer_id: str
    answers: list[pb.EmbedResponse]
    headers: dict[str, str] | None

    def respond(self, fields: dict[str, Any]) -> JSONResponse:
        """The answer: its ``id``, then ``fields``."""
        return JSONResponse({"id": self.answer_id, **fields}, headers=self.headers)

    def listed(self, data: list[dict[str, Any]], num_tokens: int) -> JSONResponse:
        """The answer in OpenAI's list shape (the embeddings', vLLM's classification's and score's)."""
        usage = {
            "prompt_tokens": num_tokens,
            "total_tokens": num_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        }
        return self.respond(
            {"object": "list", "created": int(time.time()), "model": self.model, "data": data, "usage": usage}
        )


@dataclass(frozen=True, slots=True)
class PoolingRunner:
    """Runs pooling bodies; ``parse``, ``max_prompts_per_request``, ``log_requests`` and ``request_id_headers`` are
    the gateway's (``app.build_app``)."""

    routes: EngineRoutes
    drain: Drain
    parse: Parse
    max_prompts_per_request: int
    log_requests: bool
    request_id_headers: bool

    async def run(self, http: Request, body_type: type[B], api: PoolingApi, prefix: str) -> Pooled[B]:
        """The ``body_type`` body of ``http`` run for ``api``, answered as ``{prefix}-{request id}``."""
        slot = Slot(http.state.tenant_gate, self.drain)
        try:
            body = await self.parse(http, body_type)
            model, stub = await self.routes.find(body.model)
            info = await check_serves(self.routes, model, api)
            if info is None and api.needs_info:
                info = await self.routes.answered_info(model)
            param, count = body.counted()
            check_count(param, count, self.max_prompts_per_request, "max_prompts_per_request", "inputs")
            request_id = body.request_id or header_request_id(http)
            answer_id = f"{prefix}-{request_id or uuid.uuid4().hex}"
            requests = body.embed_requests(model, info)
            for request, engine_id in zip(requests, engine_request_ids(answer_id, len(requests))):
                request.request_id = engine_id
            engine_metadata = await admit(slot, http, len(requests), self.drain)
            if self.log_requests:
                tenant = slot.gate.tenant.name
                logger.info("request %s: model=%s tenant=%s inputs=%d", answer_id, model, tenant, len(requests))
            calls = [stub.Embed(request, metadata=engine_metadata) for request in requests]
            answers = await unless_disconnected(http, all_answered(calls, self.drain))
        finally:
            slot.release()
        headers = {"X-Request-Id": request_id or answer_id} if self.request_id_headers else None
        return Pooled(body, model, info, answer_id, answers, headers)

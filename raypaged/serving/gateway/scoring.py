"""vLLM's classification and scoring APIs: ``POST /classify`` (a classifier's class probabilities of each input),
``POST /score`` (a score per text pair) and ``POST /rerank`` (Jina's and Cohere's: documents ordered by their score
against a query).

A pair is scored by a cross-encoder (a classifier of one label), the two texts tokenized together as the
tokenizer's text pair, or by an embedding model, the cosine similarity of the two texts' vectors (a query scored
against many documents is embedded once). Each engine call runs as ``pooled.py`` runs them; every field but the
ones below is refused by name.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import model_validator

from raypaged.serving.gateway.embeddings import InputBody
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.pooled import CLASSIFICATION, RERANK, SCORE, PoolingFields, PoolingRunner
from raypaged.serving.gateway.schemas import Unsigned, body_doc
from raypaged.serving.proto import generate_pb2 as pb

SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")


class ClassifyBody(InputBody):
    """vLLM's ``ClassificationCompletionRequest`` (``input``) and ``ClassificationChatRequest`` (``messages``)."""

    def embed_requests(self, model: str, info: pb.ModelInfo | None) -> list[pb.EmbedRequest]:
        return self.pooled(model, "classify", self.inputs())


class _PairsBody(PoolingFields):
    """A body of text pairs to score: the first texts (one, against every second text, or one per second text)
    and the second texts, in the fields ``PAIR_FIELDS`` names."""

    PAIR_FIELDS: ClassVar[tuple[str, str]]

    @abstractmethod
    def pairs(self) -> tuple[list[str], list[str]]:
        """The first texts and the second texts."""

    @model_validator(mode="after")
    def _matched(self) -> _PairsBody:
        (firsts, seconds), (first, second) = self.pairs(), self.PAIR_FIELDS
        for texts, name in ((firsts, first), (seconds, second)):
            if not texts:
                raise APIError(400, f"{name} must not be empty", name)
        if len(firsts) > 1 and len(firsts) != len(seconds):
            raise APIError(
                400,
                f"Input lengths must be either 1:1, 1:N or N:N: {first} has {len(firsts)} texts and {second} "
                f"{len(seconds)}",
                first,
            )
        return self

    def counted(self) -> tuple[str, int]:
        return self.PAIR_FIELDS[1], len(self.pairs()[1])

    def embed_requests(self, model: str, info: pb.ModelInfo | None) -> list[pb.EmbedRequest]:
        """A cross-encoder's call per pair; an embedding model's per first text, then per second text."""
        assert info is not None  # the score and rerank APIs need it
        firsts, seconds = self.pairs()
        if info.pooling_task == "embed":
            return self.pooled(model, "embed", [{"text": text} for text in firsts + seconds])
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        pairs = [{"text_pair": pb.TextPair(text_1=a, text_2=b)} for a, b in zip(firsts, seconds, strict=True)]
        return self.pooled(model, "score", pairs)

    def scores(self, info: pb.ModelInfo, answers: list[pb.EmbedResponse]) -> list[tuple[float, int]]:
        """Each pair's score and prompt tokens (an embedding model's: both texts'), from the calls' ``answers``."""
        if info.pooling_task != "embed":
            return [(one.embedding[0], one.prompt_tokens) for one in answers]
        num_firsts = len(self.pairs()[0])
        firsts, seconds = answers[:num_firsts], answers[num_firsts:]
        if num_firsts == 1:
            firsts = firsts * len(seconds)
        return [
            (_cosine_similarity(a.embedding, b.embedding), a.prompt_tokens + b.prompt_tokens)
            for a, b in zip(firsts, seconds, strict=True)
        ]


class ScoreBody(_PairsBody):
    """vLLM's ``ScoreTextRequest``: ``text_1`` against ``text_2``, each a text or texts."""

    PAIR_FIELDS = ("text_1", "text_2")

    text_1: str | list[str]
    text_2: str | list[str]

    def pairs(self) -> tuple[list[str], list[str]]:
        return _listed(self.text_1), _listed(self.text_2)


class RerankBody(_PairsBody):
    """vLLM's ``RerankRequest``: ``documents`` scored against ``query``, the best ``top_n`` (0: all) answered."""

    PAIR_FIELDS = ("query", "documents")

    query: str
    documents: str | list[str]
    top_n: Unsigned = 0

    def pairs(self) -> tuple[list[str], list[str]]:
        return [self.query], _listed(self.documents)


def _listed(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else texts


def _cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """``a · b / (|a| |b|)``, as torch's ``cosine_similarity`` (its ``eps`` keeps a zero vector's at 0)."""
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / max(norms, 1e-8)


def add_scoring_routes(app: FastAPI, runner: PoolingRunner) -> None:
    """``/classify``, ``/score`` (and ``/v1/score``), ``/rerank`` (and ``/v1/rerank``, ``/v2/rerank``)."""

    @app.post("/classify", openapi_extra=body_doc(ClassifyBody))
    async def classify(http: Request) -> Response:
        pooled = await runner.run(http, ClassifyBody, CLASSIFICATION, "classify")
        assert pooled.info is not None  # the classification API needs it
        labels = pooled.info.labels
        data = [
            {
                "index": index,
                "label": labels[max(range(len(one.embedding)), key=one.embedding.__getitem__)],
                "probs": list(one.embedding),
                "num_classes": len(one.embedding),
            }
            for index, one in enumerate(pooled.answers)
        ]
        return pooled.listed(data, sum(one.prompt_tokens for one in pooled.answers))

    async def score(http: Request) -> Response:
        pooled = await runner.run(http, ScoreBody, SCORE, "score")
        assert pooled.info is not None  # the score API needs it
        scored = pooled.body.scores(pooled.info, pooled.answers)
        data = [{"index": index, "object": "score", "score": value} for index, (value, _) in enumerate(scored)]
        return pooled.listed(data, sum(num_tokens for _, num_tokens in scored))

    async def rerank(http: Request) -> Response:
        pooled = await runner.run(http, RerankBody, RERANK, "rerank")
        assert pooled.info is not None  # the rerank API needs it
        scored = pooled.body.scores(pooled.info, pooled.answers)
        documents = pooled.body.pairs()[1]
        ranked = sorted(range(len(scored)), key=lambda index: scored[index][0], reverse=True)  # ties keep order
        results = [
            {"index": index, "document": {"text": documents[index], "multi_modal": None}, "relevance_score": value}
            for index, (value, _) in ((index, scored[index]) for index in ranked[: pooled.body.top_n or None])
        ]
        num_tokens = sum(num_tokens for _, num_tokens in scored)
        usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
        return pooled.respond({"model": pooled.model, "usage": usage, "results": results})

    for path in SCORE_PATHS:
        app.post(path, openapi_extra=body_doc(ScoreBody))(score)
    for path in RERANK_PATHS:
        app.post(path, openapi_extra=body_doc(RerankBody))(rerank)

"""The engine server: one or more models, each an ``AsyncLLMEngine``, behind the gRPC service."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from raypaged.config import EngineConfig
from raypaged.engine.llm_engine import LLMEngine
from raypaged.serving.async_engine import AsyncLLMEngine, EngineDeadError
from raypaged.serving.channel import MESSAGE_SIZE_OPTIONS
from raypaged.serving.metrics import ServerMetrics
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc
from raypaged.serving.protocol import DeltaTracker, chat_prompt_ids, sampling_params_from_proto

logger = logging.getLogger("raypaged")
T = TypeVar("T")


@dataclass
class ServedModel:
    """One model: its engine and a tokenizer of its own for the asyncio side.

    Prompts are tokenized on one thread of the model's own (``off_loop``), never on
    the event loop or the engine thread, so a huge prompt stalls neither streams nor steps.
    """

    name: str
    engine: AsyncLLMEngine
    tokenizer: PreTrainedTokenizerBase
    _tokenizer_thread: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "tokenizer"))
    _max_token_bytes: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        # Without a normalizer, every token stands for at most this many bytes of the text.
        if self.tokenizer.is_fast and self.tokenizer.backend_tokenizer.normalizer is None:
            self._max_token_bytes = max(len(t.encode()) for t in self.tokenizer.get_vocab())

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    async def prompt_ids(self, text: str) -> list[int]:
        """The text's token ids as the engine would make them; a text that cannot fit is refused untokenized."""
        max_len = self.engine.config.max_model_len
        if self._max_token_bytes is not None:
            min_tokens = -(-len(text.encode()) // self._max_token_bytes)
            if min_tokens >= max_len:
                raise ValueError(
                    f"prompt has at least {min_tokens} tokens, which leaves no room to generate within "
                    f"max_model_len {max_len}"
                )
        return await self.off_loop(lambda: self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def info(self) -> pb.ModelInfo:
        config = self.engine.config
        return pb.ModelInfo(
            name=self.name,
            max_model_len=config.max_model_len,
            block_size=config.block_size,
            tensor_parallel_size=getattr(config, "tensor_parallel_size", 1),
            num_gpu_blocks=int(self.engine.stats()["num_gpu_blocks_total"]),
            device=config.resolved_device,
            dtype=config.resolved_dtype,
        )


class _Abort(Exception):
    """An RPC fails with this status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class EngineServicer(pb_grpc.TextGenerationServiceServicer):
    def __init__(self, models: dict[str, ServedModel], metrics: ServerMetrics) -> None:
        self.models = models
        self.metrics = metrics

    def _model(self, name: str) -> ServedModel:
        if not name:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"model is required; served models: {', '.join(self.models)}")
        model = self.models.get(name)
        if model is None:
            raise _Abort(
                grpc.StatusCode.NOT_FOUND, f"the model {name!r} does not exist; served models: {', '.join(self.models)}"
            )
        return model

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            model = self._model(request.model)
            engine = model.engine
            params = sampling_params_from_proto(request, engine.config.limits)
            text, token_ids = await _prompt(model, request)
            request_id = await engine.add_request(text, params, request.request_id or None, token_ids, request.priority)
        except _Abort as exc:
            await context.abort(exc.code, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        yield pb.GenerateResponse(request_id=request_id)
        tracker = DeltaTracker(request_id, params, model.tokenizer)
        finished = False
        try:
            async for output in engine.stream(request_id):
                finished = output.finished
                yield tracker.response(output)
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if not finished:
            yield tracker.aborted()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        ids = list(request.request_ids)
        return pb.AbortResponse(num_aborted=sum([await m.engine.abort(ids) for m in self.models.values()]))

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            model = self._model(request.model)
            if request.HasField("messages"):
                token_ids = await model.off_loop(chat_prompt_ids, model.tokenizer, request.messages)
            else:
                add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
                token_ids = await model.off_loop(
                    lambda: model.tokenizer(request.text, add_special_tokens=add_special)["input_ids"]
                )
        except _Abort as exc:
            await context.abort(exc.code, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(token_ids=token_ids, max_model_len=model.engine.config.max_model_len)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        try:
            model = self._model(request.model)
        except _Abort as exc:
            await context.abort(exc.code, str(exc))
        vocab_size = len(model.tokenizer)
        bad = [t for t in request.token_ids if t >= vocab_size]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token ids must be in [0, {vocab_size}), got {bad[0]}")
        return pb.DetokenizeResponse(text=model.tokenizer.decode(list(request.token_ids)))

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return pb.InfoResponse(models=[m.info() for m in self.models.values()])

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        failed = [name for name, m in self.models.items() if not m.engine.is_running]
        if failed:
            return pb.HealthResponse(
                status=pb.SERVING_STATUS_NOT_SERVING, message=f"engines not running: {', '.join(failed)}"
            )
        return pb.HealthResponse(status=pb.SERVING_STATUS_SERVING)

    async def Metrics(self, request: pb.MetricsRequest, context: grpc.aio.ServicerContext) -> pb.MetricsResponse:
        stats = [
            pb.ModelStats(name=name, stats={k: float(v) for k, v in m.engine.stats().items()})
            for name, m in self.models.items()
        ]
        return pb.MetricsResponse(models=stats, prometheus_text=self.metrics.exposition())


async def _prompt(model: ServedModel, request: pb.GenerateRequest) -> tuple[str | None, list[int]]:
    """The prompt's text (when it is one) and token ids."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text, await model.prompt_ids(request.text)
    if kind == "token_ids":
        return None, list(request.token_ids.ids)
    if kind == "messages":
        return None, await model.off_loop(chat_prompt_ids, model.tokenizer, request.messages)
    raise ValueError("a prompt is required: text, token_ids or messages")


class EngineServer:
    """Starts an engine per config and serves them all over gRPC on one port."""

    def __init__(self, configs: list[EngineConfig]) -> None:
        names = [c.served_model_name for c in configs]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must be distinct, got {names}")
        engines = {c.served_model_name: LLMEngine(c) for c in configs}
        device = configs[0].resolved_device
        self.metrics = ServerMetrics({name: self._stats_of(name) for name in engines}, device)
        self.models = {
            name: ServedModel(
                name,
                AsyncLLMEngine(engine, self.metrics.observer(name)),
                AutoTokenizer.from_pretrained(engine.config.model_path),
            )
            for name, engine in engines.items()
        }
        self._server: grpc.aio.Server | None = None

    def _stats_of(self, name: str):
        return lambda: self.models[name].engine.stats()

    async def start(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0 = a free port); returns the bound port."""
        self._server = grpc.aio.server(options=MESSAGE_SIZE_OPTIONS)
        pb_grpc.add_TextGenerationServiceServicer_to_server(EngineServicer(self.models, self.metrics), self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port}")
        await self._server.start()
        logger.info("gRPC engine server on %s:%d serving %s", host, bound, ", ".join(self.models))
        return bound

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
        for model in self.models.values():
            model.engine.shutdown()
            model.close()

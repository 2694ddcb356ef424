"""The engine server: one or more models, each an ``AsyncLLMEngine``, behind the gRPC service.

Callers authenticate as on HTTP, with metadata ``authorization: Bearer KEY`` (see
``gateway/tenants.py``); ``Health``, ``Info`` and ``Metrics`` stay open. With keys,
each tenant's request ids live in their own namespace (the engine sees
``TENANT/ID``; the open server's ids are used as they are), its requests hold
its gate's slots while they run, and its prefix-cache blocks are salted with its
name unless ``share_prefix_cache``. Every prompt's size is checked (``inputs/limits.py``)
before it is tokenized, rendered or copied.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import grpc
from transformers import PreTrainedTokenizerBase

from raypaged.config import SLEEP_MODE_OFF, EngineConfig, check_sleep_level, check_wake_tags
from raypaged.engine.async_llm_engine import (
    AsyncLLMEngine,
    EngineBusyError,
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
)
from raypaged.engine.input_processor import InputProcessor
from raypaged.engine.llm_engine import LLMEngine, ProcessedRequest
from raypaged.inputs.limits import (
    InputError,
    check_count,
    check_messages,
    check_priority,
    check_prompt_len,
    check_text,
    check_token_ids,
)
from raypaged.inputs.media import MediaError, MediaOptions, load_image_async
from raypaged.inputs.multimodal_input import MultiModalInput
from raypaged.lora.request import LoRARequest
from raypaged.model.default_model import DEFAULT_MODEL
from raypaged.outputs import RequestOutput
from raypaged.sampling_params import BeamSearchParams, SamplingParams
from raypaged.serving.channel import MESSAGE_SIZE_OPTIONS, PARAM_METADATA_KEY
from raypaged.serving.chat import chat_prompt_ids, chat_prompt_with_images, conversation_chars, has_images
from raypaged.serving.derender import derendered
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.tenants import AuthError, TenantGate, Tenants
from raypaged.serving.messages import AnyResponse, StreamMessages
from raypaged.serving.metrics import PREFIX as METRICS_PREFIX
from raypaged.serving.metrics import ServerMetrics
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc
from raypaged.serving.protocol import (
    DeltaTracker,
    beam_search_from_proto,
    pooling_params_from_proto,
    sampling_params_from_proto,
)

logger = logging.getLogger("raypaged")
T = TypeVar("T")
# what Generate checks first: the caller's gate, the model, its adapter, params, beam search, engine priority
_Checked = tuple[TenantGate, "ServedModel", LoRARequest | None, SamplingParams, BeamSearchParams | None, int]
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServedModel:
    """One model: its engine, and the engine's input processor for the asyncio side.

    Prompts are tokenized and rendered on one thread of the model's own (``off_loop``),
    never on the event loop or the engine thread, so a huge prompt stalls neither
    streams nor steps. The input processor has a tokenizer of its own (the engine
    thread detokenizes with another).
    """

    name: str
    engine: AsyncLLMEngine
    _tokenizer_thread: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "tokenizer"))

    @property
    def inputs(self) -> InputProcessor:
        return self.engine.engine.input_processor

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.inputs.tokenizer

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def info(self) -> pb.ModelInfo:
        """The model's static configuration; a LoRA adapter's is its base's (``Info`` names it)."""
        config = self.engine.config
        return pb.ModelInfo(
            name=self.name,
            max_model_len=config.resolved_max_model_len,
            block_size=config.block_size,
            tensor_parallel_size=getattr(config, "tensor_parallel_size", 1),
            num_gpu_blocks=int(self.engine.stats()["num_gpu_blocks_total"]),
            device=config.resolved_device,
            dtype=config.resolved_dtype,
            root=config.model or DEFAULT_MODEL,
            config_hash=config.config_hash(),
            enable_prefix_caching=config.enable_prefix_caching,
            embedding=config.pooler is not None,
            pooling_task=config.pooler.task if config.pooler is not None else "",
            labels=config.pooler.labels if config.pooler is not None else (),
        )


class _Abort(Exception):
    """An RPC fails with this status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# what ends a call early, and its status (the first matching type); APIError here is a tenant's 429, a busy
# engine (over a queue limit) is unavailable to this request as vLLM's (the gateway's 503: retry elsewhere)
_STATUS_CODES: list[tuple[type[Exception], grpc.StatusCode]] = [
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (APIError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (EngineBusyError, grpc.StatusCode.UNAVAILABLE),
    (RequestFailedError, grpc.StatusCode.INTERNAL),
    (RequestAbortedError, grpc.StatusCode.CANCELLED),  # Embed's request, aborted by an Abort call meanwhile
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
]
_REFUSED: tuple[type[Exception], ...] = (_Abort, *(kind for kind, _ in _STATUS_CODES))


async def _refuse(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """End the call with the status ``exc`` stands for; an ``InputError``'s field goes in the trailing metadata."""
    code = exc.code if isinstance(exc, _Abort) else next(c for kind, c in _STATUS_CODES if isinstance(exc, kind))
    param = exc.param if isinstance(exc, InputError) else None
    if param:
        context.set_trailing_metadata(((PARAM_METADATA_KEY, param),))
    await context.abort(code, str(exc))  # raises


class _Hold:
    """A ``Generate`` call's request id (in the server's in-flight set) and, once admitted, its tenant slot.

    ``let_go()`` gives both up, once, and only after the engine has let go of the request too:
    the id may be reused from then on and never meets this request's late outputs.
    """

    def __init__(
        self, in_flight: set[tuple[str, str]], key: tuple[str, str], gate: TenantGate, engine: AsyncLLMEngine
    ) -> None:
        self._in_flight = in_flight
        self._key = key
        self._gate = gate
        self._engine = engine
        self._admitted = False
        self._done = False
        in_flight.add(key)

    async def admit(self) -> None:
        await self._gate.admit()
        self._admitted = True

    async def let_go(self, in_engine: bool) -> None:
        """``in_engine``: the request may still be in the engine (it is aborted, and waited for)."""
        if self._done:
            return
        self._done = True
        if self._admitted:
            self._gate.release()
        try:
            if in_engine:
                await self._engine.abort([self._key[1]])
        finally:
            self._in_flight.discard(self._key)


class EngineServicer(pb_grpc.TextGenerationServiceServicer):
    def __init__(
        self,
        models: dict[str, ServedModel],
        metrics: ServerMetrics,
        tenants: Tenants,
        share_prefix_cache: bool,
        served_names: dict[str, str] | None = None,
    ) -> None:
        """``served_names`` maps every name a model answers to (its aliases too) to its own name."""
        self.models = models
        self.served_names = served_names or {name: name for name in models}
        self.metrics = metrics
        self.tenants = tenants
        self.share_prefix_cache = share_prefix_cache
        self._in_flight: set[tuple[str, str]] = set()  # (model, engine request id) of every running Generate
        self.adapters: dict[str, tuple[str, LoRARequest]] = {}  # LoRA adapter name -> (its model, the adapter)
        self._lora_ids = itertools.count(1)

    def _model(self, name: str) -> ServedModel:
        if name in self.adapters:
            return self.models[self.adapters[name][0]]
        if not name:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"model is required; served models: {', '.join(self.models)}"
            )
        model = self.models.get(self.served_names.get(name, ""))
        if model is None:
            raise _Abort(
                grpc.StatusCode.NOT_FOUND,
                f"the model {name!r} does not exist; served models: {', '.join(self.served_names)}",
            )
        return model

    def _caller(self, context: grpc.aio.ServicerContext) -> TenantGate:
        """The calling tenant's gate, from metadata ``authorization: Bearer KEY``; ``AuthError`` when refused."""
        metadata = dict(context.invocation_metadata() or ())
        return self.tenants.tenant_for(metadata.get("authorization"))

    def _engine_id(self, gate: TenantGate, request_id: str) -> str:
        """The engine's id of a caller's request id: tenants never see each other's ids."""
        return request_id if self.tenants.is_open else f"{gate.tenant.name}/{request_id}"

    def _cache_salt(self, gate: TenantGate, requested: str = "") -> str | None:
        """The request's prefix-cache namespace: its tenant's (unless all share, or there are no tenants),
        and its own ``cache_salt`` within that; a salted namespace starts with NUL, which no name does."""
        tenant = None if self.tenants.is_open or self.share_prefix_cache else gate.tenant.name
        if not requested:
            return tenant
        return "\x00" + json.dumps([tenant, requested])

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, messages: StreamMessages = pb
    ) -> AsyncIterator[AnyResponse]:
        """The request's responses as ``messages`` builds them: ``generate_pb2``'s for gRPC (the default,
        as gRPC calls the handler), the plain objects of ``messages.py`` for the in-process link."""
        try:
            gate, model, lora, params, beam, priority = self._checked(request, context)
            engine = model.engine
            request_id = request.request_id or uuid.uuid4().hex
            key = self._key(gate, model, request_id)
        except _REFUSED as exc:
            await _refuse(context, exc)
        hold = _Hold(self._in_flight, key, gate, engine)
        try:
            try:
                await hold.admit()
                images = embeds = None
                text: str | None
                token_ids: list[int] | None
                add_special = _add_special_tokens(request)  # (refused true for token ids and prompt_embeds)
                if request.WhichOneof("prompt") == "prompt_embeds":  # loaded and checked by the input processor
                    if request.echo:
                        raise InputError("echo", "echo needs the prompt's text: prompt_embeds have none")
                    text, token_ids, embeds = None, None, request.prompt_embeds
                elif request.WhichOneof("prompt") == "messages" and has_images(request.messages):
                    text, urls = await model.off_loop(chat_prompt_with_images, model.inputs, request.messages)
                    model.inputs.check_image_count(len(urls))  # before any is fetched
                    token_ids, images = None, await _images(urls, model.inputs.media_options)
                else:
                    text, token_ids = await _prompt(model, request, model.inputs.prompt_ids, add_special)
                await engine.add_request(
                    text,
                    params,
                    key[1],
                    token_ids,
                    priority,
                    cache_salt=self._cache_salt(gate, request.cache_salt),
                    lora_request=lora,
                    beam=beam,
                    multi_modal=MultiModalInput.of(  # rendered: the template wrote the special tokens, unless asked
                        images,
                        _processor_kwargs(request.mm_processor_kwargs_json),
                        rendered=not add_special,
                    ),
                    prompt_embeds=embeds,
                    owner=self._engine_id(gate, request.parent_request_id) if request.parent_request_id else None,
                )
            except _REFUSED as exc:
                await hold.let_go(in_engine=False)
                await _refuse(context, exc)
            yield messages.GenerateResponse(request_id=request_id)
            tracker = DeltaTracker(
                request_id,
                params.with_vocabulary_logprobs(engine.config.hf_config.vocab_size),
                model.tokenizer,
                messages,
                echo=request.echo,
                return_token_ids=request.return_token_ids,
            )
            last: RequestOutput | None = None
            error: Exception | None = None
            stream = engine.stream(key[1])
            assert isinstance(stream, AsyncGenerator)  # AsyncLLMEngine.stream is an async generator function
            async with contextlib.aclosing(stream) as outputs:
                try:
                    async for output in outputs:
                        if output.finished:
                            last = output
                            break
                        yield tracker.response(output)
                except (EngineDeadError, RequestFailedError, InputError) as exc:
                    error = exc
            # before the caller hears the end: from then on it may reuse the id, and the tenant its slot
            await hold.let_go(in_engine=last is None)
            if error is not None:
                await _refuse(context, error)
            yield tracker.aborted() if last is None else tracker.response(last)
        finally:
            await hold.let_go(in_engine=True)

    def _key(self, gate: TenantGate, model: ServedModel, request_id: str) -> tuple[str, str]:
        """What a call holds while it runs (its ``_Hold``'s): its model and engine request id; an id in use is
        refused."""
        key = (model.name, self._engine_id(gate, request_id))
        if key in self._in_flight:
            raise InputError("request_id", f"request_id {request_id!r} is already in use")
        return key

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        """One input's vector; the call holds its id and its tenant slot while the engine runs it, as ``Generate``
        does, and cancelling it aborts the request."""
        try:
            gate = self._caller(context)
            model = self._model(request.model)
            config = model.engine.config
            params = pooling_params_from_proto(request)
            check_priority(request.priority, config.scheduling_policy)
            priority = gate.tenant.engine_priority(request.priority)
            _check_text_size(config, request, "input")
            request_id = request.request_id or uuid.uuid4().hex
            key = self._key(gate, model, request_id)
        except _REFUSED as exc:
            await _refuse(context, exc)
        hold = _Hold(self._in_flight, key, gate, model.engine)
        try:
            try:
                await hold.admit()
                token_types = None  # BERT's pair: its second text embeds as token type 1
                add_special = _add_special_tokens(request, "input")
                if request.WhichOneof("input") == "text_pair":
                    pair_ids = partial(model.inputs.pair_ids, add_special_tokens=add_special)
                    text = None
                    token_ids, token_types = await model.off_loop(
                        pair_ids, request.text_pair.text_1, request.text_pair.text_2
                    )
                else:
                    tokenize = partial(_token_ids, model.tokenizer)
                    text, token_ids = await _prompt(model, request, tokenize, add_special, "input")
                salt = self._cache_salt(gate, request.cache_salt)
                output = await model.engine.encode(text, params, key[1], token_ids, priority, salt, token_types)
            except _REFUSED as exc:
                await hold.let_go(in_engine=False)
                await _refuse(context, exc)
            await hold.let_go(in_engine=False)  # finished: before the caller hears it (it may reuse the id)
        finally:
            await hold.let_go(in_engine=True)
        return pb.EmbedResponse(
            request_id=request_id, embedding=output.pooled.tolist(), prompt_tokens=output.num_prompt_tokens
        )

    def _checked(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> _Checked:
        """What ``Generate`` checks before it holds anything: the caller, the model (or adapter), the sampling
        params with the model's defaults, the beam search, the priority, the prompt's size."""
        gate = self._caller(context)
        model = self._model(request.model)
        lora = self.adapters[request.model][1] if request.model in self.adapters else None
        config = model.engine.config
        params = sampling_params_from_proto(request, config.limits, config.generation_defaults)
        beam = beam_search_from_proto(request, config.resolved_max_model_len)
        check_priority(request.priority, config.scheduling_policy)
        _check_prompt_size(model, request)
        return gate, model, lora, params, beam, gate.tenant.engine_priority(request.priority)

    async def Render(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.RenderResponse:
        """The request engine-ready, through the same checks and input processor as ``Generate``'s, which
        holds and queues nothing."""
        try:
            _, processed = await self._processed(request, context)
        except _REFUSED as exc:
            await _refuse(context, exc)
        return pb.RenderResponse(request=_engine_ready(request, processed))

    async def _processed(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[ServedModel, ProcessedRequest]:
        """``request`` through ``Generate``'s checks and input processor (a beam search is refused: its beams
        are not one request's)."""
        gate, model, lora, params, beam, priority = self._checked(request, context)
        if beam is not None:
            raise InputError("use_beam_search", "a beam search cannot be rendered: its beams run as one search")
        if request.WhichOneof("prompt") == "prompt_embeds":
            raise InputError("prompt_embeds", "prompt_embeds cannot be rendered: they are no token ids")
        text, token_ids = await _prompt(model, request, model.inputs.prompt_ids, _add_special_tokens(request))
        process = partial(
            model.engine.engine.process_request,
            request.request_id or "render",
            text,
            params,
            token_ids,
            priority,
            self._cache_salt(gate, request.cache_salt),
            lora,
        )
        executor = model.engine.executor_for(params, text, token_ids)
        return model, await asyncio.get_running_loop().run_in_executor(executor, process)

    async def Derender(self, request: pb.DerenderRequest, context: grpc.aio.ServicerContext) -> pb.DerenderResponse:
        """Generate's responses for tokens it generated, made again (``derender.py``): the request checked as
        ``Generate`` checks it, its prompt (when it has one) processed as ``Render`` does, for the context."""
        generate = request.request
        try:
            if generate.WhichOneof("prompt") is not None:
                model, processed = await self._processed(generate, context)
                prompt_token_ids, params = processed.core_request.prompt_token_ids, processed.params
            else:
                self._caller(context)
                model = self._model(generate.model)
                config = model.engine.config
                params = model.inputs.checked_params(
                    sampling_params_from_proto(generate, config.limits, config.generation_defaults)
                )
                prompt_token_ids = []
            config = model.engine.config
            check_count("completions", len(request.completions), config.limits.max_num_samples, "max_num_samples")
            for completion in request.completions:
                check_count("token_ids", len(completion.token_ids), config.resolved_max_model_len, "max_model_len")
                check_token_ids("token_ids", completion.token_ids, config.hf_config.vocab_size)
            responses = await model.off_loop(
                derendered,
                model.tokenizer,
                generate.request_id,
                prompt_token_ids,
                params,
                list(request.completions),
                generate.return_token_ids,
            )
        except _REFUSED as exc:
            await _refuse(context, exc)
        return pb.DerenderResponse(responses=responses)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Aborts the caller's own requests; another tenant's ids are not found."""
        try:
            gate = self._caller(context)
        except AuthError as exc:
            await _refuse(context, exc)
        ids = [self._engine_id(gate, request_id) for request_id in request.request_ids]
        return pb.AbortResponse(num_aborted=sum([await m.engine.abort(ids) for m in self.models.values()]))

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            self._caller(context)
            model = self._model(request.model)
            config = model.engine.config
            add_special = _add_special_tokens(request, "input")
            if request.HasField("messages"):
                _check_conversation(request.messages, config)
                token_ids = await model.off_loop(chat_prompt_ids, model.inputs, request.messages, add_special)
            else:
                check_text("prompt", len(request.text), config.limits, config.resolved_max_model_len)
                token_ids = await model.off_loop(model.inputs.tokenize, request.text, add_special)
        except _REFUSED as exc:
            await _refuse(context, exc)
        token_strs = model.inputs.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else []
        return pb.TokenizeResponse(
            token_ids=token_ids, max_model_len=config.resolved_max_model_len, token_strs=token_strs
        )

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        try:
            self._caller(context)
            model = self._model(request.model)
            config = model.engine.config
            check_count("tokens", len(request.token_ids), config.resolved_max_model_len, "max_model_len", "ids")
            token_ids = list(request.token_ids)
            check_token_ids("tokens", token_ids, config.hf_config.vocab_size)
        except _REFUSED as exc:
            await _refuse(context, exc)
        return pb.DetokenizeResponse(text=await model.off_loop(model.tokenizer.decode, token_ids))

    async def TokenizerInfo(
        self, request: pb.TokenizerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizerInfoResponse:
        """The model's tokenizer settings, as vLLM's ``/tokenizer_info`` gives them."""
        try:
            self._caller(context)
            model = self._model(request.model)
        except _REFUSED as exc:
            await _refuse(context, exc)
        info = tokenizer_info(model.inputs.tokenizer, model.engine.config.chat_template_text)
        return pb.TokenizerInfoResponse(config_json=json.dumps(info))

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        infos = []
        for name, own in self.served_names.items():  # an alias is listed as a model of its own
            info = self.models[own].info()
            info.name = name
            infos.append(info)
        for name, (own, lora) in self.adapters.items():
            info = self.models[own].info()
            info.name, info.root, info.parent = name, lora.lora_path, own
            infos.append(info)
        return pb.InfoResponse(models=infos)

    def add_adapter(self, name: str, path: str, base: str = "") -> LoRARequest:
        """Serve the PEFT adapter at ``path`` as model ``name`` on ``base`` (or the only LoRA-enabled
        model); reads and checks it (servers call it off the event loop)."""
        if not name or not path:
            raise InputError("lora_name" if not name else "lora_path", "both lora_name and lora_path are required")
        if name in self.adapters or name in self.served_names:
            raise _Abort(grpc.StatusCode.ALREADY_EXISTS, f"The lora adapter {name!r} has already been loaded.")
        if base:
            model = self._model(base)
        else:
            enabled = [m for m in self.models.values() if m.engine.config.enable_lora]
            if len(enabled) != 1:
                raise InputError(
                    "base_model_name", f"base_model_name is required: {len(enabled)} served models take LoRA adapters"
                )
            model = enabled[0]
        if not model.engine.config.enable_lora:
            raise _Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the model {model.name!r} runs without LoRA: start it with --enable-lora",
            )
        lora = LoRARequest(name, next(self._lora_ids), path)
        model.engine.engine.check_lora(lora)
        self.adapters[name] = (model.name, lora)
        logger.info("LoRA adapter %s loaded from %s on %s", name, path, model.name)
        return lora

    async def LoadLoRAAdapter(
        self, request: pb.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadLoRAAdapterResponse:
        try:
            self._caller(context)
            await asyncio.get_running_loop().run_in_executor(
                None, self.add_adapter, request.lora_name, request.lora_path, request.base_model_name
            )
        except _REFUSED as exc:
            await _refuse(context, exc)
        return pb.LoadLoRAAdapterResponse()

    async def UnloadLoRAAdapter(
        self, request: pb.UnloadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadLoRAAdapterResponse:
        try:
            self._caller(context)
            found = self.adapters.get(request.lora_name)
            if found is None:
                raise _Abort(grpc.StatusCode.NOT_FOUND, f"The lora adapter {request.lora_name!r} cannot be found.")
            own, lora = found
            engine = self.models[own].engine
            try:
                await engine.call(lambda: engine.engine.remove_lora(lora.lora_int_id))
            except InputError as exc:
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
            del self.adapters[request.lora_name]
            logger.info("LoRA adapter %s unloaded", request.lora_name)
        except _REFUSED as exc:
            await _refuse(context, exc)
        return pb.UnloadLoRAAdapterResponse()

    def _sleepers(self, name: str) -> list[ServedModel]:
        """The models a sleep call is about: ``name``'s, or every one; FAILED_PRECONDITION for one without sleep
        mode (before any of them changes)."""
        models = [self._model(name)] if name else list(self.models.values())
        off = [m.name for m in models if not m.engine.config.enable_sleep_mode]
        if off:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, f"{SLEEP_MODE_OFF} (model {', '.join(off)})")
        return models

    async def Sleep(self, request: pb.SleepRequest, context: grpc.aio.ServicerContext) -> pb.SleepResponse:
        try:
            self._caller(context)
            models = self._sleepers(request.model)
            check_sleep_level(request.level or 1)  # 0: unset, vLLM's default level
            for model in models:
                await model.engine.sleep(request.level or 1)
        except _REFUSED as exc:
            await _refuse(context, exc)
        return pb.SleepResponse(is_sleeping=True)

    async def WakeUp(self, request: pb.WakeUpRequest, context: grpc.aio.ServicerContext) -> pb.SleepResponse:
        try:
            self._caller(context)
            models = self._sleepers(request.model)
            check_wake_tags(request.tags)  # before any engine wakes
            for model in models:
                await model.engine.wake_up(list(request.tags) or None)
        except _REFUSED as exc:
            await _refuse(context, exc)
        return pb.SleepResponse(is_sleeping=any(m.engine.is_sleeping() for m in models))

    async def IsSleeping(self, request: pb.IsSleepingRequest, context: grpc.aio.ServicerContext) -> pb.SleepResponse:
        try:
            models = [self._model(request.model)] if request.model else list(self.models.values())
        except _REFUSED as exc:
            await _refuse(context, exc)
        return pb.SleepResponse(is_sleeping=any(m.engine.is_sleeping() for m in models))

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


def _check_conversation(messages: pb.ChatMessages, config: EngineConfig) -> None:
    """A conversation's turns and characters within the limits; the characters are only counted for few turns."""
    turns = messages.messages
    num_chars = conversation_chars(messages) if len(turns) <= config.limits.max_chat_messages else 0
    check_messages(len(turns), num_chars, config.limits, config.resolved_max_model_len)


def _check_prompt_size(model: ServedModel, request: pb.GenerateRequest) -> None:
    """The prompt within the limits, before it is tokenized, rendered or copied."""
    config = model.engine.config
    _check_text_size(config, request, "prompt")
    if request.WhichOneof("prompt") == "token_ids" and not request.HasField("truncate_prompt_tokens"):  # else the
        check_prompt_len(len(request.token_ids.ids), config.resolved_max_model_len)  # engine checks it once cut


def _check_text_size(config: EngineConfig, request: pb.GenerateRequest | pb.EmbedRequest, oneof: str) -> None:
    """The text or conversation of the request's ``oneof`` (its prompt, an ``Embed``'s input) within the limits,
    before it is tokenized or rendered; token ids pass (their caller checks them); nothing given is refused."""
    kind = request.WhichOneof(oneof)
    if kind == "text":
        check_text(oneof, len(request.text), config.limits, config.resolved_max_model_len)
    elif kind == "text_pair":
        pair = request.text_pair
        check_text(oneof, len(pair.text_1) + len(pair.text_2), config.limits, config.resolved_max_model_len)
    elif kind == "messages":
        _check_conversation(request.messages, config)
    elif kind not in ("token_ids", "prompt_embeds"):  # embeddings: bounded by the message size, checked when loaded
        raise InputError(oneof, f"{oneof} is required: {_INPUT_KINDS[oneof]}")


_INPUT_KINDS = {
    "prompt": "text, token_ids, messages or prompt_embeds",
    "input": "text, token_ids, messages or text_pair",
}
_TOKENIZER_FILES = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")  # paths on this host, left out


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """The tokenizer's settings as it was made with them (``init_kwargs``, without file paths, added
    tokens as their text), ``tokenizer_class``, and ``chat_template`` when the server has its own."""
    info = {
        k: _plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if k not in _TOKENIZER_FILES
    }
    info["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        info["chat_template"] = chat_template
    return info


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it: an added token as its text, containers item by item, the rest as text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _token_ids(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool) -> list[int]:
    """The token ids of a text."""
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def _engine_ready(request: pb.GenerateRequest, processed: ProcessedRequest) -> pb.GenerateRequest:
    """``request`` as ``Render`` answers it: its prompt the token ids the core got, no truncation left to do,
    and the values the engine resolved set where the request left them to the model's defaults."""
    ready = pb.GenerateRequest()
    ready.CopyFrom(request)
    ready.token_ids.CopyFrom(pb.TokenIds(ids=processed.core_request.prompt_token_ids))
    ready.ClearField("truncate_prompt_tokens")
    ready.ClearField("truncation_side")
    params = processed.params
    ready.sampling.temperature = params.temperature
    ready.sampling.top_p = params.top_p
    ready.sampling.repetition_penalty = params.repetition_penalty
    ready.stopping.max_tokens = processed.core_request.max_tokens
    return ready


def _processor_kwargs(text: str) -> Any:
    """A request's ``mm_processor_kwargs`` (JSON; empty: None), checked as an object by the input processor."""
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise InputError("mm_processor_kwargs", "mm_processor_kwargs must be a JSON object") from None


async def _images(urls: list[Any], options: MediaOptions) -> list[Any]:
    """A conversation's images, fetched and decoded together (``InputError`` naming the field of the first that
    cannot be loaded)."""
    try:
        return list(await asyncio.gather(*(load_image_async(url, options, "messages") for url in urls)))
    except MediaError as exc:
        raise InputError(exc.param, str(exc)) from None


async def _prompt(
    model: ServedModel,
    request: pb.GenerateRequest | pb.EmbedRequest,
    tokenize: Callable[..., list[int]],
    add_special: bool,
    oneof: str = "prompt",
) -> tuple[str | None, list[int]]:
    """The text (when it is one) and token ids of the request's ``oneof`` (its prompt, an ``Embed``'s input but a
    text pair, which ``Embed`` tokenizes itself), text made token ids by ``tokenize(text, add_special)`` on the
    model's tokenizer thread, a conversation rendered with the tokenizer's special tokens when ``add_special``
    (``_add_special_tokens``); its size is already checked."""
    kind = request.WhichOneof(oneof)
    if kind == "text":
        return request.text, await model.off_loop(tokenize, request.text, add_special)
    if kind == "token_ids":
        return None, list(request.token_ids.ids)
    return None, await model.off_loop(chat_prompt_ids, model.inputs, request.messages, add_special)


def _add_special_tokens(
    request: pb.GenerateRequest | pb.EmbedRequest | pb.TokenizeRequest, oneof: str = "prompt"
) -> bool:
    """Whether the tokenizer adds its special tokens (a BOS) to the request's ``oneof``: ``add_special_tokens``, or
    when unset, true for a text and false for messages (their template writes them). Token ids and prompt
    embeddings are used as they are: true is refused for them."""
    kind = request.WhichOneof(oneof)
    if not request.HasField("add_special_tokens"):
        return kind in ("text", "text_pair")
    if request.add_special_tokens and kind not in ("text", "text_pair", "messages"):
        raise InputError(
            "add_special_tokens", f"add_special_tokens applies to a text or messages: {kind} are used as they are"
        )
    return request.add_special_tokens


class EngineServer:
    """Starts an engine per config and serves them all over gRPC on one port.

    ``tenants`` (default: none, an open server) authenticates callers and holds each to its
    limits; ``share_prefix_cache`` lets all tenants share prefix-cache blocks.
    """

    def __init__(
        self,
        configs: list[EngineConfig],
        tenants: Tenants | None = None,
        share_prefix_cache: bool = False,
        metrics_prefix: str = METRICS_PREFIX,
        lora_modules: Mapping[str, str | tuple[str, str]] | None = None,
        engine_index: int = 0,
    ) -> None:
        """``lora_modules``: LoRA adapters served from the start (vLLM's ``--lora-modules``), name ->
        PEFT folder, or (folder, base model name) where several models take LoRA. ``engine_index``: this
        server's data-parallel rank (``raypaged serve -dp``), its metrics' ``engine`` label."""
        names = [name for c in configs for name in c.served_model_names]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must be distinct, got {names}")
        by_name = {c.served_model_names[0]: c for c in configs}  # each config by its model's own name
        # every name a client may use -> the model's own name
        self.served_names = {name: own for own, c in by_name.items() for name in c.served_model_names}
        self.tenants = tenants if tenants is not None else Tenants([])
        self.share_prefix_cache = share_prefix_cache
        # before the engines load, so a bad --metrics-prefix fails at once (the stats are read at scrape time)
        self.metrics = ServerMetrics(
            {name: self._stats_of(name) for name in by_name},
            configs[0].resolved_device,
            prefix=metrics_prefix,
            configs=by_name,
            lora_sources={name: self._lora_info_of(name) for name, c in by_name.items() if c.enable_lora},
            engine_index=engine_index,
        )
        engines = {name: LLMEngine(c, own_input_tokenizer=True) for name, c in by_name.items()}
        self.models = {
            name: ServedModel(name, AsyncLLMEngine(engine, self.metrics.observer(name)))
            for name, engine in engines.items()
        }
        self.servicer = EngineServicer(
            self.models, self.metrics, self.tenants, self.share_prefix_cache, self.served_names
        )
        for name, where in (lora_modules or {}).items():
            path, base = (where, "") if isinstance(where, str) else where
            self.servicer.add_adapter(name, path, base)
        self._server: grpc.aio.Server | None = None

    def _stats_of(self, name: str) -> Callable[[], dict[str, int | float]]:
        return lambda: self.models[name].engine.stats()

    def _lora_info_of(self, name: str) -> Callable[[], tuple[list[str], list[str]]]:
        return lambda: self.models[name].engine.lora_info()

    async def start(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0 = a free port); returns the bound port."""
        self._server = grpc.aio.server(options=MESSAGE_SIZE_OPTIONS)
        pb_grpc.add_TextGenerationServiceServicer_to_server(self.servicer, self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port}")
        await self._server.start()
        logger.info("gRPC engine server on %s:%d serving %s", host, bound, ", ".join(self.models))
        if self.tenants.is_open and host not in _LOOPBACK:
            logger.warning("gRPC on %s:%d takes calls without an API key; set --api-key or --tenants", host, bound)
        return bound

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
        for model in self.models.values():
            model.engine.shutdown()
            model.close()

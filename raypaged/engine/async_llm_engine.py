"""The engine for services: asyncio callers, one engine thread.

``LLMEngine`` is synchronous and not thread-safe, so every call on it happens on
one thread, but its input processor's (``LLMEngine.process_request``): a coroutine runs
that on a thread-pool thread (tokenizing, checking, compiling a grammar, reading an
adapter), or on the event loop itself when that is only checks and copies (a short prompt
of token ids, no grammar, no adapter), then queues the processed request. Adds and aborts
are commands; the thread applies them between steps, runs ``step()`` while any request is unfinished, and hands each
step's outputs to the per-request asyncio queues in one ``call_soon_threadsafe``.
An abort is applied before the next step, so its KV blocks are free within one
step's time. A request over the engine's queue limits (``max_num_queued_reqs``, ``max_num_queued_tokens``,
vLLM's admission control) is refused with ``EngineBusyError`` before it is queued.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from raypaged.config import EngineConfig
from raypaged.engine.llm_engine import LLMEngine, ProcessedRequest
from raypaged.inputs.limits import InputError
from raypaged.inputs.multimodal_input import MultiModalInput
from raypaged.outputs import RequestOutput
from raypaged.sampling_params import BeamSearchParams, SamplingParams
from raypaged.structured.backend import COMPILE_SLOTS

if TYPE_CHECKING:
    from raypaged.lora.request import LoRARequest
    from raypaged.pooling_params import PoolingParams

logger = logging.getLogger("raypaged")
T = TypeVar("T")


class EngineObserver(Protocol):
    """Told on the engine thread about every step's outputs and every abort, and on the event loop about every
    request refused by a queue limit (for metrics)."""

    def on_outputs(self, outputs: list[RequestOutput], arrival_times: dict[str, float], now: float) -> None: ...

    def on_abort(self, request_ids: list[str]) -> None: ...

    def on_refused(self, reason: str) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (a step failed, or the engine was shut down)."""


class RequestFailedError(RuntimeError):
    """The engine ended this request alone: handling it failed (the message says how)."""


class RequestAbortedError(RuntimeError):
    """A request awaited whole (``encode``) was aborted before it finished (by ``abort``, or a drain)."""


class EngineBusyError(RuntimeError):
    """A request refused because it would pass the queue limit ``reason`` (``max_num_queued_reqs`` or
    ``max_num_queued_tokens``): the client may send it again later, or to another replica."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class _Add:
    processed: ProcessedRequest  # through the input processor, off the engine thread
    stream: _Stream
    accepted: concurrent.futures.Future


@dataclass(slots=True)
class _Call:
    """Run ``fn`` on the engine thread, between steps (what touches the scheduler)."""

    fn: Callable[[], object]
    done: concurrent.futures.Future


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]
    done: concurrent.futures.Future


@dataclass(slots=True)
class _Stream:
    """One request's outputs, read by the coroutine that added it; what it counts for the queue limits."""

    num_seqs: int = 1  # the sequences it runs (n, best_of, beam width)
    num_prefill_tokens: int = 0  # its prompt's tokens until its first output: 0 after
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival_time: float = field(default_factory=time.monotonic)


_INLINE_PROMPT_TOKENS = 4096  # a prompt of token ids up to this long is checked on the event loop


def _cheap(params: SamplingParams, prompt_token_ids: list[int] | None) -> bool:
    """Whether processing the request is only checks and copies: no tokenizing, no grammar to
    compile, no bad words to tokenize, a short prompt."""
    return (
        prompt_token_ids is not None
        and len(prompt_token_ids) <= _INLINE_PROMPT_TOKENS
        and params.structured_outputs is None
        and not params.bad_words
    )


_END = object()  # queued after an abort or an engine failure: the stream ends


def _has_work(engine: LLMEngine) -> bool:
    """Whether the engine has a step to run: unfinished requests, and it is awake (asleep, they wait)."""
    return engine.has_unfinished_requests() and not engine.is_sleeping()


class AsyncLLMEngine:
    """Adds from any number of coroutines; ``generate`` yields cumulative ``RequestOutput`` s."""

    def __init__(self, engine: LLMEngine, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self.config: EngineConfig = engine.config
        self._observer = observer
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats: Mapping[str, int | float] = engine.stats()
        self._lora_info: tuple[list[str], list[str]] = ([], [])
        # engine thread only: requests added and not yet finished, and the stream each was added with
        # (outputs go to that stream object, so a later request reusing the id never gets them)
        self._active: dict[str, _Stream] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self._grammar_threads = concurrent.futures.ThreadPoolExecutor(COMPILE_SLOTS, "raypaged-grammar")
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.config.served_model_name}", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stats(self) -> dict[str, int | float]:
        """The engine's counters as of its last step or command."""
        return dict(self._stats)

    def lora_info(self) -> tuple[list[str], list[str]]:
        """Running and waiting LoRA adapters as of the last step (see ``LLMEngine.lora_info``)."""
        return self._lora_info

    # ---- asyncio side ----------------------------------------------------------
    async def add_request(
        self,
        prompt: str | None,
        params: SamplingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        beam: BeamSearchParams | None = None,
        pooling: PoolingParams | None = None,
        token_type_ids: list[int] | None = None,
        multi_modal: MultiModalInput | None = None,
        prompt_embeds: Any = None,
        owner: str | None = None,
    ) -> str:
        """Queue a request; returns its id once the engine accepted it. Bad input raises ``ValueError``.
        With ``beam`` it is a beam search: one finished output, its beams best first. With ``pooling`` it is an
        embedding model's request (``params`` unused): one finished output whose ``pooled`` is its embedding
        (``token_type_ids``: a BERT text pair's). ``multi_modal``: the images for a text prompt's image
        placeholders with their options. ``prompt_embeds``: the prompt as embedding rows (``LLMEngine.add_request``).
        ``owner``: the client request it is a part of (``EngineCoreRequest.owner``).

        A caller cancelled at any point, even while the engine thread is adding the
        request, leaves nothing running: an abort is queued behind the add.
        """
        self._check_alive()
        self._loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if pooling is not None and (prompt_embeds is not None or multi_modal is not None):
            param = "prompt_embeds" if multi_modal is None else "multi_modal_data"
            raise InputError(param, f"{param} does not apply to a pooling request")
        # checked, tokenized, its grammar compiled and its adapter read here, off the engine thread: the batch runs on
        if pooling is not None:
            process = partial(
                self.engine.process_pooling,
                request_id,
                prompt,
                pooling,
                prompt_token_ids,
                priority,
                cache_salt,
                token_type_ids,
            )
        elif beam is None:
            process = partial(
                self.engine.process_request,
                request_id,
                prompt,
                params,
                prompt_token_ids,
                priority,
                cache_salt,
                lora_request,
                multi_modal,
                prompt_embeds,
            )
        else:
            if multi_modal is not None and multi_modal.images:
                raise InputError("multi_modal_data", "a beam search with images is not supported")
            if multi_modal is not None and multi_modal.processor_kwargs:
                raise InputError("mm_processor_kwargs", "mm_processor_kwargs applies to a request with images")
            if prompt_embeds is not None:
                raise InputError("prompt_embeds", "a beam search with prompt_embeds is not supported")
            process = partial(
                self.engine.process_beam_search, request_id, prompt, beam, prompt_token_ids, lora_request, cache_salt
            )
        if beam is None and lora_request is None and prompt_embeds is None and _cheap(params, prompt_token_ids):
            processed = process()  # checks and a copy, under 0.1 ms: a thread hop would cost more under load
        else:
            processed = await self._loop.run_in_executor(self.executor_for(params, prompt, prompt_token_ids), process)
        if request_id in self._streams:  # taken while this one was processed
            raise ValueError(f"request_id {request_id!r} is already in use")
        if owner is not None:
            processed.core_request.owner = owner
        num_seqs = beam.beam_width if beam is not None else params.num_samples
        if self.engine.is_sleeping():  # as vLLM: new work is refused (in-flight requests wait for the wake-up)
            raise EngineBusyError(
                "sleeping",
                f"{self.config.served_model_name} is sleeping (sleep mode): send the request again once it is woken "
                "up (POST /wake_up), or to another replica",
            )
        self._admit(num_seqs)
        stream = self._streams[request_id] = _Stream(num_seqs, len(processed.core_request.prompt_token_ids))
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Add(processed, stream, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except BaseException:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            refused = accepted.done() and not accepted.cancelled() and accepted.exception() is not None
            if not refused:  # the engine may hold it (added, or being added right now); commands run
                self._abort_nowait([request_id])  # in order, so this abort comes after the add
            raise
        return request_id

    def num_unfinished_seqs(self) -> int:
        """The sequences of the requests added and not yet finished (waiting or running)."""
        return sum(stream.num_seqs for stream in self._streams.values())

    def num_queued_tokens(self) -> int:
        """The prompt tokens of the unfinished requests without an output yet (queued or in their prefill)."""
        return sum(stream.num_prefill_tokens for stream in self._streams.values())

    def _admit(self, num_seqs: int) -> None:
        """``EngineBusyError`` when a request of ``num_seqs`` sequences would pass a queue limit: the unfinished
        requests' sequences and its own more than ``max_num_queued_reqs``, or the prompt tokens of the requests
        without an output yet at ``max_num_queued_tokens`` already (vLLM's admission control)."""
        config = self.config
        refused: tuple[str, str] | None = None
        if config.max_num_queued_reqs is not None:
            unfinished = self.num_unfinished_seqs()
            if unfinished + num_seqs > config.max_num_queued_reqs:
                refused = (
                    "max_num_queued_reqs",
                    f"its {num_seqs} sequence(s) and the {unfinished} unfinished would be more than "
                    f"--max-num-queued-reqs {config.max_num_queued_reqs}",
                )
        if refused is None and config.max_num_queued_tokens is not None:
            queued = self.num_queued_tokens()
            if queued >= config.max_num_queued_tokens:
                refused = (
                    "max_num_queued_tokens",
                    f"{queued} prompt tokens wait for their prefill (--max-num-queued-tokens "
                    f"{config.max_num_queued_tokens})",
                )
        if refused is not None:
            reason, why = refused
            self._observe(lambda observer: observer.on_refused(reason))
            raise EngineBusyError(
                reason,
                f"{config.served_model_name} is busy: {why}; send the request again later, or to another replica",
            )

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of an added request until it finishes; ends early if it is aborted.

        Leaving the iteration before the request finished (a cancelled consumer)
        aborts it.
        """
        stream = self._streams[request_id]
        finished = False
        try:
            while True:
                item = await stream.outputs.get()
                if item is _END:
                    self._check_alive()
                    return
                finished = item.finished
                if item.error is not None and item.error_param:  # its own fields left nothing to do: a client error
                    raise InputError(item.error_param, item.error)
                if item.error is not None:
                    raise RequestFailedError(item.error)
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:
                self._abort_nowait([request_id])

    async def generate(
        self,
        prompt: str | None,
        params: SamplingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``add_request`` then ``stream``: the request's cumulative outputs, last one finished."""
        request_id = await self.add_request(prompt, params, request_id, prompt_token_ids, priority, cache_salt)
        async for output in self.stream(request_id):
            yield output

    async def encode(
        self,
        prompt: str | None,
        params: PoolingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        token_type_ids: list[int] | None = None,
    ) -> RequestOutput:
        """An embedding model's request, added and awaited: its finished output (``pooled``: the embedding).
        ``token_type_ids``: a BERT text pair's. Cancelling the caller aborts it."""
        request_id = await self.add_request(
            prompt,
            SamplingParams(),
            request_id,
            prompt_token_ids,
            priority,
            cache_salt,
            pooling=params,
            token_type_ids=token_type_ids,
        )
        async for output in self.stream(request_id):
            if output.finished:
                return output
        raise RequestAbortedError(f"request {request_id} was aborted before it finished")

    async def abort(self, request_ids: list[str]) -> int:
        """Abort requests (running or queued); returns how many were unfinished. Their streams end."""
        if not self.is_running:
            return 0
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Abort(list(request_ids), done))
        return await asyncio.wrap_future(done)

    async def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the engine thread between steps; its exception is raised here."""
        self._check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, done))
        return await asyncio.wrap_future(done)

    async def sleep(self, level: int = 1) -> None:
        """``LLMEngine.sleep`` between steps; the requests in flight wait, to be recomputed once awake."""
        await self.call(lambda: self.engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.call(lambda: self.engine.wake_up(tags))

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def executor_for(
        self, params: SamplingParams, prompt: str | None, prompt_token_ids: list[int] | None
    ) -> concurrent.futures.ThreadPoolExecutor | None:
        """Where a request is processed: one whose grammar must be compiled on the grammar threads (its
        compile may take minutes, and it must not hold a thread every other request's processing
        needs), any other on the loop's default executor."""
        structured = params.structured_outputs
        if structured is None or self.engine.input_processor.grammar_is_cached(structured, prompt, prompt_token_ids):
            return None
        return self._grammar_threads

    def _abort_nowait(self, request_ids: list[str]) -> None:
        self._commands.put(_Abort(list(request_ids), concurrent.futures.Future()))

    def shutdown(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=30)
        self._grammar_threads.shutdown(wait=False, cancel_futures=True)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine {self.config.served_model_name} has failed: {self.error}")
        if not self._thread.is_alive():
            raise EngineDeadError(f"engine {self.config.served_model_name} is shut down")

    # ---- engine thread -----------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                command = self._next_command(block=not _has_work(engine))
                while command is not None:
                    self._apply(command)
                    command = self._next_command(block=False)
                if self._stopping:
                    break
                outputs = engine.step() if _has_work(engine) else None
                # the counters first: a caller that got a step's outputs sees the step in them too
                self._stats = engine.stats()
                if self.config.enable_lora:
                    self._lora_info = engine.lora_info()
                if outputs is not None:
                    self._publish(outputs)
        except BaseException as exc:  # a failed step: every stream ends with the error
            logger.exception("engine %s failed", self.config.served_model_name)
            self.error = exc
        self._end_all()
        engine.shutdown()

    def _next_command(self, block: bool) -> _Add | _Abort | _Call | None:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return None
        if command is None:
            self._stopping = True
        return command

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        engine = self.engine
        if isinstance(command, _Call):
            if command.done.set_running_or_notify_cancel():
                try:
                    command.done.set_result(command.fn())
                except Exception as exc:
                    command.done.set_exception(exc)
        elif isinstance(command, _Add):
            if not command.accepted.set_running_or_notify_cancel():
                return  # the caller was cancelled before the engine saw the request
            try:
                request_id = engine.add_processed(command.processed)
            except ValueError as exc:
                command.accepted.set_exception(exc)
            else:
                self._active[request_id] = command.stream
                command.accepted.set_result(None)
        else:
            unfinished = [rid for rid in command.request_ids if rid in self._active]
            engine.abort_request(unfinished)
            for request_id in unfinished:
                self._push(self._active.pop(request_id), _END)
            if unfinished:
                logger.info("aborted requests %s", ", ".join(unfinished))
                self._observe(lambda observer: observer.on_abort(unfinished))
            if command.done.set_running_or_notify_cancel():
                command.done.set_result(len(unfinished))
        self._stats = engine.stats()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        routed = [(self._active.get(o.request_id), o) for o in outputs]
        for output in outputs:
            if output.finished:
                self._active.pop(output.request_id, None)
        arrivals = {o.request_id: s.arrival_time for s, o in routed if s is not None}
        self._observe(lambda observer: observer.on_outputs(outputs, arrivals, time.monotonic()))
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, routed)

    def _observe(self, call: Callable[[EngineObserver], None]) -> None:
        """Tell the observer; a failing observer is logged and never stops the engine."""
        if self._observer is None:
            return
        try:
            call(self._observer)
        except Exception:
            logger.exception("metrics observer of engine %s failed; the engine goes on", self.config.served_model_name)

    def _deliver(self, routed: list[tuple[_Stream | None, RequestOutput]]) -> None:
        for stream, output in routed:
            if stream is not None:
                stream.num_prefill_tokens = 0  # past its prefill
                stream.outputs.put_nowait(output)

    def _push(self, stream: _Stream, item: object) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(stream.outputs.put_nowait, item)

    def _end_all(self) -> None:
        while True:  # fail commands still queued
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(EngineDeadError("engine stopped"))
            elif isinstance(command, _Abort) and command.done.set_running_or_notify_cancel():
                command.done.set_result(0)
            elif isinstance(command, _Call) and command.done.set_running_or_notify_cancel():
                command.done.set_exception(EngineDeadError("engine stopped"))
        for stream in list(self._streams.values()):
            self._push(stream, _END)

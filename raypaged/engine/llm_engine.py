"""The synchronous engine: add requests, call ``step()`` until none are left.

``LLMEngine`` puts the three parts of the request path together: the
``InputProcessor`` (text to checked token ids), the ``EngineCore`` (scheduler,
executor and token-level state; ``step()`` gives per-sequence deltas) and the
``OutputProcessor`` (deltas to text, stop strings and ``RequestOutput`` s). Requests
are keyed by the caller's id here; the core knows only its own sequence ids
(``<n>:<request id>``, from a counter of the engine's, so no user id collides with one).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raypaged.config import EngineConfig
from raypaged.core.beam_search import BeamSearchParams
from raypaged.core.request import RequestStatus
from raypaged.core.stats import SchedulerStats
from raypaged.engine.core import EngineCore, EngineCoreRequest
from raypaged.engine.input_processor import InputProcessor
from raypaged.engine.output_processor import OutputProcessor
from raypaged.executor.base import Executor, WorkerLostError
from raypaged.inputs.limits import InputError
from raypaged.inputs.multimodal_input import MultiModalInput
from raypaged.inputs.tokenizer import load_tokenizer
from raypaged.outputs import RequestOutput
from raypaged.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

    from raypaged.core.scheduler import Scheduler
    from raypaged.lora.request import LoRARequest
    from raypaged.pooling_params import PoolingParams

logger = logging.getLogger("raypaged")


class LLMEngine:
    def __init__(self, config: EngineConfig, own_input_tokenizer: bool = False) -> None:
        """``own_input_tokenizer``: the input processor loads a tokenizer of its own, for servers
        that process inputs on other threads than the engine's (which detokenizes)."""
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer_path, config.resolved_tokenizer_mode)
        self.input_processor = InputProcessor(config, None if own_input_tokenizer else self.tokenizer)
        self.eos_token_ids = self.input_processor.eos_token_ids
        self.eos_token_id = self.input_processor.eos_token_id  # the EOS; the others stop too
        logger.info(
            "generation config %s: EOS token ids %s, sampling defaults %s",
            config.generation_config,
            list(self.eos_token_ids),
            config.generation_defaults.as_dict() or "none",
        )
        self.core = EngineCore(config, self.eos_token_id)
        self.output_processor = OutputProcessor(self.tokenizer, config.stream_interval, self.eos_token_id)
        self._ids = itertools.count()  # request ids for callers that give none
        self._seq_numbers = itertools.count()  # the core's sequence ids: "<n>:<request id>", never a user's id

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def executor(self) -> Executor:
        return self.core.executor

    # ---- requests ----------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def compile_grammar(
        self, structured: StructuredOutputsParams, prompt: str | None = None, prompt_token_ids: list[int] | None = None
    ) -> xgrammar.CompiledGrammar:
        """See ``InputProcessor.compile_grammar``; thread-safe."""
        return self.input_processor.compile_grammar(structured, prompt, prompt_token_ids)

    def check_lora(self, lora: LoRARequest) -> LoRARequest:
        """See ``InputProcessor.check_lora``; thread-safe."""
        return self.input_processor.check_lora(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (False when it is unknown); ``InputError`` while a request uses it."""
        lora = self.input_processor.lora(lora_int_id)
        if lora is None:
            return False
        if self.core.lora_in_use(lora_int_id):
            raise InputError("lora_name", f"LoRA adapter {lora.lora_name!r} is in use by running requests")
        self.input_processor.forget_lora(lora_int_id)
        self.core.forget_lora(lora_int_id)
        return True

    def lora_info(self) -> tuple[list[str], list[str]]:
        """The adapters of running and of waiting sequences, by name (vLLM's ``lora_requests_info``)."""
        return self.core.lora_info()

    def new_request_id(self, request_id: str | None) -> str:
        """``request_id``, or a fresh one when it is None; one in use raises ``InputError``."""
        if request_id is None:
            request_id = str(next(self._ids))
        if request_id in self.output_processor:
            raise InputError("request_id", f"request_id {request_id!r} is already in use")
        return request_id

    def process_request(
        self,
        request_id: str,
        prompt: str | None,
        sampling_params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        multi_modal: MultiModalInput | None = None,
        prompt_embeds: Any = None,
    ) -> ProcessedRequest:
        """The input processor's half of ``add_request``: touches no engine state, so servers run it
        off the engine thread and hand the result to ``add_processed`` there."""
        params, core_request = self.input_processor.process(
            self._seq_id(request_id),
            prompt,
            sampling_params,
            prompt_token_ids,
            priority,
            cache_salt,
            lora_request,
            multi_modal,
            prompt_embeds,
        )
        return ProcessedRequest(request_id, prompt, params, core_request)

    def process_beam_search(
        self,
        request_id: str,
        prompt: str | None,
        params: BeamSearchParams,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> ProcessedRequest:
        """``process_request`` for a beam search."""
        beam_params, core_request = self.input_processor.process_beam_search(
            self._seq_id(request_id), prompt, params, prompt_token_ids, lora_request, cache_salt
        )
        return ProcessedRequest(request_id, prompt, beam_params, core_request)

    def process_pooling(
        self,
        request_id: str,
        prompt: str | None,
        params: PoolingParams,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        token_type_ids: list[int] | None = None,
    ) -> ProcessedRequest:
        """``process_request`` for an embedding model's request (``InputProcessor.process_pooling``)."""
        seq_params, core_request = self.input_processor.process_pooling(
            self._seq_id(request_id), prompt, params, prompt_token_ids, priority, cache_salt, token_type_ids
        )
        return ProcessedRequest(request_id, prompt, seq_params, core_request)

    def add_pooling_request(
        self,
        prompt: str | None,
        params: PoolingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        token_type_ids: list[int] | None = None,
    ) -> str:
        """Queue an embedding model's request; its one output, when its prompt is computed, carries ``pooled``.
        ``token_type_ids``: a BERT text pair's (``InputProcessor.process_pooling``)."""
        request_id = self.new_request_id(request_id)
        return self.add_processed(
            self.process_pooling(request_id, prompt, params, prompt_token_ids, priority, cache_salt, token_type_ids)
        )

    def add_processed(self, processed: ProcessedRequest) -> str:
        """Queue a processed request in the core; returns its id."""
        request_id = self.new_request_id(processed.request_id)
        core_request = processed.core_request
        core_request.arrival_time = time.monotonic()  # queued in the engine
        seq_ids = self.core.add(core_request)
        if core_request.beam is not None:
            self.output_processor.add_beam_search(
                request_id, processed.prompt, core_request.prompt_token_ids, processed.params, seq_ids[0]
            )
        else:
            self.output_processor.add(
                request_id,
                processed.prompt,
                core_request.prompt_token_ids if core_request.prompt_embeds is None else None,
                processed.params,
                seq_ids,
                core_request.max_tokens,
                core_request.arrival_time,
                0 if core_request.prompt_embeds is None else len(core_request.prompt_token_ids),
            )
        return request_id

    def _seq_id(self, request_id: str) -> str:
        return f"{next(self._seq_numbers)}:{request_id}"

    def add_request(
        self,
        prompt: str | None,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        multi_modal: MultiModalInput | None = None,
        prompt_embeds: Any = None,
    ) -> str:
        """Validate and queue one request; returns its id. Bad input raises ``ValueError``.

        ``prompt_token_ids``, when given, are used as they are (``prompt`` is then
        only reported back); otherwise ``prompt`` is tokenized. Requests with
        different ``cache_salt`` never share prefix-cache blocks, nor do requests on
        different LoRA adapters (``lora_request``; ``None``: the base model). ``multi_modal``: the images for the
        image placeholders of a text ``prompt`` (an image-text model's) with their options. ``prompt_embeds``: the
        prompt as a ``[num_tokens, hidden_size]`` float tensor (or its ``torch.save`` bytes), vLLM's, instead of
        ``prompt``/``prompt_token_ids`` (needs ``enable_prompt_embeds``).
        """
        request_id = self.new_request_id(request_id)
        return self.add_processed(
            self.process_request(
                request_id,
                prompt,
                sampling_params,
                prompt_token_ids,
                priority,
                cache_salt,
                lora_request,
                multi_modal,
                prompt_embeds,
            )
        )

    def add_beam_search(
        self,
        prompt: str | None,
        params: BeamSearchParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a beam search; its output (beams best first) comes when it finishes."""
        request_id = self.new_request_id(request_id)
        return self.add_processed(
            self.process_beam_search(request_id, prompt, params, prompt_token_ids, lora_request, cache_salt)
        )

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests (all their sequences); their blocks are free when this returns."""
        for request_id in request_ids:
            seq_ids, beam_id = self.output_processor.pop(request_id)
            if beam_id is not None:
                self.core.abort_beam_search(beam_id)
            if seq_ids:
                self.core.abort(seq_ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- the step ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for each request that got a token.

        A shard that dies mid-step is replaced and every in-flight sequence is
        recomputed from its tokens (this step then returns no outputs); with
        ``enable_recovery=False`` every request is aborted and the :class:`WorkerLostError`
        (for Ray shards, a ``WorkerDiedError``) is raised, now and on every later step.
        """
        try:
            core_outputs = self.core.step()
        except WorkerLostError:
            self.abort_request(list(self.output_processor.states) + list(self.output_processor.beams))
            raise
        outputs, stopped, failed = self.output_processor.process(core_outputs, time.monotonic())
        if stopped:
            self.core.finish(stopped, RequestStatus.FINISHED_STOPPED)
        if failed:
            self.core.abort(failed)
        return outputs

    def shutdown(self) -> None:
        """Release the workers (Ray actors and their placement group); the engine is unusable after."""
        core = getattr(self, "core", None)  # None when __init__ failed before making it
        if core is not None:
            core.shutdown()

    def stats(self) -> SchedulerStats:
        """The scheduler's counters: typed attributes, and a read-only mapping by the same names."""
        return self.core.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks; False (nothing done) while requests hold blocks."""
        return self.core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Sleep mode (``enable_sleep_mode``): free the weights and the KV cache (``EngineCore.sleep``)."""
        self.core.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back the ``tags`` (``"weights"``, ``"kv_cache"``; ``None``: both) that ``sleep`` freed."""
        self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.core.sleep_level > 0


@dataclass(slots=True, frozen=True)
class ProcessedRequest:
    """A request through the input processor, ready for ``LLMEngine.add_processed``."""

    request_id: str
    prompt: str | None
    params: SamplingParams  # what its outputs are built by (a beam search: its beams')
    core_request: EngineCoreRequest

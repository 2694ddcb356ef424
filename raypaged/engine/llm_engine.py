"""The synchronous engine: add requests, call ``step()`` until none are left.

The driver side of every step: ``Scheduler.schedule()`` → executor →
``Scheduler.update_from_output()`` → detokenize and check stop strings.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from transformers import AutoTokenizer

from raypaged.config import EngineConfig
from raypaged.core.beam_search import BeamGroup, BeamSearchParams
from raypaged.core.block_manager import KVCacheManager
from raypaged.core.outputs import GrammarBitmask, SchedulerOutput
from raypaged.core.request import Request, RequestStatus, SequenceGroup
from raypaged.core.stats import SchedulerStats
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from raypaged.engine.detokenizer import IncrementalDetokenizer
from raypaged.engine.output_processor import (
    RequestState,
    SeqState,
    end_seq,
    error_output,
    make_output,
    process_token,
)
from raypaged.executor.base import Executor, WorkerLostError
from raypaged.executor.uniproc import UniProcExecutor
from raypaged.inputs.limits import (
    InputError,
    check_context,
    check_count,
    check_prompt_ids,
    check_sampling,
    check_text,
)
from raypaged.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    FinishReason,
    RequestOutput,
    decode_logprobs,
)
from raypaged.sampling_params import SamplingParams, StructuredOutputsParams
from raypaged.spec_decode.config import SpeculativeConfig
from raypaged.spec_decode.ngram import NgramProposer
from raypaged.structured.backend import PARAM as STRUCTURED_PARAM
from raypaged.structured.backend import GrammarBackend, num_valid_tokens
from raypaged.structured.reasoning import closed_in

if TYPE_CHECKING:
    import torch
    import xgrammar

    from raypaged.lora.request import LoRARequest

logger = logging.getLogger("raypaged")
T = TypeVar("T")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path)
        if len(self.tokenizer) > config.hf_config.vocab_size:
            raise ValueError(f"the tokenizer in {config.tokenizer_path} has {len(self.tokenizer)} tokens, more than "
                             f"the model's vocabulary of {config.hf_config.vocab_size}: it is not this model's tokenizer")
        self.eos_token_ids = self._eos_token_ids()
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None  # the EOS; the others stop too
        logger.info(
            "generation config %s: EOS token ids %s, sampling defaults %s",
            config.generation_config, list(self.eos_token_ids), config.generation_defaults.as_dict() or "none",
        )
        self.executor: Executor
        if config.uses_ray:  # Ray is imported only when shards are Ray actors
            from raypaged.executor.ray_executor import RayExecutor

            self.executor = RayExecutor(config, self.eos_token_id)
        else:
            self.executor = UniProcExecutor(config, self.eos_token_id)
        self._worker_error: WorkerLostError | None = None  # set when a worker was lost with recovery off
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            policy=config.scheduling_policy,
            preemption_mode=config.preemption_mode,
            max_loras=config.lora_config.max_loras if config.lora_config is not None else 0,
            **_spec_scheduler_options(config.speculative_config),
        )
        num_blocks, num_cpu_blocks = self.executor.determine_num_blocks()
        try:
            _check_pool_holds_one_sequence(num_blocks, config)
        except ValueError:
            self.shutdown()
            raise
        self.executor.initialize_cache(num_blocks, num_cpu_blocks)
        self.scheduler = Scheduler(
            scheduler_config,
            KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks),
        )
        self._states: dict[str, RequestState] = {}  # by request id
        self._seq_states: dict[str, tuple[RequestState, SeqState]] = {}  # by sequence id
        self._beam_states: dict[str, tuple[RequestState, BeamGroup]] = {}  # beam searches by request id
        self.grammars = GrammarBackend(
            self.tokenizer, config.hf_config.vocab_size, self.eos_token_ids, config.structured_outputs_config
        )
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}  # constrained sequences' grammar states, by sequence id
        self._mask_thread: ThreadPoolExecutor | None = None  # fills the step's grammar masks during the forward
        self._loras: dict[int, LoRARequest] = {}  # adapters checked against the model, by lora_int_id
        self._lora_lock = threading.Lock()
        spec = config.speculative_config
        self.ngram: NgramProposer | None = None  # prompt-lookup proposals, made here between steps
        if spec is not None and spec.method == "ngram":
            self.ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        self._ids = itertools.count()  # request ids for callers that give none
        self._seq_numbers = itertools.count()  # internal sequence ids: "<n>:<request id>", never a user's id

    def _eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation, without repeats: config.json's ``eos_token_id`` (an int or
        a list), the generation config's, then the tokenizer's. The first is the EOS."""
        found = getattr(self.config.hf_config, "eos_token_id", None)
        ids = [found] if isinstance(found, int) else list(found or [])
        ids += self.config.generation_eos_token_ids
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))

    def _with_eos_stops(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the EOS ids after the first among its stop tokens, as vLLM adds a generation
        config's extra EOS ids to ``stop_token_ids``: such a stop reports its id as ``stop_reason`` and
        ``min_tokens`` bans it. ``ignore_eos`` ignores every EOS id, as in vLLM."""
        extra = [token_id for token_id in self.eos_token_ids[1:] if token_id not in params.stop_token_ids]
        if params.ignore_eos or not extra:
            return params
        return replace(params, stop_token_ids=params.stop_token_ids + extra)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as it would be written alone and after a space, as vLLM bans them."""
        found: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                if ids and ids not in found:
                    found.append(ids)
        return found

    # ---- requests ----------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def _validate_prompt(
        self, request_id: str | None, prompt: str | None, prompt_token_ids: list[int] | None,
        truncate_to: int | None = None,
    ) -> tuple[str, list[int]]:
        """A fresh request id and the prompt's token ids (only the last ``truncate_to`` of them, when
        given, as vLLM's ``truncate_prompt_tokens``); bad input raises ``ValueError`` (the input
        gate's ``InputError``), sizes checked before tokenizing or copying."""
        if request_id is None:
            request_id = str(next(self._ids))
        if request_id in self._states or request_id in self._beam_states:
            raise InputError("request_id", f"request_id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if prompt is None:
                raise InputError("prompt", "either prompt or prompt_token_ids is required")
            check_text("prompt", len(prompt), self.config.limits, self.config.max_model_len)
            prompt_token_ids = self.tokenize(prompt)
        if truncate_to is not None:
            prompt_token_ids = prompt_token_ids[-truncate_to:]
        check_prompt_ids(prompt_token_ids, self.config.hf_config.vocab_size, self.config.max_model_len)
        return request_id, list(prompt_token_ids)

    def compile_grammar(
        self, structured: StructuredOutputsParams, prompt: str | None = None, prompt_token_ids: list[int] | None = None
    ) -> xgrammar.CompiledGrammar:
        """The constraint's grammar for this prompt, its size checked first; thread-safe (servers
        call it off the engine thread, so ``add_request`` then finds it cached). With a reasoning
        parser the constraint applies after the output's reasoning section, unless the prompt
        closed that section itself. Raises ``InputError``."""
        check_text(STRUCTURED_PARAM, structured.num_chars, self.config.limits, self.config.max_model_len)
        reasoning = self.config.structured_outputs_config.reasoning
        if reasoning is not None:
            tail = prompt[-64:] if prompt_token_ids is None and prompt is not None else self.tokenizer.decode(
                (prompt_token_ids or [])[-16:])
            if closed_in(tail):
                reasoning = None
        return self.grammars.compile(structured, reasoning)

    def check_lora(self, lora: LoRARequest) -> LoRARequest:
        """The adapter, read and checked against the model once per ``lora_int_id`` (``InputError``
        naming what does not fit: its rank, a module the model lacks, another adapter's id)."""
        if self.config.lora_config is None:
            raise InputError("lora_request", f"LoRA adapter {lora.lora_name!r} asked for, but LoRA is off "
                                             "(--enable-lora, LLM(enable_lora=True))")
        with self._lora_lock:  # servers check adapters off the engine thread
            if (known := self._known_lora(lora)) is not None:
                return known
        from raypaged.lora.layout import read_checked_adapter

        try:
            read_checked_adapter(lora, self.config.hf_config, self.config.lora_config.max_lora_rank)
        except (ValueError, OSError) as exc:
            raise InputError("lora_request", str(exc)) from None
        with self._lora_lock:
            if (known := self._known_lora(lora)) is not None:
                return known
            self._loras[lora.lora_int_id] = lora
        return lora

    def _known_lora(self, lora: LoRARequest) -> LoRARequest | None:
        """The adapter already checked, ``None`` for a new one; one clashing with another raises."""
        known = self._loras.get(lora.lora_int_id)
        if known is not None and known.lora_name == lora.lora_name and known.lora_path == lora.lora_path:
            return known
        for other in self._loras.values():
            if other.lora_int_id == lora.lora_int_id or other.lora_name == lora.lora_name:
                raise InputError("lora_request", f"LoRA adapter {lora.lora_name!r} (lora_int_id {lora.lora_int_id}) "
                                                 f"clashes with {other.lora_name!r} (lora_int_id {other.lora_int_id}, "
                                                 f"{other.lora_path}): each name and id belongs to one adapter")
        return None

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (False when it is unknown); ``InputError`` while a request uses it."""
        lora = self._loras.get(lora_int_id)
        if lora is None:
            return False
        if any(r.lora is not None and r.lora.lora_int_id == lora_int_id for r in self.scheduler.requests.values()):
            raise InputError("lora_name", f"LoRA adapter {lora.lora_name!r} is in use by running requests")
        with self._lora_lock:
            del self._loras[lora_int_id]
        if self.scheduler.loras is not None:
            self.scheduler.loras.forget(lora_int_id)
        return True

    def lora_info(self) -> tuple[list[str], list[str]]:
        """The adapters of running and of waiting sequences, by name (vLLM's ``lora_requests_info``)."""
        sched = self.scheduler
        running = {r.lora.lora_name for r in sched.running if r.lora is not None}
        waiting = {r.lora.lora_name for r in sched.waiting if r.lora is not None}
        return sorted(running), sorted(waiting)

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
    ) -> str:
        """Validate and queue one request; returns its id. Bad input raises ``ValueError``.

        ``prompt_token_ids``, when given, are used as they are (``prompt`` is then
        only reported back); otherwise ``prompt`` is tokenized. Requests with
        different ``cache_salt`` never share prefix-cache blocks, nor do requests on
        different LoRA adapters (``lora_request``; ``None``: the base model).
        """
        lora = None if lora_request is None else self.check_lora(lora_request)
        check_sampling(sampling_params, self.config.hf_config.vocab_size, self.config.limits)
        sampling_params = sampling_params.with_vocabulary_logprobs(self.config.hf_config.vocab_size)
        request_id, prompt_token_ids = self._validate_prompt(
            request_id, prompt, prompt_token_ids, sampling_params.truncate_prompt_tokens
        )
        check_context(len(prompt_token_ids), sampling_params.max_tokens, self.config.max_model_len)
        max_tokens = sampling_params.max_tokens or self.config.max_model_len - len(prompt_token_ids)
        num_samples = sampling_params.num_samples
        grammar = None
        if (structured := sampling_params.structured_outputs) is not None:  # cached when a server compiled it
            grammar = self.compile_grammar(structured, prompt, prompt_token_ids)  # off the engine thread
        seq_id = self._seq_id(request_id)
        seq_params = self._with_eos_stops(sampling_params)
        if sampling_params.bad_words:
            seq_params = replace(seq_params, bad_words_token_ids=self._bad_words_token_ids(sampling_params.bad_words))
        seqs = [
            Request(
                seq_id if i == 0 else f"{seq_id}#{i}",
                prompt_token_ids,
                seq_params,
                max_tokens,
                self.eos_token_id,
                priority=priority,
                sample_index=i,
                cache_salt=_prefix_namespace(cache_salt, lora),
                lora=lora,
                num_spec_tokens=self._num_spec_tokens(sampling_params),
            )
            for i in range(num_samples)
        ]
        fork_at = len(prompt_token_ids) - 1
        if num_samples > 1 and fork_at > 0:
            group = SequenceGroup(seq_id, fork_at, seqs[1:])
            for seq in seqs:
                seq.group = group
            self.scheduler.add_request(seqs[0])
        else:
            for seq in seqs:
                self.scheduler.add_request(seq)
        state = RequestState(request_id, prompt, prompt_token_ids, sampling_params, [])
        for seq in seqs:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sampling_params.skip_special_tokens,
                                           sampling_params.spaces_between_special_tokens)
            seq_state = SeqState(seq, detok)
            state.seqs.append(seq_state)
            self._seq_states[seq.request_id] = (state, seq_state)
            if grammar is not None:
                self._matchers[seq.request_id] = self.grammars.matcher(grammar)
        self._states[request_id] = state
        return request_id

    def _num_spec_tokens(self, params: SamplingParams) -> int:
        """Drafts a request may verify per step (0 without speculation)."""
        spec = self.config.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    def add_beam_search(
        self,
        prompt: str | None,
        params: BeamSearchParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a beam search; its output (beams best first) comes when it finishes."""
        limits = self.config.limits
        check_count("n", params.beam_width, limits.max_num_samples, "max_num_samples", "beams")
        lora = None if lora_request is None else self.check_lora(lora_request)
        request_id, prompt_token_ids = self._validate_prompt(request_id, prompt, prompt_token_ids)
        max_tokens = min(params.max_tokens, self.config.max_model_len - len(prompt_token_ids))
        if params.structured_outputs is None:
            grammar = None
        else:
            grammar = self.compile_grammar(params.structured_outputs, prompt, prompt_token_ids)
        # each beam proposes its 2 * beam_width best next tokens; the group decides
        beam_params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2 * params.beam_width, ignore_eos=True)
        seq_id = self._seq_id(request_id)
        group = BeamGroup(seq_id, params, self.eos_token_id)
        first = Request(seq_id, prompt_token_ids, beam_params, max_tokens, self.eos_token_id, beam=group,
                        cache_salt=_prefix_namespace(None, lora), lora=lora)
        group.beams.append(first)
        if grammar is not None:
            self._matchers[seq_id] = self.grammars.matcher(grammar)
        self.scheduler.add_request(first)
        self._beam_states[request_id] = (RequestState(request_id, prompt, prompt_token_ids, beam_params, []), group)
        return request_id

    def _beam_output(self, state: RequestState, group: BeamGroup) -> RequestOutput:
        if state.error is not None:
            return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [], finished=True,
                                 error=state.error)
        texts = [self.tokenizer.decode(hyp.token_ids, skip_special_tokens=True) for hyp in group.hypotheses]
        completions = [
            CompletionOutput(
                index=rank,
                text=text,
                token_ids=hyp.token_ids,
                cumulative_logprob=hyp.cumulative_logprob,
                logprobs=None,
                finish_reason=hyp.finish_reason,
            )
            for rank, (hyp, text) in enumerate(zip(group.hypotheses, texts))
        ]
        sequences = []
        for hyp, text in zip(group.hypotheses, texts):
            decode_logprobs(hyp.logprobs, self.tokenizer)
            sequences.append(BeamSearchSequence(state.prompt_token_ids + hyp.token_ids, hyp.logprobs,
                                                hyp.cumulative_logprob, text, hyp.finish_reason))
        return BeamSearchOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished=True,
                                num_generated_tokens=sum(len(h.token_ids) for h in group.hypotheses),
                                sequences=sequences)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests (all their sequences); their blocks are free when this returns."""
        for request_id in request_ids:
            beam = self._beam_states.pop(request_id, None)
            if beam is not None:
                group = beam[1]
                self.scheduler.finish_requests([b.request_id for b in group.beams], RequestStatus.FINISHED_ABORTED)
                group.done = True
                self._forget_beam_grammars(group)
            state = self._states.pop(request_id, None)
            if state is None:
                continue
            seq_ids = [seq.request.request_id for seq in state.seqs]
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            for seq_id in seq_ids:
                self._seq_states.pop(seq_id, None)
                self._matchers.pop(seq_id, None)
                if self.ngram is not None:
                    self.ngram.forget(seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for each request that got a token.

        A shard that dies mid-step is replaced and every in-flight sequence is
        recomputed from its tokens (this step then returns no outputs); with
        ``enable_recovery=False`` every request is aborted and the :class:`WorkerLostError`
        (for Ray shards, a ``WorkerDiedError``) is raised, now and on every later step.
        """
        if self._worker_error is not None:
            raise self._worker_error
        scheduler_output = self.scheduler.schedule()
        grammar = self._grammar_bitmask(scheduler_output) if self._matchers else None
        scheduler_output.grammar_bitmask = grammar
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except WorkerLostError as err:
            self._recover_from(err)
            return []
        finally:
            fill_failures = self._grammar_fill_failures(grammar)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        touched: dict[str, RequestState] = {}
        for seq_id, message in fill_failures.items():
            if (found := self._seq_states.get(seq_id)) is not None:
                self._fail(found[0], message)
                touched[found[0].request_id] = found[0]
            elif (beam := self._beam_of(seq_id)) is not None:  # a beam: its whole search fails
                self._fail(beam, message)
        for ended in self.scheduler.take_ended():
            state, seq = self._seq_states[ended.request.request_id]
            self._guarded(state, "ending", end_seq, seq, ended.message)
            touched[state.request_id] = state
        for seq_id, message in runner_output.failed.items():
            if (found := self._seq_states.get(seq_id)) is not None:
                self._fail(found[0], message)
                touched[found[0].request_id] = found[0]
        if self.ngram is not None and scheduler_output.propose_drafts:
            self._propose_ngrams(updated)
        now = time.monotonic()
        for request in updated:
            state, seq = self._seq_states[request.request_id]
            if state.error is None and (matcher := self._matchers.get(request.request_id)) is not None:
                self._guarded(state, "advancing the grammar", self._advance_grammar, matcher, request)
            if state.error is None:
                try:  # _guarded, inlined: this loop and the next run for every sequence every step
                    stopped = process_token(seq, now)
                except Exception as exc:
                    self._failed(state, "detokenizing or stop matching", exc)
                else:
                    if stopped:
                        self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            output = None
            if state.error is None:
                try:
                    output = make_output(state)
                except Exception as exc:
                    self._failed(state, "building the output", exc)
            if state.error is not None:
                output = error_output(state)
            if output is not None:
                outputs.append(output)
                if output.finished:
                    self._forget(state)
            elif state.finished:
                self._forget(state)
        for request_id, (state, group) in list(self._beam_states.items()):
            if group.lineage:
                if state.error is None:
                    self._guarded(state, "advancing the grammar", self._advance_beam_grammars, group)
                group.lineage.clear()
            if group.done:
                outputs.append(self._beam_output(state, group))
                del self._beam_states[request_id]
                self._forget_beam_grammars(group)
        return outputs

    def _propose_ngrams(self, updated: list[Request]) -> None:
        """Prompt-lookup drafts for the next step of every speculating sequence that got tokens."""
        for request in updated:
            if request.num_spec_tokens and not request.status.finished:
                request.spec_token_ids = self.ngram.propose(
                    request.request_id, request.prompt_token_ids, request.output_token_ids, request.num_spec_tokens)

    def _grammar_bitmask(self, so: SchedulerOutput) -> GrammarBitmask | None:
        """Masks of the constrained sequences that sample this step (their last known token is
        computed now), filled on the mask thread while the forward runs."""
        requests = self.scheduler.requests
        drafts = so.scheduled_spec_tokens
        rows = [
            (rid, self._matchers[rid], drafts.get(rid, [])) for rid, num_new in so.num_scheduled_tokens.items()
            if rid in self._matchers
            and requests[rid].num_computed_tokens + num_new == requests[rid].num_tokens + len(drafts.get(rid, ()))
            and ((found := self._seq_states.get(rid)) is None or found[0].error is None)  # None: a beam
        ]
        if not rows:
            return None
        bitmask = self.grammars.allocate_bitmask(sum(1 + len(seq_drafts) for _, _, seq_drafts in rows))
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="raypaged-grammar-mask")
        pending = self._mask_thread.submit(_fill_masks, rows, bitmask)
        return GrammarBitmask([rid for rid, _, _ in rows], bitmask, pending)

    @staticmethod
    def _grammar_fill_failures(grammar: GrammarBitmask | None) -> dict[str, str]:
        """Waits for the step's masks; the sequences whose matcher raised (their rows allowed
        every token), each with its message: those requests fail alone."""
        if grammar is None:
            return {}
        return grammar.pending.result() if grammar.pending is not None else {}

    def _advance_grammar(self, matcher: xgrammar.GrammarMatcher, request: Request) -> None:
        """Feed the step's tokens to the sequence's grammar; a complete output ends the sequence. Its
        drafts for the next step are cut before the first the grammar refuses.

        The mask thread walks the kept drafts again next step (it needs the matcher's state at each
        position to fill that position's mask, and runs while the forward does); cutting here costs
        an accept and a rollback per draft, against a forward slot for every refused one."""
        for token_id in request.output_token_ids[-request.num_new_tokens:]:
            if not matcher.accept_token(token_id):
                raise RuntimeError(f"the grammar refused token {token_id}")
        if matcher.is_terminated() and not request.status.finished:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        elif request.spec_token_ids:
            del request.spec_token_ids[num_valid_tokens(matcher, request.spec_token_ids):]

    def _advance_beam_grammars(self, group: BeamGroup) -> None:
        """After the group's beam steps: each kept beam's grammar state is its parent's (forked for
        every beam but the parent itself, before the parent moves on), advanced by the token the
        beam got; dropped beams' states go."""
        for lineage in group.lineage:
            parents = {parent: self._matchers.pop(parent) for parent, _, _ in lineage if parent in self._matchers}
            kept = [(beam_id, parents[parent] if beam_id == parent else parents[parent].fork(), token_id)
                    for parent, beam_id, token_id in lineage if beam_id is not None]
            for beam_id, matcher, token_id in kept:
                if not matcher.accept_token(token_id):
                    raise RuntimeError(f"the grammar refused token {token_id}")
                self._matchers[beam_id] = matcher

    def _beam_of(self, seq_id: str) -> RequestState | None:
        """The beam search whose beam ``seq_id`` is."""
        request = self.scheduler.requests.get(seq_id)
        group = request.beam if request is not None else None
        return next((state for state, g in self._beam_states.values() if g is group), None) if group else None

    def _forget_beam_grammars(self, group: BeamGroup) -> None:
        if group.params.structured_outputs is None:
            return
        prefix = group.group_id + "#"
        for seq_id in [s for s in self._matchers if s == group.group_id or s.startswith(prefix)]:
            del self._matchers[seq_id]

    def _recover_from(self, err: WorkerLostError) -> None:
        if not self.config.enable_recovery:
            logger.error("%s; recovery is off: aborting every request", err)
            self._worker_error = err
            self.abort_request(list(self._states) + list(self._beam_states))
            self.executor.shutdown()
            raise err
        num_in_flight = len(self.scheduler.running) + sum(len(g) for g in self.scheduler.swapped)
        logger.error("%s; restarting the shard group, recomputing %d in-flight sequences", err, num_in_flight)
        self.executor.restart()
        self.scheduler.reset_after_worker_loss()

    def shutdown(self) -> None:
        """Release the workers (Ray actors and their placement group); the engine is unusable after."""
        self.executor.shutdown()
        mask_thread = getattr(self, "_mask_thread", None)  # None too when __init__ failed before making it
        if mask_thread is not None:
            mask_thread.shutdown(wait=True)

    def _guarded(self, state: RequestState, doing: str, call: Callable[..., T], *args: object) -> T | None:
        """``call(*args)`` for one request; if it raises, that request alone fails (``_fail``)."""
        try:
            return call(*args)
        except Exception as exc:
            self._failed(state, doing, exc)
            return None

    def _failed(self, state: RequestState, doing: str, exc: Exception) -> None:
        """``doing`` raised ``exc`` for one request (call inside its ``except``): it alone fails."""
        logger.exception("request %s: %s failed; ending it alone", state.request_id, doing)
        self._fail(state, f"{doing} failed: {type(exc).__name__}: {exc}")

    def _fail(self, state: RequestState, message: str) -> None:
        """End a request whose handling failed: its sequences (or beams) are aborted (blocks freed)
        and it is reported once, finished, with ``error`` set; the other requests go on."""
        if state.error is not None:
            return
        state.error = message
        if (beam := self._beam_states.get(state.request_id)) is not None and beam[0] is state:
            group = beam[1]
            self.scheduler.finish_requests([b.request_id for b in group.beams], RequestStatus.FINISHED_ABORTED)
            group.done = True
            return
        self.scheduler.finish_requests([seq.request.request_id for seq in state.seqs], RequestStatus.FINISHED_ABORTED)
        for seq in state.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = FinishReason.ERROR

    def _forget(self, state: RequestState) -> None:
        del self._states[state.request_id]
        for seq in state.seqs:
            self._seq_states.pop(seq.request.request_id, None)
            self._matchers.pop(seq.request.request_id, None)
            if self.ngram is not None:
                self.ngram.forget(seq.request.request_id)

    def stats(self) -> SchedulerStats:
        """The scheduler's counters: typed attributes, and a read-only mapping by the same names."""
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks; False (nothing done) while requests hold blocks."""
        return self.scheduler.kv.reset_prefix_cache()


def _prefix_namespace(cache_salt: str | None, lora: LoRARequest | None) -> str | None:
    """The prefix-cache namespace of a request: its salt and its adapter (``None``: the shared one).
    The adapter id comes first, before a ``|``: distinct (salt, adapter) pairs never meet."""
    if lora is None and cache_salt is None:
        return None
    return f"{lora.lora_int_id if lora is not None else 0}|{cache_salt or ''}"


def _fill_masks(rows: list[tuple[str, xgrammar.GrammarMatcher, list[int]]], bitmask: torch.Tensor) -> dict[str, str]:
    """Fill ``bitmask`` from ``rows``' matchers (on the mask thread): a sequence verifying drafts
    has a row per position, each its matcher's after the drafts before it (then rolled back). A
    matcher that raises leaves its rows allowing every token and is returned with its message."""
    failures = {}
    row = 0
    for seq_id, matcher, drafts in rows:
        try:
            for j in range(len(drafts) + 1):
                matcher.fill_next_token_bitmask(bitmask, row + j)
                if j < len(drafts) and not matcher.accept_token(drafts[j]):
                    raise RuntimeError(f"the grammar refused draft token {drafts[j]}, checked when proposed")
            if drafts:
                matcher.rollback(len(drafts))
        except Exception as exc:
            logger.exception("request %s: filling the grammar mask failed; ending it alone", seq_id)
            bitmask[row:row + len(drafts) + 1].fill_(-1)
            failures[seq_id] = f"filling the grammar mask failed: {type(exc).__name__}: {exc}"
        row += len(drafts) + 1
    return failures


def _spec_scheduler_options(spec: SpeculativeConfig | None) -> dict[str, int | None]:
    """The scheduler's speculative-decoding settings; a draft model keeps lookahead slots to propose into."""
    if spec is None:
        return {}
    return {
        "num_spec_tokens": spec.num_speculative_tokens,
        "spec_disable_batch_size": spec.disable_by_batch_size,
        "num_lookahead_slots": spec.num_speculative_tokens if spec.method == "draft_model" else 0,
    }


def _check_pool_holds_one_sequence(num_blocks: int, config: EngineConfig) -> None:
    """One sequence of ``max_model_len`` tokens must fit the KV pool, or it could never finish."""
    needed = -(-config.max_model_len // config.block_size)
    if needed > num_blocks:
        raise ValueError(
            f"the KV cache has {num_blocks} blocks of {config.block_size} tokens ({num_blocks * config.block_size} "
            f"tokens), but one sequence of max_model_len {config.max_model_len} needs {needed} blocks; raise "
            "--kv-cache-space (CPU), --gpu-memory-utilization (CUDA) or --num-gpu-blocks-override, or lower "
            "--max-model-len"
        )

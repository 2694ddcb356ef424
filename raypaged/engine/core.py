"""The engine core: token ids in, per-sequence deltas out; no tokenizer, no text.

``EngineCore`` owns the scheduler, the KV cache manager and the executor, and the
token-level state beside them: each constrained sequence's grammar matcher (and the
thread that fills a step's masks during the forward), prompt-lookup proposals, beam
groups, and recovery from a lost worker. A caller (``LLMEngine``) gives it
``EngineCoreRequest`` s built by the ``InputProcessor`` and turns the
``EngineCoreOutputs`` of each ``step()`` into text with the ``OutputProcessor``.

Sequence ids are the caller's: a request's first sequence is its ``request_id``,
its other samples ``<request_id>#i``, a beam search's beams ``<request_id>#k``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from raypaged.config import SLEEP_MODE_OFF, WAKE_TAGS, EngineConfig, check_sleep_level, check_wake_tags
from raypaged.core import beam_search
from raypaged.core.beam_search import BeamGroup, BeamSearchParams, Hypothesis
from raypaged.core.block_manager import KVCacheManager
from raypaged.core.outputs import GrammarBitmask, ModelRunnerOutput, RequestFailure, SchedulerOutput
from raypaged.core.request import Request, RequestStatus, SequenceGroup
from raypaged.core.scheduler import EndedRequest, Scheduler, SchedulerConfig
from raypaged.core.stats import SchedulerStats
from raypaged.executor.base import Executor, PendingStep, WorkerLostError
from raypaged.heap import freeze_startup_heap, thaw
from raypaged.multimodal import ImageInputs
from raypaged.outputs import FinishReason
from raypaged.pooling import finish_embedding
from raypaged.sampling_params import SamplingParams
from raypaged.spec_decode.config import SpeculativeConfig
from raypaged.spec_decode.ngram import NgramProposer
from raypaged.structured.backend import allocate_bitmask, num_valid_tokens

if TYPE_CHECKING:
    import torch

    from raypaged.lora.request import LoRARequest
    from raypaged.pooling_params import PoolingParams

logger = logging.getLogger("raypaged")


@dataclass(slots=True)
class EngineCoreRequest:
    """A request as the core takes it: checked token ids and sampling params, nothing to tokenize."""

    request_id: str  # the id of its first sequence; the core's ids of its others derive from it
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # checked, with the extra EOS ids and the bad words' token ids resolved
    max_tokens: int  # resolved against max_model_len
    priority: int = 0
    cache_salt: str | None = None  # the prefix-cache namespace (salt and adapter)
    lora: LoRARequest | None = None
    matchers: list[Any] = field(default_factory=list)  # a grammar matcher per sample (or the beam's); [] unconstrained
    beam: BeamSearchParams | None = None  # a beam search: one output, its hypotheses, when it ends
    arrival_time: float = field(default_factory=time.monotonic)  # queued in the engine (set when it is)
    num_spec_tokens: int = 0  # drafts each sequence may verify per step
    pooling: PoolingParams | None = None  # an embedding model's request: it ends with its prompt, with its vector
    token_type_start: int | None = None  # BERT's text pair: its second text's first token (token type 1 from there)
    images: ImageInputs | None = None  # the prompt's images (a model with a vision tower)
    # vLLM's prompt_embeds: one float row per prompt token ([num_prompt, hidden]); prompt_token_ids then hold
    # placeholders (0), which the workers' embedding rows replace
    prompt_embeds: Any = None
    # the client request it is a part of (one of a multi-prompt completion's prompts): under FCFS the scheduler
    # shares slots and blocks between client requests (``Request.owner``); None: its own
    owner: str | None = None


@dataclass(slots=True)
class SeqDelta:
    """What one step did to one sequence: tokens it got (a run of accepted drafts is several), and how
    it ended if it did. The fields after ``stop_reason`` are set once: with its first tokens, or when
    the core ended it on its own (``message``: why)."""

    seq_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None  # each new token's top logprobs, when the request asked
    run_logprobs: list[float] | None  # a run of several tokens: their own logprobs (to drop a cut tail)
    cumulative_logprob: float
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    message: str | None = None
    first_scheduled_time: float | None = None
    num_cached_tokens: int | None = None
    prompt_logprobs: list[dict[int, float]] | None = None  # of prompt tokens 1, 2, ... when asked
    pooled: torch.Tensor | None = None  # an embedding model's request, ended: its embedding (float32, CPU)


@dataclass(slots=True)
class BeamResult:
    """A beam search that ended this step: its hypotheses best first, or the error that ended it."""

    request_id: str
    hypotheses: list[Hypothesis]
    error: RequestFailure | None = None


@dataclass(slots=True)
class EngineCoreOutputs:
    """One step's results, in the order the caller applies them: ``failed`` sequences end their
    requests with the message; ``seqs`` are the sequences that got tokens or were ended by the core."""

    seqs: list[SeqDelta] = field(default_factory=list)
    failed: dict[str, RequestFailure] = field(default_factory=dict)
    beams: list[BeamResult] = field(default_factory=list)


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_id: int | None) -> None:
        self.config = config
        self.eos_token_id = eos_token_id
        self.executor: Executor
        if config.uses_ray:  # Ray is imported only when shards are Ray actors
            from raypaged.executor.ray_executor import RayExecutor

            self.executor = RayExecutor(config, eos_token_id)
        else:
            from raypaged.executor.uniproc import UniProcExecutor

            self.executor = UniProcExecutor(config, eos_token_id)
        self._worker_error: WorkerLostError | None = None  # set when a worker was lost with recovery off
        self._restarted_without_progress = False  # the shard group was restarted and has not finished a step since
        self._mask_thread: ThreadPoolExecutor | None = None  # fills the step's grammar masks during the forward
        self._grammar_limit = GrammarLimit.of(config)
        # async scheduling: the thread the executor runs steps on, and the step running there
        self._step_thread: ThreadPoolExecutor | None = None
        self._in_flight: tuple[SchedulerOutput, Future[ModelRunnerOutput]] | None = None
        self.num_overlapped_steps = 0  # steps scheduled and submitted while the one before ran
        # pipeline parallelism: up to one micro-batch per stage in flight, oldest first
        self._max_batches = config.pipeline_parallel_size
        self._batches: deque[PendingStep] = deque()
        self.num_pipelined_steps = 0  # micro-batches submitted while others were in flight
        self.sleep_level = 0  # sleep mode: 0 awake, else the level of the last sleep() until wake_up() ends it
        self._asleep: set[str] = set()  # what sleep() freed and wake_up() has not brought back (WAKE_TAGS)
        num_blocks, num_cpu_blocks = self.executor.determine_num_blocks()
        if config.fit_max_model_len:
            _fit_max_model_len(num_blocks, config)
        try:
            _check_pool_holds_one_sequence(num_blocks, config)
        except ValueError:
            self.shutdown()
            raise
        self.executor.initialize_cache(num_blocks, num_cpu_blocks)
        if config.resolved_async_scheduling:
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="raypaged-step")
        max_num_batched_tokens, max_model_len = config.resolved_max_num_batched_tokens, config.resolved_max_model_len
        spec = config.parsed_speculative_config
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_active_seqs or config.max_num_seqs,  # the graphs are sized by max_num_seqs
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=config.scheduling_policy,
            preemption_mode=config.preemption_mode,
            max_loras=config.lora_config.max_loras if config.lora_config is not None else 0,
            pooling_type=None if config.pooler is None else config.pooler.pooling_type,
            whole_prompts=config.whole_prompts,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            long_prompt_chunk=config.resolved_long_prompt_chunk,
            **_spec_scheduler_options(spec),
        )
        self.scheduler = Scheduler(
            scheduler_config,
            KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks),
        )
        self._matchers: dict[str, Any] = {}  # constrained sequences' grammar states, by sequence id
        self._beams: dict[str, BeamGroup] = {}  # live beam searches, by request id
        self.ngram: NgramProposer | None = None  # prompt-lookup proposals, made here between steps
        if spec is not None and spec.method == "ngram":
            low, high = spec.prompt_lookup_min, spec.prompt_lookup_max
            assert low is not None and high is not None, "SpeculativeConfig sets both bounds of ngram"
            self.ngram = NgramProposer(spec.num_speculative_tokens, low, high)
        freeze_startup_heap("engine core")  # no full collection rescans the weights, tokenizer and graphs

    # ---- requests ----------------------------------------------------------
    def add(self, request: EngineCoreRequest) -> list[str]:
        """Queue a request; returns its sequences' ids (a beam search: its first beam's)."""
        if request.beam is not None:
            return [self._add_beam_search(request, request.beam)]
        params = request.sampling_params
        num_samples = params.num_samples
        seqs = [
            Request(
                request.request_id if i == 0 else f"{request.request_id}#{i}",
                request.prompt_token_ids,
                params,
                request.max_tokens,
                self.eos_token_id,
                arrival_time=request.arrival_time,
                priority=request.priority,
                sample_index=i,
                owner=request.owner,
                cache_salt=request.cache_salt,
                lora=request.lora,
                num_spec_tokens=request.num_spec_tokens,
                pooling=request.pooling,
                token_type_start=request.token_type_start,
                images=request.images,
                prompt_embeds=request.prompt_embeds,
            )
            for i in range(num_samples)
        ]
        fork_at = len(request.prompt_token_ids) - 1
        if num_samples > 1 and fork_at > 0:
            group = SequenceGroup(request.request_id, fork_at, seqs[1:])
            for seq in seqs:
                seq.group = group
            self.scheduler.add_request(seqs[0])
        else:
            for seq in seqs:
                self.scheduler.add_request(seq)
        for seq, matcher in zip(seqs, request.matchers):
            self._matchers[seq.request_id] = matcher
        return [seq.request_id for seq in seqs]

    def _add_beam_search(self, request: EngineCoreRequest, params: BeamSearchParams) -> str:
        """Every beam proposes its ``2 * beam_width`` best next tokens; its group decides (``params``:
        the request's ``beam``)."""
        group = BeamGroup(request.request_id, params=params, eos_token_id=self.eos_token_id)
        first = Request(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.max_tokens,
            self.eos_token_id,
            arrival_time=request.arrival_time,
            gang=group,
            cache_salt=request.cache_salt,
            lora=request.lora,
            images=request.images,
        )
        group.members.append(first)
        if request.matchers:
            self._matchers[first.request_id] = request.matchers[0]
        self.scheduler.add_request(first)
        self._beams[request.request_id] = group
        return first.request_id

    def abort(self, seq_ids: list[str]) -> None:
        """End sequences (aborted); their blocks are free when this returns."""
        self.finish(seq_ids, RequestStatus.FINISHED_ABORTED)

    def finish(self, seq_ids: list[str], status: RequestStatus) -> None:
        """End sequences with ``status`` (a stop string found by the caller: ``FINISHED_STOPPED``)."""
        self.scheduler.finish_requests(seq_ids, status)
        for seq_id in seq_ids:
            self._release(seq_id)

    def abort_beam_search(self, request_id: str) -> bool:
        """Abort a beam search (every live beam); False when there is none by that id."""
        group = self._beams.pop(request_id, None)
        if group is None:
            return False
        beam_search.abort(self.scheduler, group)
        self._forget_beam_grammars(group)
        return True

    def _release(self, seq_id: str) -> None:
        """Drop a finished sequence's token-level state."""
        self._matchers.pop(seq_id, None)
        if self.ngram is not None:
            self.ngram.forget(seq_id)

    def has_unfinished_requests(self) -> bool:
        """Sequences are live. (Under async scheduling a step may still run for sequences that ended
        meanwhile; the next ``step`` applies it, to no one.)"""
        return self.scheduler.has_unfinished_requests() or bool(self._batches)

    def in_flight_seq_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    # ---- the step ------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Run one iteration: schedule, run the model, apply the sampled tokens.

        A shard that dies mid-step is replaced and every in-flight sequence is recomputed
        from its tokens (this step then reports nothing); with ``enable_recovery=False``
        every sequence is aborted and the :class:`WorkerLostError` (for Ray shards, a
        ``WorkerDiedError``) is raised, now and on every later step.
        """
        if self._worker_error is not None:
            raise self._worker_error
        if self.sleep_level:
            return EngineCoreOutputs()  # asleep: requests wait for wake_up()
        if (step_thread := self._step_thread) is not None:
            return self._step_async(step_thread)
        if self._max_batches > 1:
            return self._step_pipelined()
        scheduler_output = self._schedule()
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except WorkerLostError as err:
            self._recover_from(err)
            return EngineCoreOutputs()
        finally:
            fill_failures = _grammar_fill_failures(scheduler_output.grammar_bitmask)
        return self._apply(scheduler_output, runner_output, fill_failures)

    def _schedule(self, overlap: bool = False, max_batch_seqs: int | None = None) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule(overlap, max_batch_seqs)
        if self._matchers:
            scheduler_output.grammar_bitmask = self._grammar_bitmask(scheduler_output)
        return scheduler_output

    def _step_async(self, step_thread: ThreadPoolExecutor) -> EngineCoreOutputs:
        """Async scheduling: the executor runs steps on ``step_thread``, one at a time, and while
        step N runs this schedules step N+1 (its sequences' coming tokens are placeholders: the
        worker computes them from its own samples), submits it the moment N is done, then applies
        N's results and returns them; the host work of both hides behind N+1's forward. While a
        beam search or a grammar is live (its next step depends on this one's tokens) steps run
        as on the synchronous path; speculative decoding and tensor parallelism are refused with
        async scheduling (``EngineConfig``)."""
        in_flight = self._in_flight
        if in_flight is None:
            scheduler_output = self._schedule()
            in_flight = scheduler_output, step_thread.submit(self.executor.execute_model, scheduler_output)
        scheduler_output, future = in_flight
        self._in_flight = None
        following = None
        if not (self._matchers or self._beams) and scheduler_output.num_scheduled_tokens:
            self.scheduler.commit_in_flight(scheduler_output)
            following = self._schedule(overlap=True)
        try:
            runner_output = future.result()
        except WorkerLostError as err:
            self._recover_from(err)  # the following step was never submitted: the reset drops it
            return EngineCoreOutputs()
        finally:
            fill_failures = _grammar_fill_failures(scheduler_output.grammar_bitmask)
        if following is not None:
            if following.is_empty:
                self.scheduler.forget_later(following)  # nothing to run beside: the next schedule starts over
            else:
                self._in_flight = following, step_thread.submit(self.executor.execute_model, following)
                self.num_overlapped_steps += 1
        return self._apply(scheduler_output, runner_output, fill_failures)

    def _step_pipelined(self) -> EngineCoreOutputs:
        """Pipeline parallelism's micro-batches (vLLM's batch queue): while fewer than one per stage are in
        flight, schedule another from the sequences no micro-batch in flight computes and submit it (the first
        stage starts it while the later ones finish those before); return nothing while it found one and room
        is left, else collect the oldest and apply its results. A micro-batch scheduled beside others preempts,
        swaps out and ends no one (``Scheduler.schedule``'s ``overlap``): the full schedule, which breaks
        stalls, runs when none is in flight. Each micro-batch takes at most its share of the live sequences
        (``max_num_seqs`` of them at most) over the stages, so that the stages stay evenly busy. A live beam
        search runs one micro-batch at a time, uncapped (its beams wait for each other)."""
        batches = self._batches
        submitted = False
        if len(batches) < self._max_batches and not (batches and self._beams):
            scheduler = self.scheduler
            share = None
            if not self._beams:
                live = len(scheduler.running) + len(scheduler.waiting) + sum(len(g) for g in scheduler.swapped)
                share = -(-min(live, scheduler.config.max_num_seqs) // self._max_batches)
            scheduler_output = self._schedule(bool(batches), share)
            if not batches or scheduler_output.num_scheduled_tokens or scheduler_output.block_ops:
                try:
                    step = self.executor.submit_step(scheduler_output)
                except WorkerLostError as err:
                    _grammar_fill_failures(scheduler_output.grammar_bitmask)
                    return self._lost_in_pipeline(err)
                self.scheduler.mark_in_flight(scheduler_output)
                self.num_pipelined_steps += bool(batches)
                batches.append(step)
                submitted = bool(scheduler_output.num_scheduled_tokens) and not self._beams
            else:
                self.scheduler.forget_later(scheduler_output)  # nothing to run beside: the next one tells
        if submitted and len(batches) < self._max_batches:
            return EngineCoreOutputs()
        step = batches.popleft()
        scheduler_output = step.scheduler_output
        try:
            runner_output = self.executor.collect_step(step)
        except WorkerLostError as err:
            return self._lost_in_pipeline(err)
        finally:
            fill_failures = _grammar_fill_failures(scheduler_output.grammar_bitmask)
        return self._apply(scheduler_output, runner_output, fill_failures)

    def _lost_in_pipeline(self, err: WorkerLostError) -> EngineCoreOutputs:
        """A shard was lost with micro-batches in flight: they are lost with it (their sequences are
        recomputed with the others)."""
        for step in self._batches:
            _grammar_fill_failures(step.scheduler_output.grammar_bitmask)
        self._batches.clear()
        self._recover_from(err)
        return EngineCoreOutputs()

    def _apply(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        fill_failures: dict[str, RequestFailure],
    ) -> EngineCoreOutputs:
        """A step's results into the scheduler, the grammars, the drafts and the beam searches;
        the deltas for the caller."""
        self._restarted_without_progress = False
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        out = EngineCoreOutputs()
        failed = out.failed
        beam_failures: dict[str, RequestFailure] = {}
        for seq_id, failure in (*fill_failures.items(), *runner_output.failed.items()):
            if (group := self._beam_of(seq_id)) is not None:  # a beam: its whole search fails
                beam_failures.setdefault(group.group_id, failure)
            else:
                failed.setdefault(seq_id, failure)
        deltas = out.seqs
        ended_beams: dict[str, list[EndedRequest]] = {}
        for ended in self.scheduler.take_ended():
            request = ended.request
            if request.gang is not None:  # a beam: its search settles below
                ended_beams.setdefault(request.gang.gang_id, []).append(ended)
                continue
            deltas.append(
                SeqDelta(
                    request.request_id,
                    [],
                    None,
                    None,
                    request.cumulative_logprob,
                    request.status.finish_reason,
                    request.stop_reason,
                    ended.message,
                    request.first_scheduled_time,
                    request.num_cached_tokens,
                )
            )
            self._release(request.request_id)
        if (ngram := self.ngram) is not None and scheduler_output.propose_drafts:
            self._propose_ngrams(ngram, updated)
        matchers = self._matchers
        for request in updated:
            seq_id = request.request_id
            if seq_id in failed:
                continue
            if matchers and (matcher := matchers.get(seq_id)) is not None:
                try:
                    self._advance_grammar(matcher, request)
                except GrammarTooSlow as exc:
                    failed[seq_id] = exc.failure
                    continue
                except Exception as exc:
                    logger.exception("sequence %s: advancing the grammar failed; ending its request alone", seq_id)
                    failed[seq_id] = RequestFailure(f"advancing the grammar failed: {type(exc).__name__}: {exc}")
                    continue
            num_new = request.num_new_tokens
            num_output = len(request.output_token_ids)
            status = request.status
            delta = SeqDelta(
                seq_id,
                request.output_token_ids[-num_new:],
                request.output_logprobs[-num_new:] if request.output_logprobs else None,
                request.run_logprobs,
                request.cumulative_logprob,
                status.finish_reason,
                request.stop_reason,
            )
            if num_output == num_new:  # its first tokens
                delta.first_scheduled_time = request.first_scheduled_time
                delta.num_cached_tokens = request.num_cached_tokens
                if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_missing:
                    delta.prompt_logprobs = request.prompt_logprobs
            if request.pooling is not None:
                try:
                    delta.pooled = self._embedding(request)
                except Exception as exc:
                    logger.exception("sequence %s: finishing its embedding failed; ending its request alone", seq_id)
                    failed[seq_id] = RequestFailure(f"finishing the embedding failed: {type(exc).__name__}: {exc}")
                    continue
            deltas.append(delta)
            if status.finished:
                self._release(seq_id)
        self._step_beams(out, ended_beams, beam_failures)
        return out

    def _embedding(self, request: Request) -> torch.Tensor:
        """An embedding model's request, its prompt computed: its vector finished as it asked."""
        pooler = self.config.pooler
        assert pooler is not None and request.pooling is not None, "only an embedding model's requests pool"
        if request.pooled is None:
            raise RuntimeError("no hidden state of its prompt reached the pooler")
        return finish_embedding(request.pooled, request.num_prompt_tokens, request.pooling, pooler)

    def _step_beams(
        self, out: EngineCoreOutputs, ended: dict[str, list[EndedRequest]], failures: dict[str, RequestFailure]
    ) -> None:
        """Beam searches, after the step: the scheduler's own ends settled, a beam step for every
        search whose live beams all sampled (the scheduler held their candidates), the grammars of
        beams that moved advanced; the searches that ended are reported."""
        beam_search.after_step(self.scheduler, self._beams.values(), ended)
        for request_id, group in list(self._beams.items()):
            error = failures.get(group.group_id)
            if group.lineage:
                if error is None:
                    try:
                        self._advance_beam_grammars(group)
                    except GrammarTooSlow as exc:
                        error = exc.failure
                    except Exception as exc:
                        logger.exception("beam search %s: advancing the grammar failed; ending it alone", request_id)
                        error = RequestFailure(f"advancing the grammar failed: {type(exc).__name__}: {exc}")
                group.lineage.clear()
            if error is not None and not group.done:
                beam_search.abort(self.scheduler, group)
            if group.done:
                out.beams.append(BeamResult(request_id, group.hypotheses, error))
                del self._beams[request_id]
                self._forget_beam_grammars(group)

    def _propose_ngrams(self, ngram: NgramProposer, updated: list[Request]) -> None:
        """Prompt-lookup drafts for the next step of every speculating sequence that got tokens."""
        for request in updated:
            if request.num_spec_tokens and not request.status.finished:
                request.spec_token_ids = ngram.propose(
                    request.request_id, request.prompt_token_ids, request.output_token_ids, request.num_spec_tokens
                )

    def _grammar_bitmask(self, so: SchedulerOutput) -> GrammarBitmask | None:
        """Masks of the constrained sequences that sample this step (their last known token is
        computed now), filled on the mask thread while the forward runs."""
        requests = self.scheduler.requests
        drafts = so.scheduled_spec_tokens
        rows = [
            (rid, self._matchers[rid], drafts.get(rid, []))
            for rid, num_new in so.num_scheduled_tokens.items()
            if rid in self._matchers
            and requests[rid].num_computed_tokens + num_new == requests[rid].num_tokens + len(drafts.get(rid, ()))
        ]
        if not rows:
            return None
        bitmask = allocate_bitmask(
            sum(1 + len(seq_drafts) for _, _, seq_drafts in rows), self.config.hf_config.vocab_size
        )
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="raypaged-grammar-mask")
        pending = self._mask_thread.submit(_fill_masks, rows, bitmask, self._grammar_limit)
        return GrammarBitmask([rid for rid, _, _ in rows], bitmask, pending)

    def _advance_grammar(self, matcher: Any, request: Request) -> None:
        """Feed the step's tokens to the sequence's grammar; a complete output ends the sequence. Its
        drafts for the next step are cut before the first the grammar refuses.

        The mask thread walks the kept drafts again next step (it needs the matcher's state at each
        position to fill that position's mask, and runs while the forward does); cutting here costs
        an accept and a rollback per draft, against a forward slot for every refused one."""
        num_new = request.num_new_tokens
        start = time.thread_time()
        for token_id in request.output_token_ids[-num_new:]:
            if not matcher.accept_token(token_id):
                raise RuntimeError(f"the grammar refused token {token_id}")
        if (limit := self._grammar_limit) is not None:
            limit.check(time.thread_time() - start, num_new, "taking the sampled token")
        if matcher.is_terminated() and not request.status.finished:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        elif request.spec_token_ids:
            del request.spec_token_ids[num_valid_tokens(matcher, request.spec_token_ids) :]

    def _advance_beam_grammars(self, group: BeamGroup) -> None:
        """After the group's beam steps: each kept beam's grammar state is its parent's (forked for
        every beam but the parent itself, before the parent moves on), advanced by the token the
        beam got; dropped beams' states go."""
        for lineage in group.lineage:
            parents = {parent: self._matchers.pop(parent) for parent, _, _ in lineage if parent in self._matchers}
            kept = [
                (beam_id, parents[parent] if beam_id == parent else parents[parent].fork(), token_id)
                for parent, beam_id, token_id in lineage
                if beam_id is not None
            ]
            for beam_id, matcher, token_id in kept:
                start = time.thread_time()
                if not matcher.accept_token(token_id):
                    raise RuntimeError(f"the grammar refused token {token_id}")
                if (limit := self._grammar_limit) is not None:
                    limit.check(time.thread_time() - start, 1, "taking the sampled token")
                self._matchers[beam_id] = matcher

    def _beam_of(self, seq_id: str) -> BeamGroup | None:
        """The beam search whose beam ``seq_id`` is."""
        request = self.scheduler.requests.get(seq_id)
        gang = request.gang if request is not None else None
        assert gang is None or isinstance(gang, BeamGroup), "the core's gangs are beam searches"
        return gang

    def _forget_beam_grammars(self, group: BeamGroup) -> None:
        if group.params.structured_outputs is None:
            return
        prefix = group.group_id + "#"
        for seq_id in [s for s in self._matchers if s == group.group_id or s.startswith(prefix)]:
            del self._matchers[seq_id]

    def _recover_from(self, err: WorkerLostError) -> None:
        """Restart the shard group and recompute the in-flight sequences; with recovery off, or when the group
        is lost again before any step succeeded since the last restart (a step that fails whatever shards run
        it, as a model that cannot run its batch: restarting would loop forever and stall every request), abort
        every request and raise ``err``, now and on every later step."""
        if not self.config.enable_recovery or self._restarted_without_progress:
            why = "recovery is off" if not self.config.enable_recovery else "lost again before any step succeeded"
            logger.error("%s; %s: aborting every request", err, why)
            self._worker_error = err
            for request_id in list(self._beams):
                self.abort_beam_search(request_id)
            self.abort(self.in_flight_seq_ids())
            self.executor.shutdown()
            raise err
        num_in_flight = len(self.scheduler.running) + sum(len(g) for g in self.scheduler.swapped)
        logger.error("%s; restarting the shard group, recomputing %d in-flight sequences", err, num_in_flight)
        self.executor.restart()
        self.scheduler.reset_after_worker_loss()
        self._restarted_without_progress = True

    # ---- sleep mode ------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the weights and the KV cache until ``wake_up`` (vLLM's levels 1 and 2 alike: both go, and
        ``wake_up`` reads the weights back from the checkpoint). A step running under async scheduling ends
        first and its tokens are dropped; the sequences in flight are recomputed once awake, as after a lost
        worker (the prefix cache starts over empty), and requests added meanwhile wait."""
        if not self.config.enable_sleep_mode:
            raise ValueError(SLEEP_MODE_OFF)
        check_sleep_level(level)
        if self._in_flight is not None:
            _, future = self._in_flight
            self._in_flight = None
            future.exception()  # waits; a lost worker goes with the others
        while self._batches:  # micro-batches in flight end first
            step = self._batches.popleft()
            try:
                self.executor.collect_step(step)
            except WorkerLostError:
                self._batches.clear()  # a lost worker goes with the others
            finally:
                _grammar_fill_failures(step.scheduler_output.grammar_bitmask)
        if len(self._asleep) < len(WAKE_TAGS):
            self.scheduler.reset_after_worker_loss("engine put to sleep")
            thaw()  # the start-up heap's cycles, the model's among them, can be collected
            self.executor.sleep()
            self._asleep = set(WAKE_TAGS)
        self.sleep_level = level
        logger.info("engine %s asleep (level %d): weights and KV cache freed", self.config.served_model_name, level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back the weights, the KV cache or both (``tags`` of ``WAKE_TAGS``; ``None``: all); the KV cache
        needs the weights back first. Awake once both are, and the waiting requests run."""
        wanted = set(WAKE_TAGS if tags is None else tags)
        check_wake_tags(wanted)
        weights, kv_cache = ("weights" in wanted & self._asleep), ("kv_cache" in wanted & self._asleep)
        if kv_cache and "weights" in self._asleep and not weights:
            raise ValueError("the KV cache wakes with or after the weights: wake_up(tags=['weights']) first")
        if weights or kv_cache:
            self.executor.wake_up(weights, kv_cache)
            self._asleep -= wanted
        if self.sleep_level and not self._asleep:
            self.sleep_level = 0
            freeze_startup_heap("engine woken")
            logger.info("engine %s awake", self.config.served_model_name)

    # ---- adapters, stats, lifecycle ------------------------------------------
    def lora_in_use(self, lora_int_id: int) -> bool:
        return any(r.lora is not None and r.lora.lora_int_id == lora_int_id for r in self.scheduler.requests.values())

    def forget_lora(self, lora_int_id: int) -> None:
        if self.scheduler.loras is not None:
            self.scheduler.loras.forget(lora_int_id)

    def lora_info(self) -> tuple[list[str], list[str]]:
        """The adapters of running and of waiting sequences, by name (vLLM's ``lora_requests_info``)."""
        sched = self.scheduler
        running = {r.lora.lora_name for r in sched.running if r.lora is not None}
        waiting = {r.lora.lora_name for r in sched.waiting if r.lora is not None}
        return sorted(running), sorted(waiting)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        """Release the workers (Ray actors and their placement group); the core is unusable after."""
        step_thread = getattr(self, "_step_thread", None)  # None too when __init__ failed before making it
        if step_thread is not None:
            step_thread.shutdown(wait=True)  # the step in flight ends before its workers go
        self.executor.shutdown()
        mask_thread = getattr(self, "_mask_thread", None)
        if mask_thread is not None:
            mask_thread.shutdown(wait=True)
        thaw()


def _grammar_fill_failures(grammar: GrammarBitmask | None) -> dict[str, RequestFailure]:
    """Waits for the step's masks; the sequences whose matcher raised (their rows allowed every
    token), each with its message: those requests fail alone."""
    if grammar is None:
        return {}
    return grammar.pending.result() if grammar.pending is not None else {}


@dataclass(slots=True, frozen=True)
class GrammarLimit:
    """The most CPU time one request's grammar may spend on one token (``max_grammar_ms`` of
    ``--structured-outputs-config``): every sequence of the batch waits for the step's masks."""

    ms: float

    @classmethod
    def of(cls, config: EngineConfig) -> GrammarLimit | None:
        ms = config.parsed_structured_outputs_config.max_grammar_ms
        return None if ms is None else cls(ms)

    def check(self, seconds: float, num_tokens: int, what: str) -> None:
        """Raise :class:`GrammarTooSlow` if ``seconds`` of CPU for ``num_tokens`` tokens are over the limit."""
        if seconds * 1000 > self.ms * num_tokens:
            raise GrammarTooSlow(
                RequestFailure(
                    f"the request's grammar took {seconds * 1000 / num_tokens:.2f} ms of CPU for one token "
                    f"({what}), more than the limit of {self.ms:g} ms (max_grammar_ms of "
                    "--structured-outputs-config); every request in the batch waits for it",
                    "structured_outputs",
                )
            )


class GrammarTooSlow(Exception):
    """A request's grammar went over its :class:`GrammarLimit`: the request ends alone, a client error."""

    def __init__(self, failure: RequestFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def _fill_masks(
    rows: list[tuple[str, Any, list[int]]], bitmask: torch.Tensor, limit: GrammarLimit | None
) -> dict[str, RequestFailure]:
    """Fill ``bitmask`` from ``rows``' matchers (on the mask thread): a sequence verifying drafts
    has a row per position, each its matcher's after the drafts before it (then rolled back). A
    matcher that raises leaves its rows allowing every token and is returned with its message; one
    over ``limit`` keeps its rows and is returned too."""
    failures = {}
    row = 0
    for seq_id, matcher, drafts in rows:
        start = time.thread_time()
        try:
            for j in range(len(drafts) + 1):
                matcher.fill_next_token_bitmask(bitmask, row + j)
                if j < len(drafts) and not matcher.accept_token(drafts[j]):
                    raise RuntimeError(f"the grammar refused draft token {drafts[j]}, checked when proposed")
            if drafts:
                matcher.rollback(len(drafts))
            if limit is not None:
                limit.check(time.thread_time() - start, len(drafts) + 1, "filling its token mask")
        except GrammarTooSlow as exc:
            failures[seq_id] = exc.failure
        except Exception as exc:
            logger.exception("request %s: filling the grammar mask failed; ending it alone", seq_id)
            bitmask[row : row + len(drafts) + 1].fill_(-1)
            failures[seq_id] = RequestFailure(f"filling the grammar mask failed: {type(exc).__name__}: {exc}")
        row += len(drafts) + 1
    return failures


class _SpecSchedulerOptions(TypedDict, total=False):
    """``SchedulerConfig``'s speculative-decoding keywords."""

    num_spec_tokens: int
    spec_disable_batch_size: int | None
    num_lookahead_slots: int


def _spec_scheduler_options(spec: SpeculativeConfig | None) -> _SpecSchedulerOptions:
    """The scheduler's speculative-decoding settings; a draft model keeps lookahead slots to propose into."""
    if spec is None:
        return {}
    return {
        "num_spec_tokens": spec.num_speculative_tokens,
        "spec_disable_batch_size": spec.disable_by_batch_size,
        "num_lookahead_slots": spec.num_speculative_tokens if spec.method == "draft_model" else 0,
    }


def _fit_max_model_len(num_blocks: int, config: EngineConfig) -> None:
    """``--max-model-len auto``: the model's length, or what ``num_blocks`` hold for one sequence if that is less."""
    fits = num_blocks * config.block_size
    if fits < config.resolved_max_model_len:
        logger.info(
            "max_model_len auto: %d tokens, what the KV cache's %d blocks hold (the model's is %d)",
            fits,
            num_blocks,
            config.resolved_max_model_len,
        )
        config.max_model_len = fits


def _check_pool_holds_one_sequence(num_blocks: int, config: EngineConfig) -> None:
    """One sequence of ``max_model_len`` tokens must fit the KV pool, or it could never finish."""
    needed = -(-config.resolved_max_model_len // config.block_size)
    if needed > num_blocks:
        raise ValueError(
            f"the KV cache has {num_blocks} blocks of {config.block_size} tokens ({num_blocks * config.block_size} "
            f"tokens), but one sequence of max_model_len {config.max_model_len} needs {needed} blocks; raise "
            "--kv-cache-space (CPU), --gpu-memory-utilization (CUDA) or --num-gpu-blocks-override, or lower "
            "--max-model-len"
        )

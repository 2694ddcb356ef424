"""Iteration-level (continuous) batching over a paged KV cache.

Every step ``schedule()`` picks the batch under one token budget: running
sequences first (decodes, or the next chunk of a long prefill), then swapped-out
sequences back in, then waiting ones in policy order while blocks and
``max_num_seqs`` allow. When the pool runs dry a victim is preempted — the
newest sequence (FCFS) or the lowest-priority one — either swapped out to CPU
blocks (its whole group, so shared blocks stay shared) or freed to be
recomputed from its tokens at the front of the queue.

Under FCFS one request of many samples (``n``, ``best_of``) shares the pool with the others: while two or
more of its samples run, the victim is the newest sample of the request running the most (not a request
running alone), and its preempted samples wait behind requests that have nothing running. Before, one
request of 64 samples × 1,500 tokens on a pool of 11,648 tokens held every block for six minutes, its
preempted samples went back ahead of every newer request, and a 10-token request sent meanwhile waited 234 s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from raypaged.core.block_manager import KVCacheManager
from raypaged.core.lora_plan import LoRASlotPlan
from raypaged.core.outputs import (
    BlockOp,
    BlockOpKind,
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SampledToken,
    SchedulerOutput,
)
from raypaged.core.request import Request, RequestStatus
from raypaged.core.stats import SchedulerStats
from raypaged.core.waiting_queue import WaitingQueue
from raypaged.pooling import add_part

logger = logging.getLogger("raypaged")

POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = (None, "swap", "recompute")


@dataclass(slots=True, frozen=True)
class EndedRequest:
    """A sequence the scheduler finished on its own, and why (for the client)."""

    request: Request
    message: str
    whole_gang: bool = False  # its whole gang was ended with it: it could never fit


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    policy: str = "fcfs"
    preemption_mode: str | None = None  # None: swap groups that share blocks when CPU blocks exist
    max_loras: int = 0  # LoRA adapters in device slots at once (0: no LoRA)
    num_spec_tokens: int = 0  # speculative decoding: most drafts per sequence per step (0: off)
    spec_disable_batch_size: int | None = None  # no drafts in a step while more sequences than this run
    # slots kept past a sampling sequence's tokens, where a draft model writes while it proposes
    num_lookahead_slots: int = 0
    pooling_type: str | None = None  # an embedding model's (every request pools its prompt; see raypaged.pooling)
    # an encoder's, EmbeddingGemma's (every token attends to its whole prompt): a prompt is scheduled whole in one
    # step, never cut into chunks
    whole_prompts: bool = False
    # vLLM's long_prefill_token_threshold: a sequence computes at most this many tokens a step (0: the budget's),
    # so one long prompt leaves room in each step for the prompts behind it
    long_prefill_token_threshold: int = 0
    # a prompt with more tokens left to compute than a step's budget computes at most this many a step (0: the
    # budget's), leaving the rest of each step to the requests that arrive meanwhile; shorter ones are not cut
    long_prompt_chunk: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be swap, recompute or None, got {self.preemption_mode!r}")


class Scheduler:
    """Owns the waiting queue, the running batch, swapped sequences and the block tables."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}  # every live sequence, by id
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.swapped: list[list[Request]] = []  # sequences swapped out together
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._forget_ids: set[str] = set()  # the workers drop these at the next step
        self._unsent_ids: set[str] = set()  # running sequences the workers do not hold yet
        self._out: SchedulerOutput = SchedulerOutput()  # the step being scheduled
        self._budget = 0  # tokens left in it
        self._ended: list[EndedRequest] = []  # ended by the scheduler itself, not yet told to the engine
        # async scheduling: the step in flight whose tokens count as computed already, its sequences
        # with their scheduled tokens (the objects: an id may be reused once a sequence ends)
        self._committed: SchedulerOutput | None = None
        self._committed_requests: list[tuple[Request, int, bool]] = []
        self._overlap = False  # schedule() runs beside a step in flight: it never preempts
        self._max_batch_seqs: int | None = None  # schedule()'s cap on the step's sequences
        # pipeline parallelism: the micro-batches in flight (by their output's id), each with its sequences
        # (sequence, its tokens, whether they were counted as computed when it was sent)
        self._in_flight_batches: dict[int, list[tuple[Request, int, bool]]] = {}
        self.loras = LoRASlotPlan(config.max_loras) if config.max_loras else None
        self.spec = SpecDecodeStats(config.num_spec_tokens)

    # ---- queue management -------------------------------------------------
    def _enqueue(self, request: Request, front: bool = False) -> None:
        self.waiting.push(request, front)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        num_blocks = self.kv.num_blocks_for(request.num_tokens + 1)
        if num_blocks > self.kv.num_blocks:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens needs {num_blocks} KV blocks but the cache "
                f"only has {self.kv.num_blocks}; raise kv_cache_space or num_gpu_blocks_override"
            )
        self.requests[request.request_id] = request
        self._enqueue(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (stop, abort) sequences wherever they are; frees their blocks now."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.SWAPPED:
                self._remove_swapped(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _remove_swapped(self, request: Request) -> None:
        for entry in self.swapped:
            if request in entry:
                entry.remove(request)
        self.swapped = [entry for entry in self.swapped if entry]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request.group is not None and request.group.pending_children:
            request.group.pending_children.clear()  # the first sequence ended before the fork
        if request.gang is not None:
            request.gang.held.pop(request.request_id, None)
        self.kv.free(request.request_id)
        self._forget_ids.add(request.request_id)
        self._unsent_ids.discard(request.request_id)
        del self.requests[request.request_id]

    def reset_after_worker_loss(self, reason: str = "workers restarted") -> None:
        """The workers' KV caches are gone: recompute every live sequence from its tokens.

        Every block table (device and swapped) is freed and the block pools start
        over empty, prefix-cache keys included (their contents are lost);
        running then swapped sequences, in that order, go back to the front of
        the waiting queue with ``num_computed_tokens = 0``. The new workers hold
        nothing, so nothing is left for them to forget.
        """
        in_flight = self.running + [request for group in self.swapped for request in group]
        kv = self.kv
        self.kv = KVCacheManager(kv.num_blocks, kv.block_size, kv.enable_prefix_caching, kv.num_cpu_blocks)
        self.running = []
        self.swapped = []
        for request in reversed(in_flight):
            if request.gang is not None:
                request.gang.held.pop(request.request_id, None)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.num_placeholders = 0  # the step that sampled them is lost
            request.num_preemptions += 1
            self._enqueue(request, front=True)
        self._forget_ids.clear()
        for batch in self._in_flight_batches.values():
            for request, _, _ in batch:
                request.in_flight = False
        self._in_flight_batches.clear()
        self._committed = None
        self._committed_requests = []
        self._unsent_ids.clear()
        if self.loras is not None:
            self.loras.reset()
        logger.warning("%s: %d in-flight sequences will be recomputed", reason, len(in_flight))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ---------------------------------------------------------
    def commit_in_flight(self, so: SchedulerOutput) -> None:
        """Async scheduling: before the next step is scheduled beside ``so`` (in flight), count ``so`` 's
        tokens as computed and give each sequence it samples for a placeholder for its coming token.
        ``update_from_output(so, ...)`` then appends the tokens in their place."""
        requests = self.requests
        committed = []
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            request = requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens == request.num_tokens:  # it samples: its next token is coming
                request.num_placeholders += 1
            self._maybe_fork(request)
            committed.append((request, num_tokens, True))
        self._committed = so
        self._committed_requests = committed

    def mark_in_flight(self, so: SchedulerOutput) -> None:
        """Pipeline parallelism: ``so`` runs as one of several micro-batches in flight. A chunk of a prompt that
        samples nothing counts as computed now, so that the prompt's next chunk can go in the next micro-batch (each
        stage computes them in order); every other sequence of ``so`` sits out every schedule until
        ``update_from_output(so, ...)`` brings its results (scheduled with ``overlap`` meanwhile, so none is
        preempted). The sequence objects are kept: one that ends meanwhile and a new one under its id are told
        apart."""
        requests = self.requests
        batch = []
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            request = requests[request_id]
            ahead = request.num_computed_tokens + num_tokens < request.num_tokens
            if ahead:
                request.num_computed_tokens += num_tokens
                self._maybe_fork(request)
            else:
                request.in_flight = True
            batch.append((request, num_tokens, ahead))
        self._in_flight_batches[id(so)] = batch

    def forget_later(self, so: SchedulerOutput) -> None:
        """A scheduled step that will not run (it had nothing to compute): the workers hear of its
        finished sequences with the next one."""
        self._forget_ids |= so.finished_request_ids

    def schedule(self, overlap: bool = False, max_batch_seqs: int | None = None) -> SchedulerOutput:
        """The next step. ``overlap``: it is scheduled while the step committed by
        ``commit_in_flight`` runs, so it only takes what is free: no sequence is preempted, swapped out
        or ended (one short of blocks waits, and no waiting one is admitted after it), a sequence whose
        coming token is its last is left out, and a step that can run nothing is left to the next
        schedule without ``overlap`` (which breaks stalls). A sequence of a micro-batch in flight
        (``mark_in_flight``) is left out, and ``max_batch_seqs`` caps the sequences of this one (pipeline
        parallelism's micro-batches share the running sequences instead of the first taking them all)."""
        self._out = out = SchedulerOutput()
        self._budget = self.config.max_num_batched_tokens
        self._overlap = overlap
        self._max_batch_seqs = max_batch_seqs
        preempted = False

        speculate = self.config.num_spec_tokens > 0 and (
            self.config.spec_disable_batch_size is None or len(self.running) <= self.config.spec_disable_batch_size
        )
        out.propose_drafts = speculate
        for request in list(self.running):
            if self._budget <= 0 or self._batch_full():
                break
            if request.status != RequestStatus.RUNNING or request.in_flight:
                continue  # preempted earlier in this step, or computed by a micro-batch in flight
            num_new = self._num_new_tokens(request, self._budget)
            if num_new == 0:
                continue
            if (
                overlap
                and request.num_placeholders
                and (request.num_output_tokens + request.num_placeholders >= request.max_tokens)
            ):
                continue  # its coming token ends it by length
            if self.kv.num_blocks_for(request.num_computed_tokens + num_new) > self.kv.num_blocks:
                if overlap:
                    preempted = True  # the next schedule without overlap ends it
                    continue
                message = (
                    f"request {request.request_id} outgrew the whole KV cache ({self.kv.num_blocks} blocks of "
                    f"{self.kv.block_size} tokens) at {request.num_tokens} tokens; finished with what it has"
                )
                logger.warning("%s", message)
                self.running.remove(request)
                self._end(request, message)
                continue
            drafts = self._drafts(request, num_new) if speculate and request.spec_token_ids else []
            if overlap:  # short of blocks: no one is preempted beside a step in flight (drafts go first)
                if not self._allocate(request, num_new, drafts) and not (drafts and self._allocate(request, num_new)):
                    preempted = True
                continue
            while request.status == RequestStatus.RUNNING and not self._allocate(request, num_new, drafts):
                if drafts:  # drafts never preempt anyone: without them first
                    drafts = []
                    continue
                self._preempt(self._pick_victim(request))
                preempted = True

        if not preempted:
            self._swap_in()
        # swapped-out sequences go back before any new one is admitted
        if not preempted and not self.swapped:
            self._admit_waiting()

        if not overlap and not out.num_scheduled_tokens and not out.block_ops and (self.waiting or self.swapped):
            self._resolve_stall()
        out.finished_request_ids = self._forget_ids
        self._forget_ids = set()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "step: %d tokens, running=%d waiting=%d swapped=%d, blocks used=%d free=%d, cpu blocks free=%d",
                out.total_num_scheduled_tokens,
                len(self.running),
                len(self.waiting),
                sum(len(entry) for entry in self.swapped),
                self.kv.num_blocks - self.kv.num_free_blocks,
                self.kv.num_free_blocks,
                self.kv.num_free_cpu_blocks,
            )
        return out

    def _batch_full(self) -> bool:
        """The step has as many sequences as ``schedule``'s ``max_batch_seqs``."""
        cap = self._max_batch_seqs
        return cap is not None and len(self._out.num_scheduled_tokens) >= cap

    def _admit_waiting(self) -> None:
        """Admit waiting sequences in policy order while the batch and the pool have room."""
        while self.waiting and self._budget > 0:
            if self._batch_full():
                break
            request = self._next_waiting()
            if request is None:
                break  # every waiting request's adapter wants a slot that running sequences hold
            if self.config.whole_prompts and request.num_tokens > self._budget:
                break  # a whole prompt: it waits for a step with room for all of it
            images = request.images
            if images is not None and images.bidirectional and max(n for _, n in images.placeholders) > self._budget:
                break  # its images are computed whole: it waits for a step with room for the largest
            full = len(self.running) >= self.config.max_num_seqs
            if full and not self._slot_back(request) and not self._free_slot_for(request):
                break
            if not self._admit(request):
                if self._preempt_for(request):
                    continue  # a lower-priority sequence made room: try again
                logger.debug(
                    "No free blocks available for request %s (%d free); it waits",
                    request.request_id,
                    self.kv.num_free_blocks,
                )
                break
            self._place_loras([request])

    def _next_waiting(self) -> Request | None:
        """The head of the queue, or with LoRA the first request whose adapter can have a slot now; under FCFS,
        the samples of a request with samples running (``_yields``) go after the requests behind them."""
        head = self.waiting.head()
        busy = self._busy_groups(head)
        if (self.loras is None or head.lora is None) and not busy:
            return head
        loras = self.loras
        in_use = loras.in_use(self.running) if loras is not None else set()
        first = None  # the first that fits, should every one that fits yield
        for request in self.waiting:
            if loras is not None and request.lora is not None and not loras.fits([request], in_use):
                continue
            if not self._yields(request, busy):
                return request
            first = first or request
        return first

    def _busy_groups(self, head: Request) -> set[int | str]:
        """FCFS, with ``head`` a sample of a request or a prompt of a client request: the share keys
        (``_share_key``) of the running sequences."""
        if self.config.policy != "fcfs" or _share_key(head) is None:
            return set()
        return {key for r in self.running if (key := _share_key(r)) is not None}

    @staticmethod
    def _yields(request: Request, busy: set[int | str]) -> bool:
        key = _share_key(request)
        return key is not None and key in busy

    def _free_slot_for(self, request: Request) -> bool:
        """FCFS, the batch at ``max_num_seqs``: a waiting request with nothing running takes the slot of the
        newest sample of the request running the most (two at least), which is recomputed later (it waits
        behind the requests with nothing running, ``_yields``). One for one: a batch that a group's forks
        took past ``max_num_seqs`` keeps its size. Without this, one request of many samples kept every
        later request waiting until it ended."""
        if self.config.policy != "fcfs" or self._overlap:
            return False
        if self._yields(request, self._busy_groups(request)):
            return False  # a sample (or prompt) of a request that runs already: it waits its turn
        victim = self._newest_of_the_largest_group(self.running)
        if victim is None:
            return False
        self._recompute_later(victim)
        victim.gave_slot_to = request
        logger.info(
            "preempted request %s (recompute, %d tokens) to give request %s its slot",
            victim.request_id,
            victim.num_tokens,
            request.request_id,
        )
        return True

    @staticmethod
    def _slot_back(request: Request) -> bool:
        """``request`` gave its slot to a request that has ended since: the slot is its own again."""
        holder = request.gave_slot_to
        if holder is None or not holder.status.finished:
            return False
        request.gave_slot_to = None
        return True

    def _place_loras(self, requests: list[Request]) -> None:
        """Slots for the adapters of sequences that just joined the batch; new ones are loaded this step."""
        if self.loras is None:
            return
        in_use = self.loras.in_use(self.running)
        for request in requests:
            if request.lora is not None and (slot := self.loras.place(request.lora, in_use)) is not None:
                self._out.lora_loads.append((slot, request.lora))

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        start = request.num_computed_tokens
        num_new = min(request.num_tokens - start, budget)
        group = request.group
        if group is not None and group.pending_children:
            num_new = min(num_new, group.fork_at - start)
        threshold = self.config.long_prefill_token_threshold
        capped = min(num_new, threshold) if 0 < threshold < num_new else num_new
        chunk = self.config.long_prompt_chunk
        if 0 < chunk < capped and request.num_tokens - start > self.config.max_num_batched_tokens:
            capped = chunk
        images = request.images
        if images is not None and images.bidirectional:  # Gemma 3: an image's tokens in one step (0: not this one)
            whole = images.whole_images_end(start, start + capped) - start
            if whole or capped == num_new:
                return whole
            # the threshold cut an image that starts the chunk: that image whole, within the budget
            cut = start + capped
            image_end = next(offset + n for offset, n in images.placeholders if offset < cut < offset + n)
            return images.whole_images_end(start, min(image_end, start + num_new)) - start
        return capped

    def _drafts(self, request: Request, num_new: int) -> list[int]:
        """The drafts a decoding sequence verifies this step: as many of its proposals as the budget,
        ``max_model_len``, its ``max_tokens`` (the step adds up to one token more than its drafts) and
        the whole pool allow."""
        if num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []  # only a decode speculates
        k = min(
            len(request.spec_token_ids),
            self._budget - 1,
            self.config.max_model_len - request.num_tokens,
            request.max_tokens - request.num_output_tokens - 1,
            self.kv.num_blocks * self.kv.block_size - request.num_tokens,
        )
        return request.spec_token_ids[:k] if k > 0 else []

    def _allocate(self, request: Request, num_new: int, drafts: Sequence[int] = ()) -> bool:
        """Reserve blocks for ``num_new`` tokens and ``drafts`` and record the request in this step's
        output; False if the pool is short."""
        num_slots = num_new + len(drafts)
        lookahead = self._lookahead(request, num_slots, len(drafts)) if self.config.num_lookahead_slots else 0
        allocation = self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_slots + lookahead)
        if allocation is None and lookahead:  # the draft model proposes fewer tokens: no one is preempted for it
            allocation = self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_slots)
        if allocation is None:
            return False
        out = self._out
        if allocation.copies:
            out.block_ops.extend(BlockOp(BlockOpKind.COPY, src, dst) for src, dst in allocation.copies)
        if request.request_id in self._unsent_ids:
            self._unsent_ids.discard(request.request_id)
            out.new_requests.append(self._new_request_data(request))
        else:
            # the output tokens the workers lack: the last step's sampled token (under async scheduling
            # the one before, the last being still in flight), or a run of accepted drafts
            outputs = request.output_token_ids
            sent = request.num_outputs_sent
            request.num_outputs_sent = len(outputs)
            # positional (this runs per sequence per step): id, new token ids, new block ids, computed
            # tokens, replaced block ids, the table's length
            out.cached_requests.append(
                CachedRequestData(
                    request.request_id,
                    outputs[sent:],
                    allocation.new_block_ids,
                    request.num_computed_tokens,
                    allocation.replaced,
                    len(self.kv.tables[request.request_id].block_ids),
                )
            )
        if drafts:
            out.scheduled_spec_tokens[request.request_id] = list(drafts)
        out.num_scheduled_tokens[request.request_id] = num_slots
        self._budget -= num_slots
        return True

    def _lookahead(self, request: Request, num_slots: int, num_drafts: int) -> int:
        """Slots past this step's tokens for the draft model to propose into, when it proposes for
        this sequence after this step (it samples and speculates)."""
        lookahead = self.config.num_lookahead_slots
        end = request.num_computed_tokens + num_slots
        if not (
            lookahead
            and request.num_spec_tokens
            and self._out.propose_drafts
            and end == request.num_tokens + num_drafts
        ):
            return 0
        return max(0, min(lookahead, self.config.max_model_len - end, self.kv.num_blocks * self.kv.block_size - end))

    def _new_request_data(self, request: Request) -> NewRequestData:
        request.num_outputs_sent = len(request.output_token_ids)  # every output token travels with it
        return NewRequestData(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=list(self.kv.get_block_ids(request.request_id)),
            num_computed_tokens=request.num_computed_tokens,
            sample_index=request.sample_index,
            lora_int_id=None if request.lora is None else request.lora.lora_int_id,
            num_spec_tokens=request.num_spec_tokens,
            token_type_start=request.token_type_start,
            images=request.images,
            prompt_embeds=request.prompt_embeds,
        )

    def _admit(self, request: Request) -> bool:
        """Move the head of the queue into the batch if its blocks fit."""
        # positions whose prompt logprobs are still wanted are computed, not taken from the cache
        limit = len(request.prompt_logprobs) if request.prompt_logprobs_missing else None
        num_cached = self.kv.computed_prefix(request.request_id, request.all_token_ids, request.cache_salt, limit)
        request.num_computed_tokens = num_cached
        num_new = self._num_new_tokens(request, self._budget)
        if num_new == 0:  # the prefix its group shares is all cached: fork right away
            self._maybe_fork(request)
            num_new = self._num_new_tokens(request, self._budget)
        self._unsent_ids.add(request.request_id)
        if not self._allocate(request, num_new):
            self._unsent_ids.discard(request.request_id)
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
            return False
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        request.gave_slot_to = None
        if self.kv.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
        if request.num_cached_tokens is None:  # its first admission: the hits its caller is told of
            request.num_cached_tokens = num_cached
        return True

    def _maybe_fork(self, request: Request) -> None:
        """Fork the group's other samples off its first sequence once the shared prefix is computed."""
        group = request.group
        if group is None or not group.pending_children or request.num_computed_tokens < group.fork_at:
            return
        for child in group.pending_children:
            self.fork(request, child)
        group.pending_children.clear()

    def fork(self, parent: Request, child: Request) -> None:
        """Run ``child`` from now on, sharing every block of ``parent`` (a sample of ``n``, or a
        gang's owner forking a member)."""
        self.kv.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)
        self._unsent_ids.add(child.request_id)

    # ---- preemption and swapping -------------------------------------------
    def _pick_victim(self, needy: Request | None = None) -> Request:
        """The sequence to preempt: newest (FCFS) or least urgent (priority).

        Never a member of ``needy``'s gang: members wait for each other, so preempting
        one for another would only trade places; ``needy`` itself may be chosen.
        """
        pool = self.running
        if needy is not None and needy.gang is not None:
            pool = [r for r in self.running if r.gang is not needy.gang or r is needy]
        if self.config.policy == "priority":
            return max(pool, key=lambda r: (r.priority, r.arrival_time))
        return self._newest_of_the_largest_group(pool) or pool[-1]

    @staticmethod
    def _newest_of_the_largest_group(pool: list[Request]) -> Request | None:
        """The newest running sample of the request with the most samples running (two at least; the newest
        such request on a tie; a client request's prompts count as its samples, ``_share_key``): FCFS takes
        from it before any request running alone."""
        counts: dict[int | str, int] = {}
        newest: dict[int | str, Request] = {}
        for request in pool:
            if request.gang is None and (key := _share_key(request)) is not None:
                counts[key] = counts.get(key, 0) + 1
                newest[key] = request
        if not counts or max(counts.values()) < 2:
            return None
        key = max(counts, key=lambda k: (counts[k], newest[k].arrival_time))
        return newest[key]

    def _preempt_for(self, waiting: Request) -> bool:
        """Priority policy: preempt a running sequence of lower priority than ``waiting``.

        Only when preempting every one of lower priority would make room for it:
        otherwise the victims would lose their place for nothing (and a group
        swapped in would be swapped out again at once, step after step).
        """
        if self.config.policy != "priority" or not self.running or self._overlap:
            return False
        victim = self._pick_victim()
        if victim.priority <= waiting.priority:
            return False  # only a strictly more urgent request may displace a running one
        if not self._room_after_preempting(waiting):
            return False
        self._preempt(victim)
        return True

    def _room_after_preempting(self, waiting: Request) -> bool:
        """Would ``waiting`` be admitted once every running sequence of lower priority is gone?"""
        victims = [r for r in self.running if r.priority > waiting.priority]
        if len(self.running) - len(victims) >= self.config.max_num_seqs:
            return False
        refs: dict[int, int] = {}
        for request in victims:
            for block_id in self.kv.get_block_ids(request.request_id):
                refs[block_id] = refs.get(block_id, 0) + 1
        ref_counts = self.kv.pool.ref_counts
        num_freed = sum(1 for block_id, n in refs.items() if ref_counts[block_id] == n)
        hits = self.kv.cached_prefix_blocks(waiting.all_token_ids, waiting.cache_salt)
        num_cached = len(hits) * self.kv.block_size
        num_new = min(waiting.num_tokens - num_cached, self._budget)
        if waiting.group is not None and waiting.group.pending_children:
            num_new = max(min(num_new, waiting.group.fork_at - num_cached), 0)
        kept = sum(1 for block_id in hits if ref_counts[block_id] > refs.get(block_id, 0))
        return self.kv.num_blocks_for(num_cached + num_new) - kept <= self.kv.num_free_blocks + num_freed

    def _preempt(self, victim: Request) -> None:
        group = [victim]
        if victim.group is not None:
            group = [r for r in self.running if r.group is victim.group]
        mode = self.config.preemption_mode
        shares_blocks = len(group) > 1
        # gang members (beams) fork and drop every step: they are recomputed, never swapped; and a
        # group that is the whole batch is not swapped either (it would come back to
        # the same shortage): its newest sequence is recomputed alone
        swap = mode == "swap" or (mode is None and shares_blocks)
        if swap and victim.gang is None and len(group) < len(self.running):
            copies = self.kv.swap_out([r.request_id for r in group])
            if copies is not None:
                self._out.block_ops.extend(BlockOp(BlockOpKind.SWAP_OUT, src, dst) for src, dst in copies)
                for request in group:
                    self._drop_from_batch(request)
                    request.status = RequestStatus.SWAPPED
                self.swapped.append(group)
                self.num_preemptions += 1
                self.num_swap_outs += 1
                logger.warning(
                    "No free blocks available: swapped out %s (%d blocks to CPU)",
                    ", ".join(r.request_id for r in group),
                    len(copies),
                )
                return
        self._recompute_later(victim)
        logger.warning(
            "No free blocks available: preempted request %s (recompute, %d tokens)",
            victim.request_id,
            victim.num_tokens,
        )

    def _recompute_later(self, victim: Request) -> None:
        """Preempt ``victim`` by recomputation: its blocks are freed and it waits at the front of the queue."""
        self._drop_from_batch(victim)
        self.kv.free(victim.request_id)
        if victim.gang is not None:
            victim.gang.held.pop(victim.request_id, None)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(victim, front=True)

    def _drop_from_batch(self, request: Request) -> None:
        """Take a running sequence out of the batch, and out of this step's output if it was in."""
        self.running.remove(request)
        self._forget_ids.add(request.request_id)
        self._unsent_ids.discard(request.request_id)
        out = self._out
        num_scheduled = out.num_scheduled_tokens.pop(request.request_id, None)
        if num_scheduled is not None:
            self._budget += num_scheduled
            out.scheduled_spec_tokens.pop(request.request_id, None)
            out.new_requests = [d for d in out.new_requests if d.request_id != request.request_id]
            out.cached_requests = [d for d in out.cached_requests if d.request_id != request.request_id]

    def _swap_in(self) -> None:
        """Bring swapped groups back, oldest first, while they can run this very step.

        Beside running sequences a group comes back only if its blocks and the
        blocks its next tokens take fit, so it is scheduled as it returns (a group
        that came back without room would be swapped out again at once, for
        ever). When nothing else runs it comes back as soon as its blocks fit, so
        a group larger than the batch limits or short of spare blocks still
        progresses (its newest sequences are recomputed if it must shrink).
        """
        while self.swapped and self._budget > 0 and not self._batch_full():
            group = self.swapped[0]
            if self.running:
                if len(self.running) + len(group) > self.config.max_num_seqs:
                    break
                plan, budget = [], self._budget
                for request in group:
                    num_new = self._num_new_tokens(request, budget)
                    budget -= num_new
                    plan.append((request.request_id, request.num_computed_tokens, num_new))
                if self.kv.num_blocks_to_swap_in(plan) > self.kv.num_free_blocks:
                    break
            elif len({b for r in group for b in self.kv.swapped[r.request_id].block_ids}) > self.kv.num_free_blocks:
                break
            if self.loras is not None and not self.loras.fits(group, self.loras.in_use(self.running)):
                break  # its adapter waits for a slot
            copies = self.kv.swap_in([r.request_id for r in group])
            assert copies is not None, "its blocks were counted free above"
            self._out.block_ops.extend(BlockOp(BlockOpKind.SWAP_IN, src, dst) for src, dst in copies)
            self.swapped.pop(0)
            for request in group:
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                self._unsent_ids.add(request.request_id)
            self._place_loras(group)
            for request in group:
                num_new = self._num_new_tokens(request, self._budget)
                if num_new:
                    self._allocate(request, num_new)

    # ---- results ------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish what stopped.

        Returns the sequences that received a token this step (finished ones
        included); a gang member's sample is held in its gang for the owner instead.
        """
        updated = []
        committed = scheduler_output is self._committed
        # a micro-batch's own sequences, or under async scheduling those whose tokens were counted when the
        # next step was scheduled beside this one: those still running (not finished or preempted meanwhile)
        batch = self._in_flight_batches.pop(id(scheduler_output), None)
        if committed:
            batch, self._committed, self._committed_requests = self._committed_requests, None, []
        if batch is not None:
            for request, _, counted in batch:
                if not counted:  # a chunk counted ahead set no flag (a later one may have)
                    request.in_flight = False
            scheduled = [entry for entry in batch if entry[0].status == RequestStatus.RUNNING]
        else:
            scheduled = [
                (found, num_tokens, False)
                for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items()
                if (found := self.requests.get(request_id)) is not None and found.status == RequestStatus.RUNNING
            ]
        for request, num_tokens, counted in scheduled:
            request_id = request.request_id
            if (run := runner_output.sampled_runs.get(request_id)) is not None:
                num_drafts = len(scheduler_output.scheduled_spec_tokens.get(request_id, ()))
                self._apply_run(request, run, num_tokens - num_drafts, num_drafts)
                request.spec_token_ids = runner_output.draft_token_ids.get(request_id, [])
                updated.append(request)
                continue
            if not counted:
                request.num_computed_tokens += num_tokens
            self.kv.cache_blocks(
                request_id, request.prompt_token_ids, request.output_token_ids, request.num_computed_tokens
            )
            self._maybe_fork(request)
            if (prompt_logprobs := runner_output.prompt_logprobs.get(request_id)) is not None:
                request.add_prompt_logprobs(prompt_logprobs.start, prompt_logprobs.logprobs)
            if request.pooling is not None:  # an embedding: its chunk's part added; done with its prompt
                if (part := runner_output.pooled.get(request_id)) is not None:
                    assert self.config.pooling_type is not None, "pooled parts come from an embedding model's runner"
                    request.pooled = add_part(self.config.pooling_type, request.pooled, part[1], part[0])
                if request.num_computed_tokens >= request.num_prompt_tokens:
                    self.running.remove(request)
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                    updated.append(request)
                continue
            sampled = runner_output.sampled.get(request_id)
            if committed and request.num_placeholders:
                request.num_placeholders -= 1  # the token comes now (or its row failed)
            if sampled is None:
                continue
            if request.gang is not None:
                top_logprobs = sampled.top_logprobs
                assert top_logprobs is not None, "a gang member's params ask for logprobs"
                request.gang.held[request_id] = top_logprobs
                continue
            request.append_output_token(sampled.token_id, sampled.logprob, sampled.top_logprobs)
            request.num_new_tokens, request.run_logprobs = 1, None
            if runner_output.draft_token_ids or request.spec_token_ids:
                request.spec_token_ids = runner_output.draft_token_ids.get(request_id, [])
            status = request.check_stop()
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updated.append(request)
        return updated

    def _apply_run(self, request: Request, run: list[SampledToken], num_verified: int, num_drafts: int) -> None:
        """A step that verified ``num_drafts`` drafts gave ``run``: the accepted ones, then the target's
        own token. Its K/V counts up to the last accepted draft; the rejected drafts' slots are rolled
        back (blocks past its tokens freed); tokens after a stop inside the run are dropped."""
        num_accepted = len(run) - 1
        self.spec.record(num_drafts, num_accepted)
        request.num_computed_tokens += num_verified + num_accepted
        num_before = request.num_output_tokens
        status = None
        for token in run:
            request.append_output_token(token.token_id, token.logprob, token.top_logprobs)
            if (status := request.check_stop()) is not None:
                break
        request.num_new_tokens = request.num_output_tokens - num_before
        request.run_logprobs = [token.logprob for token in run[: request.num_new_tokens]]
        if status is not None:
            self.running.remove(request)
            self._finish(request, status)
            return
        self.kv.cache_blocks(
            request.request_id, request.prompt_token_ids, request.output_token_ids, request.num_computed_tokens
        )
        self.kv.trim(request.request_id, request.num_tokens + self.config.num_lookahead_slots)

    def _resolve_stall(self) -> None:
        """Nothing ran this step although sequences wait: give the pool to the most urgent.

        Every running sequence is then idle (a gang member waiting for a sibling
        that was preempted), holding blocks that the oldest swapped group or the
        head of the queue needs, while they wait behind it: neither could ever
        move. The oldest swapped group, else the head of the queue (with the rest
        of its gang), gets the pool: every other running sequence is preempted and it
        comes back now. Only a head that cannot fit even then is finished.
        """
        if self.swapped:
            for victim in self.running[::-1]:
                if victim.status == RequestStatus.RUNNING:
                    self._preempt(victim)
            self._swap_in()
            return
        head = self.waiting.head()
        unit = [head] if head.gang is None else [r for r in self.requests.values() if r.gang is head.gang]
        held = [r.request_id for r in unit if r.status == RequestStatus.RUNNING]
        recomputed = [r.all_token_ids for r in unit if r.status != RequestStatus.RUNNING]
        if (
            len(unit) > self.config.max_num_seqs
            or self.kv.num_blocks_to_hold(held, recomputed, head.cache_salt) > self.kv.num_blocks
        ):
            self._break_stall(head)
            return
        for victim in self.running[::-1]:
            if victim.status == RequestStatus.RUNNING and victim not in unit:
                self._preempt(victim)
        if self.config.policy == "fcfs":  # the preempted went to the front: the head goes first still
            self.waiting.move_to_front([r for r in self.waiting if r in unit])
        self._admit_waiting()
        if head.status != RequestStatus.RUNNING:
            self._break_stall(head)  # alone in the pool and still short: it never fits

    def _break_stall(self, head: Request) -> None:
        """Nothing could run although a request waits: it can never fit, so end it.

        This is a gang (beam search) whose members together need more blocks than
        the cache has (the waiting member needs blocks its siblings hold while they
        wait for it), or a sequence that outgrew the cache while preempted.
        """
        gang = head.gang
        stalled = [head] if gang is None else [r for r in self.requests.values() if r.gang is gang]
        message = (
            f"request {head.request_id if gang is None else gang.gang_id} cannot fit in the KV cache "
            f"({self.kv.num_blocks} blocks of {self.kv.block_size} tokens); finished with what it has"
        )
        logger.warning("%s", message)
        for request in stalled:
            (self.running if request.status == RequestStatus.RUNNING else self.waiting).remove(request)
            self._end(request, message, whole_gang=gang is not None)

    def _end(self, request: Request, message: str, whole_gang: bool = False) -> None:
        """Finish a sequence the scheduler gives up on; the engine hears of it from ``take_ended``."""
        self._finish(request, RequestStatus.FINISHED_LENGTH)
        self._ended.append(EndedRequest(request, message, whole_gang))

    def take_ended(self) -> list[EndedRequest]:
        """Sequences ended by the scheduler itself (outgrew the pool, stall broken) since the last call."""
        ended, self._ended = self._ended, []
        return ended

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_gpu_blocks_total=self.kv.num_blocks,
            num_gpu_blocks_free=self.kv.num_free_blocks,
            num_cpu_blocks_total=self.kv.num_cpu_blocks,
            num_cpu_blocks_free=self.kv.num_free_cpu_blocks,
            kv_cache_usage=self.kv.usage,
            num_requests_running=len(self.running),
            num_requests_waiting=len(self.waiting),
            num_requests_swapped=sum(len(entry) for entry in self.swapped),
            num_preemptions=self.num_preemptions,
            num_swap_outs=self.num_swap_outs,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            spec_decode=self.spec.as_dict(),
        )


class SpecDecodeStats:
    """Speculative decoding's counters, as vLLM names them: verifications, drafts, accepted drafts,
    and accepted drafts by position in their run."""

    def __init__(self, num_spec_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_spec_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            for pos in range(num_accepted):
                self.accepted_per_pos[pos] += 1

    def as_dict(self) -> dict[str, int]:
        """The counters by stats key; position ``i``'s as ``spec_decode_num_accepted_tokens_per_pos_<i>``."""
        found = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
        for pos, count in enumerate(self.accepted_per_pos):
            found[f"{ACCEPTED_PER_POS}_{pos}"] = count
        return found


ACCEPTED_PER_POS = "spec_decode_num_accepted_tokens_per_pos"


def _share_key(request: Request) -> int | str | None:
    """What shares the batch and the KV pool under FCFS: the client request of several prompts (``owner``),
    else the sample group of ``n``/``best_of``; None: a request of one sequence, on its own."""
    if request.owner is not None:
        return request.owner
    return None if request.group is None else id(request.group)

"""Iteration-level (continuous) batching over a paged KV cache.

Every step ``schedule()`` picks the batch under one token budget: running
requests first (decodes, or the next chunk of a long prefill), then waiting
requests in FCFS order while blocks and ``max_num_seqs`` allow. When the pool
runs dry the newest running request is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed from its tokens.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from raypaged.core.block_manager import KVCacheManager
from raypaged.core.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from raypaged.core.request import Request, RequestStatus

logger = logging.getLogger("raypaged")


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")


class Scheduler:
    """Owns the waiting queue, the running batch and the KV block tables."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # requests the workers must forget at the next step
        self._forget_ids: set[str] = set()

    # ---- queue management -------------------------------------------------
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
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (stop, abort) requests wherever they are; frees their blocks now."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request.request_id)
        self._forget_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ---------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.kv.num_blocks_for(request.num_computed_tokens + num_new) > self.kv.num_blocks:
                logger.warning("request %s outgrew the whole KV cache; finishing it", request.request_id)
                self.running.pop(index)
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                continue
            while (new_block_ids := self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new)) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_block_ids is None:
                break
            first_new_output = max(request.num_computed_tokens, request.num_prompt_tokens) - request.num_prompt_tokens
            last_new_output = request.num_computed_tokens + num_new - request.num_prompt_tokens
            out.cached_requests.append(
                CachedRequestData(
                    request_id=request.request_id,
                    new_token_ids=request.output_token_ids[first_new_output:max(first_new_output, last_new_output)],
                    new_block_ids=new_block_ids,
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
            scheduled.append(request)
            index += 1

        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_block_ids = self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            if new_block_ids is None:
                logger.debug(
                    "No free blocks available for request %s (%d free); it waits",
                    request.request_id,
                    self.kv.num_free_blocks,
                )
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.new_requests.append(
                NewRequestData(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=list(self.kv.get_block_ids(request.request_id)),
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new

        out.finished_request_ids = self._forget_ids
        self._forget_ids = set()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "step: %d tokens, running=%d waiting=%d, blocks used=%d free=%d",
                out.total_num_scheduled_tokens,
                len(self.running),
                len(self.waiting),
                self.kv.num_blocks - self.kv.num_free_blocks,
                self.kv.num_free_blocks,
            )
        return out

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._forget_ids.add(request.request_id)
        self.waiting.appendleft(request)
        logger.warning(
            "No free blocks available: preempted request %s (recompute, %d tokens)",
            request.request_id,
            request.num_tokens,
        )

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish what stopped.

        Returns the requests that received a token this step (finished ones included).
        """
        updated = []
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or preempted while the step ran
            request.num_computed_tokens += num_tokens
            sampled = runner_output.sampled.get(request_id)
            if sampled is None:
                continue
            request.append_output_token(sampled.token_id, sampled.logprob, sampled.top_logprobs)
            status = request.check_stop()
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updated.append(request)
        return updated

    def stats(self) -> dict[str, int | float]:
        return {
            "num_gpu_blocks_total": self.kv.num_blocks,
            "num_gpu_blocks_free": self.kv.num_free_blocks,
            "kv_cache_usage": self.kv.usage,
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "num_preemptions": self.num_preemptions,
        }

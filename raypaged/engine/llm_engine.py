"""The synchronous engine: add requests, call ``step()`` until none are left.

The driver side of every step: ``Scheduler.schedule()`` → executor →
``Scheduler.update_from_output()`` → detokenize and check stop strings.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from transformers import AutoTokenizer

from raypaged.config import EngineConfig
from raypaged.core.block_manager import KVCacheManager
from raypaged.core.request import Request, RequestStatus
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from raypaged.engine.detokenizer import IncrementalDetokenizer
from raypaged.executor.uniproc import UniProcExecutor
from raypaged.outputs import CompletionOutput, RequestOutput
from raypaged.sampling_params import SamplingParams

logger = logging.getLogger("raypaged")


@dataclass(slots=True)
class _RequestState:
    """Engine-side view of a request: its text as it streams out."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.eos_token_id = self._eos_token_id()
        self.executor = UniProcExecutor(config, self.eos_token_id)
        num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_cache(num_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
            ),
            KVCacheManager(num_blocks, config.block_size),
        )
        self._states: dict[str, _RequestState] = {}
        self._ids = itertools.count()

    def _eos_token_id(self) -> int | None:
        eos = getattr(self.config.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos if eos is not None else self.tokenizer.eos_token_id

    # ---- requests ----------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def add_request(
        self,
        prompt: str | None,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        """Validate and queue one request; returns its id. Bad input raises ``ValueError``.

        ``prompt_token_ids``, when given, are used as they are (``prompt`` is then
        only reported back); otherwise ``prompt`` is tokenized.
        """
        if request_id is None:
            request_id = str(next(self._ids))
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("either prompt or prompt_token_ids is required")
            prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = list(prompt_token_ids)
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.config.hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab}), got {bad[0]}")
        max_len = self.config.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, which leaves no room to generate within "
                f"max_model_len {max_len}"
            )
        room = max_len - len(prompt_token_ids)
        max_tokens = room if sampling_params.max_tokens is None else min(sampling_params.max_tokens, room)
        request = Request(request_id, prompt_token_ids, sampling_params, max_tokens, self.eos_token_id)
        self.scheduler.add_request(request)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sampling_params.skip_special_tokens)
        self._states[request_id] = _RequestState(request, prompt, detok)
        return request_id

    def abort_request(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for each request that got a token."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs = []
        for request in updated:
            state = self._states[request.request_id]
            self._process_token(state)
            outputs.append(self._make_output(state))
            if state.finish_reason is not None:
                del self._states[request.request_id]
        return outputs

    def _process_token(self, state: _RequestState) -> None:
        """Detokenize the newest token; a stop string found in the text finishes the request."""
        request = state.request
        params = request.sampling_params
        searched = max(0, len(state.text) - params.max_stop_len + 1)
        state.text += state.detokenizer.add_tokens(request.output_token_ids[-1:])
        if request.status.finished:
            state.text += state.detokenizer.flush()
        cut = _find_stop(state.text, params.stop, searched)
        if cut is not None:
            state.text, state.stop_reason = cut
            state.finish_reason = "stop"
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        elif request.status.finished:
            state.finish_reason = request.status.finish_reason
            state.stop_reason = request.stop_reason

    def _make_output(self, state: _RequestState) -> RequestOutput:
        request = state.request
        wants_logprobs = request.sampling_params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob,
            logprobs=list(request.output_logprobs) if wants_logprobs else None,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=state.finish_reason is not None,
        )

    def stats(self) -> dict[str, int | float]:
        return self.scheduler.stats()


def _find_stop(text: str, stops: list[str], start: int) -> tuple[str, str] | None:
    """The text cut before the earliest stop string found at or after ``start``, and that string."""
    best = None
    for stop in stops:
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    return text[: best[0]], best[1]

"""Turns a SchedulerOutput into one forward pass and the sampled tokens.

The runner keeps a per-request cache (tokens, block table, sampling params)
that the scheduler's deltas update; finished and preempted requests are
dropped when the scheduler says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raypaged.attention.metadata import AttentionMetadata, PrefillSpan
from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.sampling_params import SamplingParams
from raypaged.worker.cache import KVCache
from raypaged.worker.sampler import SamplingInput, sample


@dataclass(slots=True)
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    sample_index: int = 0

    def token_at(self, position: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < num_prompt else self.output_token_ids[position - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampled] token index whose logits are sampled
    sampled_request_ids: list[str]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        block_size: int,
        eos_token_id: int | None,
        seed: int,
        device: torch.device,
        samples: bool = True,
    ) -> None:
        """``samples``: this rank samples and reports tokens (rank 0); the others only run the forward."""
        self.model = model
        self.samples = samples
        self.cache = cache
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)
        self.requests: dict[str, CachedRequestState] = {}

    def update_states(self, so: SchedulerOutput) -> None:
        for request_id in so.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in so.new_requests:
            self.requests[new.request_id] = CachedRequestState(
                new.request_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                new.sampling_params,
                list(new.block_ids),
                new.num_computed_tokens,
                new.sample_index,
            )
        for cached in so.cached_requests:
            state = self.requests[cached.request_id]
            state.output_token_ids.extend(cached.new_token_ids)
            for index, block_id in cached.replaced_block_ids:
                state.block_ids[index] = block_id
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """Flatten the step: decodes (one token) first, then prefill spans."""
        order = sorted(so.num_scheduled_tokens, key=lambda rid: so.num_scheduled_tokens[rid] != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        sample_indices: list[int] = []
        sampled_ids: list[str] = []
        bs = self.block_size
        for request_id in order:
            state = self.requests[request_id]
            num_new = so.num_scheduled_tokens[request_id]
            start = state.num_computed_tokens
            end = start + num_new
            query_start = len(input_ids)
            for pos in range(start, end):
                input_ids.append(state.token_at(pos))
                positions.append(pos)
                slots.append(state.block_ids[pos // bs] * bs + pos % bs)
            num_blocks = -(-end // bs)
            if num_new == 1:
                decode_tables.append(state.block_ids[:num_blocks])
                decode_lens.append(end)
            else:
                block_ids = torch.tensor(state.block_ids[:num_blocks], dtype=torch.long, device=self.device)
                prefills.append(PrefillSpan(query_start, num_new, end, block_ids))
            if end == state.num_tokens:  # the last known token: its logits give the next one
                sample_indices.append(len(input_ids) - 1)
                sampled_ids.append(request_id)
        max_blocks = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
        as_long = dict(dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, **as_long),
            num_decode_tokens=len(decode_tables),
            decode_block_tables=torch.tensor(padded, **as_long).view(len(padded), max_blocks),
            decode_context_lens=torch.tensor(decode_lens, **as_long),
            prefills=prefills,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, **as_long),
            positions=torch.tensor(positions, **as_long),
            meta=meta,
            sample_indices=torch.tensor(sample_indices, **as_long),
            sampled_request_ids=sampled_ids,
        )

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(so)
        self.cache.run_block_ops(so.block_ops)
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput()
        step = self.prepare_inputs(so)
        hidden = self.model(step.input_ids, step.positions, self.cache.layers, step.meta)
        if not step.sampled_request_ids:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[step.sample_indices]).cpu()  # a collective under TP
        if not self.samples:
            return ModelRunnerOutput()
        inputs = [
            SamplingInput(s.sampling_params, s.prompt_token_ids, s.output_token_ids, self.eos_token_id, s.sample_index)
            for s in (self.requests[rid] for rid in step.sampled_request_ids)
        ]
        tokens = sample(logits, inputs, self.generator)
        return ModelRunnerOutput(sampled=dict(zip(step.sampled_request_ids, tokens)))

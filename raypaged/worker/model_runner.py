"""Turns a SchedulerOutput into one forward pass and the sampled tokens.

The runner keeps a per-request cache (tokens, block table, sampling params)
that the scheduler's deltas update; finished and preempted requests are
dropped when the scheduler says so.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from raypaged import envs
from raypaged.attention.metadata import AttentionMetadata, PrefillSpan
from raypaged.core.outputs import ModelRunnerOutput, PromptLogprobs, RequestFailure, SampledToken, SchedulerOutput
from raypaged.model.encoder import EncoderModel, uses_token_types
from raypaged.model.llama import ImageRows
from raypaged.multimodal import ImageInputs, mrope_positions
from raypaged.pooling import chunk_part
from raypaged.sampling_params import RAW_LOGPROBS, SamplingParams
from raypaged.spec_decode.verify import accepted_run
from raypaged.worker.block_tables import BlockTables
from raypaged.worker.cache import KVCache
from raypaged.worker.cuda_graphs import DecodeGraphs
from raypaged.worker.piecewise_graphs import PiecewiseGraphs
from raypaged.worker.sampler import (
    NoTokenLeft,
    SamplingInput,
    apply_token_bitmask,
    greedy_fast_path,
    logprob_entry,
    sample,
    token_ranks,
)

if TYPE_CHECKING:
    from raypaged.lora.manager import LoRAManager
    from raypaged.lora.request import LoRARequest
    from raypaged.model.llama import LlamaForCausalLM
    from raypaged.model.loader import ImageEncoder
    from raypaged.spec_decode.draft_model import DraftModelProposer

logger = logging.getLogger("raypaged")
_PROMPT_LOGPROBS_CHUNK = 512  # prompt positions whose full-vocabulary logits exist at once
# a decode-only step of at most this many sequences builds its inputs as Python lists: the numpy
# path's fixed cost (about 16 us) is more than a list per row below five rows (8 against 16 us at 1)
_LIST_INPUTS_MAX_DECODES = 4


@dataclass(slots=True)
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    num_blocks: int  # its block table's length; the ids are its row of the runner's BlockTables
    num_computed_tokens: int
    sample_index: int = 0
    lora_int_id: int | None = None
    num_spec_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # the drafts it verifies this step
    # async scheduling: tokens this runner sampled that the scheduler has not sent back yet, oldest
    # first (the next step may be scheduled before they reach the scheduler: it computes them from here)
    sampled_unsent: list[int] = field(default_factory=list)
    prompt_array: np.ndarray | None = None  # the prompt as int64, made for its first span of several tokens
    token_type_start: int | None = None  # BERT's text pair: its second text's first token (type 1 from there)
    row: int = -1  # its row of the runner's BlockTables
    images: ImageInputs | None = None  # the prompt's images
    prompt_embeds: torch.Tensor | None = None  # vLLM's prompt_embeds: a row per prompt token (its ids are placeholders)
    image_embeds: torch.Tensor | None = None  # their embeddings, one row per image token, once a step needs them
    # Qwen2-VL's M-RoPE: the prompt's positions [3, num_prompt] and the shift of the later tokens' (None: a
    # request whose positions are its token indices)
    mrope: np.ndarray | None = None
    mrope_shift: int = 0

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """M-RoPE positions ``[3, end - start]`` of tokens ``start..end-1``."""
        assert self.mrope is not None
        num_prompt = self.mrope.shape[1]
        later = np.arange(max(start, num_prompt), max(end, num_prompt), dtype=np.int64) + self.mrope_shift
        return np.concatenate([self.mrope[:, start:end], np.broadcast_to(later, (3, len(later)))], axis=1)

    def token_at(self, position: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        if position < num_prompt:
            return self.prompt_token_ids[position]
        index = position - num_prompt
        num_output = len(self.output_token_ids)
        if index < num_output:
            return self.output_token_ids[index]
        return (self.spec_token_ids or self.sampled_unsent)[index - num_output]

    def token_array(self, start: int, end: int) -> np.ndarray:
        """Positions ``start..end-1``'s tokens (int64): slices of the prompt's array, and of the
        outputs and drafts after it, with no per-token Python."""
        if self.prompt_array is None:
            self.prompt_array = np.array(self.prompt_token_ids, dtype=np.int64)
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_array[start:end]
        first, last = max(start - num_prompt, 0), end - num_prompt  # indices past the prompt
        outputs = self.output_token_ids
        num_output = len(outputs)
        extra = self.spec_token_ids or self.sampled_unsent
        tail = np.array(
            outputs[first:last] + extra[max(first - num_output, 0) : max(last - num_output, 0)], dtype=np.int64
        )
        return np.concatenate((self.prompt_array[start:], tail)) if start < num_prompt else tail

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + len(self.sampled_unsent)

    @property
    def known_output_token_ids(self) -> list[int]:
        """Every output token so far, those sampled here and not yet sent back included."""
        return self.output_token_ids + self.sampled_unsent if self.sampled_unsent else self.output_token_ids


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampled] token index whose logits are sampled
    sampled_request_ids: list[str]
    # requests wanting prompt logprobs: (request id, first step token index, first prompt token predicted, count)
    prompt_spans: list[tuple[str, int, int, int]] = field(default_factory=list)
    embeds: ImageRows | None = None  # the step's image rows
    mrope_positions: torch.Tensor | None = None  # [3, num_tokens]: M-RoPE's, where the step has image tokens


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: KVCache,
        block_size: int,
        eos_token_id: int | None,
        seed: int,
        device: torch.device,
        samples: bool = True,
        lora: LoRAManager | None = None,
        async_scheduling: bool = False,
        logprobs_mode: str = RAW_LOGPROBS,
        pooling_type: str | None = None,
        image_encoder: ImageEncoder | None = None,
        last_stage: bool = True,
        first_stage: bool = True,
        reports_inputs: bool = True,
    ) -> None:
        """``samples``: this rank samples and reports tokens (rank 0); the others only run the forward.
        ``last_stage`` False: a pipeline stage before the last, whose forward hands its stream on (no logits).
        ``first_stage`` False: a pipeline stage after the first, whose forward takes the stream from the stage
        before (no embeddings: images and prompt embeddings are the first stage's). ``reports_inputs``: this rank
        reports the requests whose inputs failed (images that could not be encoded): rank 0 of the first stage.
        ``logprobs_mode``: what the logprobs requests ask for hold (``sampler.sample``).
        ``lora``: the model's LoRA slots, filled as each step's ``lora_loads`` say.
        ``async_scheduling``: a step may be scheduled before the tokens of the one before it reach the
        scheduler; the runner keeps each sampled token until the scheduler sends it back (one shard only).
        ``pooling_type``: an embedding model's (``raypaged.pooling``): no token is sampled; each step reports what
        every chunk adds to its request's vector."""
        assert samples or not async_scheduling, "async scheduling needs the tokens of the rank that samples"
        self.model = model
        self.samples = samples
        self.last_stage = last_stage
        self.first_stage = first_stage
        self.reports_inputs = reports_inputs
        self.async_scheduling = async_scheduling
        self.logprobs_mode = logprobs_mode
        self.pooling_type = pooling_type
        # BERT's token types: a pair's second text embeds as type 1 (from its request's token_type_start)
        self.token_types = isinstance(model, EncoderModel) and uses_token_types(model.config)
        self.cache = cache
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # unseeded draws, where the logits are
        self.requests: dict[str, CachedRequestState] = {}
        self.block_tables = BlockTables()  # every request's table, a row each
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None  # steps with prefill spans ($RAYPAGED_PIECEWISE_GRAPHS)
        self.lora = lora
        self._lora_slot_of: dict[int, int] = {}  # adapter id -> the slot holding it
        self.spec_states: list[CachedRequestState] = []  # the requests verifying drafts this step
        self.drafter: DraftModelProposer | None = None  # speculative decoding with a draft model
        self.image_encoder = image_encoder  # an image-text model's: encodes a request's images when first needed
        self.image_failures: dict[str, RequestFailure] = {}  # this step's requests whose images did not encode

    def update_states(self, so: SchedulerOutput) -> None:
        tables = self.block_tables
        for request_id in so.finished_request_ids:
            if (gone := self.requests.pop(request_id, None)) is not None:
                tables.release(gone.row)
        if self.drafter is not None:
            for request_id in itertools.chain(so.finished_request_ids, (new.request_id for new in so.new_requests)):
                self.drafter.forget(request_id)
        for new in so.new_requests:
            self.requests[new.request_id] = CachedRequestState(
                new.request_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                new.sampling_params,
                len(new.block_ids),
                new.num_computed_tokens,
                new.sample_index,
                new.lora_int_id,
                new.num_spec_tokens,
                row=tables.add(new.block_ids),
                token_type_start=new.token_type_start,
                images=new.images,
                prompt_embeds=new.prompt_embeds,
            )
            if new.images is not None and new.images.grids is not None:
                state = self.requests[new.request_id]
                state.mrope, state.mrope_shift = mrope_positions(len(new.prompt_token_ids), new.images)
        for cached in so.cached_requests:
            state = self.requests[cached.request_id]
            if new_tokens := cached.new_token_ids:
                state.output_token_ids.extend(new_tokens)
                if state.sampled_unsent:  # they come back in the order they were sampled
                    del state.sampled_unsent[: len(new_tokens)]
            for index, block_id in cached.replaced_block_ids:
                tables.write(state.row, index, [block_id])
            if cached.num_block_ids is not None:  # blocks of rejected drafts were freed
                state.num_blocks = cached.num_block_ids - len(cached.new_block_ids)
            if cached.new_block_ids:
                tables.write(state.row, state.num_blocks, cached.new_block_ids)
                state.num_blocks += len(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        for state in self.spec_states:
            state.spec_token_ids = []
        self.spec_states = [self.requests[rid] for rid in so.scheduled_spec_tokens]
        for state, drafts in zip(self.spec_states, so.scheduled_spec_tokens.values()):
            state.spec_token_ids = drafts

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """Flatten the step: decodes (one token) first, then prefill spans.

        A decode adds its token, position and ``BlockTables`` row; their slots and padded tables
        come from the persistent tables in a few numpy operations over all of them (a step of a few
        decodes and no span reads its rows as lists instead, cheaper at that size). A span's
        tokens, positions and slots are numpy slices and vectorized arithmetic (no Python per
        token, however long the chunk). Everything is packed into one host array and sent to the
        device in a single copy; the step's tensors are contiguous slices of it.
        """
        order = _batch_order(so)
        input_ids: list[int] = []  # the decodes'
        positions: list[int] = []
        rows: list[int] = []  # their BlockTables rows
        spans: list[tuple[int, int, int]] = []  # (query start, query length, context length)
        span_images: list[tuple[tuple[int, int], ...]] = []  # each span's images attended both ways (Gemma 3's)
        span_ids: list[np.ndarray] = []
        span_positions: list[np.ndarray] = []
        span_slots: list[np.ndarray] = []
        span_tables: list[np.ndarray] = []
        sample_indices: list[int] = []
        sampled_ids: list[str] = []
        prompt_spans: list[tuple[str, int, int, int]] = []
        image_spans: list[tuple[CachedRequestState, int, int, int]] = []  # (state, query start, start, end)
        mrope_rows: list[tuple[int, np.ndarray]] = []  # M-RoPE requests': (query start, their positions [3, n])
        token_slots: list[int | None] | None = [] if self.lora is not None else None
        bs = self.block_size
        num_step_tokens = 0
        for request_id in order:
            state = self.requests[request_id]
            num_new = so.num_scheduled_tokens[request_id]
            if token_slots is not None:
                token_slots += [None if state.lora_int_id is None else self._lora_slot_of[state.lora_int_id]] * num_new
            start = state.num_computed_tokens
            end = start + num_new
            query_start = num_step_tokens
            num_step_tokens = end_index = query_start + num_new
            if num_new == 1:
                input_ids.append(state.token_at(start))
                positions.append(start)
                rows.append(state.row)
            else:
                table = self.block_tables.array[state.row, : -(-end // bs)].copy()  # its table's entries in use
                span_pos = np.arange(start, end, dtype=np.int64)
                span_ids.append(state.token_array(start, end))
                span_positions.append(span_pos)
                span_slots.append(table[span_pos // bs] * bs + span_pos % bs)
                span_tables.append(table)
                spans.append((query_start, num_new, end))
                images = state.images
                span_images.append(images.blocks(start, end) if images is not None and images.bidirectional else ())
            if self.first_stage and (
                (state.images is not None and state.images.overlaps(start, end))
                or (state.prompt_embeds is not None and start < len(state.prompt_token_ids))
            ):
                image_spans.append((state, query_start, start, end))
            if state.mrope is not None:
                mrope_rows.append((query_start, state.rope_positions(start, end)))
            num_drafts = len(state.spec_token_ids)
            if end == state.num_tokens + num_drafts:  # the last known token: its logits give the next one
                # a run of drafts: every position's logits, each verifying the draft after it
                sample_indices.extend(range(end_index - 1 - num_drafts, end_index))
                sampled_ids.append(request_id)
            num_prompt = len(state.prompt_token_ids)
            if state.sampling_params.prompt_logprobs is not None and start < num_prompt - 1:
                # positions start..min(end, P-1)-1 predict prompt tokens start+1..
                prompt_spans.append((request_id, query_start, start + 1, min(end, num_prompt - 1) - start))
        num_decodes = len(rows)
        if not spans and num_decodes <= _LIST_INPUTS_MAX_DECODES:
            slot_list, table_list, max_blocks = self.block_tables.decode_inputs_list(rows, positions, bs)
            flat = torch.tensor(
                input_ids + positions + slot_list + [p + 1 for p in positions] + sample_indices + table_list,
                dtype=torch.int64,
            )
            num_table_entries = len(table_list)
        else:
            decode_positions = _ints(positions)
            slots, tables, max_blocks = self.block_tables.decode_inputs(_ints(rows), decode_positions, bs)
            # numpy reads the ints 4x faster than torch.tensor(list) (60 against 250 us at 256 sequences)
            sections = [
                _ints(input_ids),
                *span_ids,
                decode_positions,
                *span_positions,
                slots,
                *span_slots,
                decode_positions + 1,
                _ints(sample_indices),
                tables.ravel(),
                *span_tables,
            ]
            flat = torch.from_numpy(np.concatenate(sections))
            num_table_entries = tables.size
        if self.device.type != "cpu":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        sizes = [num_step_tokens] * 3 + [num_decodes, len(sample_indices), num_table_entries, *map(len, span_tables)]
        input_ids_t, positions_t, slots_t, lens_t, sample_t, tables_t, *span_blocks = flat.split(sizes)
        prefills = [
            PrefillSpan(q0, n, end, ids, images)
            for (q0, n, end), ids, images in zip(spans, span_blocks, span_images, strict=True)
        ]
        mrope = None
        if mrope_rows:  # positions that are not token indices (the slots and lengths above are by index)
            rope = np.broadcast_to(np.concatenate([_ints(positions), *span_positions]), (3, num_step_tokens)).copy()
            for query_start, request_rope in mrope_rows:
                rope[:, query_start : query_start + request_rope.shape[1]] = request_rope
            if (rope[0] == rope[1]).all() and (rope[0] == rope[2]).all():  # text only: one position a token
                positions_t = torch.from_numpy(rope[0]).to(self.device)
            else:
                mrope = torch.from_numpy(rope).to(self.device)
        if token_slots is not None:  # LoRA on: every step maps its tokens (none adapted: an empty mapping)
            assert self.lora is not None  # token_slots is a list exactly when LoRA is on
            self.lora.set_slot_mapping(token_slots)
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            num_decode_tokens=num_decodes,
            decode_block_tables=tables_t.view(num_decodes, max_blocks),
            decode_context_lens=lens_t,
            prefills=prefills,
        )
        return StepInputs(
            input_ids=input_ids_t,
            positions=positions_t,
            meta=meta,
            sample_indices=sample_t,
            sampled_request_ids=sampled_ids,
            prompt_spans=prompt_spans,
            embeds=self._embedding_rows(image_spans) if image_spans else None,
            mrope_positions=mrope,
        )

    def _embedding_rows(self, spans: list[tuple[CachedRequestState, int, int, int]]) -> ImageRows | None:
        """The step's rows at image positions and their embeddings: each request's images are encoded when a step
        first reaches them (again after a preemption that rebuilt it) and dropped once its prompt is computed. A
        request's ``prompt_embeds`` give its prompt's rows as they are."""
        encoder = self.image_encoder
        indices: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for state, query_start, start, end in spans:
            if state.prompt_embeds is not None:
                last = min(end, len(state.prompt_token_ids))
                indices.append(torch.arange(query_start, query_start + last - start))
                values.append(state.prompt_embeds[start:last].to(self.device))
                continue
            assert encoder is not None, "a request with images reached a model without a vision tower"
            images = state.images
            assert images is not None
            if state.image_embeds is None:
                try:
                    state.image_embeds = _encoded(encoder, images, self.device)
                except Exception as exc:  # this request fails alone: its rows keep the placeholder's embedding
                    logger.exception("encoding the images of request %s failed", state.request_id)
                    self.image_failures[state.request_id] = RequestFailure(
                        f"encoding its images failed: {type(exc).__name__}: {exc}"
                    )
                    continue
            first_row = 0  # the image's first row of image_embeds
            for offset, length in images.placeholders:
                lo, hi = max(start, offset), min(end, offset + length)
                if lo < hi:
                    indices.append(torch.arange(query_start + lo - start, query_start + hi - start))
                    values.append(state.image_embeds[first_row + lo - offset : first_row + hi - offset])
                first_row += length
            if end >= images.placeholders[-1][0] + images.placeholders[-1][1]:
                state.image_embeds = None  # every image token is computed: no later step reads them
        if not indices:
            return None
        # Qwen3-VL: each row's deepstack features after its embedding (see _encoded)
        parts = torch.cat(values).chunk(1 + getattr(encoder, "num_deepstack", 0), dim=-1)  # (no prompt_embeds there)
        return ImageRows(torch.cat(indices).to(self.device), parts[0], parts[1:])

    def capture_decode_graphs(
        self, decode_sizes: list[int], max_model_len: int, token_buckets: list[int] | None = None
    ) -> None:
        """Record CUDA graphs of the decode-only forward for ``decode_sizes`` (batch sizes); with
        ``$RAYPAGED_PIECEWISE_GRAPHS``, also the piecewise graphs of steps with prefill spans for
        ``token_buckets`` (token counts; see ``graph_sizes.capture_sizes``)."""
        lora_step = self.lora.lora_model.step if self.lora is not None and self.lora.bgmv else None
        self.graphs = DecodeGraphs(
            self.model,
            self.cache.layers,
            decode_sizes[-1],
            -(-max_model_len // self.block_size),
            self.device,
            lora_step,
            sizes=decode_sizes,
        )
        self.graphs.capture()
        if token_buckets and envs.piecewise_graphs():
            self.piecewise = PiecewiseGraphs(
                self.model, self.cache.layers, token_buckets[-1], self.device, lora_step, buckets=token_buckets
            )
            self.piecewise.capture(pool=self.graphs.pool)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.image_failures = {}
        out = self._execute_model(so)
        if self.image_failures and self.reports_inputs:  # those requests fail alone; their tokens are dropped
            fail_alone(out, self.image_failures)
        return out

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(so)
        self.cache.run_block_ops(so.block_ops)
        if self.drafter is not None:
            self.drafter.cache.run_block_ops(so.block_ops)
        if so.lora_loads:
            self._load_loras(so.lora_loads)
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput()
        step = self.prepare_inputs(so)
        meta = step.meta
        adapted = (
            self.lora is not None
            and self.lora.lora_model.step.mapping is not None
            and (not self.lora.lora_model.step.mapping.is_empty)
        )
        if step.embeds is not None or step.mrope_positions is not None:  # image rows: the eager forward takes them
            hidden = self.model(  # (no graph records embeddings)
                step.input_ids, step.positions, self.cache.layers, meta, step.embeds, step.mrope_positions
            )
        elif (
            self.graphs is not None
            and not meta.prefills
            and (not adapted or self.graphs.records_lora)
            and self.graphs.fits(meta.num_decode_tokens)
        ):
            hidden = self.graphs.run(step.input_ids, step.positions, meta)
        elif (
            self.piecewise is not None
            and meta.prefills
            and (not adapted or self.piecewise.records_lora)
            and self.piecewise.fits(len(step.input_ids))
        ):
            hidden = self.piecewise.run(step.input_ids, step.positions, meta)
        elif self.token_types:
            encoder = cast(EncoderModel, self.model)
            hidden = encoder(step.input_ids, step.positions, self.cache.layers, meta, self._token_types(so))
        else:
            hidden = self.model(step.input_ids, step.positions, self.cache.layers, meta)
        if not self.last_stage:
            return ModelRunnerOutput()
        if self.pooling_type is not None:
            return self._pooled_output(hidden, so) if self.samples else ModelRunnerOutput()
        prompt_logprobs = {
            request_id: self._prompt_logprobs(hidden, request_id, first, token, count)
            for request_id, first, token, count in step.prompt_spans
        }
        if not step.sampled_request_ids:
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs if self.samples else {})
        logits = self.model.compute_logits(hidden[step.sample_indices])  # a collective under TP
        if not self.samples:
            return ModelRunnerOutput()
        # a request verifying k drafts has k + 1 rows, each sampled as if the drafts before it were accepted
        rows: list[tuple[str, int]] = []  # (request id, drafts before the row)
        for request_id in step.sampled_request_ids:
            rows += [(request_id, j) for j in range(len(self.requests[request_id].spec_token_ids) + 1)]
        if (grammar := so.grammar_bitmask) is not None:  # a mask row for each of a request's rows, in order
            first_row = {request_id: row for row, (request_id, j) in enumerate(rows) if j == 0}
            masked = [
                first_row[request_id] + j
                for request_id in grammar.request_ids
                for j in range(len(self.requests[request_id].spec_token_ids) + 1)
            ]
            apply_token_bitmask(logits, grammar.ready(), masked)
        inputs = [self._sampling_input(self.requests[request_id], j) for request_id, j in rows]
        try:
            tokens = greedy_fast_path(logits, inputs)
            if tokens is None:
                tokens = sample(logits, inputs, self.generator, self.logprobs_mode, grammar is not None)  # on device
            out = self._runner_output(rows, tokens)
        except Exception:  # one row's parameters broke the batch: find it, sample the others
            out = self._sample_rows(logits, inputs, rows, set(grammar.request_ids) if grammar is not None else set())
        if self.async_scheduling:
            requests = self.requests
            for request_id, token in out.sampled.items():
                requests[request_id].sampled_unsent.append(token.token_id)
        out.prompt_logprobs = prompt_logprobs
        if self.drafter is not None and so.propose_drafts:
            out.draft_token_ids = self._propose_drafts(out)
        return out

    def _pooled_output(self, hidden: torch.Tensor, so: SchedulerOutput) -> ModelRunnerOutput:
        """An embedding model's step: each request's chunk's part of its vector (``pooling.chunk_part``; rows in
        ``prepare_inputs``' order), copied to the host in one transfer."""
        assert self.pooling_type is not None
        ids: list[str] = []
        starts: list[int] = []
        parts: list[torch.Tensor] = []
        counts: list[int] = []  # each part's prompt tokens (a classifier's mean is taken before its head)
        row = 0
        for request_id in _batch_order(so):
            state, num_new = self.requests[request_id], so.num_scheduled_tokens[request_id]
            start = state.num_computed_tokens
            part = chunk_part(
                self.pooling_type, hidden[row : row + num_new], start, start + num_new, len(state.prompt_token_ids)
            )
            if part is not None:
                ids.append(request_id)
                starts.append(start)
                parts.append(part)
                counts.append(len(state.prompt_token_ids))
            row += num_new
        out = ModelRunnerOutput()
        if parts:
            stacked = torch.stack(parts)
            if (score := self.model.score) is not None:  # a classifier: its head's logits (of its pooled state)
                if self.pooling_type == "MEAN":  # ModernBERT's mean pooling: a whole prompt's sum (an encoder's)
                    stacked = stacked / torch.tensor(counts, dtype=stacked.dtype, device=stacked.device)[:, None]
                stacked = score(stacked.to(next(score.parameters()).dtype)).float()
            host = stacked.cpu()
            out.pooled = {request_id: (start, host[i]) for i, (request_id, start) in enumerate(zip(ids, starts))}
        return out

    def _token_types(self, so: SchedulerOutput) -> torch.Tensor:
        """Each step token's type (BERT's, rows in ``prepare_inputs``' order): 1 from its request's
        ``token_type_start`` on (a text pair's second text), 0 before it and for a single text."""
        parts = []
        for request_id in _batch_order(so):
            state, num_new = self.requests[request_id], so.num_scheduled_tokens[request_id]
            first = state.token_type_start
            start = state.num_computed_tokens
            positions = np.arange(start, start + num_new, dtype=np.int64)
            parts.append(positions >= first if first is not None else np.zeros(num_new, dtype=bool))
        return torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(self.device)

    def _sampling_input(self, state: CachedRequestState, num_drafts_before: int) -> SamplingInput:
        outputs = state.known_output_token_ids
        if num_drafts_before:
            outputs = outputs + state.spec_token_ids[:num_drafts_before]
        # a prompt given as embeddings has no token ids: penalties see the generated tokens only, as transformers'
        prompt = state.prompt_token_ids if state.prompt_embeds is None else []
        return SamplingInput(state.sampling_params, prompt, outputs, self.eos_token_id, state.sample_index)

    def _runner_output(self, rows: list[tuple[str, int]], tokens: list[SampledToken]) -> ModelRunnerOutput:
        """Each request's token, or for one verifying drafts the run it keeps."""
        out = ModelRunnerOutput()
        start = 0
        while start < len(rows):
            request_id = rows[start][0]
            drafts = self.requests[request_id].spec_token_ids
            if drafts:
                out.sampled_runs[request_id] = accepted_run(tokens[start : start + len(drafts) + 1], drafts)
            else:
                out.sampled[request_id] = tokens[start]
            start += len(drafts) + 1
        return out

    def _propose_drafts(self, out: ModelRunnerOutput) -> dict[str, list[int]]:
        """The draft model's proposals for every speculating request that got tokens this step."""
        seqs = []
        for request_id, tokens in [*((r, [t]) for r, t in out.sampled.items()), *out.sampled_runs.items()]:
            state = self.requests[request_id]
            if state.num_spec_tokens:
                context = state.prompt_token_ids + state.output_token_ids + [t.token_id for t in tokens]
                seqs.append((request_id, context, self.block_tables.array[state.row, : state.num_blocks].tolist()))
        assert self.drafter is not None, "drafts proposed by a runner without a draft model"
        return self.drafter.propose(seqs) if seqs else {}

    def _load_loras(self, loads: list[tuple[int, LoRARequest]]) -> None:
        """Write adapters into the slots the driver placed them in (replacing what was there)."""
        assert self.lora is not None, "LoRA loads sent to a worker without --enable-lora"
        for slot, request in loads:
            self._lora_slot_of = {i: s for i, s in self._lora_slot_of.items() if s != slot}
            self.lora.place(slot, request)
            self._lora_slot_of[request.lora_int_id] = slot

    def _prompt_logprobs(
        self, hidden: torch.Tensor, request_id: str, first: int, token: int, count: int
    ) -> PromptLogprobs:
        """Prompt tokens ``token..token+count-1``'s logprobs from the hidden states at step indices
        ``first..``, ``_PROMPT_LOGPROBS_CHUNK`` positions at a time (a [chunk, vocab] tensor at most).
        Every rank runs it (the logits are a collective under TP)."""
        state = self.requests[request_id]
        num_top = state.sampling_params.prompt_logprobs or 0
        entries: list[dict[int, float]] = []
        for offset in range(0, count, _PROMPT_LOGPROBS_CHUNK):
            size = min(_PROMPT_LOGPROBS_CHUNK, count - offset)
            logprobs = torch.log_softmax(
                self.model.compute_logits(hidden[first + offset : first + offset + size]).float(), -1
            )
            targets = state.prompt_token_ids[token + offset : token + offset + size]
            chosen_t = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
            chosen = chosen_t.squeeze(1).tolist()
            ranks = token_ranks(logprobs, chosen_t)
            tops: list[tuple[list[int], list[float]]]
            if num_top:
                top_values, top_ids = logprobs.topk(num_top, dim=-1)
                tops = list(zip(top_ids.tolist(), top_values.tolist()))
            else:
                tops = [([], [])] * size
            entries += [
                logprob_entry(target, value, rank, ids, values)
                for target, value, rank, (ids, values) in zip(targets, chosen, ranks, tops)
            ]
        return PromptLogprobs(token, entries)

    def _sample_rows(
        self, logits: torch.Tensor, inputs: list[SamplingInput], rows: list[tuple[str, int]], grammar_ids: set[str]
    ) -> ModelRunnerOutput:
        """Sample row by row; a request with a row that raises is reported in ``failed``, the others
        get their tokens. A row its masks left no token (``NoTokenLeft``) fails its request as the request's
        own doing, unless it verifies a draft that an earlier row of it rejected (the row is never read)."""
        tokens: list[SampledToken | None] = []
        failed: dict[str, RequestFailure] = {}
        for row, ((request_id, j), row_input) in enumerate(zip(rows, inputs)):
            masked = request_id in grammar_ids
            try:
                tokens.append(sample(logits[row : row + 1], [row_input], self.generator, self.logprobs_mode, masked)[0])
            except NoTokenLeft:
                drafts = self.requests[request_id].spec_token_ids
                earlier = tokens[row - j : row]
                if any(token is not None and token.token_id != drafts[i] for i, token in enumerate(earlier)):
                    tokens.append(earlier[-1])  # after a rejected draft: a stand-in that is never read
                    continue
                failed.setdefault(request_id, no_token_left(row_input, masked))
                logger.info("request %s: %s", request_id, failed[request_id].message)
                tokens.append(None)
            except Exception as exc:
                logger.exception("sampling failed for request %s", request_id)
                failed.setdefault(request_id, RequestFailure(f"sampling failed: {type(exc).__name__}: {exc}"))
                tokens.append(None)
        # a row's token is None only when its request failed
        kept = [(row, token) for row, token in zip(rows, tokens) if token is not None and row[0] not in failed]
        out = self._runner_output([row for row, _ in kept], [token for _, token in kept])
        out.failed = failed
        return out


def no_token_left(row: SamplingInput, grammar: bool) -> RequestFailure:
    """The failure of a request whose masks left its row no token, naming them (the first is its ``param``)."""
    params = row.params
    masks = [
        name
        for name, applies in (
            ("allowed_token_ids", params.allowed_token_ids is not None),
            ("bad_words", bool(params.bad_words_token_ids)),
            ("structured_outputs", grammar),
        )
        if applies
    ]
    where = f"no token is left to sample after {len(row.output_token_ids)} output tokens"
    if not masks:
        return RequestFailure(f"{where}: no logit of its row is finite")
    shown = " and ".join("the structured output's grammar" if name == "structured_outputs" else name for name in masks)
    return RequestFailure(f"{where}: {shown} {'allows' if len(masks) == 1 else 'together allow'} no token", masks[0])


def _batch_order(so: SchedulerOutput) -> list[str]:
    """The step's requests in batch order: decodes (one token) first, then prefill spans."""
    return sorted(so.num_scheduled_tokens, key=lambda rid: so.num_scheduled_tokens[rid] != 1)


def _ints(values: list[int]) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=len(values))


def fail_alone(out: ModelRunnerOutput, failures: dict[str, RequestFailure]) -> None:
    """Requests whose step failed on their own (``failures``: id -> why) end with that failure, their tokens
    (if any) dropped."""
    for request_id, failure in failures.items():
        out.failed.setdefault(request_id, failure)
        out.sampled.pop(request_id, None)
        out.sampled_runs.pop(request_id, None)


def _encoded(encoder: Any, images: ImageInputs, device: torch.device) -> torch.Tensor:
    """A prompt's images through the vision tower and projector: one row per image token, in prompt order."""
    pixels = images.pixel_values.to(device)
    if images.tile_masks is not None:  # Idefics3: its tiles, each a placeholder's tokens
        return encoder(pixels, images.tile_masks.to(device)).flatten(0, 1)
    if images.image_sizes is not None:  # Mistral 3: each image's size inside the padded pixels
        return encoder(pixels, torch.tensor(images.image_sizes, dtype=torch.int64))
    if images.grids is not None:  # Qwen2-VL: each image's grid of patches
        encoded = encoder(pixels, torch.tensor(images.grids, dtype=torch.int64))
        if isinstance(encoded, tuple):  # Qwen3-VL: each row's deepstack features beside its embedding
            return torch.cat([encoded[0], *encoded[1]], dim=-1)
        return encoded
    if images.patches is None:  # LLaVA: one row of pixels an image, the same number of tokens each
        return encoder(pixels).flatten(0, 1)
    features, first = [], 0  # LLaVA-NeXT: each image's patches and original size
    for rows, size in images.patches:
        features.append(encoder(pixels[first : first + rows], size))
        first += rows
    return torch.cat(features)

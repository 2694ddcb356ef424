"""What one step's attention needs to know about the flattened batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillSpan:
    """One sequence computing more than one token this step (a prompt or a chunk of it)."""

    query_start: int  # index of its first token in the flattened batch
    query_len: int
    context_len: int  # tokens in the cache once this step's K/V are written
    block_ids: torch.Tensor  # [num_blocks] long, covering context_len
    # (first, end) positions of images whose tokens attend to each other both ways (Gemma 3's), beside causally
    image_blocks: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class VarlenPrefill:
    """A step's prefill spans as one packed batch, the inputs of a varlen attention kernel."""

    query_start: int  # the first span's first row in the flattened batch
    num_tokens: int  # rows of all spans, back to back from query_start
    max_query_len: int
    cu_seqlens_q: torch.Tensor  # [num_spans + 1] int32, from 0
    context_lens: torch.Tensor  # [num_spans] int32
    block_tables: torch.Tensor  # [num_spans, max_blocks], the spans' block ids (long), padded with 0


def build_varlen_prefill(prefills: list[PrefillSpan], block_size: int) -> VarlenPrefill | None:
    """``prefills`` as one packed batch on their block ids' device, or None where they are not one:
    no spans, spans not back to back, or a span whose block ids do not cover its context (a step
    that writes nothing to the cache, as the memory profile's, attends over its fresh K/V instead)."""
    if not prefills:
        return None
    end = prefills[0].query_start
    for span in prefills:
        if span.query_start != end or span.block_ids.shape[0] * block_size < span.context_len:
            return None
        end += span.query_len
    start = prefills[0].query_start
    host = torch.tensor(
        [s.query_start - start for s in prefills] + [end - start] + [s.context_len for s in prefills], dtype=torch.int32
    )
    ids = [s.block_ids for s in prefills]
    device = ids[0].device
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    if len({t.shape[0] for t in ids}) == 1:
        tables = torch.stack(ids)
    else:
        tables = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=0)
    num_spans = len(prefills)
    return VarlenPrefill(
        query_start=start,
        num_tokens=end - start,
        max_query_len=max(s.query_len for s in prefills),
        cu_seqlens_q=host[: num_spans + 1],
        context_lens=host[num_spans + 1 :],
        block_tables=tables,
    )


@dataclass(slots=True)
class AttentionMetadata:
    """Batch layout: ``num_decode_tokens`` single-token decodes first, then the prefills.

    ``slot_mapping[i]`` is the cache slot (block_id * block_size + offset) where
    token i's K/V go; negative slots are padding and are not written.
    """

    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_num_blocks] long, padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] long
    prefills: list[PrefillSpan]
    # build_varlen_prefill's result per block size, built by the step's first layer for all the others
    varlen_cache: dict[int, VarlenPrefill | None] = field(default_factory=dict, repr=False, compare=False)

    def varlen_prefill(self, block_size: int) -> VarlenPrefill | None:
        """The prefills as one packed batch (see build_varlen_prefill), built once per step."""
        try:
            return self.varlen_cache[block_size]
        except KeyError:
            varlen = self.varlen_cache[block_size] = build_varlen_prefill(self.prefills, block_size)
            return varlen

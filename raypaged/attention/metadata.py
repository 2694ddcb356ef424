"""What one step's attention needs to know about the flattened batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSpan:
    """One sequence computing more than one token this step (a prompt or a chunk of it)."""

    query_start: int  # index of its first token in the flattened batch
    query_len: int
    context_len: int  # tokens in the cache once this step's K/V are written
    block_ids: torch.Tensor  # [num_blocks] long, covering context_len


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

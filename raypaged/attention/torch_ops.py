"""Paged attention in plain torch: the CPU backend and the reference for the CUDA kernels.

Cache layout per layer: ``key_cache``/``value_cache`` are
``[num_blocks, num_kv_heads, block_size, head_dim]``: one KV head's tokens of a block are
contiguous, so the CUDA decode kernel reads each (block, head) as one run of memory.

An fp8 cache (``--kv-cache-dtype fp8``) holds each element in one byte: K/V are rounded to it when written
and read back in the query's dtype. A layer's K/V scales (``KVScales``) are its callers': they write
``key / k_scale`` and ``value / v_scale``, and fold the scales into the reads (``AttentionBackend.attend``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] long, negative = skip
) -> None:
    """Write each token's K/V into its slot (block = slot // block_size, offset = slot % block_size)."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    block_size = key_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    # the two index tensors broadcast to [tokens]: rows are [heads, dim]
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_seqs, max_blocks] block ids -> [num_seqs, max_blocks * block_size, num_kv_heads, head_dim]."""
    return gather_heads_first(cache, block_tables).transpose(1, 2)


def gather_heads_first(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_seqs, max_blocks] block ids -> [num_seqs, num_kv_heads, max_blocks * block_size, head_dim].

    ``cache`` must be contiguous. The result is heads-major in memory ([H, S, T, D], returned as a
    transposed view): one ``index_select`` of whole (block, head) rows, a memcpy of block_size x
    head_dim elements each, about 2x faster on CPU than advanced indexing of the transposed cache.
    """
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    num_seqs, max_blocks = block_tables.shape
    rows = block_tables * num_kv_heads + torch.arange(num_kv_heads, device=block_tables.device)[:, None, None]
    gathered = cache.view(num_blocks * num_kv_heads, block_size, head_dim).index_select(0, rows.flatten())
    return gathered.view(num_kv_heads, num_seqs, max_blocks * block_size, head_dim).transpose(0, 1)


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] long
    context_lens: torch.Tensor,  # [num_seqs] long
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to its first ``context_lens[i]`` cached tokens."""
    keys = gather_heads_first(key_cache, block_tables).to(query.dtype)  # [S, Hkv, T, D]
    values = gather_heads_first(value_cache, block_tables).to(query.dtype)
    max_len = keys.shape[2]
    visible = torch.arange(max_len, device=query.device)[None, :] < context_lens[:, None]  # [S, T]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [S, H, 1, D]
        keys,
        values,
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def paged_attention_prefill(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,  # [num_blocks] long
    context_len: int,
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Causal attention of the last ``query_len`` positions of a sequence over its cached context."""
    keys = gather_blocks(key_cache, block_ids[None])[0, :context_len].to(query.dtype)
    values = gather_blocks(value_cache, block_ids[None])[0, :context_len].to(query.dtype)
    return prefill_attention(query, keys, values, scale)


def prefill_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim], the last query_len positions
    keys: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    values: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Causal SDPA of a sequence's newest ``query_len`` positions over its whole (gathered) context."""
    query_len, context_len = query.shape[0], keys.shape[0]
    if query_len == context_len:
        mask, causal = None, True
    else:
        query_pos = torch.arange(context_len - query_len, context_len, device=query.device)
        mask = torch.arange(context_len, device=query.device)[None, :] <= query_pos[:, None]
        causal = False
    # 4-D inputs: torch's fused CPU kernel; 3-D ones fall back to the ~6x slower math path
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)

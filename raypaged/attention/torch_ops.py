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
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to its first ``context_lens[i]`` cached tokens (``sliding_window``:
    to the last ``sliding_window`` of them; ``softcap``: see :func:`attention`)."""
    keys = gather_heads_first(key_cache, block_tables).to(query.dtype)  # [S, Hkv, T, D]
    values = gather_heads_first(value_cache, block_tables).to(query.dtype)
    key_pos = torch.arange(keys.shape[2], device=query.device)[None, :]
    visible = key_pos < context_lens[:, None]  # [S, T]
    if (starts := first_visible(context_lens, sliding_window, chunk)) is not None:
        visible &= key_pos >= starts[:, None]
    out = attention(query.unsqueeze(2), keys, values, visible[:, None, None, :], scale, softcap, sinks)  # [S, H, 1, D]
    return out.squeeze(2)


def first_visible(
    context_lens: torch.Tensor, sliding_window: int | None, chunk: int | None
) -> torch.Tensor | None:  # [num_seqs] long
    """The first key each decode query (at position ``context_len - 1``) sees: the window's, and the start of its
    Llama 4 chunk; None when it sees them all."""
    starts = None
    if sliding_window is not None:
        starts = (context_lens - sliding_window).clamp(min=0)
    if chunk is not None:
        chunk_starts = (context_lens - 1).clamp(min=0) // chunk * chunk
        starts = chunk_starts if starts is None else torch.maximum(starts, chunk_starts)
    return starts


def paged_attention_prefill(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,  # [num_blocks] long
    context_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    image_blocks: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Causal attention of the last ``query_len`` positions of a sequence over its cached context."""
    keys = gather_blocks(key_cache, block_ids[None])[0, :context_len].to(query.dtype)
    values = gather_blocks(value_cache, block_ids[None])[0, :context_len].to(query.dtype)
    return prefill_attention(
        query,
        keys,
        values,
        scale,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
        chunk=chunk,
        image_blocks=image_blocks,
    )


def prefill_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim], the last query_len positions
    keys: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    values: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    causal: bool = True,
    image_blocks: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Causal SDPA of a sequence's newest ``query_len`` positions over its whole (gathered) context; with
    ``sliding_window`` the query at position p sees the keys from ``max(0, p + 1 - sliding_window)`` to p.
    ``image_blocks`` ((first, end) positions, Gemma 3's images): a query in one also sees every key of it, later
    ones too (those are in the context: a chunk never ends inside an image).
    ``causal`` False (a whole prompt of bidirectional attention, EmbeddingGemma's): every key, or with
    ``sliding_window`` those fewer than that many positions away on either side."""
    query_len, context_len = query.shape[0], keys.shape[0]
    if not causal and query_len != context_len:
        raise ValueError(f"bidirectional attention takes whole prompts, got {query_len} queries over {context_len}")
    # 4-D inputs: torch's fused CPU kernel; 3-D ones fall back to the ~6x slower math path
    q, k, v = query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    plain = sliding_window is None and softcap is None and sinks is None and chunk is None and not image_blocks
    if query_len == context_len and plain:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    query_pos = torch.arange(context_len - query_len, context_len, device=query.device)[:, None]
    key_pos = torch.arange(context_len, device=query.device)[None, :]
    if not causal:  # EmbeddingGemma's: every key, or those within the window on either side
        near = (key_pos - query_pos).abs() < (sliding_window or context_len + 1)
        return attention(q, k, v, near, scale, softcap, sinks)[0].transpose(0, 1)
    mask = key_pos <= query_pos  # [query_len, context_len]
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    if chunk is not None:  # Llama 4's chunked attention: only the keys of the query's chunk
        mask &= key_pos >= query_pos // chunk * chunk
    for first, end in image_blocks:
        mask |= (query_pos >= first) & (query_pos < end) & (key_pos >= first) & (key_pos < end)
    return attention(q, k, v, mask, scale, softcap, sinks)[0].transpose(0, 1)


def attention(
    query: torch.Tensor,  # [B, num_heads, Q, head_dim]
    keys: torch.Tensor,  # [B, num_kv_heads, T, head_dim]
    values: torch.Tensor,  # [B, num_kv_heads, T, head_dim]
    visible: torch.Tensor,  # bool, broadcasting to [B, num_heads, Q, T]; each query sees at least one key
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [B, num_heads, Q, head_dim]
    """Masked GQA attention; ``softcap`` (Gemma 2's attn_logit_softcapping): the scaled scores become
    ``softcap * tanh(scores / softcap)`` before the mask, and the softmax is taken in fp32, as transformers' eager
    attention computes them. ``sinks`` (gpt-oss's): each head's sink logit joins every query's scores as one more
    column of the softmax, which is then dropped (the probabilities of the keys sum to less than 1)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale, enable_gqa=True)
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(query.dtype), values)
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(query.dtype), values)

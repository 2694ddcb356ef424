"""Paged torch attention against dense attention over the same tokens, with random block tables."""

import random

import pytest
import torch

from raypaged.attention.backend import TORCH
from raypaged.attention.metadata import AttentionMetadata, PrefillSpan
from raypaged.attention.torch_ops import reshape_and_cache

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 64, 4, 8, 2, 16


def dense_attention(q, k, v, num_cached, window=None, softcap=None):
    """q: [Q, H, D] for positions num_cached.., k/v: [L, Hkv, D] for all positions; ``window``: the query at p sees
    keys p - window + 1 .. p; ``softcap``: scores capped by softcap * tanh(scores / softcap)."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos, k_pos = torch.arange(num_cached, num_cached + q.shape[0])[:, None], torch.arange(k.shape[0])[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (3, None), (5, 2.0), (None, 1.5)])
@pytest.mark.parametrize("seed", range(5))
def test_mixed_decode_and_prefill_step_matches_dense(seed, window, softcap):
    """``window`` and ``softcap``: Gemma's sliding-window and soft-capped attention (options of the torch ops)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # stale garbage everywhere: only slots inside each context may be read
    key_cache = torch.randn(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM) * 100
    value_cache = torch.randn_like(key_cache) * 100
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    # (tokens already cached, tokens computed now): decodes first, then a fresh prompt and a chunk
    seqs = [(rng.randint(1, 20), 1) for _ in range(3)] + [
        (0, rng.randint(2, 9)),
        (rng.randint(1, 9), rng.randint(2, 7)),
    ]
    full_k, full_v, tables = [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        k, v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM), torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
        slots = torch.tensor(
            [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached)], dtype=torch.long
        )
        reshape_and_cache(k[:cached], v[:cached], key_cache, value_cache, slots)
        full_k.append(k), full_v.append(v), tables.append(table)

    q = torch.randn(sum(n for _, n in seqs), NUM_HEADS, HEAD_DIM)
    step_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs)])
    step_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs)])
    slots, prefills, start = [], [], 0
    for (cached, new), table in zip(seqs, tables):
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, cached + new)]
        if new > 1:
            prefills.append(PrefillSpan(start, new, cached + new, torch.tensor(table)))
        start += new
    max_blocks = max(len(t) for t in tables[:3])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1]),  # a padding slot is skipped
        num_decode_tokens=3,
        decode_block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables[:3]]),
        decode_context_lens=torch.tensor([c + n for c, n in seqs[:3]]),
        prefills=prefills,
    )
    # the padding token's query row is ignored; the step's K/V are written by the backend
    q = torch.cat([q, torch.zeros(1, NUM_HEADS, HEAD_DIM)])
    step_k = torch.cat([step_k, torch.zeros(1, NUM_KV_HEADS, HEAD_DIM)])
    step_v = torch.cat([step_v, torch.zeros(1, NUM_KV_HEADS, HEAD_DIM)])
    TORCH.write_cache(step_k, step_v, key_cache, value_cache, meta.slot_mapping)
    out = TORCH.attend(q, step_k, step_v, key_cache, value_cache, meta, HEAD_DIM**-0.5, None, window, softcap)
    start = 0
    for (cached, new), k, v in zip(seqs, full_k, full_v):
        expected = dense_attention(q[start : start + new], k, v, cached, window, softcap)
        torch.testing.assert_close(out[start : start + new], expected, rtol=1e-5, atol=1e-5)
        start += new


def test_reshape_and_cache_writes_exact_slots():
    # 4 blocks x 2 KV heads x block size 2 x head dim 1: slot 5 = block 2, offset 1
    key_cache = torch.zeros(4, 2, 2, 1)
    value_cache = torch.zeros(4, 2, 2, 1)
    key = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]]).view(3, 2, 1)
    reshape_and_cache(key, -key, key_cache, value_cache, torch.tensor([5, -1, 0]))
    # per block: head 0's two slots, then head 1's
    assert key_cache.flatten().tolist() == [3.0, 0, 30.0, 0] + [0] * 4 + [0, 1.0, 0, 10.0] + [0] * 4
    assert value_cache.flatten().tolist() == [-3.0, 0, -30.0, 0] + [0] * 4 + [0, -1.0, 0, -10.0] + [0] * 4

"""The step's packed prefill batch (AttentionMetadata.varlen_prefill) and the backend's one varlen call
per layer, on CPU: a torch stand-in for the CUDA kernel, run through AttentionBackend.forward, must give
what the per-span torch path gives, with the packed inputs built once for all layers."""

import dataclasses
import random

import pytest
import torch

from raypaged.attention import torch_ops
from raypaged.attention.backend import TORCH
from raypaged.attention.metadata import AttentionMetadata, PrefillSpan, build_varlen_prefill

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 64, 4, 8, 2, 16


def varlen_reference(
    query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, scale, max_query_len, out=None
):
    """The varlen kernel's contract in torch: span s's rows cu[s]..cu[s+1]-1 attend over its cache."""
    out = torch.empty_like(query) if out is None else out
    for s in range(context_lens.shape[0]):
        a, b = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        assert 1 <= b - a <= max_query_len
        out[a:b] = torch_ops.paged_attention_prefill(
            query[a:b], key_cache, value_cache, block_tables[s], int(context_lens[s]), scale
        )
    return out


def span(start, query_len, context_len, num_blocks):
    return PrefillSpan(start, query_len, context_len, torch.arange(10, 10 + num_blocks))


def meta_of(prefills, num_decodes=0):
    return AttentionMetadata(
        torch.zeros(0, dtype=torch.long),
        num_decodes,
        torch.zeros((num_decodes, 1), dtype=torch.long),
        torch.ones(num_decodes, dtype=torch.long),
        prefills,
    )


def test_packs_spans_after_the_decodes():
    varlen = build_varlen_prefill([span(3, 5, 9, 3), span(8, 1, 4, 1), span(9, 6, 6, 2)], BLOCK_SIZE)
    assert (varlen.query_start, varlen.num_tokens, varlen.max_query_len) == (3, 12, 6)
    assert varlen.cu_seqlens_q.tolist() == [0, 5, 6, 12] and varlen.cu_seqlens_q.dtype == torch.int32
    assert varlen.context_lens.tolist() == [9, 4, 6] and varlen.context_lens.dtype == torch.int32
    assert varlen.block_tables.tolist() == [[10, 11, 12], [10, 0, 0], [10, 11, 0]]


@pytest.mark.parametrize(
    "prefills",
    [
        [],
        [span(0, 5, 9, 3), span(6, 2, 2, 1)],  # a gap: the spans are not one packed run
        [span(0, 5, 5, 0)],  # the memory profile's spans: no blocks, nothing written to the cache
        [span(0, 5, 9, 3), span(5, 6, 6, 1)],  # a table short of its context
    ],
)
def test_no_packed_batch_without_back_to_back_spans_and_covering_tables(prefills):
    assert build_varlen_prefill(prefills, BLOCK_SIZE) is None


def test_built_once_per_step():
    meta = meta_of([span(0, 5, 9, 3)])
    first = meta.varlen_prefill(BLOCK_SIZE)
    assert meta.varlen_prefill(BLOCK_SIZE) is first
    assert meta_of([]).varlen_prefill(BLOCK_SIZE) is None


def random_step(seed, head_dim=HEAD_DIM, block_size=BLOCK_SIZE):
    """A mixed step over a cache of stale garbage: decodes, a fresh prompt, chunks with cached context, a
    one-token span; returns (query, key, value, key_cache, value_cache, meta), on CPU."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    key_cache = torch.randn(NUM_BLOCKS, NUM_KV_HEADS, block_size, head_dim) * 100
    value_cache = torch.randn_like(key_cache) * 100
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    seqs = [(rng.randint(1, 20), 1) for _ in range(2)]  # decodes: (cached, new)
    seqs += [
        (0, rng.randint(2, 9)),
        (rng.randint(1, 9), rng.randint(2, 7)),
        (rng.randint(1, 9), 1),
        (rng.randint(5, 30), rng.randint(2, 12)),
    ]
    slots, tables, prefills, keys, values, start = [], [], [], [], [], 0
    for i, (cached, new) in enumerate(seqs):
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        k, v = torch.randn(total, NUM_KV_HEADS, head_dim), torch.randn(total, NUM_KV_HEADS, head_dim)
        torch_ops.reshape_and_cache(
            k[:cached],
            v[:cached],
            key_cache,
            value_cache,
            torch.tensor(
                [table[p // block_size] * block_size + p % block_size for p in range(cached)], dtype=torch.long
            ),
        )
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        keys.append(k[cached:]), values.append(v[cached:]), tables.append(table)
        if i >= 2:  # the one-token span too: a draft model's prefill span may have one query token
            prefills.append(PrefillSpan(start, new, total, torch.tensor(table)))
        start += new
    width = max(len(t) for t in tables[:2])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=2,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables[:2]]),
        decode_context_lens=torch.tensor([c + n for c, n in seqs[:2]]),
        prefills=prefills,
    )
    query = torch.randn(start, NUM_HEADS, head_dim)
    return query, torch.cat(keys), torch.cat(values), key_cache, value_cache, meta


@pytest.mark.parametrize("seed", range(4))
def test_one_varlen_call_per_layer_matches_the_per_span_path(seed, monkeypatch):
    query, key, value, key_cache, value_cache, meta = random_step(seed)
    expected = TORCH.forward(
        query, key, value, key_cache.clone(), value_cache.clone(), dataclasses.replace(meta), HEAD_DIM**-0.5
    )
    calls, builds = [], []
    import raypaged.attention.metadata as metadata

    real_build = metadata.build_varlen_prefill
    monkeypatch.setattr(metadata, "build_varlen_prefill", lambda *a: builds.append(1) or real_build(*a))
    backend = dataclasses.replace(
        TORCH, name="varlen", varlen_prefill=lambda *a, **k: calls.append(1) or varlen_reference(*a, **k)
    )
    for _layer in range(3):
        out = backend.forward(query, key, value, key_cache, value_cache, meta, HEAD_DIM**-0.5)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == 3 and len(builds) == 1  # one call per layer, the packed inputs built once per step

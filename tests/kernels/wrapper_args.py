"""Arguments for the attention kernel wrappers' check tests: a small paged cache layout, and a valid call of
each wrapper (``reshape_and_cache``, the decode, the varlen prefill) that a test overrides one argument of."""

import torch

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, NUM_HEADS = 8, 16, 2, 64, 8


def cache(dtype: torch.dtype = torch.float16, **shape: int) -> torch.Tensor:
    dims = dict(num_blocks=NUM_BLOCKS, kv_heads=NUM_KV_HEADS, block_size=BLOCK_SIZE, head_size=HEAD_SIZE)
    dims.update(shape)
    return torch.zeros(*dims.values(), dtype=dtype)


def rows(dtype: torch.dtype = torch.float16, tokens: int = 5, heads: int = NUM_KV_HEADS, head_size: int = HEAD_SIZE):
    return torch.zeros(tokens, heads, head_size, dtype=dtype)


def reshape_args(cache_dtype: torch.dtype = torch.float16, **overrides) -> dict:
    caches = dict(key_cache=cache(cache_dtype), value_cache=cache(cache_dtype))
    args = dict(key=rows(), value=rows(), **caches, slot_mapping=torch.arange(5))
    return {**args, **overrides}


def decode_args(cache_dtype: torch.dtype = torch.float16, **overrides) -> dict:
    args = dict(
        query=rows(tokens=3, heads=NUM_HEADS),
        key_cache=cache(cache_dtype),
        value_cache=cache(cache_dtype),
        block_tables=torch.zeros(3, 4, dtype=torch.long),
        context_lens=torch.ones(3, dtype=torch.long),
        scale=0.125,
    )
    return {**args, **overrides}


def prefill_args(cache_dtype: torch.dtype = torch.float16, **overrides) -> dict:
    args = dict(
        query=rows(tokens=7, heads=NUM_HEADS),
        key_cache=cache(cache_dtype),
        value_cache=cache(cache_dtype),
        cu_seqlens_q=torch.tensor([0, 4, 7], dtype=torch.int32),
        context_lens=torch.tensor([20, 3], dtype=torch.int32),
        block_tables=torch.zeros(2, 2, dtype=torch.int32),
        scale=0.125,
        max_query_len=4,
    )
    return {**args, **overrides}

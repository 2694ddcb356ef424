"""Varlen paged prefill attention: every prefill span of a step in one launch of ``kernels/paged_prefill.cu``.

The spans' query tokens are packed back to back in ``query``; each span attends causally over
its cached context (its own K/V of this step already written by ``reshape_and_cache``),
reading K/V tiles through its block-table row: no gather. The cache may be fp8 e4m3 (``torch.float8_e4m3fn``, the
``*_fp8`` kernels: tiles widened exactly to the query's dtype, fp32 for the FMA kernel). Reference: per span,
``raypaged.attention.torch_ops.paged_attention_prefill`` (or ``prefill_attention`` over the
span's fresh K/V when nothing was cached before it).
"""

from __future__ import annotations

import numpy as np
import torch

from raypaged.kernels import loader
from raypaged.kernels.checks import (
    FLOAT_DTYPES,
    check_aligned,
    check_contiguous,
    check_cuda,
    check_head_size,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from raypaged.kernels.ops import cache_suffix, check_kv_caches, check_query_reads_cache

NUM_THREADS = 128  # kernels/paged_prefill.cu
MMA_BLOCK_M = 64  # query rows (token x head) per thread block, tensor-core kernel
SIMT_BLOCK_M = 16  # the same, fp32-FMA kernel
INT32 = (torch.int32,)
TABLE_DTYPES = (torch.int32, torch.int64)
TENSOR_CORE_DTYPES = (torch.float16, torch.bfloat16)
MAX_SPANS = 65535


def heads_per_block(group: int, block_m: int) -> int:
    """Query heads one thread block serves: the KV head's whole group when it fits in a tile's
    rows (each K/V tile is then read once for all of them), else one."""
    return group if group <= block_m else 1


def launch_geometry(max_query_len: int, num_spans: int, num_heads: int, group: int, block_m: int):
    """(grid, heads per block): grid (query tiles of the longest span, spans, head slices)."""
    per_block = heads_per_block(group, block_m)
    tokens_per_tile = block_m // per_block
    return (-(-max_query_len // tokens_per_tile), num_spans, num_heads // per_block), per_block


def paged_prefill_attention(
    query: torch.Tensor,  # [total_q_tokens, num_heads, head_dim]; rows may be strided (a view of qkv)
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_spans + 1] int32: span s owns query rows cu[s]..cu[s+1]-1
    context_lens: torch.Tensor,  # [num_spans] int32: tokens in the cache, this step's included
    block_tables: torch.Tensor,  # [num_spans, max_blocks] int32 or int64, padded
    scale: float,
    max_query_len: int,  # the longest span's query length (sizes the grid without a device sync)
    out: torch.Tensor | None = None,  # [total_q_tokens, num_heads, head_dim] contiguous, written in place
    tensor_cores: bool | None = None,  # None: mma.sync for fp16/bf16 on sm_80+, else the fp32-FMA kernel
) -> torch.Tensor:  # out: the rows of every span written, others untouched
    """Causal attention of each span's query tokens over its paged context, all spans in one launch.

    Query token i of span s sits at position ``context_lens[s] - query_len_s + i`` and sees the
    cache positions up to it. Not checked (device values; checking would sync): ``cu_seqlens_q``
    ascending from any start and ending at most at ``total_q_tokens``, ``1 <= query_len_s <=
    max_query_len``, ``query_len_s <= context_lens[s] <= max_blocks * block_size``, block ids valid.
    """
    fp8 = check_kv_caches(key_cache, value_cache)
    check_tensor("query", query, FLOAT_DTYPES, 3)
    check_query_reads_cache("query", query, key_cache, fp8)
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    check_head_size("query", head_size)
    check_shape("key_cache", key_cache, (None, None, None, head_size))
    if num_heads % num_kv_heads:
        raise ValueError(f"query's {num_heads} heads are not a multiple of key_cache's {num_kv_heads} KV heads")
    if query.stride()[1:] != (head_size, 1) or (query.stride(0) * query.element_size()) % 16:
        raise ValueError(
            f"query must have contiguous [num_heads, head_dim] rows at a 16-byte token stride; "
            f"got strides {query.stride()}"
        )
    check_aligned("query", query)
    check_tensor("cu_seqlens_q", cu_seqlens_q, INT32, 1)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have num_spans + 1 >= 1 entries, got 0")
    num_spans = cu_seqlens_q.shape[0] - 1
    if num_spans > MAX_SPANS:
        raise ValueError(f"{num_spans} spans exceed the grid's {MAX_SPANS} (its y dimension)")
    check_contiguous("cu_seqlens_q", cu_seqlens_q)
    check_tensor("context_lens", context_lens, INT32, 1)
    check_shape("context_lens", context_lens, (num_spans,))
    check_contiguous("context_lens", context_lens)
    check_tensor("block_tables", block_tables, TABLE_DTYPES, 2)
    check_shape("block_tables", block_tables, (num_spans, None))
    check_contiguous("block_tables", block_tables)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not isinstance(max_query_len, int) or isinstance(max_query_len, bool):
        raise TypeError(f"max_query_len must be an int, got {type(max_query_len).__name__}")
    if not 0 <= max_query_len <= num_tokens:
        raise ValueError(f"max_query_len must be in [0, {num_tokens}] (the query's tokens), got {max_query_len}")
    if out is not None:
        check_tensor("out", out, FLOAT_DTYPES, 3)
        check_same_dtype(("out", "query"), (out, query))
        check_shape("out", out, query.shape)
        check_contiguous("out", out)
        check_aligned("out", out)
    if tensor_cores and query.dtype not in TENSOR_CORE_DTYPES:
        raise ValueError(f"tensor_cores=True needs float16 or bfloat16, got {query.dtype}")
    tensors = {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "cu_seqlens_q": cu_seqlens_q,
        "context_lens": context_lens,
        "block_tables": block_tables,
    }
    if out is not None:
        tensors["out"] = out
    device = check_cuda(list(tensors), list(tensors.values()))
    capable = loader.capability(device) >= (8, 0)
    if tensor_cores and not capable:
        raise ValueError("tensor_cores=True needs compute capability 8.0 or newer (mma.sync m16n8k16, cp.async)")
    if tensor_cores is None:
        tensor_cores = query.dtype in TENSOR_CORE_DTYPES and capable

    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=device)
    if num_spans == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    variant, block_m = ("mma", MMA_BLOCK_M) if tensor_cores else ("simt", SIMT_BLOCK_M)
    grid, per_block = launch_geometry(max_query_len, num_spans, num_heads, group, block_m)
    name = f"paged_prefill_{variant}_{loader.DTYPE_SUFFIX[query.dtype]}_{head_size}{cache_suffix(fp8)}"
    kernel = loader.function("paged_prefill.cu", name, device)
    args = (
        loader.device_pointer(out),
        loader.device_pointer(query),
        loader.device_pointer(key_cache),
        loader.device_pointer(value_cache),
        loader.device_pointer(cu_seqlens_q),
        loader.device_pointer(context_lens),
        loader.device_pointer(block_tables),
        np.int32(block_tables.dtype == torch.int64),
        np.float32(scale),
        np.int64(query.stride(0)),
        np.int32(num_heads),
        np.int32(num_kv_heads),
        np.int32(per_block),
        np.int32(block_size),
        np.int32(block_tables.shape[1]),
    )
    loader.launch(kernel, device, grid, (NUM_THREADS,), args)
    return out

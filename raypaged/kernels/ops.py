"""CUDA versions of raypaged.attention.torch_ops, backed by the kernels in ``kernels/*.cu``.

Each wrapper checks its arguments (``checks``) before importing cupy or touching a
device, allocates its outputs with torch and launches on torch's current stream.
Cache layout per layer: ``[num_blocks, num_kv_heads, block_size, head_dim]``, of the model's dtype or
``torch.float8_e4m3fn`` (``--kv-cache-dtype fp8``: K/V narrowed with scale 1.0 as ``.to(torch.float8_e4m3fn)``
narrows them, and read back widened, as ``torch_ops`` does; the ``*_fp8`` kernels, ``kernels/fp8.cuh``).
"""

from __future__ import annotations

import numpy as np
import torch

from raypaged.attention.torch_ops import prefill_attention
from raypaged.kernels import loader
from raypaged.kernels.checks import (
    FLOAT_DTYPES,
    LONG,
    check_aligned,
    check_cache_pair,
    check_contiguous,
    check_cuda,
    check_head_size,
    check_same_dtype,
    check_shape,
    check_tensor,
)

NUM_THREADS = 128  # paged_attention.cu
COPY_THREADS = 256  # copy_blocks.cu, reshape_and_cache.cu
MAX_SHARED_BYTES = 48 * 1024  # without opting in to more
V2_PARTITION_SIZE = 512
FP8_CACHE = torch.float8_e4m3fn  # an fp8 KV cache: e4m3, scale 1.0 (torch_ops' and the CPU kernels' type for it)
CACHE_DTYPES = (*FLOAT_DTYPES, FP8_CACHE)


def check_cache_tensor(name: str, cache: object, ndim: int = 4) -> torch.Tensor:
    """A KV cache (or pool of them): of a float dtype, or ``torch.float8_e4m3fn``."""
    if isinstance(cache, torch.Tensor) and cache.dtype == torch.uint8:
        raise TypeError(
            f"{name} has dtype torch.uint8: an fp8 e4m3 cache must have dtype torch.float8_e4m3fn "
            f"(view its bytes with .view(torch.float8_e4m3fn))"
        )
    return check_tensor(name, cache, CACHE_DTYPES, ndim)


def check_kv_caches(key_cache: object, value_cache: object) -> bool:
    """``checks.check_cache_pair`` for the kernels that also read or write an fp8 e4m3 cache: one dtype (a float
    one or ``torch.float8_e4m3fn``), one shape, contiguous, 16-byte aligned, a supported block size. Returns
    whether the caches are fp8."""
    return check_cache_pair(key_cache, value_cache, check_cache_tensor).dtype == FP8_CACHE


def check_query_reads_cache(name: str, query: torch.Tensor, key_cache: torch.Tensor, fp8: bool) -> None:
    """A query (or K/V rows) and the cache it meets: the same dtype, except that any float dtype meets an fp8 cache."""
    if not fp8:
        check_same_dtype((name, "key_cache"), (query, key_cache))


def cache_suffix(fp8: bool) -> str:
    return loader.FP8_CACHE_SUFFIX if fp8 else ""


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rows may be strided (a view of qkv)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] long, negative = skip
) -> None:
    """Write each token's K/V into its slot (block_id * block_size + offset); into an fp8 cache narrowed as
    ``.to(torch.float8_e4m3fn)`` narrows them."""
    fp8 = check_kv_caches(key_cache, value_cache)
    num_kv_heads, block_size, head_dim = key_cache.shape[1:]
    for name, rows in (("key", key), ("value", value)):
        check_tensor(name, rows, FLOAT_DTYPES, 3)
        check_shape(name, rows, (None, num_kv_heads, head_dim))
        if rows.stride()[1:] != (head_dim, 1) or (rows.stride(0) * rows.element_size()) % 16:
            raise ValueError(
                f"{name} must have contiguous [num_kv_heads, head_dim] rows at a 16-byte token stride; "
                f"got strides {rows.stride()}"
            )
        check_aligned(name, rows)
    if fp8:
        check_same_dtype(("key", "value"), (key, value))
    else:
        check_same_dtype(("key", "value", "key_cache"), (key, value, key_cache))
    check_shape("value", value, key.shape)
    check_tensor("slot_mapping", slot_mapping, LONG, 1)
    check_shape("slot_mapping", slot_mapping, (key.shape[0],))
    check_contiguous("slot_mapping", slot_mapping)
    head_bytes = head_dim * key.element_size()
    if head_bytes % 16:  # key's: the kernels move (or narrow) the rows' 16-byte vectors
        raise ValueError(f"{'key' if fp8 else 'key_cache'} heads of {head_bytes} bytes are not a multiple of 16")
    device = check_cuda(
        ("key", "value", "key_cache", "value_cache", "slot_mapping"), (key, value, key_cache, value_cache, slot_mapping)
    )
    if key.shape[0] == 0:
        return
    head_vecs = head_bytes // 16
    name = f"reshape_and_cache_{loader.DTYPE_SUFFIX[key.dtype]}_fp8" if fp8 else "reshape_and_cache"
    kernel = loader.function("reshape_and_cache.cu", name, device)
    threads = min(COPY_THREADS, -(-(num_kv_heads * head_vecs) // 32) * 32)
    args = (
        loader.device_pointer(key),
        loader.device_pointer(value),
        loader.device_pointer(key_cache),
        loader.device_pointer(value_cache),
        loader.device_pointer(slot_mapping),
        np.int64(key.stride(0) * key.element_size() // 16),
        np.int64(value.stride(0) * value.element_size() // 16),
        np.int32(num_kv_heads),
        np.int32(head_vecs),
        np.int32(block_size),
    )
    loader.launch(kernel, device, (key.shape[0],), (threads,), args)


def decode_partition_size(
    num_seqs: int, num_kv_heads: int, group: int, head_size: int, max_context: int, num_sms: int
) -> int:
    """Tokens per thread block: the whole context (v1) when it fits shared memory and the
    batch alone fills the GPU, else ``V2_PARTITION_SIZE`` (v2: split context + reduce)."""
    fit = shared_bytes_limit_tokens(group, head_size)
    if max_context <= fit and num_seqs * num_kv_heads >= num_sms:
        return max_context
    return min(V2_PARTITION_SIZE, fit)


def shared_bytes_limit_tokens(group: int, head_size: int) -> int:
    """Most tokens one partition can hold in MAX_SHARED_BYTES (see paged_attention.cu)."""
    tokens = (MAX_SHARED_BYTES // 4 - 2 * group * head_size - 2 * group) // group
    if tokens < 1:
        raise ValueError(f"{group} query heads per KV head at head size {head_size} do not fit in shared memory")
    return tokens


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] long
    context_lens: torch.Tensor,  # [num_seqs] long, each >= 1
    scale: float,
    partition_size: int | None = None,  # tokens per thread block; None picks v1 or v2
    defines: tuple[str, ...] = (),  # compile-time knobs of paged_attention.cu (benchmarks/gpu_check.py)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to its first ``context_lens[i]`` cached tokens (an fp8 cache's
    elements widened as they are read; the output in the query's dtype)."""
    fp8 = check_kv_caches(key_cache, value_cache)
    check_tensor("query", query, FLOAT_DTYPES, 3)
    check_query_reads_cache("query", query, key_cache, fp8)
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[1]
    check_head_size("query", head_size)
    check_shape("key_cache", key_cache, (None, None, None, head_size))
    if num_heads % num_kv_heads:
        raise ValueError(f"query's {num_heads} heads are not a multiple of key_cache's {num_kv_heads} KV heads")
    check_contiguous("query", query)
    check_tensor("block_tables", block_tables, LONG, 2)
    check_shape("block_tables", block_tables, (num_seqs, None))
    check_contiguous("block_tables", block_tables)
    check_tensor("context_lens", context_lens, LONG, 1)
    check_shape("context_lens", context_lens, (num_seqs,))
    check_contiguous("context_lens", context_lens)
    if not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    group = num_heads // num_kv_heads
    fit = shared_bytes_limit_tokens(group, head_size)
    if partition_size is not None and not 1 <= partition_size <= fit:
        raise ValueError(f"partition_size must be in [1, {fit}] for this shape, got {partition_size}")
    device = check_cuda(
        ("query", "key_cache", "value_cache", "block_tables", "context_lens"),
        (query, key_cache, value_cache, block_tables, context_lens),
    )

    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    block_size, max_blocks = key_cache.shape[2], block_tables.shape[1]
    max_context = max_blocks * block_size  # an upper bound known without a device sync
    if partition_size is None:
        num_sms = loader.multiprocessors(device)
        partition_size = decode_partition_size(num_seqs, num_kv_heads, group, head_size, max_context, num_sms)
    num_parts = -(-max_context // partition_size)
    shared = 4 * (2 * group * head_size + group * partition_size + 2 * group)
    suffix = f"{loader.DTYPE_SUFFIX[query.dtype]}_{head_size}"  # v2's reduce: the same for either cache
    common = (
        loader.device_pointer(query),
        loader.device_pointer(key_cache),
        loader.device_pointer(value_cache),
        loader.device_pointer(block_tables),
        loader.device_pointer(context_lens),
        np.float32(scale),
        np.int32(num_kv_heads),
        np.int32(group),
        np.int32(block_size),
        np.int32(max_blocks),
        np.int32(partition_size),
    )
    if num_parts == 1:
        kernel = loader.function(
            "paged_attention.cu", f"paged_attention_v1_{suffix}{cache_suffix(fp8)}", device, defines
        )
        loader.launch(
            kernel, device, (num_kv_heads, num_seqs, 1), (NUM_THREADS,), (loader.device_pointer(out), *common), shared
        )
        return out
    partial_out = torch.empty(num_seqs, num_heads, num_parts, head_size, dtype=torch.float32, device=device)
    partial_max = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=device)
    partial_sum = torch.empty_like(partial_max)
    partials = tuple(loader.device_pointer(t) for t in (partial_out, partial_max, partial_sum))
    kernel = loader.function("paged_attention.cu", f"paged_attention_v2_{suffix}{cache_suffix(fp8)}", device, defines)
    loader.launch(kernel, device, (num_kv_heads, num_seqs, num_parts), (NUM_THREADS,), (*partials, *common), shared)
    reduce = loader.function("paged_attention.cu", f"paged_attention_v2_reduce_{suffix}", device, defines)
    loader.launch(
        reduce,
        device,
        (num_heads, num_seqs),
        (NUM_THREADS,),
        (
            loader.device_pointer(out),
            *partials,
            loader.device_pointer(context_lens),
            np.int32(num_parts),
            np.int32(partition_size),
        ),
        4 * num_parts,
    )
    return out


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """``dst[:, :, d] = src[:, :, s]`` for each (s, d) row of ``block_mapping``.

    ``src``/``dst``: ``[num_layers, 2, num_blocks, kv_heads, block_size, head_dim]`` (their
    num_blocks may differ). Copy-on-write: src is dst. Swap out/in: one side is a pinned
    CPU tensor, read or written through its mapped device address. ``block_mapping``:
    ``[num_pairs, 2]`` long on the CUDA device.
    """
    for name, pool in (("src", src), ("dst", dst)):
        check_cache_tensor(name, pool, 6)
        check_contiguous(name, pool)
        check_aligned(name, pool)
    check_same_dtype(("src", "dst"), (src, dst))
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must match except in num_blocks")
    block_bytes = src[0, 0, 0].numel() * src.element_size()
    if block_bytes % 16:
        raise ValueError(f"src blocks of {block_bytes} bytes are not a multiple of 16")
    check_tensor("block_mapping", block_mapping, LONG, 2)
    check_shape("block_mapping", block_mapping, (None, 2))
    check_contiguous("block_mapping", block_mapping)
    on_device = [(n, t) for n, t in (("src", src), ("dst", dst)) if loader.on_device(t)]
    for name, pool in (("src", src), ("dst", dst)):
        if not loader.on_device(pool) and pool.device.type == "cpu" and not pool.is_pinned():
            raise ValueError(f"{name} is a CPU tensor but not in pinned memory; swap needs pinned host blocks")
    if not on_device:
        raise ValueError("src or dst must be on a CUDA device")
    device = check_cuda([n for n, _ in on_device] + ["block_mapping"], [t for _, t in on_device] + [block_mapping])
    if block_mapping.shape[0] == 0:
        return
    block_vecs = block_bytes // 16
    kernel = loader.function("copy_blocks.cu", "copy_blocks", device)
    args = (
        _pool_pointer(dst),
        _pool_pointer(src),
        loader.device_pointer(block_mapping),
        np.int64(src.shape[2] * block_vecs),
        np.int64(dst.shape[2] * block_vecs),
        np.int32(block_vecs),
    )
    loader.launch(kernel, device, (block_mapping.shape[0], src.shape[0] * src.shape[1]), (COPY_THREADS,), args)


def _pool_pointer(pool: torch.Tensor):
    return loader.device_pointer(pool) if loader.on_device(pool) else loader.host_device_pointer(pool)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_seqs, max_blocks] block ids -> [num_seqs, max_blocks * block_size, num_kv_heads, head_dim], in the
    cache's dtype."""
    check_cache_tensor("cache", cache)
    check_tensor("block_tables", block_tables, LONG, 2)
    check_contiguous("cache", cache)
    check_cuda(("cache", "block_tables"), (cache, block_tables))
    num_seqs, max_blocks = block_tables.shape
    num_kv_heads, block_size, head_dim = cache.shape[1:]
    out = torch.empty(num_seqs * max_blocks, *cache.shape[1:], dtype=cache.dtype, device=cache.device)
    flat_ids = block_tables.reshape(-1)
    mapping = torch.stack((flat_ids, torch.arange(flat_ids.numel(), device=flat_ids.device)), dim=1)
    copy_blocks(cache[None, None], out[None, None], mapping)
    out = out.view(num_seqs, max_blocks, num_kv_heads, block_size, head_dim).transpose(2, 3)
    return out.reshape(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)


def paged_attention_prefill(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,  # [num_blocks] long, covering context_len
    context_len: int,
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Causal attention of a sequence's last ``query_len`` positions over its cached context:
    the gather kernel assembles the context (an fp8 one then widened to the query's dtype in torch, exactly),
    torch SDPA (flash/efficient backends) attends."""
    fp8 = check_kv_caches(key_cache, value_cache)
    check_tensor("query", query, FLOAT_DTYPES, 3)
    check_query_reads_cache("query", query, key_cache, fp8)
    check_shape("query", query, (None, None, key_cache.shape[3]))
    check_tensor("block_ids", block_ids, LONG, 1)
    if not query.shape[0] <= context_len <= block_ids.shape[0] * key_cache.shape[2]:
        raise ValueError(
            f"context_len {context_len} must cover the {query.shape[0]} query tokens and fit in "
            f"{block_ids.shape[0]} blocks of {key_cache.shape[2]}"
        )
    check_cuda(("query", "key_cache", "value_cache", "block_ids"), (query, key_cache, value_cache, block_ids))
    keys = gather_blocks(key_cache, block_ids[None])[0, :context_len].to(query.dtype)
    values = gather_blocks(value_cache, block_ids[None])[0, :context_len].to(query.dtype)
    return prefill_attention(query, keys, values, scale)

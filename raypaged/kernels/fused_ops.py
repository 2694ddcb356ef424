"""CUDA versions of the model step's elementwise work, backed by ``kernels/fused_ops.cu``.

References (the CPU path, and what the kernels must equal): ``raypaged.model.layers``'s
``rms_norm``, ``add_rms_norm``, ``silu_and_mul`` and ``RotaryEmbedding.rotate_`` followed by
``reshape_and_cache``. Each wrapper checks its arguments (``checks``) before importing cupy or
touching a device and launches on torch's current stream with no host sync, so the kernels
are recorded into CUDA graphs like the attention kernels.

The residual stream is in the model's dtype, as ``add_rms_norm`` keeps it: ``x + residual`` is
rounded to that dtype before it is normed and before it is carried on. Norms reduce in fp32.
"""

from __future__ import annotations

import numpy as np
import torch

from raypaged.kernels import loader
from raypaged.kernels.checks import (
    FLOAT_DTYPES,
    LONG,
    check_aligned,
    check_cache_pair,
    check_contiguous,
    check_cuda,
    check_eps,
    check_norm_input,
    check_norm_weight,
    check_rotary_table,
    check_same_dtype,
    check_shape,
    check_tensor,
)

NORM_MAX_THREADS = 1024  # kernels/fused_ops.cu
SILU_THREADS = 256
ROTARY_THREADS = 256
VECTOR_BYTES = 16


def _warps(units: int, most: int) -> int:
    """Threads for ``units`` work items: a whole number of warps, at least one, at most ``most``."""
    return min(most, max(32, -(-units // 32) * 32))


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % VECTOR_BYTES == 0 for t in tensors)


def _norm_threads(rows: int, units: int) -> int:
    # few rows (decode): wide blocks, so one row's reduction is spread over many threads;
    # many rows: 256-thread blocks, several resident per SM
    return _warps(units, NORM_MAX_THREADS if rows < 256 else 256)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * T(x * rsqrt(mean(x^2) + eps))`` over the last dimension, into a new contiguous tensor.

    ``x``: ``[tokens, hidden]`` or ``[tokens, heads, head_dim]`` (Qwen3's per-head q/k norm),
    its last dimension contiguous; the other strides are free (a view of a fused qkv).
    """
    check_norm_input("x", x, FLOAT_DTYPES)
    hidden = x.shape[-1]
    check_norm_weight(weight, x, FLOAT_DTYPES)
    check_eps(eps)
    device = check_cuda(("x", "weight"), (x, weight))
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0] * heads
    if rows == 0 or hidden == 0:
        return out
    head_stride = x.stride(1) if x.dim() == 3 else 0
    size = x.element_size()
    vectorized = (
        (hidden * size) % VECTOR_BYTES == 0
        and (x.stride(0) * size) % VECTOR_BYTES == 0
        and (head_stride * size) % VECTOR_BYTES == 0
        and _aligned(x, weight)
    )
    units = hidden // (VECTOR_BYTES // size) if vectorized else hidden
    kernel = loader.function("fused_ops.cu", f"rms_norm_{loader.DTYPE_SUFFIX[x.dtype]}", device)
    args = (
        loader.device_pointer(out),
        loader.device_pointer(x),
        loader.device_pointer(weight),
        np.int32(hidden),
        np.int32(heads),
        np.int64(x.stride(0)),
        np.int64(head_stride),
        np.float32(eps),
        np.int32(vectorized),
    )
    loader.launch(kernel, device, (rows,), (_norm_threads(rows, units),), args)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual = T(x + residual)``, then ``x = rms_norm(residual, weight, eps)``.

    ``x``, ``residual``: ``[tokens, hidden]``, contiguous, one dtype, two different buffers.
    Equals ``layers.add_rms_norm(x, residual, weight, eps)`` with the two results swapped into
    place: the normed rows land in ``x``, the residual stream in ``residual``.
    """
    check_tensor("x", x, FLOAT_DTYPES, 2)
    check_tensor("residual", residual, FLOAT_DTYPES, 2)
    check_same_dtype(("x", "residual"), (x, residual))
    check_shape("residual", residual, x.shape)
    for name, tensor in (("x", x), ("residual", residual)):
        check_contiguous(name, tensor)
    hidden = x.shape[1]
    check_norm_weight(weight, x, FLOAT_DTYPES)
    check_eps(eps)
    if x.numel() and x.data_ptr() == residual.data_ptr():
        raise ValueError("x and residual must be different buffers (both are written)")
    device = check_cuda(("x", "residual", "weight"), (x, residual, weight))
    rows = x.shape[0]
    if rows == 0 or hidden == 0:
        return
    size = x.element_size()
    vectorized = (hidden * size) % VECTOR_BYTES == 0 and _aligned(x, residual, weight)
    units = hidden // (VECTOR_BYTES // size) if vectorized else hidden
    kernel = loader.function("fused_ops.cu", f"fused_add_rms_norm_{loader.DTYPE_SUFFIX[x.dtype]}", device)
    args = (
        loader.device_pointer(x),
        loader.device_pointer(residual),
        loader.device_pointer(weight),
        np.int32(hidden),
        np.float32(eps),
        np.int32(vectorized),
    )
    loader.launch(kernel, device, (rows,), (_norm_threads(rows, units),), args)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for ``x: [tokens, 2 * d]`` (gate | up), contiguous -> ``[tokens, d]``."""
    check_tensor("x", x, FLOAT_DTYPES, 2)
    check_contiguous("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"x must have an even last dimension (gate | up halves), got shape {tuple(x.shape)}")
    device = check_cuda(("x",), (x,))
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, d, dtype=x.dtype, device=device)
    if rows == 0 or d == 0:
        return out
    size = x.element_size()
    vectorized = (d * size) % VECTOR_BYTES == 0 and _aligned(x, out)
    units = d // (VECTOR_BYTES // size) if vectorized else d
    kernel = loader.function("fused_ops.cu", f"silu_and_mul_{loader.DTYPE_SUFFIX[x.dtype]}", device)
    args = (loader.device_pointer(out), loader.device_pointer(x), np.int32(d), np.int32(vectorized))
    loader.launch(kernel, device, (rows, -(-units // SILU_THREADS)), (SILU_THREADS,), args)
    return out


def _check_rows(name: str, rows: object, heads: int | None, head_dim: int | None, dtypes=FLOAT_DTYPES) -> None:
    """``[tokens, heads, head_dim]`` with contiguous ``[heads, head_dim]`` rows at a 16-byte token stride."""
    rows = check_tensor(name, rows, dtypes, 3)
    check_shape(name, rows, (None, heads, head_dim))
    _, h, d = rows.shape
    if (
        (h > 1 and rows.stride(1) != d)
        or (d > 1 and rows.stride(2) != 1)
        or (rows.stride(0) * rows.element_size()) % VECTOR_BYTES
    ):
        raise ValueError(
            f"{name} must have contiguous [heads, head_dim] rows at a 16-byte token stride; got strides {rows.stride()}"
        )
    check_aligned(name, rows)


def rotary_and_cache(
    positions: torch.Tensor,  # [tokens] long, each in [0, cos_sin.shape[0])
    query: torch.Tensor,  # [tokens, num_heads, head_dim], rotated in place; rows may be strided (a view of qkv)
    key: torch.Tensor,  # [tokens, num_kv_heads, head_dim], rotated in place and written to key_cache
    value: torch.Tensor,  # [tokens, num_kv_heads, head_dim], written to value_cache
    cos_sin: torch.Tensor,  # [max_positions, 2, rotary_dim / 2]: RotaryEmbedding.cos_sin
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens] long, negative = skip
) -> None:
    """``RotaryEmbedding.rotate_(positions, query, key)`` and then ``reshape_and_cache(key, value,
    key_cache, value_cache, slot_mapping)``, in one launch: q and k are rotated in place and the
    rotated k (with v) goes to its cache slot from registers. Tokens with a negative slot are
    rotated but not cached. Rotate-half (neox) convention over a head's first ``R = 2 * cos_sin.shape[2]``
    features (``R = head_dim``, or fewer for a partial rotation: the rest pass): halves ``x1 = x[:R/2]``,
    ``x2 = x[R/2:R]`` become ``x1 cos - x2 sin`` and ``x2 cos + x1 sin``."""
    check_cache_pair(key_cache, value_cache)
    num_kv_heads, block_size, head_dim = key_cache.shape[1:]
    _check_rows("query", query, None, head_dim)
    _check_rows("key", key, num_kv_heads, head_dim)
    _check_rows("value", value, num_kv_heads, head_dim)
    tokens = query.shape[0]
    check_shape("key", key, (tokens, None, None))
    check_shape("value", value, (tokens, None, None))
    check_tensor("cos_sin", cos_sin, FLOAT_DTYPES, 3)
    rotary_dim = check_rotary_table(cos_sin, head_dim)
    check_contiguous("cos_sin", cos_sin)
    check_aligned("cos_sin", cos_sin)
    check_same_dtype(("query", "key", "value", "cos_sin", "key_cache"), (query, key, value, cos_sin, key_cache))
    half_bytes = head_dim // 2 * query.element_size()
    if head_dim == 0 or head_dim % 2 or half_bytes % VECTOR_BYTES:
        raise ValueError(
            f"head_dim {head_dim} is not supported: each half of a head ({half_bytes} bytes) must be a "
            f"multiple of {VECTOR_BYTES} bytes"
        )
    rotated_half_bytes = rotary_dim // 2 * query.element_size()  # then the features past it are whole vectors too
    if rotated_half_bytes % VECTOR_BYTES:
        raise ValueError(
            f"a rotation of {rotary_dim} of {head_dim} features is not supported: each half of it "
            f"({rotated_half_bytes} bytes) must be a multiple of {VECTOR_BYTES} bytes"
        )
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_tensor(name, index, LONG, 1)
        check_shape(name, index, (tokens,))
        check_contiguous(name, index)
    device = check_cuda(
        ("positions", "query", "key", "value", "cos_sin", "key_cache", "value_cache", "slot_mapping"),
        (positions, query, key, value, cos_sin, key_cache, value_cache, slot_mapping),
    )
    if tokens == 0:
        return
    num_heads = query.shape[1]
    vector = VECTOR_BYTES // query.element_size()
    units = max((num_heads + num_kv_heads) * (rotary_dim // 2 // vector), num_kv_heads * head_dim // vector)
    kernel = loader.function("fused_ops.cu", f"rotary_and_cache_{loader.DTYPE_SUFFIX[query.dtype]}", device)
    args = (
        loader.device_pointer(positions),
        loader.device_pointer(query),
        loader.device_pointer(key),
        loader.device_pointer(value),
        loader.device_pointer(cos_sin),
        loader.device_pointer(key_cache),
        loader.device_pointer(value_cache),
        loader.device_pointer(slot_mapping),
        np.int64(query.stride(0)),
        np.int64(key.stride(0)),
        np.int64(value.stride(0)),
        np.int32(num_heads),
        np.int32(num_kv_heads),
        np.int32(head_dim),
        np.int32(rotary_dim),
        np.int32(block_size),
    )
    loader.launch(kernel, device, (tokens,), (_warps(units, ROTARY_THREADS),), args)

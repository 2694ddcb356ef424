"""The fused path's step ops on CPU (fp32), in C (``cpu_fused.c``, built by ``cpu_ops.library``).

Same contracts as the CUDA ones in ``raypaged.kernels.fused_ops`` (``FusedOps`` in
``raypaged.attention.backend`` names them), so the model runs one fused path on either device:
``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul`` and ``rotary_and_cache``. References:
``raypaged.model.layers`` (rotary bit for bit; the norms and SiLU within fp32 rounding, their
reductions and exp being the library's own). Run on ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import torch

from raypaged.attention import cpu_ops
from raypaged.kernels.checks import (
    LONG,
    check_contiguous,
    check_eps,
    check_norm_input,
    check_norm_weight,
    check_rotary_table,
    check_shape,
    check_tensor,
)

F32 = (torch.float32,)


def _check_cpu(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    for name, tensor in zip(names, tensors):
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got {tensor.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dimension, into a new contiguous tensor.
    ``x``: ``[tokens, hidden]`` or ``[tokens, heads, head_dim]``, its last dimension contiguous."""
    check_norm_input("x", x, F32)
    hidden = x.shape[-1]
    check_norm_weight(weight, x, F32)
    check_eps(eps)
    _check_cpu(("x", "weight"), (x, weight))
    out = torch.empty(x.shape, dtype=x.dtype)
    heads = x.shape[1] if x.dim() == 3 else 1
    if out.numel():
        cpu_ops.library().raypaged_rms_norm_f32(
            x.data_ptr(),
            x.stride(0),
            x.stride(1) if x.dim() == 3 else 0,
            weight.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            heads,
            hidden,
            eps,
            torch.get_num_threads(),
        )
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual = x + residual``, then ``x = rms_norm(residual, weight, eps)``;
    ``x``, ``residual``: ``[tokens, hidden]``, contiguous, two different buffers."""
    check_tensor("x", x, F32, 2)
    check_tensor("residual", residual, F32, 2)
    check_shape("residual", residual, x.shape)
    check_contiguous("x", x)
    check_contiguous("residual", residual)
    check_norm_weight(weight, x, F32)
    check_eps(eps)
    _check_cpu(("x", "residual", "weight"), (x, residual, weight))
    if x.numel() and x.data_ptr() == residual.data_ptr():
        raise ValueError("x and residual must be different buffers (both are written)")
    if x.numel():
        cpu_ops.library().raypaged_fused_add_rms_norm_f32(
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads()
        )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for ``x: [tokens, 2 * d]`` (gate | up), contiguous -> ``[tokens, d]``."""
    check_tensor("x", x, F32, 2)
    check_contiguous("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"x must have an even last dimension (gate | up halves), got shape {tuple(x.shape)}")
    _check_cpu(("x",), (x,))
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, d, dtype=x.dtype)
    if out.numel():
        cpu_ops.library().raypaged_silu_and_mul_f32(x.data_ptr(), out.data_ptr(), rows, d, torch.get_num_threads())
    return out


def _check_rows(name: str, rows: torch.Tensor, tokens: int | None, heads: int | None, head_dim: int) -> None:
    """``[tokens, heads, head_dim]`` with contiguous ``[heads, head_dim]`` rows at any token stride."""
    check_tensor(name, rows, F32, 3)
    check_shape(name, rows, (tokens, heads, head_dim))
    if (rows.shape[1] > 1 and rows.stride(1) != head_dim) or (head_dim > 1 and rows.stride(2) != 1):
        raise ValueError(f"{name} must have contiguous [heads, head_dim] rows; got strides {rows.stride()}")


def rotary_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``RotaryEmbedding.rotate_(positions, query, key)``, then ``reshape_and_cache(key, value, key_cache,
    value_cache, slot_mapping)``, in one pass over the tokens (a negative slot: rotated, not cached); ``cos_sin``
    ``[max_positions, 2, R / 2]`` rotates the first ``R`` features of each head (a partial rotation where
    ``R < head_dim``), as ``layers.apply_rotary_``. The cache
    may be float32, bfloat16 (written as ``key.to(torch.bfloat16)`` writes it) or fp8 e4m3, which holds ``key /
    k_scale`` and ``value / v_scale`` (written as ``(key / k_scale).to(torch.float8_e4m3fn)`` writes it; the
    scales are an fp8 cache's only).
    The arguments' shapes are those of ``raypaged.kernels.fused_ops.rotary_and_cache``; here the token
    stride of query, key and value is free."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_tensor(name, cache, cpu_ops.CACHE_DTYPES, 4)
        check_contiguous(name, cache)
    check_shape("value_cache", value_cache, key_cache.shape)
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"key_cache and value_cache differ in dtype: {key_cache.dtype} and {value_cache.dtype}")
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even (rotate-half)")
    tokens = query.shape[0] if isinstance(query, torch.Tensor) else None
    _check_rows("query", query, tokens, None, head_dim)
    _check_rows("key", key, tokens, num_kv_heads, head_dim)
    _check_rows("value", value, tokens, num_kv_heads, head_dim)
    check_tensor("cos_sin", cos_sin, F32, 3)
    rotary_dim = check_rotary_table(cos_sin, head_dim)
    check_contiguous("cos_sin", cos_sin)
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_tensor(name, index, LONG, 1)
        check_shape(name, index, (tokens,))
        check_contiguous(name, index)
    _check_cpu(
        ("positions", "query", "key", "value", "cos_sin", "key_cache", "value_cache", "slot_mapping"),
        (positions, query, key, value, cos_sin, key_cache, value_cache, slot_mapping),
    )
    if key_cache.dtype != torch.float8_e4m3fn and (k_scale, v_scale) != (1.0, 1.0):
        name = str(key_cache.dtype).removeprefix("torch.")
        raise ValueError(f"K/V scales ({k_scale}, {v_scale}) apply to an fp8 cache, not a {name} one")
    if not tokens:
        return
    status = cpu_ops.library().raypaged_rotary_and_cache_f32(
        positions.data_ptr(),
        query.data_ptr(),
        query.stride(0),
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        cos_sin.data_ptr(),
        cos_sin.shape[0],
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        cpu_ops.cache_format(key_cache.dtype),
        k_scale,
        v_scale,
        num_blocks,
        slot_mapping.data_ptr(),
        tokens,
        query.shape[1],
        num_kv_heads,
        head_dim,
        rotary_dim,
        block_size,
        torch.get_num_threads(),
    )
    raise_for_rotary_status(status, cos_sin.shape[0], num_blocks, block_size)


def raise_for_rotary_status(status: int, max_positions: int, num_blocks: int, block_size: int) -> None:
    """The rotary kernel's failures (-1 a position past the table, -2 a slot past the cache)."""
    if status == -1:
        raise ValueError(f"a position is outside the rotary table's {max_positions} positions")
    if status == -2:
        raise ValueError(f"a slot is outside the cache's {num_blocks} blocks of {block_size}")

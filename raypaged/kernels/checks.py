"""Argument checks for the CUDA kernel wrappers: pure tensor metadata, no device work.

Every check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape,
layout, alignment or device) naming the argument, so the wrappers fail before cupy is
imported or a kernel is launched and the checks can be tested on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from raypaged.kernels import host

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LONG = (torch.int64,)  # index tensors: block tables, slot mappings, token ids
HEAD_SIZES = (64, 80, 96, 128)
BLOCK_SIZES = (8, 16, 32)


def check_tensor(name: str, tensor: object, dtypes: Sequence[torch.dtype], ndim: int) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    return tensor


def check_norm_input(name: str, x: object, dtypes: Sequence[torch.dtype]) -> None:
    """A norm's input: ``[tokens, hidden]`` or ``[tokens, heads, head_dim]``, its last dimension
    contiguous (the other strides free: a view of a fused qkv)."""
    if isinstance(x, torch.Tensor) and x.dim() not in (2, 3):
        raise ValueError(f"{name} must have 2 or 3 dimensions, got shape {tuple(x.shape)}")
    x = check_tensor(name, x, dtypes, x.dim() if isinstance(x, torch.Tensor) else 2)
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension; got strides {x.stride()}")


def check_norm_weight(weight: object, x: torch.Tensor, dtypes: Sequence[torch.dtype]) -> None:
    """A norm's weight: one contiguous row of ``x``'s last dimension, in ``x``'s dtype."""
    weight = check_tensor("weight", weight, dtypes, 1)
    check_shape("weight", weight, (x.shape[-1],))
    check_contiguous("weight", weight)
    check_same_dtype(("x", "weight"), (x, weight))


def check_rotary_table(cos_sin: torch.Tensor, head_dim: int) -> int:
    """A rotary table ``[max_positions, 2, R / 2]`` (``RotaryEmbedding.cos_sin``, 3-D) for heads of ``head_dim``:
    it rotates their first ``R`` features, all of them or fewer (a partial rotation, as Phi-3's). Returns R."""
    check_shape("cos_sin", cos_sin, (None, 2, None))
    if not 0 < cos_sin.shape[2] <= head_dim // 2:
        raise ValueError(
            f"cos_sin must have shape (*, 2, {head_dim // 2}), or a narrower last dimension for a partial rotation; "
            f"got {tuple(cos_sin.shape)}"
        )
    return 2 * cos_sin.shape[2]


def check_eps(eps: object) -> None:
    """A norm's epsilon: a number >= 0."""
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int | None]) -> None:
    """``expected`` entries of None accept any size."""
    if any(want is not None and got != want for got, want in zip(tensor.shape, expected)):
        shown = ", ".join("*" if want is None else str(want) for want in expected)
        raise ValueError(
            f"{name} must have shape ({shown}{',' if len(expected) == 1 else ''}), got {tuple(tensor.shape)}"
        )


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {tensor.stride()} for shape {tuple(tensor.shape)})")


def check_aligned(name: str, tensor: torch.Tensor) -> None:
    """The kernels use 16-byte vector loads and stores."""
    if tensor.data_ptr() % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary (it is a view at an unaligned offset)")


def check_same_dtype(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    if len({t.dtype for t in tensors}) > 1:
        found = ", ".join(f"{n}={t.dtype}" for n, t in zip(names, tensors))
        raise TypeError(f"{', '.join(names)} must share one dtype; got {found}")


def check_head_size(name: str, head_size: int) -> None:
    if head_size not in HEAD_SIZES:
        raise ValueError(f"{name} head size {head_size} is not supported; kernels exist for {HEAD_SIZES}")


def check_block_size(name: str, block_size: int) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{name} block size {block_size} is not supported; use one of {BLOCK_SIZES}")


def check_cuda(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> torch.device:
    """All tensors on one CUDA device (the CPU where the kernels run on the host); returns it."""
    devices = {t.device for t in tensors}
    for name, tensor in zip(names, tensors):
        if tensor.device.type != host.device_type():
            where = f"the CPU ({host.ENV}=1)" if host.enabled() else "a CUDA device"
            raise ValueError(f"{name} must be on {where}, got {tensor.device}")
    if len(devices) > 1:
        found = ", ".join(f"{n}={t.device}" for n, t in zip(names, tensors))
        raise ValueError(f"{', '.join(names)} must be on the same CUDA device; got {found}")
    return devices.pop()


def check_cache_pair(
    key_cache: object, value_cache: object, check_cache: Callable[[str, object], torch.Tensor] | None = None
) -> torch.Tensor:
    """A layer's K and V caches: ``[num_blocks, num_kv_heads, block_size, head_dim]`` each, one dtype,
    contiguous, 16-byte aligned, a supported block size. ``check_cache`` checks each one's type (by default:
    a float dtype, 4 dims). Returns the K cache."""
    if check_cache is None:
        check_cache = lambda name, cache: check_tensor(name, cache, FLOAT_DTYPES, 4)  # noqa: E731
    key_cache = check_cache("key_cache", key_cache)
    value_cache = check_cache("value_cache", value_cache)
    check_same_dtype(("key_cache", "value_cache"), (key_cache, value_cache))
    check_shape("value_cache", value_cache, key_cache.shape)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_contiguous(name, cache)
        check_aligned(name, cache)
    check_block_size("key_cache", key_cache.shape[2])
    return key_cache

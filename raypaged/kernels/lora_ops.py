"""CUDA versions of the batched LoRA product of ``raypaged.lora.ops``, backed by ``kernels/lora_bgmv.cu``
(one adapter token per block, Punica's BGMV). Same layout as the torch path: ``lora_a: [num_slots,
in, rank]`` (A transposed), ``lora_b: [num_slots, rank, out]`` (B transposed, the scale folded in).
The tokens are named by ``token_ids`` (rows of ``x``/``y``, each at most once) and ``slot_of``
(each one's slot, ``-1`` for a token of no adapter: its ``h`` row is zero and its ``y`` row kept);
rows not listed keep ``y`` too.
"""

from __future__ import annotations

import numpy as np
import torch

from raypaged.kernels import loader
from raypaged.kernels.checks import (
    FLOAT_DTYPES,
    LONG,
    check_contiguous,
    check_cuda,
    check_same_dtype,
    check_shape,
    check_tensor,
)

SHRINK_THREADS = EXPAND_THREADS = 256  # kernels/lora_bgmv.cu
MAX_RANK = 512  # the expand kernel's shared h row


def _check_tokens(token_ids: object, slot_of: object) -> None:
    """Long vectors of one length; their values are the caller's (the LoRA mapping builds them from
    the scheduler's slots and the step's rows)."""
    token_ids = check_tensor("token_ids", token_ids, LONG, 1)
    check_contiguous("token_ids", token_ids)
    slot_of = check_tensor("slot_of", slot_of, LONG, 1)
    check_contiguous("slot_of", slot_of)
    check_shape("slot_of", slot_of, token_ids.shape)


def lora_bgmv_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_ids: torch.Tensor, slot_of: torch.Tensor
) -> torch.Tensor:
    """``h[t] = x[token_ids[t]] @ lora_a[slot_of[t]]``: fp32 ``[len(token_ids), rank]``."""
    check_tensor("x", x, FLOAT_DTYPES, 2)
    check_tensor("lora_a", lora_a, FLOAT_DTYPES, 3)
    check_same_dtype(("x", "lora_a"), (x, lora_a))
    _, in_features, rank = lora_a.shape
    check_shape("x", x, (None, in_features))
    for name, tensor in (("x", x), ("lora_a", lora_a)):
        check_contiguous(name, tensor)
    _check_tokens(token_ids, slot_of)
    device = check_cuda(("x", "lora_a", "token_ids", "slot_of"), (x, lora_a, token_ids, slot_of))
    h = torch.empty(token_ids.shape[0], rank, dtype=torch.float32, device=device)
    if token_ids.shape[0] == 0 or rank == 0:
        return h
    kernel = loader.function("lora_bgmv.cu", f"lora_shrink_{loader.DTYPE_SUFFIX[x.dtype]}", device)
    args = (
        loader.device_pointer(h),
        loader.device_pointer(x),
        loader.device_pointer(lora_a),
        loader.device_pointer(token_ids),
        loader.device_pointer(slot_of),
        np.int32(in_features),
        np.int32(rank),
    )
    loader.launch(kernel, device, (token_ids.shape[0],), (SHRINK_THREADS,), args)
    return h


def lora_bgmv_expand(
    y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, token_ids: torch.Tensor, slot_of: torch.Tensor
) -> None:
    """``y[token_ids[t]] += h[t] @ lora_b[slot_of[t]]`` in place (``h`` fp32, from :func:`lora_bgmv_shrink`)."""
    check_tensor("y", y, FLOAT_DTYPES, 2)
    check_tensor("lora_b", lora_b, FLOAT_DTYPES, 3)
    check_tensor("h", h, (torch.float32,), 2)
    check_same_dtype(("y", "lora_b"), (y, lora_b))
    _, rank, out_features = lora_b.shape
    if rank > MAX_RANK:
        raise ValueError(f"lora_b has rank {rank}; the kernel holds at most {MAX_RANK}")
    _check_tokens(token_ids, slot_of)
    check_shape("y", y, (None, out_features))
    check_shape("h", h, (token_ids.shape[0], rank))
    for name, tensor in (("y", y), ("h", h), ("lora_b", lora_b)):
        check_contiguous(name, tensor)
    device = check_cuda(("y", "h", "lora_b", "token_ids", "slot_of"), (y, h, lora_b, token_ids, slot_of))
    if token_ids.shape[0] == 0 or rank == 0:
        return
    kernel = loader.function("lora_bgmv.cu", f"lora_expand_{loader.DTYPE_SUFFIX[y.dtype]}", device)
    args = (
        loader.device_pointer(y),
        loader.device_pointer(h),
        loader.device_pointer(lora_b),
        loader.device_pointer(token_ids),
        loader.device_pointer(slot_of),
        np.int32(rank),
        np.int32(out_features),
    )
    loader.launch(kernel, device, (token_ids.shape[0], -(-out_features // EXPAND_THREADS)), (EXPAND_THREADS,), args)

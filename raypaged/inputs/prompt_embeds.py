"""vLLM's ``prompt_embeds``: a prompt given as one embedding row per token instead of token ids.

Offline (``LLM.generate({"prompt_embeds": tensor})``) the tensor comes as it is; over HTTP and gRPC it comes as the
bytes ``torch.save`` writes (HTTP: base64 of them). Either is checked here before anything reaches the engine: a
dense float tensor (float32, float16 or bfloat16) of shape ``[num_tokens, hidden_size]`` (or ``[1, num_tokens,
hidden_size]``) with at least one row and finite values. Bytes are read with ``torch.load(weights_only=True)`` and
sparse tensors' invariants checked while they are built, so a crafted payload cannot write out of bounds (the
flaw vLLM fixed in its own loader); anything but a dense tensor is refused by name.
"""

from __future__ import annotations

import io
import logging
from typing import Any

import torch

from raypaged.inputs.limits import InputError

logger = logging.getLogger(__name__)

PARAM = "prompt_embeds"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_prompt_embeds(data: bytes) -> torch.Tensor:
    """The tensor ``torch.save`` wrote into ``data``; ``InputError`` when it is not one."""
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # whatever the bytes hold, the request fails alone, naming why
        logger.info("prompt_embeds refused: torch.load raised %s: %s", type(exc).__name__, str(exc)[:200])
        raise InputError(PARAM, "prompt_embeds is not a tensor saved by torch.save") from None
    return tensor


def checked_prompt_embeds(tensor: Any, hidden_size: int) -> torch.Tensor:
    """``tensor`` as the engine takes it: a contiguous CPU ``[num_tokens, hidden_size]`` float tensor, detached;
    ``InputError`` naming what is wrong with it."""
    if not isinstance(tensor, torch.Tensor):
        raise InputError(PARAM, f"prompt_embeds must be a tensor, got {type(tensor).__name__}")
    if tensor.layout is not torch.strided:
        raise InputError(PARAM, f"prompt_embeds must be a dense tensor, got layout {tensor.layout}")
    if tensor.dtype not in _DTYPES:
        raise InputError(PARAM, f"prompt_embeds must be float32, float16 or bfloat16, got {tensor.dtype}")
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[1] != hidden_size:
        raise InputError(
            PARAM,
            f"prompt_embeds must be [num_tokens, {hidden_size}] (the model's hidden size), got {list(tensor.shape)}",
        )
    if tensor.shape[0] == 0:
        raise InputError(PARAM, "prompt_embeds has no rows")
    tensor = tensor.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(tensor).all()):
        raise InputError(PARAM, "prompt_embeds has values that are not finite (inf or NaN)")
    return tensor


def truncated(tensor: torch.Tensor, keep: int | None, keep_first: bool) -> torch.Tensor:
    """``truncate_prompt_tokens``: the last ``keep`` rows (``keep_first``: the first), as vLLM cuts token ids."""
    if keep is None or keep >= tensor.shape[0]:
        return tensor
    return tensor[:keep] if keep_first else tensor[tensor.shape[0] - keep :]


def embeds_salt(cache_salt: str | None, tensor: torch.Tensor) -> str:
    """The prefix-cache namespace of a prompt given as embeddings: its placeholder ids say nothing, so the
    rows' sha256 keys its blocks (two requests share blocks only for the same rows)."""
    import hashlib

    digest = hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes() + str(tensor.dtype).encode()).hexdigest()
    return f"{cache_salt or ''}\x00embeds:{digest}"

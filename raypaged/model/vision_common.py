"""What the image encoders share (``llava_vision``, ``qwen2_vl_vision``, ``qwen3_vl_vision``): their activations by
Hugging Face name, and the copy of their tensors out of a checkpoint's."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": lambda x: F.silu(x),
    "swish": lambda x: F.silu(x),
}


def activation(name: str, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation ``name``; ``ValueError`` naming ``what`` (the config field) for one not in ``ACTIVATIONS``."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{what} {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    key_of: Callable[[str], str | None],
    derived: tuple[str, ...] = (),
) -> None:
    """Copy into ``module``'s parameters the checkpoint tensors ``key_of`` names a parameter for (None: a tensor not
    read; nor is one whose key ends with a ``derived`` suffix: a buffer the module computes from its config).
    ``ValueError`` naming a tensor with no place or of the wrong shape, or the parameters left unfilled."""
    owner = type(module).__name__
    params = dict(module.named_parameters())
    filled: set[str] = set()
    for name, tensor in weights:
        key = key_of(name)
        if key is None or key.endswith(derived):
            continue
        if key not in params:
            raise ValueError(f"checkpoint tensor {name} has no place in {owner} (as {key})")
        if params[key].shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name} has shape {list(tensor.shape)}, expected {list(params[key].shape)}"
            )
        with torch.no_grad():
            params[key].copy_(tensor)
        filled.add(key)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors of {owner}: {', '.join(missing)}")

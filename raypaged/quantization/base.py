"""What a quantization scheme provides: a config read from a checkpoint (or built online) and, for
each linear layer, a method that declares the layer's on-disk tensors, finishes them after loading,
multiplies with them and dequantizes them (the torch reference every fast path is tested against)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

Merge = Literal["shard", "same", "max"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a quantized linear as it lies on disk, and how it splits over fused parts and ranks.

    ``out_dim``/``in_dim``: the dims running along output/input features (None: not split that way);
    ``out_pack``/``in_pack``: features per entry along them (a packing factor or a group size).
    ``merge``: how the parts of a fused layer (q/k/v, gate/up) fill it: ``shard`` each its own rows,
    ``same`` every part must bring the same tensor, ``max`` the largest part's value is kept.
    ``broadcast``: a one-element checkpoint tensor fills every row of its part (a per-tensor scale
    stored as per-channel).
    ``out_block``: each on-disk entry along ``out_dim`` covers this many output rows (a block-wise
    scale); the layer holds one entry per row, so a fused part or a rank's share may start mid-block.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dim: int | None = None
    in_dim: int | None = None
    out_pack: int = 1
    in_pack: int = 1
    merge: Merge = "shard"
    broadcast: bool = False
    out_block: int = 1


@dataclass(frozen=True, slots=True)
class LinearShape:
    """This rank's features of a linear; ``in_total`` is the whole layer's input (more under row parallelism)."""

    in_features: int
    out_features: int
    in_total: int

    @property
    def row_sharded(self) -> bool:
        return self.in_features != self.in_total


def layer_tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` a method declared (``tensors``) or built (``finish``) on ``layer``."""
    tensor = getattr(layer, name)
    assert isinstance(tensor, torch.Tensor)
    return tensor


class LinearMethod(ABC):
    """How one quantized linear stores, loads and multiplies its weight."""

    @abstractmethod
    def tensors(self, shape: LinearShape) -> dict[str, TensorSpec]:
        """The checkpoint tensors of the layer (bias excluded), sized for this rank."""

    def checked(self, name: str, tensor: torch.Tensor, rows_read: int, shape: LinearShape) -> bool:
        """True when ``name`` is an on-disk tensor only checked, not kept (raises when it disagrees with
        the layer, of whose checkpoint tensor the first ``rows_read`` output rows are read)."""
        return False

    def finish(self, layer: nn.Module) -> None:  # noqa: B027  (not abstract: nothing to build by default)
        """After every tensor is loaded and cast: build what ``apply`` uses."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` (no bias), ``x: [num_tokens, in_features]`` in the model's dtype."""

    @abstractmethod
    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The weight ``[out_features, in_features]`` in float32: the reference of ``apply``."""

    def pack_gated(self, layer: nn.Module) -> None:  # noqa: B027  (not abstract: most methods have no gated form)
        """For an MLP's gate | up layer, after ``finish``: its weight in a layout whose GEMM can store
        ``silu(gate) * up`` itself (:meth:`silu_and_mul`), where the method has one."""

    def silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``silu_and_mul(layer(x))`` in one pass (bias included) where :meth:`pack_gated` gave the layer
        such a weight and ``x`` suits it, the same bits as the C silu_and_mul after the layer; else None."""
        return None


class QuantizationConfig(ABC):
    """A scheme's settings: from a checkpoint's ``quantization_config``, or online (from float weights)."""

    name: str  # vLLM's --quantization value

    @classmethod
    @abstractmethod
    def from_checkpoint(cls, config: dict[str, Any]) -> QuantizationConfig:
        """The scheme of a checkpoint's ``quantization_config``; ``ValueError`` naming what is not supported."""

    @classmethod
    def online(cls) -> QuantizationConfig:
        """The scheme applied at load to a float checkpoint (only schemes that quantize online)."""
        raise ValueError(
            f"--quantization {cls.name} needs a checkpoint quantized with {cls.name}, but the model's config.json "
            "has no quantization_config (quantize it with python -m raypaged.quantization.quantizer, or use "
            "--quantization fp8, which quantizes a float checkpoint at load)"
        )

    @abstractmethod
    def linear_method(self, part_names: tuple[str, ...]) -> LinearMethod | None:
        """The method of the linear fusing the checkpoint modules ``part_names`` (None: left unquantized)."""


def known_keys(scheme: str, config: dict[str, Any], allowed: set[str]) -> None:
    """Refuse a quantization_config key this scheme would otherwise ignore."""
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise ValueError(
            f"{scheme} quantization_config field {unknown[0]!r} is not supported "
            f"(supported: {', '.join(sorted(allowed))})"
        )


def is_ignored(part_names: tuple[str, ...], ignored: tuple[str, ...], scheme: str, substring: bool = False) -> bool:
    """Whether a fused layer's parts are all in ``ignored`` (left unquantized; ``substring``: a name
    containing an entry is in it, as AutoAWQ and AutoGPTQ match); a split is an error."""
    hits = [any(entry in name if substring else entry == name for entry in ignored) for name in part_names]
    if any(hits) and not all(hits):
        raise ValueError(f"{scheme}: the fused modules {', '.join(part_names)} must all be quantized or all ignored")
    return all(hits)

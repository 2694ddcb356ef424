"""``--quantization fp8``: online from a float checkpoint, or an fp8 checkpoint (``quant_method: fp8``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raypaged.quantization.base import LinearMethod, QuantizationConfig, is_ignored, known_keys
from raypaged.quantization.block_fp8 import BlockFp8Method, block_shape
from raypaged.quantization.w8a8 import FP8, Fp8OnlineMethod, W8A8Method

ACTIVATION_SCHEMES = ("dynamic", "static")
_KEYS = {"quant_method", "activation_scheme", "ignored_layers", "modules_to_not_convert", "weight_block_size", "fmt"}


@dataclass(frozen=True, slots=True)
class Fp8Config(QuantizationConfig):
    """``serialized``: the checkpoint holds fp8 weights with per-tensor (or per-channel) ``weight_scale``,
    or with ``weight_block_size`` [block_n, block_k] one ``weight_scale_inv`` per tile (block-wise, dynamic
    activations only, as vLLM); else float weights are quantized at load, one scale per output channel.
    Activations: per-token scales (``dynamic``; per token and group of block_k inputs with blocks) or the
    checkpoint's per-tensor ``input_scale`` (``static``). ``ignored_layers`` (or transformers'
    ``modules_to_not_convert``, matched as substrings) stay float."""

    serialized: bool
    activation_scheme: str = "dynamic"
    ignored_layers: tuple[str, ...] = ()
    block: tuple[int, int] | None = None
    not_converted: tuple[str, ...] = ()
    name = "fp8"

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any]) -> Fp8Config:
        known_keys("fp8", config, _KEYS)
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 fmt {config['fmt']!r} is not supported (only e4m3)")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (supported: dynamic, static)")
        block = config.get("weight_block_size")
        shape = None if block is None else block_shape(block)
        if block is not None:
            if shape is None:
                raise ValueError(f"fp8 weight_block_size must be two positive integers [block_n, block_k], got {block}")
            if scheme != "dynamic":
                raise ValueError(
                    f"fp8 weight_block_size {block} with activation_scheme {scheme!r} is not supported "
                    "(block-wise scales take dynamic activations only)"
                )
        return cls(
            True,
            scheme,
            tuple(config.get("ignored_layers") or ()),
            shape,
            tuple(config.get("modules_to_not_convert") or ()),
        )

    @classmethod
    def online(cls) -> Fp8Config:
        return cls(serialized=False)

    def linear_method(self, part_names: tuple[str, ...]) -> LinearMethod | None:
        if is_ignored(part_names, self.ignored_layers, "fp8") or is_ignored(
            part_names, self.not_converted, "fp8", substring=True
        ):
            return None
        if not self.serialized:
            return Fp8OnlineMethod()
        if self.block is not None:
            return BlockFp8Method(*self.block, scale_name="weight_scale_inv")
        return W8A8Method(FP8, static=self.activation_scheme == "static")

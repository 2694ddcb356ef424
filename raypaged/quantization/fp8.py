"""``--quantization fp8``: online from a float checkpoint, or an fp8 checkpoint (``quant_method: fp8``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raypaged.quantization.base import LinearMethod, QuantizationConfig, is_ignored, known_keys
from raypaged.quantization.w8a8 import FP8, Fp8OnlineMethod, W8A8Method

ACTIVATION_SCHEMES = ("dynamic", "static")


@dataclass(frozen=True, slots=True)
class Fp8Config(QuantizationConfig):
    """``serialized``: the checkpoint holds fp8 weights with per-tensor (or per-channel) ``weight_scale``;
    else float weights are quantized at load, one scale per output channel. Activations: per-token
    scales (``dynamic``) or the checkpoint's per-tensor ``input_scale`` (``static``)."""

    serialized: bool
    activation_scheme: str = "dynamic"
    ignored_layers: tuple[str, ...] = ()
    name = "fp8"

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any]) -> Fp8Config:
        known_keys("fp8", config, {"quant_method", "activation_scheme", "ignored_layers", "weight_block_size", "fmt"})
        if config.get("weight_block_size") is not None:
            raise ValueError(
                f"fp8 weight_block_size {config['weight_block_size']} (block-wise scales) is not "
                "supported: per-tensor or per-channel weight scales only"
            )
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 fmt {config['fmt']!r} is not supported (only e4m3)")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (supported: dynamic, static)")
        return cls(True, scheme, tuple(config.get("ignored_layers") or ()))

    @classmethod
    def online(cls) -> Fp8Config:
        return cls(serialized=False)

    def linear_method(self, part_names: tuple[str, ...]) -> LinearMethod | None:
        if is_ignored(part_names, self.ignored_layers, "fp8"):
            return None
        if not self.serialized:
            return Fp8OnlineMethod()
        return W8A8Method(FP8, static=self.activation_scheme == "static")

"""``--quantization awq``: AWQ checkpoints (``quant_method: awq``), 4 bits, GEMM layout, with zero points."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raypaged.quantization.base import LinearMethod, QuantizationConfig, is_ignored, known_keys
from raypaged.quantization.wna16 import AWQMethod


@dataclass(frozen=True, slots=True)
class AWQConfig(QuantizationConfig):
    group_size: int
    modules_to_not_convert: tuple[str, ...] = ()
    name = "awq"

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any]) -> AWQConfig:
        known_keys(
            "awq",
            config,
            {
                "quant_method",
                "bits",
                "w_bit",
                "group_size",
                "q_group_size",
                "zero_point",
                "version",
                "modules_to_not_convert",
                "backend",
            },
        )
        bits = int(config.get("bits", config.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"awq bits {bits} is not supported (only 4)")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported (only gemm, the layout vLLM reads)")
        if not config.get("zero_point", True):
            raise ValueError("awq zero_point false is not supported (AWQ checkpoints carry zero points)")
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        return cls(group_size, tuple(config.get("modules_to_not_convert") or ()))

    def linear_method(self, part_names: tuple[str, ...]) -> LinearMethod | None:
        if is_ignored(part_names, self.modules_to_not_convert, "awq", substring=True):
            return None
        return AWQMethod(self.group_size)

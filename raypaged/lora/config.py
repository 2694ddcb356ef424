"""The LoRA flags (``--max-loras``, ``--max-cpu-loras``, ``--max-lora-rank``), validated once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """``max_loras`` adapters sit in device slots at once, ``max_cpu_loras`` (at least as many; by
    default the same) stay loaded on the CPU behind them, and no adapter's rank exceeds ``max_lora_rank``."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras {self.max_cpu_loras} is below --max-loras {self.max_loras}: "
                "every adapter on the device is also kept on the CPU"
            )

    @property
    def num_cpu_loras(self) -> int:
        """``max_cpu_loras`` resolved (never None after construction)."""
        assert self.max_cpu_loras is not None
        return self.max_cpu_loras

"""What a request names to run on an adapter instead of the base model (vLLM's ``LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, eq=False)
class LoRARequest:
    """One adapter: ``lora_name`` (what a request's ``model`` field says), ``lora_int_id`` (a positive
    id, unique per adapter, that the engine keys on) and ``lora_path`` (a PEFT folder).

    Two requests are equal when their names are (as vLLM's), so the same adapter named by
    separate engines compares equal.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a non-empty lora_name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a lora_path")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

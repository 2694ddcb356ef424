"""The driver's plan of LoRA device slots: which adapter each of the ``--max-loras`` slots holds.

The scheduler decides, the workers follow (each step's ``lora_loads`` says which adapter to write
into which slot), so every tensor-parallel rank holds the same adapters in the same slots. An
adapter used by a running sequence keeps its slot; a newcomer takes a free slot, else the slot of
the least recently placed adapter no running sequence uses. A waiting request whose adapter finds
no slot waits; the requests behind it go on. Torch-free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from raypaged.core.request import Request
from raypaged.lora.request import LoRARequest


class LoRASlotPlan:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently placed first

    @staticmethod
    def in_use(running: Iterable[Request]) -> set[int]:
        return {r.lora.lora_int_id for r in running if r.lora is not None}

    def fits(self, requests: Iterable[Request], in_use: set[int]) -> bool:
        """Could the adapters of ``requests`` all sit in slots beside those ``in_use``?"""
        wanted = {r.lora.lora_int_id for r in requests if r.lora is not None} | in_use
        return len(wanted) <= self.num_slots

    def place(self, lora: LoRARequest, in_use: set[int]) -> int | None:
        """Put ``lora`` in a slot (``fits`` said it can); the slot when it must be written there now,
        ``None`` when it is there already."""
        lora_id = lora.lora_int_id
        if lora_id in self._slot_of:
            self._slot_of.move_to_end(lora_id)
            return None
        taken = set(self._slot_of.values())
        free = [slot for slot in range(self.num_slots) if slot not in taken]
        if free:
            slot = free[0]
        else:
            evicted = next(a for a in self._slot_of if a not in in_use)
            slot = self._slot_of.pop(evicted)
        self._slot_of[lora_id] = slot
        return slot

    def forget(self, lora_int_id: int) -> None:
        """An adapter unloaded: its slot is free (no running sequence may use it)."""
        self._slot_of.pop(lora_int_id, None)

    def reset(self) -> None:
        """The workers restarted with empty slots."""
        self._slot_of.clear()

    def slot_of(self, lora_int_id: int) -> int | None:
        return self._slot_of.get(lora_int_id)

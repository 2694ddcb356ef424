"""Which adapter sits in which of the ``--max-loras`` device slots: an LRU that never evicts
an adapter a running request holds. Torch-free, so the driver can plan with it too."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    """Where :meth:`SlotTable.acquire` put an adapter; ``loaded`` is False when it was already there."""

    slot: int
    loaded: bool
    evicted_id: int | None  # the adapter whose slot it took


class SlotTable:
    """``num_slots`` slots keyed by adapter id (``lora_int_id``), each with a count of holders.

    Invariants: an adapter is in at most one slot; a held adapter (count > 0) stays put;
    the adapter evicted for a newcomer is the least recently acquired of the unheld ones,
    and an empty slot (the lowest) is used before any eviction.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"--max-loras must be at least 1, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # least recently acquired first
        self._holders: dict[int, int] = {}

    def slot_of(self, adapter_id: int) -> int | None:
        return self._slot_of.get(adapter_id)

    def holders(self, adapter_id: int) -> int:
        return self._holders.get(adapter_id, 0)

    def resident_ids(self) -> list[int]:
        """Resident adapters, least recently acquired first."""
        return list(self._slot_of)

    def acquire(self, adapter_id: int) -> Placement | None:
        """Hold ``adapter_id`` in a slot (placing it if needed); ``None`` when every slot is held by others."""
        slot = self._slot_of.get(adapter_id)
        if slot is not None:
            self._slot_of.move_to_end(adapter_id)
            self._holders[adapter_id] += 1
            return Placement(slot, loaded=False, evicted_id=None)
        evicted_id = None
        used = set(self._slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if free:
            slot = free[0]
        else:
            evicted_id = next((a for a in self._slot_of if self._holders[a] == 0), None)
            if evicted_id is None:
                return None
            slot = self._slot_of.pop(evicted_id)
            del self._holders[evicted_id]
        self._slot_of[adapter_id] = slot
        self._holders[adapter_id] = 1
        return Placement(slot, loaded=True, evicted_id=evicted_id)

    def release(self, adapter_id: int) -> None:
        """Drop one hold; the adapter stays resident (evictable once no one holds it)."""
        if self._holders.get(adapter_id, 0) == 0:
            raise ValueError(f"LoRA adapter {adapter_id} is not held")
        self._holders[adapter_id] -= 1

    def remove(self, adapter_id: int) -> int | None:
        """Free ``adapter_id``'s slot (returned; ``None`` if it had none); ``ValueError`` while it is held."""
        if self._holders.get(adapter_id, 0):
            raise ValueError(f"LoRA adapter {adapter_id} is in use by {self._holders[adapter_id]} running requests")
        self._holders.pop(adapter_id, None)
        return self._slot_of.pop(adapter_id, None)

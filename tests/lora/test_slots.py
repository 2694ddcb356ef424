"""Device slots: exact slot ids, LRU eviction order, and held adapters never evicted."""

from __future__ import annotations

import pytest

from raypaged.lora.slots import Placement, SlotTable


def test_empty_slots_fill_lowest_first_then_the_least_recently_acquired_unheld_is_evicted():
    table = SlotTable(3)
    assert table.acquire(10) == Placement(0, loaded=True, evicted_id=None)
    assert table.acquire(11) == Placement(1, loaded=True, evicted_id=None)
    assert table.acquire(12) == Placement(2, loaded=True, evicted_id=None)
    for adapter_id in (10, 11, 12):
        table.release(adapter_id)
    assert table.acquire(10) == Placement(0, loaded=False, evicted_id=None)  # resident: refreshed, not reloaded
    table.release(10)
    assert table.resident_ids() == [11, 12, 10]
    assert table.acquire(13) == Placement(1, loaded=True, evicted_id=11)
    assert table.acquire(14) == Placement(2, loaded=True, evicted_id=12)
    assert table.slot_of(11) is None and table.slot_of(14) == 2


def test_held_adapters_are_never_evicted():
    table = SlotTable(2)
    table.acquire(1)
    table.acquire(2)
    table.acquire(2)  # two requests hold adapter 2
    assert table.holders(2) == 2
    assert table.acquire(3) is None  # every slot held: the request waits
    table.release(2)
    assert table.acquire(3) is None  # adapter 2 is still held once
    table.release(1)
    assert table.acquire(3) == Placement(0, loaded=True, evicted_id=1)
    assert table.slot_of(2) == 1


def test_remove_frees_the_slot_only_when_unheld():
    table = SlotTable(2)
    table.acquire(7)
    with pytest.raises(ValueError, match=r"^LoRA adapter 7 is in use by 1 running requests$"):
        table.remove(7)
    table.release(7)
    assert table.remove(7) == 0
    assert table.remove(7) is None
    assert table.acquire(8) == Placement(0, loaded=True, evicted_id=None)


def test_misuse_is_an_error():
    with pytest.raises(ValueError, match=r"^--max-loras must be at least 1, got 0$"):
        SlotTable(0)
    table = SlotTable(1)
    with pytest.raises(ValueError, match=r"^LoRA adapter 5 is not held$"):
        table.release(5)

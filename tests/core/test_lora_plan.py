"""The driver's LoRA slot plan: exact slots, eviction order, adapters in use never evicted."""

from __future__ import annotations

from raypaged.core.lora_plan import LoRASlotPlan
from raypaged.core.request import Request
from raypaged.lora.request import LoRARequest
from raypaged.sampling_params import SamplingParams

ADAPTERS = {i: LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in range(1, 6)}


def running(*ids: int | None) -> list[Request]:
    return [
        Request(f"r{n}", [1, 2], SamplingParams(), 4, None, lora=None if i is None else ADAPTERS[i])
        for n, i in enumerate(ids)
    ]


def test_free_slots_first_then_the_least_recently_placed_unused_one():
    plan = LoRASlotPlan(2)
    assert plan.place(ADAPTERS[1], set()) == 0
    assert plan.place(ADAPTERS[2], {1}) == 1
    assert plan.place(ADAPTERS[1], {1, 2}) is None  # already there: nothing to load
    assert plan.slot_of(1) == 0
    # a3 needs a slot: a2 is the least recently placed, but a1 was placed again after it
    assert plan.place(ADAPTERS[3], set()) == 1
    assert (plan.slot_of(1), plan.slot_of(2), plan.slot_of(3)) == (0, None, 1)
    # with a1 in use, a4 takes a3's slot even though a1 is older
    assert plan.place(ADAPTERS[4], {1}) == 1
    assert (plan.slot_of(1), plan.slot_of(3), plan.slot_of(4)) == (0, None, 1)


def test_fits_counts_the_adapters_in_use_and_the_newcomers():
    plan = LoRASlotPlan(2)
    in_use = LoRASlotPlan.in_use(running(1, None, 1))
    assert in_use == {1}
    assert plan.fits(running(2), in_use) and plan.fits(running(1, 2, None), in_use)
    assert not plan.fits(running(2, 3), in_use)
    assert plan.fits(running(None, None), {1, 2})  # the base model needs no slot


def test_forget_and_reset_free_slots():
    plan = LoRASlotPlan(2)
    plan.place(ADAPTERS[1], set())
    plan.place(ADAPTERS[2], set())
    plan.forget(1)
    assert plan.place(ADAPTERS[3], {2}) == 0  # the unloaded adapter's slot
    plan.reset()
    assert plan.slot_of(2) is None and plan.place(ADAPTERS[5], set()) == 0

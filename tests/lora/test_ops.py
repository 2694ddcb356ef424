"""The batched LoRA product: each path's layout, and every path equal to the per-token reference."""

from __future__ import annotations

import pytest
import torch

from raypaged.lora.ops import (
    add_lora,
    add_lora_reference,
    build_bgmv_mapping,
    build_lora_mapping,
    lora_expand,
    lora_shrink,
    static_bgmv_mapping,
)

NUM_SLOTS, IN, OUT, RANK = 4, 24, 40, 6


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_SLOTS, IN, RANK, generator=g), torch.randn(NUM_SLOTS, RANK, OUT, generator=g)


def test_mapping_layout_of_an_even_spread_is_the_padded_batch():
    mapping = build_lora_mapping([2, None, 0, 2, 0, 0])
    assert mapping.slot_ids == (0, 2)
    assert mapping.segments == ((0, 3), (3, 5))
    assert mapping.token_ids.tolist() == [2, 4, 5, 0, 3]
    assert mapping.padded.token_ids.tolist() == [2, 4, 5, 0, 3, 0]  # slot 2's third row is padding
    assert mapping.padded.rows.tolist() == [0, 1, 2, 3, 4]
    assert not mapping.one_slot_for_all


def test_mapping_of_a_skewed_spread_loops_over_slots():
    mapping = build_lora_mapping([1] * 100 + [3, 0])  # padding to 3 x 100 rows for 102 tokens
    assert mapping.slot_ids == (0, 1, 3)
    assert mapping.segments == ((0, 1), (1, 101), (101, 102))
    assert mapping.padded is None


def test_mapping_fast_paths():
    empty = build_lora_mapping([None, None], "meta")  # nothing goes to the device
    assert empty.is_empty and empty.num_tokens == 2 and empty.token_ids.device.type == "cpu"
    assert build_lora_mapping([3, 3, 3]).one_slot_for_all
    one_with_base = build_lora_mapping([3, None, 3])
    assert not one_with_base.one_slot_for_all and one_with_base.padded is None


def test_bgmv_mapping_lists_every_token_by_its_slot():
    mapping = build_bgmv_mapping([2, None, 0, 2])
    assert mapping.slot_ids == (0, 2) and mapping.num_tokens == 4 and not mapping.static
    assert mapping.token_ids.tolist() == [0, 1, 2, 3] and mapping.slot_of.tolist() == [2, -1, 0, 2]
    assert mapping.segments == () and mapping.padded is None and not mapping.one_slot_for_all
    assert not mapping.is_empty
    empty = build_bgmv_mapping([None, None], "meta")  # as the plain mapping: nothing built, nothing on the device
    assert empty.is_empty and empty.slot_of is None
    buffers = torch.arange(5), torch.full((5,), -1)
    static = static_bgmv_mapping(*buffers)  # what a CUDA graph records: it runs whatever its slots hold
    assert not static.is_empty and static.slot_ids == () and static.num_tokens == 5
    assert static.slot_of is buffers[1] and static.token_ids is buffers[0]


def test_reference_is_the_per_token_formula():
    lora_a, lora_b = weights()
    x = torch.randn(3, IN)
    y = torch.randn(3, OUT)
    expected = y.clone()
    expected[0] += x[0] @ lora_a[1] @ lora_b[1]
    expected[2] += x[2] @ lora_a[3] @ lora_b[3]
    add_lora_reference(y, x, lora_a, lora_b, [1, None, 3])
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize(
    "token_slots",
    [
        [None] * 5,
        [2] * 7,  # one slot for all
        [2, None, 2],  # one slot beside base tokens
        [2, None, 0, 2, 0, 0, 1, 3, 3],  # padded batch
        [0, 1, 2, 3] * 4,  # every slot active
        [1] * 40 + [3, None, 0],  # skewed: per-slot loop
    ],
)
@pytest.mark.parametrize("build", [build_lora_mapping, build_bgmv_mapping], ids=["segments", "bgmv"])
def test_add_lora_equals_reference(token_slots, build):
    lora_a, lora_b = weights()
    x = torch.randn(len(token_slots), IN)
    base = torch.randn(len(token_slots), OUT)
    got, want = base.clone(), base.clone()
    add_lora(got, x, lora_a, lora_b, build(token_slots))
    add_lora_reference(want, x, lora_a, lora_b, token_slots)
    torch.testing.assert_close(got, want)
    for i, slot in enumerate(token_slots):
        if slot is None:
            assert torch.equal(got[i], base[i])  # base tokens untouched, bit for bit


def test_a_static_mapping_of_no_slot_leaves_y_bit_for_bit():
    lora_a, lora_b = weights()
    x, y = torch.randn(3, IN), torch.randn(3, OUT)
    before = y.clone()
    add_lora(y, x, lora_a, lora_b, static_bgmv_mapping(torch.arange(3), torch.tensor([-1, -1, -1])))
    assert torch.equal(y, before)


def test_add_lora_checks_shapes():
    lora_a, lora_b = weights()
    mapping = build_lora_mapping([0, 4])
    with pytest.raises(
        ValueError,
        match=r"^x \[3, 24\] and y \[2, 40\] do not fit a mapping of 2 tokens and lora_a "
        r"\[4, 24, 6\], lora_b \[4, 6, 40\]$",
    ):
        add_lora(torch.zeros(2, OUT), torch.zeros(3, IN), lora_a, lora_b, mapping)
    with pytest.raises(ValueError, match=r"^lora_b \[4, 5, 40\] does not match lora_a \[4, 24, 6\]$"):
        add_lora(torch.zeros(2, OUT), torch.zeros(2, IN), lora_a, lora_b[:, :5], mapping)
    with pytest.raises(ValueError, match=r"^the mapping reads slot 4 of 4$"):
        add_lora(torch.zeros(2, OUT), torch.zeros(2, IN), lora_a, lora_b, mapping)


@pytest.mark.parametrize("token_slots", [[2] * 5, [2, None, 0, 2, 0], [1] * 9 + [3]])
def test_row_sharded_shrinks_summed_then_expanded_equal_the_whole_product(token_slots):
    """What a row-parallel layer does over 2 ranks: A split by input columns, the shrinks all-reduced."""
    lora_a, lora_b = weights(1)
    x = torch.randn(len(token_slots), IN)
    mapping = build_lora_mapping(token_slots)
    half = IN // 2
    h = lora_shrink(x[:, :half], lora_a[:, :half].contiguous(), mapping) + lora_shrink(
        x[:, half:], lora_a[:, half:].contiguous(), mapping
    )
    got = torch.zeros(len(token_slots), OUT)
    lora_expand(got, h, lora_b, mapping)
    want = torch.zeros(len(token_slots), OUT)
    add_lora_reference(want, x, lora_a, lora_b, token_slots)
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("token_slots", [[2] * 7, [2, None, 0, 2, 0, 0, 1, 3, 3], [1] * 40 + [3, None, 0]])
@pytest.mark.parametrize("build", [build_lora_mapping, build_bgmv_mapping], ids=["segments", "bgmv"])
def test_add_lora_on_cuda_equals_reference(token_slots, build):
    if build is build_bgmv_mapping:
        pytest.importorskip("cupy")  # the BGMV kernels
    lora_a, lora_b = (w.cuda() for w in weights())
    x = torch.randn(len(token_slots), IN, device="cuda")
    got, want = torch.zeros(len(token_slots), OUT, device="cuda"), torch.zeros(len(token_slots), OUT, device="cuda")
    add_lora(got, x, lora_a, lora_b, build(token_slots, "cuda"))
    add_lora_reference(want, x, lora_a, lora_b, token_slots)
    torch.testing.assert_close(got, want)

"""kernels/lora_bgmv.cu against the torch reference of raypaged.lora.ops (add_lora_reference) on
random slots, ranks (powers of two and not) and token spreads; outputs poisoned with NaN first."""

import random

import pytest
import torch

from raypaged.kernels.lora_ops import lora_bgmv_expand, lora_bgmv_shrink
from raypaged.lora.ops import add_lora_reference
from tests.gpu import DEVICE, NEEDS_KERNELS

pytestmark = NEEDS_KERNELS

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def adapter_rows(token_slots: list[int | None]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [i for i, slot in enumerate(token_slots) if slot is not None]
    return (
        torch.tensor(rows, dtype=torch.long, device=DEVICE),
        torch.tensor([token_slots[i] for i in rows], dtype=torch.long, device=DEVICE),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [1, 8, 16, 20, 64, 100])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1536), (1536, 576), (64, 192)])
def test_bgmv_equals_the_reference(dtype, rank, in_features, out_features):
    rng = random.Random(rank * 7 + in_features)
    num_slots, num_tokens = 4, 77
    token_slots = [rng.choice([None, 0, 1, 2, 3]) for _ in range(num_tokens)]
    x = torch.randn(num_tokens, in_features, dtype=dtype, device=DEVICE)
    lora_a = (torch.randn(num_slots, in_features, rank, device=DEVICE) / in_features**0.5).to(dtype)
    lora_b = torch.randn(num_slots, rank, out_features, dtype=dtype, device=DEVICE)
    y = torch.randn(num_tokens, out_features, dtype=dtype, device=DEVICE)
    expected = y.float().clone()
    add_lora_reference(expected, x.float(), lora_a.float(), lora_b.float(), token_slots)
    token_ids, slot_of = adapter_rows(token_slots)
    # freed at once: torch's caching allocator hands these NaN bytes to h (fp32, the same size), so a row
    # the kernel fails to write shows
    torch.full((token_ids.shape[0] * rank * 4,), 255, dtype=torch.uint8, device=DEVICE)
    h = lora_bgmv_shrink(x, lora_a, token_ids, slot_of)
    reference_h = torch.bmm(x.float()[token_ids].unsqueeze(1), lora_a.float()[slot_of]).squeeze(1)
    torch.testing.assert_close(h, reference_h, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    lora_bgmv_expand(y, h, lora_b, token_ids, slot_of)
    scale = expected.abs().max()
    assert ((y.float() - expected).abs().max() / scale).item() < TOLERANCE[dtype]
    untouched = [i for i, slot in enumerate(token_slots) if slot is None]
    assert torch.equal(y[untouched].float(), expected[untouched])  # rows of no adapter keep y exactly


def test_no_adapter_tokens_is_a_no_op():
    x = torch.randn(3, 64, device=DEVICE)
    lora_a, lora_b = torch.randn(2, 64, 8, device=DEVICE), torch.randn(2, 8, 32, device=DEVICE)
    y = torch.randn(3, 32, device=DEVICE)
    before = y.clone()
    none = torch.zeros(0, dtype=torch.long, device=DEVICE)
    h = lora_bgmv_shrink(x, lora_a, none, none)
    lora_bgmv_expand(y, h, lora_b, none, none)
    assert h.shape == (0, 8) and torch.equal(y, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_slot_of_minus_one_is_a_token_of_no_adapter(dtype):
    """Every token listed, as a CUDA graph's BGMV mapping lists them: rows of slot -1 get a zero h
    row and keep y bit for bit."""
    rng = random.Random(5)
    token_slots = [rng.choice([None, 0, 1]) for _ in range(40)]
    x = torch.randn(40, 64, dtype=dtype, device=DEVICE)
    lora_a = (torch.randn(2, 64, 8, device=DEVICE) / 8).to(dtype)
    lora_b = torch.randn(2, 8, 96, dtype=dtype, device=DEVICE)
    y = torch.randn(40, 96, dtype=dtype, device=DEVICE)
    expected = y.float().clone()
    add_lora_reference(expected, x.float(), lora_a.float(), lora_b.float(), token_slots)
    token_ids = torch.arange(40, device=DEVICE)
    slot_of = torch.tensor([-1 if s is None else s for s in token_slots], device=DEVICE)
    h = lora_bgmv_shrink(x, lora_a, token_ids, slot_of)
    base = [i for i, s in enumerate(token_slots) if s is None]
    assert h[base].eq(0).all()
    lora_bgmv_expand(y, h, lora_b, token_ids, slot_of)
    assert torch.equal(y[base].float(), expected[base])
    assert ((y.float() - expected).abs().max() / expected.abs().max()).item() < TOLERANCE[dtype]

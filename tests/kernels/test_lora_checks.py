"""The LoRA kernel wrappers reject bad arguments by name, on CPU, before cupy or a device is touched."""

import sys

import pytest
import torch

from raypaged.kernels.lora_ops import lora_bgmv_expand, lora_bgmv_shrink

IN, RANK, OUT, SLOTS = 64, 8, 32, 3


def shrink_args(**overrides):
    args = dict(
        x=torch.zeros(5, IN, dtype=torch.float16),
        lora_a=torch.zeros(SLOTS, IN, RANK, dtype=torch.float16),
        token_ids=torch.tensor([0, 3]),
        slot_of=torch.tensor([2, 0]),
    )
    args.update(overrides)
    return args


def expand_args(**overrides):
    args = dict(
        y=torch.zeros(5, OUT, dtype=torch.float16),
        h=torch.zeros(2, RANK),
        lora_b=torch.zeros(SLOTS, RANK, OUT, dtype=torch.float16),
        token_ids=torch.tensor([0, 3]),
        slot_of=torch.tensor([2, 0]),
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"x": torch.zeros(5, IN, dtype=torch.int32)}, TypeError, "x must have dtype"),
        (
            {"lora_a": torch.zeros(SLOTS, IN, RANK)},
            TypeError,
            "x, lora_a must share one dtype; got x=torch.float16, lora_a=torch.float32",
        ),
        (
            {"x": torch.zeros(5, IN + 1, dtype=torch.float16)},
            ValueError,
            r"x must have shape \(\*, 64\), got \(5, 65\)",
        ),
        ({"x": torch.zeros(IN, 5, dtype=torch.float16).t()}, ValueError, "x must be contiguous"),
        ({"token_ids": torch.tensor([0, 3], dtype=torch.int32)}, TypeError, "token_ids must have dtype torch.int64"),
        ({"slot_of": torch.tensor([2])}, ValueError, r"slot_of must have shape \(2,\), got \(1,\)"),
        ({}, ValueError, "x must be on a CUDA device, got cpu"),
    ],
)
def test_shrink_checks(overrides, error, message):
    with pytest.raises(error, match=message):
        lora_bgmv_shrink(**shrink_args(**overrides))
    assert "cupy" not in sys.modules


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"h": torch.zeros(2, RANK, dtype=torch.float16)}, TypeError, "h must have dtype torch.float32"),
        ({"h": torch.zeros(3, RANK)}, ValueError, r"h must have shape \(2, 8\), got \(3, 8\)"),
        (
            {"lora_b": torch.zeros(SLOTS, 513, OUT, dtype=torch.float16), "h": torch.zeros(2, 513)},
            ValueError,
            "lora_b has rank 513; the kernel holds at most 512",
        ),
        ({"y": torch.zeros(5, OUT + 1, dtype=torch.float16)}, ValueError, r"y must have shape \(\*, 32\)"),
        ({}, ValueError, "y must be on a CUDA device, got cpu"),
    ],
)
def test_expand_checks(overrides, error, message):
    with pytest.raises(error, match=message):
        lora_bgmv_expand(**expand_args(**overrides))
    assert "cupy" not in sys.modules

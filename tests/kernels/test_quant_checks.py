"""The W4A16 layout and kernel wrappers (raypaged.kernels.quant_ops) reject bad arguments by name, on CPU,
before cupy or a device is touched; the GEMV's split of K stays within its shared memory."""

import re

import pytest
import torch

from raypaged.kernels.quant_ops import (
    GEMV_THREADS,
    SHARED_BYTES,
    W4A16Weight,
    gemv_splits,
    w4a16_dequantize,
    w4a16_gemv,
    w4a16_linear,
)

K, N, GROUP = 64, 12, 32  # 8 word rows, 2 groups


def layout(**overrides):
    args = dict(
        qweight=torch.zeros(K // 8, N, dtype=torch.int32),
        scales=torch.ones(K // GROUP, N, dtype=torch.float16),
        zeros=torch.full((K // GROUP, N), 8, dtype=torch.uint8),
        perm=None,
        group_size=GROUP,
        in_features=K,
        out_features=N,
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (dict(qweight=torch.zeros(K // 8, N)), TypeError, "qweight must have dtype torch.int32; got torch.float32"),
        (
            dict(qweight=torch.zeros(K // 8, N - 2, dtype=torch.int32)),
            ValueError,
            "qweight must have out_features (12) rounded up to a multiple of 4 columns, got 10",
        ),
        (dict(out_features=8), ValueError, "qweight must have out_features (8) rounded up to a multiple of 4"),
        (
            dict(group_size=12),
            ValueError,
            "group_size must be a positive multiple of 8 dividing the layout's 64 input features, got 12",
        ),
        (dict(group_size=24), ValueError, "group_size must be a positive multiple of 8 dividing"),
        (
            dict(scales=torch.ones(K // GROUP, N, dtype=torch.bfloat16)),
            TypeError,
            "scales must have dtype torch.float16, torch.float32; got torch.bfloat16",
        ),
        (
            dict(scales=torch.ones(3, N, dtype=torch.float16)),
            ValueError,
            "scales must have shape (2, 12), got (3, 12)",
        ),
        (dict(zeros=torch.zeros(2, N, dtype=torch.int32)), TypeError, "zeros must have dtype torch.uint8"),
        (
            dict(zeros=torch.zeros(2, N + 4, dtype=torch.uint8)),
            ValueError,
            "zeros must have shape (2, 12), got (2, 16)",
        ),
        (
            dict(qweight=torch.zeros(N, K // 8, dtype=torch.int32).t()),
            ValueError,
            "qweight must be contiguous (strides (1, 8) for shape (8, 12))",
        ),
        (
            dict(in_features=60),
            ValueError,
            "in_features 60 must be the layout's 64 input features when there is no perm",
        ),
        (dict(perm=torch.arange(K)), TypeError, "perm must have dtype torch.int32; got torch.int64"),
        (dict(perm=torch.arange(K - 8, dtype=torch.int32)), ValueError, "perm must have shape (64,), got (56,)"),
        (
            dict(perm=torch.arange(K, dtype=torch.int32), in_features=65),
            ValueError,
            "in_features 65 must be positive and at most the layout's 64",
        ),
        (
            dict(scales=torch.ones(2, N, dtype=torch.float16, device="meta")),
            ValueError,
            "qweight, scales, zeros must be on one device; got qweight=cpu, scales=meta, zeros=cpu",
        ),
        (
            dict(qweight=torch.zeros(K // 8 * N + 1, dtype=torch.int32)[1:].view(K // 8, N)),
            ValueError,
            "qweight must start on a 16-byte boundary",
        ),
    ],
)
def test_layout_checks(overrides, error, message):
    with pytest.raises(error, match=re.escape(message)):
        W4A16Weight(**layout(**overrides))


def test_a_valid_layout_is_accepted_with_padding_columns_and_a_perm():
    weight = W4A16Weight(**layout(out_features=10, perm=torch.arange(K, dtype=torch.int32), in_features=60))
    assert (weight.layout_features, weight.out_features) == (64, 10)


@pytest.mark.parametrize("wrapper", [w4a16_gemv, w4a16_linear])
@pytest.mark.parametrize(
    ("x", "error", "message"),
    [
        (torch.zeros(2, K, dtype=torch.int32), TypeError, "x must have dtype torch.float16, torch.bfloat16, torch"),
        ([[0.0]], TypeError, "x must be a torch.Tensor, got list"),
        (torch.zeros(K, dtype=torch.float16), ValueError, "x must have 2 dimensions, got shape (64,)"),
        (torch.zeros(2, K + 8, dtype=torch.float16), ValueError, "x must have shape (*, 64), got (2, 72)"),
        (torch.zeros(K, 2, dtype=torch.float16).t(), ValueError, "x must be contiguous"),
        (torch.zeros(2, K, dtype=torch.float16), ValueError, "x must be on a CUDA device, got cpu"),
    ],
)
def test_x_checks(wrapper, x, error, message):
    with pytest.raises(error, match=re.escape(message)):
        wrapper(x, W4A16Weight(**layout()))


def test_gemv_takes_at_most_eight_rows():
    with pytest.raises(
        ValueError,
        match=re.escape("x has 9 rows; the GEMV kernel takes at most 8 (w4a16_linear dequantizes and multiplies"),
    ):
        w4a16_gemv(torch.zeros(9, K, dtype=torch.float16), W4A16Weight(**layout()))


def test_linear_takes_any_number_of_rows():
    """More than 8 rows go to dequantize + matmul: the next check is the device."""
    with pytest.raises(ValueError, match="^x must be on a CUDA device, got cpu$"):
        w4a16_linear(torch.zeros(20, K, dtype=torch.float16), W4A16Weight(**layout()))


def test_the_weight_must_be_a_layout():
    with pytest.raises(TypeError, match="^weight must be a W4A16Weight, got Tensor$"):
        w4a16_linear(torch.zeros(2, K), torch.zeros(N, K))
    with pytest.raises(TypeError, match="^weight must be a W4A16Weight, got dict$"):
        w4a16_dequantize(layout(), torch.float16)


def test_dequantize_checks():
    weight = W4A16Weight(**layout())
    with pytest.raises(TypeError, match=re.escape("dtype must be one of torch.float16, torch.bfloat16, torch.float32")):
        w4a16_dequantize(weight, torch.int8)
    with pytest.raises(ValueError, match="^qweight must be on a CUDA device, got cpu$"):
        w4a16_dequantize(weight, torch.float16)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(("k", "n"), [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096), (64, 96), (40, 8)])
@pytest.mark.parametrize("sm_count", [132, 108, 1])
def test_gemv_splits_cover_k_within_shared_memory(rows, k, n, sm_count):
    words = k // 8
    splits, per_split = gemv_splits(rows, words, n, sm_count)
    assert (splits - 1) * per_split < words <= splits * per_split  # every word row, no empty split
    assert rows * 8 * per_split * 4 <= SHARED_BYTES
    assert per_split >= min(words, 64) or rows * 8 * 64 * 4 > SHARED_BYTES
    if sm_count > 1 and k >= 4096:  # Llama-2-7B shapes: at least one block per SM
        assert splits * -(-n // 128) >= sm_count
    assert GEMV_THREADS == 256

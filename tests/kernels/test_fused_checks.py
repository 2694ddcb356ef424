"""The fused kernel wrappers (raypaged.kernels.fused_ops) reject bad arguments by name, on CPU,
before cupy or a device is touched; arguments that pass every check fail only on the device."""

import pytest
import torch

from raypaged.kernels import fused_add_rms_norm, rms_norm, rotary_and_cache, silu_and_mul

TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCKS, BLOCK_SIZE, POSITIONS = 5, 64, 4, 2, 64, 8, 16, 32
F16 = torch.float16


def norm_args(**overrides):
    args = dict(x=torch.zeros(TOKENS, HIDDEN, dtype=F16), weight=torch.ones(HIDDEN, dtype=F16), eps=1e-6)
    args.update(overrides)
    return args


def add_norm_args(**overrides):
    args = dict(
        x=torch.zeros(TOKENS, HIDDEN, dtype=F16),
        residual=torch.zeros(TOKENS, HIDDEN, dtype=F16),
        weight=torch.ones(HIDDEN, dtype=F16),
        eps=1e-6,
    )
    args.update(overrides)
    return args


def rotary_args(dtype=F16, **overrides):
    qkv = torch.zeros(TOKENS, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=dtype)
    cache_shape = (BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    args = dict(
        positions=torch.arange(TOKENS),
        query=qkv[:, :HEADS],
        key=qkv[:, HEADS : HEADS + KV_HEADS],
        value=qkv[:, HEADS + KV_HEADS :],
        cos_sin=torch.zeros(POSITIONS, 2, HEAD_DIM // 2, dtype=dtype),
        key_cache=torch.zeros(cache_shape, dtype=dtype),
        value_cache=torch.zeros(cache_shape, dtype=dtype),
        slot_mapping=torch.arange(TOKENS),
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (dict(x=torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)), TypeError, "x must have dtype"),
        (dict(x=[[0.0]]), TypeError, "x must be a torch.Tensor, got list"),
        (dict(x=torch.zeros(HIDDEN, dtype=F16)), ValueError, "x must have 2 or 3 dimensions"),
        (dict(weight=torch.ones(HIDDEN)), TypeError, "x, weight must share one dtype"),
        (dict(weight=torch.ones(HIDDEN + 1, dtype=F16)), ValueError, r"weight must have shape \(64,\), got \(65,\)"),
        (dict(weight=torch.ones(HIDDEN, 2, dtype=F16)[:, 0]), ValueError, "weight must be contiguous"),
        (dict(x=torch.zeros(HIDDEN, TOKENS, dtype=F16).t()), ValueError, "x must have a contiguous last dimension"),
        (dict(eps="1e-6"), TypeError, "eps must be a float, got str"),
        (dict(eps=-1.0), ValueError, "eps must be >= 0"),
        (dict(), ValueError, "x must be on a CUDA device, got cpu"),
    ],
)
def test_rms_norm_rejects(overrides, error, message):
    with pytest.raises(error, match=message):
        rms_norm(**norm_args(**overrides))


def test_rms_norm_accepts_odd_hidden_sizes_and_per_head_views_of_qkv():
    """Hidden sizes that are no multiple of the vector width run unvectorized; a [tokens, heads,
    head_dim] view of a fused qkv (Qwen3's q/k norm) is accepted as it is."""
    qkv = torch.zeros(TOKENS, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=F16)
    q = qkv[:, : HEADS * HEAD_DIM].view(TOKENS, HEADS, HEAD_DIM)
    for args in (
        norm_args(x=torch.zeros(TOKENS, 67, dtype=F16), weight=torch.ones(67, dtype=F16)),
        norm_args(x=q, weight=torch.ones(HEAD_DIM, dtype=F16)),
    ):
        with pytest.raises(ValueError, match="x must be on a CUDA device"):  # the layout passed; the device is last
            rms_norm(**args)


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (dict(residual=torch.zeros(TOKENS, HIDDEN)), TypeError, "x, residual must share one dtype"),
        (
            dict(residual=torch.zeros(TOKENS + 1, HIDDEN, dtype=F16)),
            ValueError,
            r"residual must have shape \(5, 64\), got \(6, 64\)",
        ),
        (dict(x=torch.zeros(TOKENS, HIDDEN, 1, dtype=F16)), ValueError, "x must have 2 dimensions"),
        (dict(x=torch.zeros(HIDDEN, TOKENS, dtype=F16).t()), ValueError, "x must be contiguous"),
        (dict(residual=torch.zeros(HIDDEN, TOKENS, dtype=F16).t()), ValueError, "residual must be contiguous"),
        (dict(weight=torch.ones(HIDDEN, dtype=torch.bfloat16)), TypeError, "x, weight must share one dtype"),
        (dict(weight=torch.ones(32, dtype=F16)), ValueError, r"weight must have shape \(64,\)"),
        (dict(eps=None), TypeError, "eps must be a float, got NoneType"),
        (dict(), ValueError, "x must be on a CUDA device, got cpu"),
    ],
)
def test_fused_add_rms_norm_rejects(overrides, error, message):
    with pytest.raises(error, match=message):
        fused_add_rms_norm(**add_norm_args(**overrides))


def test_fused_add_rms_norm_rejects_one_buffer_for_both():
    x = torch.zeros(TOKENS, HIDDEN, dtype=F16)
    with pytest.raises(ValueError, match="x and residual must be different buffers"):
        fused_add_rms_norm(**add_norm_args(x=x, residual=x))


@pytest.mark.parametrize(
    ("x", "error", "message"),
    [
        (torch.zeros(TOKENS, 2 * HIDDEN, dtype=torch.int32), TypeError, "x must have dtype"),
        (torch.zeros(TOKENS, 2, HIDDEN, dtype=F16), ValueError, "x must have 2 dimensions"),
        (torch.zeros(TOKENS, 2 * HIDDEN + 1, dtype=F16), ValueError, r"x must have an even last dimension.*\(5, 129\)"),
        (torch.zeros(2 * HIDDEN, TOKENS, dtype=F16).t(), ValueError, "x must be contiguous"),
        (torch.zeros(TOKENS, 2 * 7, dtype=F16), ValueError, "x must be on a CUDA device, got cpu"),  # odd d is fine
    ],
)
def test_silu_and_mul_rejects(x, error, message):
    with pytest.raises(error, match=message):
        silu_and_mul(x)


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (dict(positions=torch.arange(TOKENS, dtype=torch.int32)), TypeError, "positions must have dtype torch.int64"),
        (dict(positions=torch.arange(TOKENS + 1)), ValueError, r"positions must have shape \(5,\), got \(6,\)"),
        (dict(slot_mapping=torch.arange(TOKENS - 1)), ValueError, r"slot_mapping must have shape \(5,\)"),
        (dict(slot_mapping=torch.arange(2 * TOKENS)[::2]), ValueError, "slot_mapping must be contiguous"),
        (
            dict(query=torch.zeros(TOKENS, HEADS, HEAD_DIM)),
            TypeError,
            "query, key, value, cos_sin, key_cache must share one dtype",
        ),
        (
            dict(cos_sin=torch.zeros(POSITIONS, 2, HEAD_DIM // 2)),
            TypeError,
            "query, key, value, cos_sin, key_cache must share one dtype",
        ),
        (dict(cos_sin=torch.zeros(POSITIONS, HEAD_DIM, dtype=F16)), ValueError, "cos_sin must have 3 dimensions"),
        (
            dict(cos_sin=torch.zeros(POSITIONS, 2, HEAD_DIM, dtype=F16)),
            ValueError,
            r"cos_sin must have shape \(\*, 2, 32\)",
        ),
        (dict(query=torch.zeros(TOKENS, HEADS, 32, dtype=F16)), ValueError, r"query must have shape \(\*, \*, 64\)"),
        (
            dict(key=torch.zeros(TOKENS, KV_HEADS + 1, HEAD_DIM, dtype=F16)),
            ValueError,
            r"key must have shape \(\*, 2, 64\)",
        ),
        (
            dict(value=torch.zeros(TOKENS + 1, KV_HEADS, HEAD_DIM, dtype=F16)),
            ValueError,
            r"value must have shape \(5, \*, \*\)",
        ),
        (
            dict(key=torch.zeros(TOKENS, HEAD_DIM, KV_HEADS, dtype=F16).transpose(1, 2)),
            ValueError,
            "key must have contiguous",
        ),
        (
            dict(query=torch.zeros(TOKENS, HEADS, HEAD_DIM + 4, dtype=F16)[..., :HEAD_DIM]),
            ValueError,
            "query must have contiguous",
        ),
        (
            dict(value_cache=torch.zeros(BLOCKS, KV_HEADS + 1, BLOCK_SIZE, HEAD_DIM, dtype=F16)),
            ValueError,
            r"value_cache must have shape \(8, 2, 16, 64\)",
        ),
        (
            dict(
                key_cache=torch.zeros(BLOCKS, KV_HEADS, 4, HEAD_DIM, dtype=F16),
                value_cache=torch.zeros(BLOCKS, KV_HEADS, 4, HEAD_DIM, dtype=F16),
            ),
            ValueError,
            "block size 4",
        ),
        (dict(), ValueError, "positions must be on a CUDA device, got cpu"),
    ],
)
def test_rotary_and_cache_rejects(overrides, error, message):
    with pytest.raises(error, match=message):
        rotary_and_cache(**rotary_args(**overrides))


def test_rotary_and_cache_rejects_heads_not_split_into_16_byte_halves():
    head_dim = 24  # halves of 12 fp16 elements, 24 bytes
    shape = (BLOCKS, KV_HEADS, BLOCK_SIZE, head_dim)
    qkv = torch.zeros(TOKENS, HEADS + 2 * KV_HEADS, head_dim, dtype=F16)
    args = rotary_args(
        query=qkv[:, :HEADS],
        key=qkv[:, HEADS : HEADS + KV_HEADS],
        value=qkv[:, HEADS + KV_HEADS :],
        cos_sin=torch.zeros(POSITIONS, 2, head_dim // 2, dtype=F16),
        key_cache=torch.zeros(shape, dtype=F16),
        value_cache=torch.zeros(shape, dtype=F16),
    )
    with pytest.raises(ValueError, match=r"head_dim 24 is not supported: each half of a head \(24 bytes\)"):
        rotary_and_cache(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotary_and_cache_accepts_q_k_v_strided_out_of_a_fused_qkv(dtype):
    with pytest.raises(ValueError, match="positions must be on a CUDA device"):  # layout passed, device is last
        rotary_and_cache(**rotary_args(dtype))

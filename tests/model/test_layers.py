"""The fused layer functions against the unfused torch expressions they replace."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from raypaged.model.layers import RotaryEmbedding, add_rms_norm, apply_rotary_, linear, rms_norm, silu_and_mul


def reference_rms_norm(x, weight, eps):
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "bias"),
    [(0, 16, 8, False), (1, 576, 960, False), (7, 33, 65, True), (300, 576, 1536, True)],
)
def test_linear_matches_f_linear(rows, in_features, out_features, bias):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features)
    weight = torch.randn(out_features, in_features) / in_features**0.5
    b = torch.randn(out_features) if bias else None
    out = linear(x, weight, b)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_linear_reads_strided_inputs():
    torch.manual_seed(0)
    x = torch.randn(9, 2 * 40)[:, 40:]  # rows 80 apart, as the up half of a gate_up output
    weight = torch.randn(64, 40)
    torch.testing.assert_close(linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)


def test_linear_in_float64_is_f_linear():
    x, weight = torch.randn(5, 12, dtype=torch.float64), torch.randn(7, 12, dtype=torch.float64)
    assert torch.equal(linear(x, weight), F.linear(x, weight))


@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (5, 3, 64)])
def test_rms_norm_is_bit_identical_in_fp32(shape):
    torch.manual_seed(len(shape))
    x, weight = torch.randn(shape) * 3, torch.randn(shape[-1])
    assert torch.equal(rms_norm(x, weight, 1e-5), reference_rms_norm(x, weight, 1e-5))


def test_rms_norm_of_a_strided_view():
    torch.manual_seed(1)
    qkv = torch.randn(6, 5 * 64)
    q = qkv[:, : 3 * 64].view(6, 3, 64)  # Qwen3's per-head norm of the q part of qkv
    weight = torch.randn(64)
    assert torch.equal(rms_norm(q, weight, 1e-6), reference_rms_norm(q.contiguous(), weight, 1e-6))


@pytest.mark.parametrize("rows", [1, 64])
def test_add_rms_norm_returns_the_norm_and_the_sum(rows):
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
    expected_sum = x + residual
    expected = reference_rms_norm(expected_sum, weight, 1e-5)
    normed, summed = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, expected_sum)
    assert torch.equal(normed, expected)
    assert torch.equal(x, expected_sum)  # written in place, as documented


def rope_config(rope_parameters):
    return LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=512, rope_parameters=rope_parameters
    )


LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        LLAMA3,
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ],
    ids=["default", "llama3", "linear"],
)
def test_rotary_in_place_on_qkv_matches_rotate_half(rope_parameters):
    """q and k rotated together as one strided view of the qkv buffer; v untouched."""
    torch.manual_seed(0)
    head_dim, num_heads, num_kv_heads, max_positions = 64, 4, 2, 512
    rotary = RotaryEmbedding(rope_config(rope_parameters), head_dim, max_positions)
    positions = torch.tensor([0, 5, 1, 511, 200, 5, 77])  # any order, repeats, the last position
    qkv = torch.randn(len(positions), (num_heads + 2 * num_kv_heads) * head_dim)
    before = qkv.clone()
    qk_width = (num_heads + num_kv_heads) * head_dim
    rotary.rotate_(positions, qkv[:, :qk_width].view(len(positions), num_heads + num_kv_heads, head_dim))

    cos, sin = rotary.cos_sin[positions, 0], rotary.cos_sin[positions, 1]  # [T, D/2]
    cos, sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]  # full width, as before
    qk = before[:, :qk_width].view(len(positions), -1, head_dim)
    expected = qk * cos + rotate_half(qk) * sin
    assert torch.equal(qkv[:, :qk_width].view_as(expected), expected)
    assert torch.equal(qkv[:, qk_width:], before[:, qk_width:])


def test_rotary_table_matches_the_full_width_one():
    """The half-width table holds what the full-width rotate-half table held (cos/sin of position x inv_freq)."""
    head_dim, max_positions, base = 64, 300, 10000.0
    rotary = RotaryEmbedding(rope_config({"rope_type": "default", "rope_theta": base}), head_dim, max_positions)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
    assert torch.equal(rotary.cos_sin[:, 0], freqs.cos())
    assert torch.equal(rotary.cos_sin[:, 1], freqs.sin())


def test_apply_rotary_on_separate_q_and_k():
    torch.manual_seed(2)
    q, k = torch.randn(3, 4, 16), torch.randn(3, 1, 16)
    cos, sin = torch.rand(3, 1, 1, 8), torch.rand(3, 1, 1, 8)
    full_cos, full_sin = torch.cat((cos, cos), -1)[:, :, 0], torch.cat((sin, sin), -1)[:, :, 0]
    expected_q, expected_k = q * full_cos + rotate_half(q) * full_sin, k * full_cos + rotate_half(k) * full_sin
    apply_rotary_(q, cos, sin)
    apply_rotary_(k, cos, sin)
    assert torch.equal(q, expected_q)
    assert torch.equal(k, expected_k)


PHI3_LONGROPE = dict(
    hidden_size=128,
    num_attention_heads=2,  # heads of 64, the first 48 rotated (Phi-4-mini's 0.75)
    max_position_embeddings=256,
    original_max_position_embeddings=64,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(24)],
        "long_factor": [1.0 + 2.0 * i for i in range(24)],
    },
)


@pytest.mark.parametrize(("max_positions", "factors"), [(64, "short"), (256, "long")])
def test_phi3_longrope_partial_rotation_is_transformers_bit_for_bit(max_positions, factors, caplog):
    """Within original_max_position_embeddings the short factors, past it the long ones (transformers' choice for a
    sequence that long), said at load; the first 48 of 64 features rotated, with longrope's attention factor."""
    config = Phi3Config(**PHI3_LONGROPE)
    rotary = RotaryEmbedding(config, 64, max_positions)
    assert rotary.rotary_dim == 48 and rotary.cos_sin.shape == (max_positions, 2, 24)
    assert ("every sequence takes the long factors" in caplog.text) == (factors == "long")
    positions = torch.arange(max_positions)
    hf_cos, hf_sin = Phi3RotaryEmbedding(config)(torch.zeros(1), positions[None])  # the sequence's own choice
    q, k = torch.randn(1, 3, max_positions, 64), torch.randn(1, 1, max_positions, 64)
    want_q, want_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    got_q, got_k = q[0].transpose(0, 1).clone(), k[0].transpose(0, 1).clone()  # [tokens, heads, 64]
    rotary.rotate_(positions, got_q, got_k)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


def test_a_partial_rotation_outside_phi3_and_glm_is_refused():
    """transformers applies partial_rotary_factor in Phi-3 and GLM only (Llama's default rotation ignores it, its
    scaled ones fail): refused elsewhere rather than guessed."""
    config = rope_config({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    message = (
        r"^partial_rotary_factor 0.5 is supported for Phi3ForCausalLM, GlmForCausalLM, Glm4ForCausalLM, "
        r"Glm4MoeForCausalLM only "
        r"\(transformers rotates whole heads in llama\)"
    )
    with pytest.raises(ValueError, match=message):
        RotaryEmbedding(config, 64, 16)


@pytest.mark.parametrize(("rows", "intermediate"), [(0, 4), (1, 1536), (33, 7)])
def test_silu_and_mul(rows, intermediate):
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * intermediate) * 4
    before = x.clone()
    gate, up = before[:, :intermediate], before[:, intermediate:]
    out = silu_and_mul(x)
    assert out.shape == (rows, intermediate)
    assert torch.equal(out, F.silu(gate) * up)
    assert torch.equal(x, before)

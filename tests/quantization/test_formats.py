"""Each format's checkpoint, as the reference quantizer writes it, loads into the layers' tensors as they
lie on disk; the layers' dequantized weights equal compressed-tensors' decompression bit for bit
(where the package reads the format) and lie within half a quantization step of the float weights."""

import json
import re
import shutil

import pytest
import torch
from compressed_tensors.compressors import FloatQuantizationCompressor, IntQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationScheme
from safetensors import safe_open

from raypaged.quantization.linear import QuantLinear
from raypaged.quantization.packing import unpack
from tests.quantization.conftest import float_weights, load

PARTS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
COMPRESSORS = {
    "w8a8-int8": IntQuantizationCompressor,
    "w8a8-fp8": FloatQuantizationCompressor,
    "w8a8-fp8-block": FloatQuantizationCompressor,
    "w4a16": PackedQuantizationCompressor,
    "w4a16-asym": PackedQuantizationCompressor,
}


def layers(model):
    for i, layer in enumerate(model.model.layers):
        for fused, parts in PARTS.items():
            yield f"model.layers.{i}", layer.get_submodule(fused), parts


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_compressed_tensors_dequantizes_to_the_same_bits(name, quantized_dirs):
    path = quantized_dirs[name]
    group = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme(
        targets=group["targets"], weights=group["weights"], input_activations=group["input_activations"]
    )
    model = load(path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    for prefix, linear, parts in layers(model):
        assert isinstance(linear, QuantLinear)
        expected = []
        for part in parts:
            module = f"{prefix}.{'self_attn' if part in PARTS['self_attn.qkv_proj'] + ('o_proj',) else 'mlp'}.{part}."
            state = {key[len(module) :]: t for key, t in tensors.items() if key.startswith(module)}
            expected.append(COMPRESSORS[name].decompress(state, scheme)["weight"])
        assert torch.equal(linear.dequantize(), torch.cat(expected))


@pytest.mark.parametrize(
    "name, step",
    [
        ("fp8", None),
        ("w8a8-fp8", None),
        ("fp8-block", None),
        ("w8a8-fp8-block", None),
        ("w8a8-int8", 1 / 127),
        ("w4a16", 1 / 7.5),
        ("w4a16-asym", 2 / 15),
        ("gptq", 1 / 7.5),
        ("gptq-actorder-asym", 2 / 15),
        ("gptq-channel", 1 / 7.5),
        ("gptq-8bit-actorder", 1 / 127.5),
        ("awq", 2 / 15),
    ],
)
def test_dequantized_weights_are_within_half_a_step_of_the_float_weights(name, step, quantized_dirs, tiny_float_dir):
    """``step``: the quantization step as a fraction of a group's amax (None: fp8, 2**-4 relative).
    GPTQ and AWQ store fp16 scales: the top level, 2**(bits-1) steps from zero, may sit that many
    times the scale's rounding (2**-11) further off, 2**bits * 2**-11 half steps."""
    slack = 1.001 + 2 ** (8 if "8bit" in name else 4) * 2**-11
    floats = float_weights(tiny_float_dir)
    model = load(quantized_dirs[name])
    for prefix, linear, parts in layers(model):
        module = "self_attn" if parts[0] in ("q_proj", "o_proj") else "mlp"
        w = torch.cat([floats[f"{prefix}.{module}.{part}.weight"] for part in parts])
        error = (linear.dequantize() - w).abs()
        if step is None:
            assert bool((error <= w.abs() * 2**-4 + w.abs().amax(1, keepdim=True) * 2**-9).all())
        else:
            assert float(error.max()) <= 0.5 * step * float(w.abs().max()) * slack
            assert float(error.max()) > 0  # the weights did go through the quantizer


def test_gptq_act_order_groups_follow_g_idx(quantized_dirs):
    path = quantized_dirs["gptq-actorder-asym"]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        g_idx = f.get_tensor("model.layers.0.mlp.gate_proj.g_idx")
        assert torch.equal(g_idx, f.get_tensor("model.layers.0.mlp.up_proj.g_idx"))
        zeros = unpack(f.get_tensor("model.layers.0.mlp.gate_proj.qzeros"), 4, 1) + 1
    assert sorted(torch.bincount(g_idx).tolist()) == [32, 32]  # two groups of 32 along a permutation
    assert not torch.equal(g_idx, torch.arange(64, dtype=torch.int32) // 32)
    assert bool(((zeros >= 1) & (zeros <= 15)).all()) and len(set(zeros.flatten().tolist())) > 1
    model = load(path)
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.g_idx, g_idx)


def test_online_fp8_keeps_one_byte_weights_and_per_channel_scales(tiny_float_dir):
    linear = load(tiny_float_dir, quantization="fp8").model.layers[0].mlp.gate_up_proj
    assert (linear.weight.dtype, tuple(linear.weight.shape), tuple(linear.weight_scale.shape)) == (
        torch.float8_e4m3fn,
        (256, 64),
        (256, 1),
    )


def test_block_scales_cover_their_tiles_across_fused_parts(quantized_dirs):
    """fp8-block [48, 32]: q (64 rows), k and v (16) each start their own tiles; the layer's rows of a part
    are the part's fp8 weight times its tile's weight_scale_inv."""
    model = load(quantized_dirs["fp8-block"])
    with safe_open(str(quantized_dirs["fp8-block"] / "model.safetensors"), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    for prefix, linear, parts in layers(model):
        assert linear.weight_scale_inv.shape == (linear.weight.shape[0], -(-linear.weight.shape[1] // 32))
        expected = []
        for part in parts:
            module = "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            weight = tensors[f"{prefix}.{module}.{part}.weight"]
            scale = tensors[f"{prefix}.{module}.{part}.weight_scale_inv"]
            n, k = weight.shape
            assert scale.shape == (-(-n // 48), -(-k // 32))
            tiles = [[weight[r : r + 48, c : c + 32].float() * scale[r // 48, c // 32] for c in range(0, k, 32)]
                     for r in range(0, n, 48)]  # fmt: skip
            expected.append(torch.cat([torch.cat(row, 1) for row in tiles]))
        assert torch.equal(linear.dequantize(), torch.cat(expected))


def test_block_scales_that_do_not_fit_the_configured_block_are_refused(quantized_dirs, tmp_path):
    """The fp8-block checkpoint's scales are 48 x 32 tiles; a config claiming 48 x 64 is refused at load."""
    path = tmp_path / "wrong-block"
    shutil.copytree(quantized_dirs["fp8-block"], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [48, 64]
    (path / "config.json").write_text(json.dumps(config))
    message = (
        "weight_scale_inv of shape [2, 4] does not fit weight_block_size [48, 64]: a weight of 64 rows and "
        "128 inputs needs [2, 2]"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        load(path)

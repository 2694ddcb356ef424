"""Quantized Phi-3 checkpoints hold qkv_proj and gate_up_proj quantized whole: each rank's q, k, v, gate and up
rows load where a float checkpoint's do, in every format the reference quantizer writes (its per-row scales and
groups along the inputs quantize a fused projection as its parts)."""

from __future__ import annotations

import pytest
import torch

from raypaged.model.loader import iter_checkpoint
from raypaged.model.parallel import TensorParallel
from raypaged.quantization import quantizer
from raypaged.quantization.linear import QuantLinear
from tests.conftest import make_tiny_model
from tests.quantization.conftest import load

# name -> (scheme, quantizer options, the largest error as a share of the float weight's largest |value|)
CHECKPOINTS = {
    "fp8-block": ("fp8-block", {"block": (48, 32)}, 2**-4),  # blocks across the q | k | v and gate | up boundaries
    "w8a8-int8": ("w8a8-int8", {}, 1 / 127),
    "gptq-actorder-asym": ("gptq", {"group_size": 32, "act_order": True, "symmetric": False}, 2 / 15),
    "awq": ("awq", {"group_size": 32}, 2 / 15),
}


@pytest.fixture(scope="module")
def phi3_dirs(tmp_path_factory, smollm2_dir):
    """A tiny Phi-3 (8 heads of 8, 2 KV heads) and its checkpoints."""
    root = tmp_path_factory.mktemp("phi3_quantized")
    float_dir = make_tiny_model(root, smollm2_dir, "phi3", pad_token_id=0)
    return float_dir, {
        name: quantizer.quantize_checkpoint(float_dir, root / name, scheme, **options)
        for name, (scheme, options, _) in CHECKPOINTS.items()
    }


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_each_ranks_fused_parts_dequantize_to_its_float_rows(name, phi3_dirs):
    float_dir, quantized = phi3_dirs
    weights = dict(iter_checkpoint(float_dir))
    q_rows, kv_rows, inter = 64, 16, 128  # per rank at tp 2: 32, 8, 64
    ranks = {
        "qkv_proj": lambda r: [
            range(32 * r, 32 * r + 32),
            range(64 + 8 * r, 72 + 8 * r),
            range(80 + 8 * r, 88 + 8 * r),
        ],
        "gate_up_proj": lambda r: [range(64 * r, 64 * r + 64), range(inter + 64 * r, inter + 64 * r + 64)],
    }
    assert q_rows + 2 * kv_rows == weights["model.layers.0.self_attn.qkv_proj.weight"].shape[0]
    whole = load(quantized[name], TensorParallel())
    shards = [load(quantized[name], TensorParallel(rank, 2)) for rank in range(2)]
    for index, layer in enumerate(whole.model.layers):
        for parent, fused in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj")):
            linear = layer.get_submodule(f"{parent}.{fused}")
            assert isinstance(linear, QuantLinear)
            want = weights[f"model.layers.{index}.{parent}.{fused}.weight"]
            got = linear.dequantize()
            assert (got - want).abs().max() <= CHECKPOINTS[name][2] * want.abs().max()
            for rank, shard in enumerate(shards):
                rows = [row for part in ranks[fused](rank) for row in part]
                shard_linear = shard.model.layers[index].get_submodule(f"{parent}.{fused}")
                assert torch.equal(shard_linear.dequantize(), got[rows])

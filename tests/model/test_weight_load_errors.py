"""A checkpoint tensor with no place in the model is refused with a ``ValueError`` naming it, whichever
layer it would go to: a bias of a quantized linear built without one, a fused projection's tensor
under a module the model does not have."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from raypaged.model.llama import LlamaForCausalLM
from raypaged.model.parallel import TensorParallel
from raypaged.quantization.base import LinearShape
from raypaged.quantization.linear import QuantLinear
from raypaged.quantization.w8a8 import W8A8Method


def tiny_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(config, max_positions=16)


@pytest.mark.parametrize("row_parallel", [False, True])
def test_a_bias_for_a_quantized_linear_without_one_is_refused(row_parallel):
    layer = QuantLinear(
        LinearShape(16, 8, 16), False, W8A8Method(torch.int8, static=False), TensorParallel(), row_parallel
    )
    with pytest.raises(ValueError, match="checkpoint tensor 'bias' has no place in a W8A8Method layer"):
        if row_parallel:
            layer.load_shard("bias", torch.zeros(8))
        else:
            layer.load_part("bias", torch.zeros(8), 0, 0, 8)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.7.self_attn.q_proj.weight",
        "visual.blocks.0.mlp.up_proj.weight",
        "model.embed_tokens.k_proj.weight",
        "model.layers.0.mlp.qkv_proj.weight",  # Phi-3's fused projections, under the other parent
        "model.layers.0.self_attn.gate_up_proj.weight",
        "model.norm.qkv_proj.weight",
    ],
)
def test_a_fused_projection_tensor_outside_the_layers_is_refused(name):
    with pytest.raises(ValueError, match=f"checkpoint tensor '{name}' has no place in the model"):
        tiny_model().load_weights([(name, torch.zeros(16, 16))])

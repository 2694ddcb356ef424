"""A mixture of experts' layer on a CUDA device in bf16: the experts as two grouped GEMMs over their stacked weights
(``SparseMoeBlock.stack_experts``, what the loader does on an H100/H200) against the expert-by-expert loop, at a
Qwen3-30B-A3B-like shape (128 experts, 8 per token) scaled down, and gpt-oss's (biases, clamped SwiGLU) and Llama 4's
(inputs scaled by the routing weights) experts."""

import pytest
import torch
from transformers import AutoConfig

from raypaged.model.llama import LlamaForCausalLM
from raypaged.model.moe import SparseMoeBlock, grouped_gemms_run
from tests.gpu import NEEDS_CUDA_AND_CUPY

pytestmark = [
    *NEEDS_CUDA_AND_CUPY,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not grouped_gemms_run(torch.bfloat16, torch.device("cuda")),
        reason="grouped GEMMs run in bf16 on compute capability 9.0+",
    ),
]


SHAPE = dict(vocab_size=256, hidden_size=512, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "qwen3_moe": dict(
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_experts=128,
        num_experts_per_tok=8,
        head_dim=128,
        norm_topk_prob=True,
    ),
    "gpt_oss": dict(intermediate_size=256, num_local_experts=32, num_experts_per_tok=4, head_dim=64),
    "llama4_text": dict(
        intermediate_size=256, intermediate_size_mlp=512, num_local_experts=16, num_experts_per_tok=1, head_dim=128
    ),
}


@pytest.mark.parametrize("num_tokens", [1, 8, 300])
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_grouped_experts_equal_the_loop_in_bf16(model_type, num_tokens):
    config = AutoConfig.for_model(model_type, **SHAPE, **CONFIGS[model_type])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config, 64).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    x = torch.randn(num_tokens, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        loop = block(x)
        assert model.stack_experts() == [True]
        grouped = block(x)
    torch.testing.assert_close(grouped.float(), loop.float(), rtol=2e-2, atol=2e-2)

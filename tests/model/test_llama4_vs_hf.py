"""Random-weight Llama 4 text models: chunked attention on the rotary layers (chunks of 8 positions here, so that
the prompts cross them), NoPE layers with attention temperature tuning (``floor_scale`` 4), rotary over interleaved
pairs, q/k RMS-normed after rotary, experts on alternate layers (a sigmoid router over the top-k logits whose
weights scale the experts' inputs, an ungated shared expert) and dense MLPs of their own size on the others. Greedy
tokens equal transformers' ``generate`` and every sampled token's logprob its logits, whole prompts and in chunks
after prefix-cache hits, and on two shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypaged import LLM
from tests.model.conftest import (
    MOE_TINY as TINY,
)
from tests.model.conftest import (
    Reference,
    assert_matches_transformers,
    tiny_models_with_word_tokenizer,
    transformers_references,
)

LLAMA4 = {
    "num_hidden_layers": 4,  # rotary, rotary, rotary, NoPE (no_rope_layer_interval 4); experts on layers 1 and 3
    "head_dim": 16,
    "intermediate_size": 32,
    "intermediate_size_mlp": 48,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "interleave_moe_layer_step": 2,
    "attention_chunk_size": 8,
    "floor_scale": 4,
    "attn_scale": 0.5,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir) -> Path:
    root = tmp_path_factory.mktemp("llama4")
    (path,) = tiny_models_with_word_tokenizer(root, smollm2_dir, {"llama4": ("llama4_text", LLAMA4)}, TINY).values()
    return path


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return transformers_references({"llama4": model_dir})["llama4"]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_matches_transformers(model_dir, reference, backend):
    """The torch attention ops, and the CPU decode kernel over each query's chunk."""
    assert_matches_transformers(model_dir, reference, attention_backend=backend)


def test_chunked_prefill_and_prefix_cache_hits_match_transformers(model_dir, reference):
    """Steps of at most 5 tokens across the attention chunks of 8, then again from the cached blocks."""
    assert_matches_transformers(
        model_dir, reference, max_num_batched_tokens=5, max_num_seqs=4, enable_prefix_caching=True
    )


def test_two_shards_match_transformers(ray_session, model_dir, reference):
    assert_matches_transformers(model_dir, reference, tensor_parallel_size=2)


def test_refused_options(model_dir):
    for options, message in (
        ({"attention_backend": "cuda"}, r"^--attention-backend cuda cannot run Llama4ForCausalLM: .*chunked attention"),
        ({"enable_lora": True}, r"^LoRA \(--enable-lora\) is not supported for Llama4ForCausalLM"),
        ({"quantization": "fp8"}, r"^quantized checkpoints \(--quantization\) are not supported for Llama4ForCausalLM"),
    ):
        with pytest.raises(ValueError, match=message):
            LLM(model=str(model_dir), device="cpu", **options)


def test_grouped_gemms_over_stacked_experts_equal_each_experts_own(model_dir):
    """The grouped GEMMs (what an H100/H200 runs in bf16) scale each expert's inputs by its weight, as the loop."""
    import torch
    from transformers import AutoConfig

    from raypaged.model.llama import LlamaForCausalLM
    from raypaged.model.loader import iter_checkpoint
    from raypaged.model.moe import SparseMoeBlock

    loaded = LlamaForCausalLM(AutoConfig.from_pretrained(model_dir), 64)
    loaded.load_weights(iter_checkpoint(model_dir))
    blocks = [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    x = torch.randn(37, TINY["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        loops = [block(x) for block in blocks]
    assert loaded.stack_experts() == [True] * len(blocks) and len(blocks) == 2
    for block, loop in zip(blocks, loops, strict=True):
        with torch.inference_mode():
            torch.testing.assert_close(block(x), loop, rtol=1e-5, atol=1e-5)

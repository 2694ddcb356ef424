"""Random-weight DeepSeek-V3 models (multi-head latent attention over the paged cache as one latent head, DeepSeek's
sigmoid router with expert groups and a score bias, shared experts, a dense first layer) and a DeepSeek-V2 model
(its softmax router over groups): greedy tokens equal transformers' ``generate`` and every prompt and sampled token's
logprob its logits, whole, in chunks after prefix-cache hits, and on two shards; V3 with YaRN (its ``mscale_all_dim``
in the softmax scale) and interleaved rotary, and without a query LoRA with rotate-half rotary."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypaged import LLM
from raypaged.model.llama import cache_head_dim, num_kv_heads_per_rank
from tests.model.conftest import (
    Reference,
    assert_matches_transformers,
    tiny_models_with_word_tokenizer,
    transformers_references,
)

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    tie_word_embeddings=False,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
MODELS = {
    "v3-yarn": ("deepseek_v3", {"q_lora_rank": 32, "rope_interleave": True, "rope_parameters": YARN}),
    "v3-plain": ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False}),
    # softmax router, groups ranked by their best expert, scaled unrenormalized weights; rotary by complex pairs
    "v2": ("deepseek_v2", {"q_lora_rank": None, "topk_method": "group_limited_greedy"}),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    return tiny_models_with_word_tokenizer(tmp_path_factory.mktemp("deepseek"), smollm2_dir, MODELS, TINY)


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, Reference]:
    return transformers_references(model_dirs)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_matches_transformers(model, model_dirs, references):
    assert_matches_transformers(model_dirs[model], references[model])


@pytest.mark.parametrize("model", sorted(MODELS))
def test_chunked_prefill_after_prefix_hits_matches_transformers(model, model_dirs, references):
    options = dict(max_num_batched_tokens=5, max_num_seqs=4, enable_prefix_caching=True)
    assert_matches_transformers(model_dirs[model], references[model], **options)


def test_two_shards_match_transformers(ray_session, model_dirs, references):
    """Each shard holds two of the four heads (their query and kv_b_proj rows, o_proj columns) and the whole latent
    projections, and caches the same latent head."""
    assert_matches_transformers(model_dirs["v3-yarn"], references["v3-yarn"], tensor_parallel_size=2)


def test_the_cache_holds_one_latent_head_and_what_it_cannot_run_is_refused(model_dirs):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dirs["v3-yarn"])
    assert (num_kv_heads_per_rank(config, 2), cache_head_dim(config)) == (1, 24)  # kv_lora_rank + qk_rope_head_dim
    path = str(model_dirs["v3-yarn"])
    with pytest.raises(ValueError, match=r"^--attention-backend cpu cannot run DeepseekV3ForCausalLM: "):
        LLM(model=path, device="cpu", attention_backend="cpu")
    with pytest.raises(ValueError, match=r"^quantized checkpoints \(--quantization\) are not supported for Deepseek"):
        LLM(model=path, device="cpu", quantization="fp8")

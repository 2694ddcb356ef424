"""Random-weight Llama, Mistral and Qwen2 models: raypaged greedy tokens equal transformers'."""

import pytest

from raypaged import LLM
from tests.conftest import make_tiny_model
from tests.model.conftest import assert_batch_greedy_matches_transformers

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

VARIANTS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied-mha": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 8}),
    "llama3-rope-scaling": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope-bias": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, "attention_bias": True},
    ),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {"num_key_value_heads": 4}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_match_transformers(variant, tmp_path, smollm2_dir):
    arch, overrides = VARIANTS[variant]
    assert_batch_greedy_matches_transformers(make_tiny_model(tmp_path, smollm2_dir, arch, **overrides))


def test_unsupported_rope_type_is_a_clear_error(tmp_path, smollm2_dir):
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    path = make_tiny_model(tmp_path, smollm2_dir, "llama", rope_parameters=rope)
    with pytest.raises(
        ValueError, match=r"rope type 'dynamic' is not supported \(supported: default, linear, llama3, yarn, longrope\)"
    ):
        LLM(model=str(path), num_gpu_blocks_override=8)

"""Random-weight Llama, Mistral and Qwen2 models: raypaged greedy tokens equal transformers'."""

import pytest

from raypaged import LLM, SamplingParams
from tests.conftest import hf_greedy, make_tiny_model

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
    from transformers import AutoModelForCausalLM

    arch, overrides = VARIANTS[variant]
    path = make_tiny_model(tmp_path, smollm2_dir, arch, **overrides)
    prompts = [[1, 5, 9, 300], list(range(100, 190)), [42] * 20, list(range(3000, 3077, 7))]
    llm = LLM(model=str(path), num_gpu_blocks_override=64, block_size=8)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, 40)
    assert llm.stats()["num_gpu_blocks_free"] == 64


def test_unsupported_rope_type_is_a_clear_error(tmp_path, smollm2_dir):
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    path = make_tiny_model(tmp_path, smollm2_dir, "llama", rope_parameters=rope)
    with pytest.raises(ValueError, match=r"rope type 'dynamic' is not supported \(supported: default, linear, llama3, yarn\)"):
        LLM(model=str(path), num_gpu_blocks_override=8)

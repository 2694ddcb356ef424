"""Random-weight Gemma 2 (soft-capped attention and logits) and Gemma 3 (q/k norms, a rotary base per layer type)
models with a sliding window of 8 on some layers: greedy tokens equal transformers' ``generate`` and every prompt
and sampled token's logprob its logits, whole prompts, in chunks and after a prefix-cache hit; what raypaged does
not run for Gemma is refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from raypaged.config import EngineConfig
from tests.model.conftest import (
    Reference,
    assert_matches_transformers,
    tiny_models_with_word_tokenizer,
    transformers_references,
)

WINDOW = 8
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=WINDOW,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    tie_word_embeddings=True,
)
MODELS = {
    "gemma2": ("gemma2", {"num_hidden_layers": 3, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": (
        "gemma3_text",
        {
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
            },
        },
    ),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """Each model with a word-level tokenizer of its 512 tokens."""
    return tiny_models_with_word_tokenizer(tmp_path_factory.mktemp("gemma"), smollm2_dir, MODELS, TINY)


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, Reference]:
    """Each model's references from transformers (eager attention: Gemma 2's soft-capping)."""
    return transformers_references(model_dirs, attn_implementation="eager")


def assert_matches(model: str, model_dirs, references, **llm_options) -> None:
    assert_matches_transformers(model_dirs[model], references[model], **llm_options)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_matches_transformers(model, model_dirs, references, backend):
    """The torch attention ops, and the CPU decode kernel with the window (and Gemma 2's soft-capping)."""
    assert_matches(model, model_dirs, references, attention_backend=backend)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_chunked_prefill_and_prefix_cache_hits_match_transformers(model, model_dirs, references):
    """Prompts in chunks of at most 5 tokens (each chunk's queries see the window over the cache), then again
    from their cached blocks."""
    assert_matches(model, model_dirs, references, max_num_batched_tokens=5, max_num_seqs=4, enable_prefix_caching=True)


def test_max_model_len_is_not_capped_at_the_window(model_dirs):
    assert EngineConfig(model=str(model_dirs["gemma3"]), device="cpu").max_model_len == 256


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"attention_backend": "cuda"},
            r"--attention-backend cuda cannot run Gemma3ForCausalLM: .* and the CPU kernels",
        ),
        ({"enable_lora": True}, r"^LoRA \(--enable-lora\) is not supported for Gemma3ForCausalLM$"),
        ({"quantization": "fp8"}, r"^quantized checkpoints \(--quantization\) are not supported for Gemma3Fo"),
    ],
)
def test_refused_options_name_what_they_refuse(model_dirs, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(model_dirs["gemma3"]), device="cpu", **options)


def test_an_image_text_architecture_without_a_text_config_is_refused_by_name(tmp_path, model_dirs):
    """An image-text checkpoint is served for text from its text_config (test_image_text_checkpoints_vs_hf.py); a
    config that names the wrapper but holds no text_config is refused."""
    path = tmp_path / "gemma3-mm"
    shutil.copytree(model_dirs["gemma3"], path)
    config = (path / "config.json").read_text().replace('"Gemma3ForCausalLM"', '"Gemma3ForConditionalGeneration"')
    (path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"^architecture Gemma3ForConditionalGeneration: its config has no text_con"):
        EngineConfig(model=str(path), device="cpu")


def test_two_shards_match_transformers(ray_session, model_dirs, references):
    """tp=2: each shard takes its heads (the q/k norms whole) and its half of the MLP; the norms are replicated."""
    assert_matches("gemma3", model_dirs, references, tensor_parallel_size=2)

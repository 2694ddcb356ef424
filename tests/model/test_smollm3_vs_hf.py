"""A random-weight SmolLM3 (no rotary on every fourth layer, NoPE): greedy tokens equal transformers' ``generate`` and
every prompt and sampled token's logprob its logits, on the torch path, the CPU backend's fused path (chunked, after
prefix-cache hits) and two shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypaged.config import EngineConfig
from raypaged.model.architecture import architecture_of
from tests.model.conftest import (
    Reference,
    assert_matches_transformers,
    tiny_models_with_word_tokenizer,
    transformers_references,
)

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir) -> Path:
    """SmolLM3's default layout: layers 0-2 rotate, layer 3 does not."""
    root = tmp_path_factory.mktemp("smollm3")
    return tiny_models_with_word_tokenizer(root, smollm2_dir, {"smollm3": ("smollm3", {})}, TINY)["smollm3"]


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return transformers_references({"smollm3": model_dir})["smollm3"]


def test_every_fourth_layer_is_nope(model_dir):
    config = EngineConfig(model=str(model_dir), device="cpu").hf_config
    assert architecture_of(config).nope_layers == (False, False, False, True)


def test_matches_transformers(model_dir, reference):
    assert_matches_transformers(model_dir, reference, attention_backend="torch")


def test_the_cpu_backend_in_chunks_and_after_prefix_hits_matches_transformers(model_dir, reference, one_call_runs):
    """The native step (one C call) rotates q and k and writes K/V on the rotary layers and only writes them on the
    NoPE layer."""
    options = dict(attention_backend="cpu", max_num_batched_tokens=5, max_num_seqs=4, enable_prefix_caching=True)
    assert_matches_transformers(model_dir, reference, **options)
    assert one_call_runs  # the steps ran in the C call


def test_two_shards_match_transformers(ray_session, model_dir, reference):
    assert_matches_transformers(model_dir, reference, tensor_parallel_size=2)

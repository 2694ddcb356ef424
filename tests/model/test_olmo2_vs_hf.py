"""A random-weight OLMo 2 (norms after the attention and the MLP, none before; q and k normed over their whole
projections): greedy tokens equal transformers' ``generate`` and every prompt and sampled token's logprob its logits,
on the torch path, the CPU attention kernels (chunked, after prefix-cache hits) and two shards that hold the one KV
head each (the k norm's mean of squares summed over both, the head counted twice, as its width is)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raypaged.config import EngineConfig
from raypaged.model.layers import Olmo2RMSNorm
from raypaged.model.llama import LlamaForCausalLM
from raypaged.model.loader import load_model
from raypaged.model.parallel import TensorParallel
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
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir) -> Path:
    root = tmp_path_factory.mktemp("olmo2")
    return tiny_models_with_word_tokenizer(root, smollm2_dir, {"olmo2": ("olmo2", {})}, TINY)["olmo2"]


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return transformers_references({"olmo2": model_dir})["olmo2"]


def test_matches_transformers(model_dir, reference):
    assert_matches_transformers(model_dir, reference, attention_backend="torch")


def test_the_cpu_attention_kernels_in_chunks_and_after_prefix_hits_match_transformers(model_dir, reference):
    options = dict(attention_backend="cpu", max_num_batched_tokens=5, max_num_seqs=4, enable_prefix_caching=True)
    assert_matches_transformers(model_dir, reference, **options)


def test_two_shards_match_transformers(ray_session, model_dir, reference):
    assert_matches_transformers(model_dir, reference, tensor_parallel_size=2)


def test_each_shard_holds_its_heads_share_of_the_q_norm_and_the_whole_k_norm(model_dir):
    config = EngineConfig(model=str(model_dir), device="cpu").hf_config
    whole = load_model(model_dir, config, 64, torch.float32, torch.device("cpu"), TensorParallel())
    shards = [
        load_model(model_dir, config, 64, torch.float32, torch.device("cpu"), TensorParallel(rank, 2))
        for rank in range(2)
    ]

    def norms(model: LlamaForCausalLM) -> tuple[Olmo2RMSNorm, Olmo2RMSNorm]:
        attn = model.attentions()[1]
        assert isinstance(attn.q_norm, Olmo2RMSNorm) and isinstance(attn.k_norm, Olmo2RMSNorm)
        return attn.q_norm, attn.k_norm

    q_whole, k_whole = norms(whole)
    assert q_whole.weight.shape == (64,) and k_whole.weight.shape == (16,)
    for rank, shard in enumerate(shards):
        q, k = norms(shard)
        assert torch.equal(q.weight, q_whole.weight[32 * rank : 32 * rank + 32])
        assert torch.equal(k.weight, k_whole.weight)
    assert not hasattr(whole.model.layers[0], "input_layernorm")

"""Random-weight SmolLM3 (no rotary on every fourth layer, NoPE), OLMo 2 (norms after the attention and the MLP,
none before; q and k normed over their whole projections), ERNIE 4.5 (interleaved rotary, biases on every
linear), GLM (interleaved rotary over half of each head, q/k/v biases, gate_up_proj whole) and GLM-4 (GLM's, with
norms after the attention and the MLP too) models: greedy tokens equal transformers' ``generate`` and every prompt
and sampled token's logprob its logits, on the torch path, the CPU backend (chunked, after prefix-cache hits;
SmolLM3 in the native one-call step) and two shards (OLMo 2's share one KV head, so the k norm's mean of squares is
summed over both with the head counted twice, as its width is)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raypaged.config import EngineConfig
from raypaged.model.architecture import architecture_of
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
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    pad_token_id=0,
)
MODELS = {
    "smollm3": ("smollm3", {"num_hidden_layers": 4, "num_key_value_heads": 2}),  # layer 3 NoPE
    "olmo2": ("olmo2", {"num_hidden_layers": 2, "num_key_value_heads": 1}),
    "ernie4_5": ("ernie4_5", {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16, "use_bias": True}),
    # interleaved rotary over the first half of each head, biases on q, k, v, gate_up_proj whole in the checkpoint
    "glm": ("glm", {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16}),
    "glm4": ("glm4", {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16}),  # and sandwich norms
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    return tiny_models_with_word_tokenizer(tmp_path_factory.mktemp("variants"), smollm2_dir, MODELS, TINY)


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, Reference]:
    return transformers_references(model_dirs)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_matches_transformers(model, model_dirs, references):
    assert_matches_transformers(model_dirs[model], references[model], attention_backend="torch")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_cpu_backend_in_chunks_and_after_prefix_hits_matches_transformers(
    model, model_dirs, references, one_call_runs
):
    """SmolLM3's steps run in the native step (one C call), which rotates q and k and writes K/V on the rotary
    layers and only writes them on the NoPE layer; OLMo 2's layers run plain torch around the CPU kernels, ERNIE
    4.5's the fused ops but for its rotary (the fused one rotates halves)."""
    options = dict(attention_backend="cpu", max_num_batched_tokens=5, max_num_seqs=4, enable_prefix_caching=True)
    assert_matches_transformers(model_dirs[model], references[model], **options)
    assert bool(one_call_runs) == (model == "smollm3")


@pytest.mark.parametrize("model", sorted(set(MODELS) - {"glm"}))  # GLM's sharding is GLM-4's, which runs
def test_two_shards_match_transformers(ray_session, model, model_dirs, references):
    assert_matches_transformers(model_dirs[model], references[model], tensor_parallel_size=2)


def test_every_fourth_smollm3_layer_is_nope(model_dirs):
    config = EngineConfig(model=str(model_dirs["smollm3"]), device="cpu").hf_config
    assert architecture_of(config).nope_layers == (False, False, False, True)


def test_each_olmo2_shard_holds_its_heads_share_of_the_q_norm_and_the_whole_k_norm(model_dirs):
    path = model_dirs["olmo2"]
    config = EngineConfig(model=str(path), device="cpu").hf_config
    whole = load_model(path, config, 64, torch.float32, torch.device("cpu"), TensorParallel())
    shards = [load_model(path, config, 64, torch.float32, torch.device("cpu"), TensorParallel(r, 2)) for r in range(2)]

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

"""Random-weight Qwen3 (q/k RMSNorm per head, explicit head_dim): logits and greedy tokens equal transformers'."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from raypaged.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from raypaged.model.llama import head_dim_of, num_kv_heads_per_rank
from raypaged.model.loader import load_model
from raypaged.sampling_params import SamplingParams
from raypaged.worker.cache import KVCache
from raypaged.worker.model_runner import ModelRunner
from tests.conftest import make_tiny_model
from tests.model.conftest import assert_batch_greedy_matches_transformers

# 8 heads of 16 dims: q is 128 wide over a hidden size of 64, so head_dim is not hidden_size / heads
VARIANTS = {
    "untied": {},
    "tied-attention-bias": {"tie_word_embeddings": True, "attention_bias": True},
}

# a prompt prefilled in two chunks (the second reads the first from the cache), a whole prompt, then decodes
PROMPTS = {"a": [1, *range(700, 710)], "b": [1, 42, 42, 9000, 17, 3]}
CONTINUATIONS = {"a": [31, 5000, 8, 19], "b": [77, 2, 40000, 600, 123]}
BLOCK_IDS = {"a": [9, 2, 14, 5], "b": [7, 0, 11]}  # scattered, 4 tokens a block
STEPS = [{"b": 6, "a": 7}, {"b": 1, "a": 4}] + [{"b": 1, "a": 1}] * 4  # decodes listed first, as the runner orders them
NUM_BLOCKS, BLOCK_SIZE = 16, 4


@pytest.fixture(params=sorted(VARIANTS))
def qwen3_dir(request, tmp_path, smollm2_dir):
    return make_tiny_model(tmp_path, smollm2_dir, "qwen3", head_dim=16, **VARIANTS[request.param])


def test_paged_prefill_and_decode_logits_match_transformers(qwen3_dir):
    hf_config = AutoConfig.from_pretrained(qwen3_dir)
    assert hf_config.architectures == ["Qwen3ForCausalLM"]
    model = load_model(qwen3_dir, hf_config, 64, torch.float32, torch.device("cpu"))
    block_shape = (num_kv_heads_per_rank(hf_config, 1), BLOCK_SIZE, head_dim_of(hf_config))
    cache = KVCache(hf_config.num_hidden_layers, NUM_BLOCKS, 0, block_shape, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, cache, BLOCK_SIZE, eos_token_id=None, seed=0, device=torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = {rid: hf(torch.tensor([PROMPTS[rid] + CONTINUATIONS[rid]])).logits[0] for rid in PROMPTS}

    num_computed = dict.fromkeys(PROMPTS, 0)
    num_outputs_sent = dict.fromkeys(PROMPTS, 0)
    for index, schedule in enumerate(STEPS):
        so = SchedulerOutput(num_scheduled_tokens=dict(schedule))
        for rid, num_new in schedule.items():
            end = num_computed[rid] + num_new
            num_outputs = max(0, end - len(PROMPTS[rid]))
            new_token_ids = CONTINUATIONS[rid][num_outputs_sent[rid] : num_outputs]
            if index == 0:
                so.new_requests.append(
                    NewRequestData(rid, PROMPTS[rid], new_token_ids, SamplingParams(temperature=0), BLOCK_IDS[rid], 0)
                )
            else:
                so.cached_requests.append(CachedRequestData(rid, new_token_ids, [], num_computed[rid]))
            num_outputs_sent[rid] = num_outputs
        runner.update_states(so)
        step = runner.prepare_inputs(so)
        with torch.inference_mode():
            logits = model.compute_logits(model(step.input_ids, step.positions, cache.layers, step.meta))
        spans = [(rid, num_computed[rid], num_computed[rid] + n) for rid, n in schedule.items()]
        assert step.positions.tolist() == [p for _, start, end in spans for p in range(start, end)]
        rows = torch.cat([expected[rid][start:end] for rid, start, end in spans])
        torch.testing.assert_close(logits, rows, rtol=1e-5, atol=1e-5, msg=lambda m, index=index: f"step {index}: {m}")
        for rid, num_new in schedule.items():
            num_computed[rid] += num_new
    assert num_computed == {rid: len(PROMPTS[rid]) + len(CONTINUATIONS[rid]) for rid in PROMPTS}


def test_batch_greedy_tokens_match_transformers(qwen3_dir):
    assert_batch_greedy_matches_transformers(qwen3_dir, device="cpu")


def test_tensor_parallel_cpu_shards_match_transformers(ray_session, qwen3_dir):
    """tp=2 splits the 8 heads and 2 KV heads; each shard holds the q/k norm weights whole."""
    assert_batch_greedy_matches_transformers(qwen3_dir, device="cpu", tensor_parallel_size=2)

"""Random-weight Phi-3 (fused qkv_proj and gate_up_proj in the checkpoint, a sliding window, a partial rotation,
longrope) and Granite (its four multipliers) models: greedy tokens equal transformers' ``generate`` and every
prompt and sampled token's logprob its logits, through the native CPU step, the torch path and two shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from raypaged import LLM, SamplingParams
from raypaged.config import EngineConfig
from tests.conftest import hf_greedy
from tests.model.conftest import tiny_models_with_word_tokenizer

TINY = dict(vocab_size=512, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)  # head_dim 16
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,  # 8 of the 16 features of each head rotated, as Phi-4-mini rotates 96 of 128
    "short_factor": [1.0, 1.2, 1.7, 2.5],
    "long_factor": [1.5, 3.0, 7.0, 16.0],
}
MODELS = {
    # a window of 48: max_model_len is capped there (attention here spans the whole context)
    "phi3": ("phi3", {"sliding_window": 48}),
    # 256 positions over an original 32: an attention factor of sqrt(1 + ln 8 / ln 32)
    "phi3-partial-longrope": (
        "phi3",
        {"rope_parameters": LONGROPE, "original_max_position_embeddings": 32, "max_position_embeddings": 256},
    ),
    "granite": (
        "granite",
        {"embedding_multiplier": 4.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 3.0},
    ),
}
SHORT_PROMPTS = [[1, 5, 9, 300], list(range(100, 116)), [42] * 11]  # within 32 tokens with their 16 new ones
LONG_PROMPTS = [list(range(200, 240)), [7, 8, 9] * 12, list(range(300, 333))]  # past 32 tokens from the start
MAX_TOKENS = 16
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
# (model, prompts, LLM options): each case's transformers reference is computed once
CASES = {
    "phi3": ("phi3", SHORT_PROMPTS, {}),
    "phi3-longrope-short": ("phi3-partial-longrope", SHORT_PROMPTS, {"max_model_len": 32}),
    "phi3-longrope-long": ("phi3-partial-longrope", LONG_PROMPTS, {}),
    "granite": ("granite", SHORT_PROMPTS, {}),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """Each model with a word-level tokenizer of its 512 tokens (SmolLM2's has more than the model)."""
    return tiny_models_with_word_tokenizer(tmp_path_factory.mktemp("phi3_granite"), smollm2_dir, MODELS, TINY)


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    """Per case, each prompt's greedy tokens from transformers' generate and the log-softmax of the logits of its
    whole sequence (prompt and those tokens) in one forward."""
    out = {}
    for case, (model, prompts, _) in CASES.items():
        hf = AutoModelForCausalLM.from_pretrained(model_dirs[model], dtype=torch.float32).eval()
        out[case] = []
        for prompt in prompts:
            tokens = hf_greedy(hf, prompt, MAX_TOKENS)
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + tokens])).logits[0]
            out[case].append((tokens, logits.log_softmax(-1)))
    return out


def assert_case_matches(case: str, model_dirs, references, **llm_options) -> LLM:
    """The case's prompts in one batch: transformers' greedy tokens, and logprobs within 2e-5 of its logits'."""
    model, prompts, options = CASES[case]
    llm = LLM(model=str(model_dirs[model]), num_gpu_blocks_override=64, block_size=8, **options, **llm_options)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, output, (tokens, expected) in zip(prompts, outputs, references[case], strict=True):
        assert output.outputs[0].token_ids == tokens
        sequence = prompt + tokens
        got = [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:], strict=True)]
        got += [entry[token].logprob for entry, token in zip(output.outputs[0].logprobs, tokens, strict=True)]
        want = expected[torch.arange(len(sequence) - 1), torch.tensor(sequence[1:])]
        torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=2e-5)
    return llm


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_cpu_step_matches_transformers(case, model_dirs, references, one_call_runs):
    llm = assert_case_matches(case, model_dirs, references, device="cpu")
    assert llm.llm_engine.executor.worker.model.model.cpu_step is not None
    assert sum(one_call_runs) == sum(map(len, CASES[case][1])) + (MAX_TOKENS - 1) * len(CASES[case][1])


@pytest.mark.parametrize("case", ["phi3", "phi3-longrope-short", "granite"])
def test_torch_path_matches_transformers(case, model_dirs, references):
    assert_case_matches(case, model_dirs, references, device="cpu", attention_backend="torch")


@pytest.mark.parametrize("case", ["phi3-longrope-long", "granite"])
def test_two_shards_match_transformers(case, ray_session, model_dirs, references):
    """tp=2: each shard takes its heads' rows of Phi-3's fused qkv_proj and its half of gate and of up."""
    assert_case_matches(case, model_dirs, references, device="cpu", tensor_parallel_size=2)


def test_max_model_len_is_capped_at_phi3s_sliding_window(model_dirs):
    config = EngineConfig(model=str(model_dirs["phi3"]), device="cpu")
    assert config.max_model_len == 48
    with pytest.raises(ValueError, match=r"^max_model_len 64 exceeds the model's sliding_window \(attention here"):
        EngineConfig(model=str(model_dirs["phi3"]), device="cpu", max_model_len=64)

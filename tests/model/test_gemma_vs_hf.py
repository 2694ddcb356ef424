"""Random-weight Gemma 2 (soft-capped attention and logits) and Gemma 3 (q/k norms, a rotary base per layer type)
models with a sliding window of 8 on some layers: greedy tokens equal transformers' ``generate`` and every prompt
and sampled token's logprob its logits, whole prompts, in chunks and after a prefix-cache hit; what raypaged does
not run for Gemma is refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from raypaged import LLM, SamplingParams
from raypaged.config import EngineConfig
from tests.conftest import hf_greedy
from tests.model.conftest import tiny_models_with_word_tokenizer

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
PROMPTS = [list(range(200, 230)), [7, 8, 9] * 4, list(range(300, 321)), [42] * 9]  # each past the window
MAX_TOKENS = 12
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """Each model with a word-level tokenizer of its 512 tokens."""
    return tiny_models_with_word_tokenizer(tmp_path_factory.mktemp("gemma"), smollm2_dir, MODELS, TINY)


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    """Per model, each prompt's greedy tokens from transformers' generate (eager attention: Gemma 2's soft-capping)
    and the log-softmax of the logits of its whole sequence in one forward."""
    out = {}
    for name, path in model_dirs.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        out[name] = []
        for prompt in PROMPTS:
            tokens = hf_greedy(hf, prompt, MAX_TOKENS)
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + tokens])).logits[0]
            out[name].append((tokens, logits.log_softmax(-1)))
    return out


def assert_matches(model: str, model_dirs, references, **llm_options) -> None:
    """The prompts in one batch: transformers' greedy tokens, and logprobs within 2e-5 of its logits'. With
    ``enable_prefix_caching`` twice more, hitting the first run's blocks (a request with prompt logprobs takes no
    cached blocks: these ask for the sampled tokens' only)."""
    llm = LLM(model=str(model_dirs[model]), device="cpu", num_gpu_blocks_override=64, block_size=4, **llm_options)
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    try:
        runs = [llm.generate(requests, PARAMS, use_tqdm=False)]
        if llm_options.get("enable_prefix_caching"):
            cached = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
            runs.append(llm.generate(requests, cached, use_tqdm=False))
            assert all(output.num_cached_tokens >= len(p) - len(p) % 4 - 4 for p, output in zip(PROMPTS, runs[-1]))
    finally:
        llm.shutdown()
    for outputs in runs:
        for prompt, output, (tokens, expected) in zip(PROMPTS, outputs, references[model], strict=True):
            assert output.outputs[0].token_ids == tokens
            sequence = prompt + tokens
            got = [entry[token].logprob for entry, token in zip(output.outputs[0].logprobs, tokens, strict=True)]
            first = len(prompt) - 1  # the first sampled token's row
            if output.prompt_logprobs is not None:
                got = [e[t].logprob for e, t in zip(output.prompt_logprobs[1:], prompt[1:], strict=True)] + got
                first = 0
            want = expected[torch.arange(first, len(sequence) - 1), torch.tensor(sequence[first + 1 :])]
            torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_matches_transformers(model, model_dirs, references):
    assert_matches(model, model_dirs, references)


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
        ({"attention_backend": "cpu"}, r"--attention-backend cpu cannot run Gemma3ForCausalLM: .* torch attention"),
        ({"enable_lora": True}, r"^LoRA \(--enable-lora\) is not supported for Gemma3ForCausalLM$"),
        ({"quantization": "fp8"}, r"^quantized checkpoints \(--quantization\) are not supported for Gemma3Fo"),
    ],
)
def test_refused_options_name_what_they_refuse(model_dirs, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(model_dirs["gemma3"]), device="cpu", **options)


def test_multimodal_gemma3_is_refused_by_name(tmp_path, model_dirs):
    path = tmp_path / "gemma3-mm"
    shutil.copytree(model_dirs["gemma3"], path)
    config = (path / "config.json").read_text().replace('"Gemma3ForCausalLM"', '"Gemma3ForConditionalGeneration"')
    (path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"architecture \['Gemma3ForConditionalGeneration'\] is not supported"):
        EngineConfig(model=str(path), device="cpu")


def test_two_shards_match_transformers(ray_session, model_dirs, references):
    """tp=2: each shard takes its heads (the q/k norms whole) and its half of the MLP; the norms are replicated."""
    assert_matches("gemma3", model_dirs, references, tensor_parallel_size=2)

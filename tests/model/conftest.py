"""What every architecture's test against transformers checks through ``raypaged.LLM``."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import GraniteConfig, Phi3Config, SmolLM3Config

from raypaged import LLM, SamplingParams
from raypaged.model.synthetic import write_synthetic_model
from tests import fused_reference as ref
from tests.conftest import TOKENIZER_FILES, hf_greedy, make_tiny_model

BATCH_PROMPTS = [[1, 5, 9, 300], list(range(100, 190)), [42] * 20, list(range(3000, 3077, 7))]
NUM_BLOCKS, BLOCK_SIZE = 64, 8


def assert_batch_greedy_matches_transformers(model_path: Path, max_tokens: int = 40, **llm_options) -> None:
    """``BATCH_PROMPTS`` in one batch: each prompt's greedy tokens equal transformers' ``generate`` (fp32,
    EOS ignored), and every KV block is free again afterwards."""
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(model_path), num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE, **llm_options)
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in BATCH_PROMPTS],
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False,
        )
        assert llm.stats()["num_gpu_blocks_free"] == NUM_BLOCKS
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for prompt, output in zip(BATCH_PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, max_tokens)


def tiny_config(architecture: str):
    """``fused_reference.tiny_config``'s shape (head size 64, GQA 2:1) as ``architecture``, with Phi-3's partial
    rotation (the first 32 features of each head), Granite's four multipliers and SmolLM3's last layer NoPE."""
    if architecture in ("llama", "qwen3"):
        return ref.tiny_config(architecture)
    llama = ref.tiny_config("llama")
    shape = {
        name: getattr(llama, name)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "rms_norm_eps",
        )
    }
    if architecture == "phi3":
        return Phi3Config(**shape, pad_token_id=0, partial_rotary_factor=0.5)
    if architecture == "smollm3":  # the last layer unrotated (NoPE)
        return SmolLM3Config(**shape, pad_token_id=0, no_rope_layers=[1] * (shape["num_hidden_layers"] - 1) + [0])
    return GraniteConfig(
        **shape, embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0
    )


def tiny_models_with_word_tokenizer(
    root: Path, smollm2_dir: Path, models: dict[str, tuple[str, dict[str, Any]]], tiny: dict[str, Any]
) -> dict[str, Path]:
    """Each of ``models`` (name -> (architecture or model type, config overrides)), ``tiny``'s shape, saved under
    ``root`` with a word-level tokenizer of its ``tiny["vocab_size"]`` tokens (SmolLM2's has more than the model)."""
    tokenizer = write_synthetic_model(root / "tokenizer", vocab_size=tiny["vocab_size"])
    dirs = {}
    for name, (arch, overrides) in models.items():
        dirs[name] = path = make_tiny_model(root / name, smollm2_dir, arch, **tiny, **overrides)
        for file in TOKENIZER_FILES:
            (path / file).unlink(missing_ok=True)
            if (tokenizer / file).exists():
                shutil.copy(tokenizer / file, path / file)
    return dirs


# the shape of the mixture-of-experts models' tests (each adds its experts and layers)
MOE_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    tie_word_embeddings=False,
)
# the prompts of the architectures' logprob comparisons: each longer than a sliding window of 8 (Gemma)
LOGPROB_PROMPTS = [list(range(200, 230)), [7, 8, 9] * 4, list(range(300, 321)), [42] * 9]
LOGPROB_TOKENS = 12
LOGPROB_PARAMS = SamplingParams(
    temperature=0, max_tokens=LOGPROB_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1
)
Reference = list[tuple[list[int], torch.Tensor]]


def transformers_references(model_dirs: dict[str, Path], **hf_options) -> dict[str, Reference]:
    """Per model, each of ``LOGPROB_PROMPTS``' greedy tokens from transformers' generate and the log-softmax of the
    logits of its whole sequence in one forward."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, path in model_dirs.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **hf_options).eval()
        out[name] = []
        for prompt in LOGPROB_PROMPTS:
            tokens = hf_greedy(hf, prompt, LOGPROB_TOKENS)
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + tokens])).logits[0]
            out[name].append((tokens, logits.log_softmax(-1)))
    return out


def assert_matches_transformers(model_dir: Path, reference: Reference, **llm_options) -> None:
    """``LOGPROB_PROMPTS`` in one batch: transformers' greedy tokens, and logprobs within 2e-5 of its logits'. With
    ``enable_prefix_caching`` twice more, hitting the first run's blocks (a request with prompt logprobs takes no
    cached blocks: these ask for the sampled tokens' only)."""
    llm = LLM(model=str(model_dir), device="cpu", num_gpu_blocks_override=64, block_size=4, **llm_options)
    requests = [{"prompt_token_ids": p} for p in LOGPROB_PROMPTS]
    try:
        runs = [llm.generate(requests, LOGPROB_PARAMS, use_tqdm=False)]
        if llm_options.get("enable_prefix_caching"):
            cached = SamplingParams(temperature=0, max_tokens=LOGPROB_TOKENS, ignore_eos=True, logprobs=1)
            runs.append(llm.generate(requests, cached, use_tqdm=False))
            cached_enough = [
                out.num_cached_tokens >= len(p) - len(p) % 4 - 4 for p, out in zip(LOGPROB_PROMPTS, runs[-1])
            ]
            assert all(cached_enough)
    finally:
        llm.shutdown()
    for outputs in runs:
        for prompt, output, (tokens, expected) in zip(LOGPROB_PROMPTS, outputs, reference, strict=True):
            assert output.outputs[0].token_ids == tokens
            sequence = prompt + tokens
            got = [entry[token].logprob for entry, token in zip(output.outputs[0].logprobs, tokens, strict=True)]
            first = len(prompt) - 1  # the first sampled token's row
            if output.prompt_logprobs is not None:
                got = [e[t].logprob for e, t in zip(output.prompt_logprobs[1:], prompt[1:], strict=True)] + got
                first = 0
            want = expected[torch.arange(first, len(sequence) - 1), torch.tensor(sequence[first + 1 :])]
            torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=2e-5)

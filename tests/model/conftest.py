"""What every architecture's test against transformers checks through ``raypaged.LLM``."""

from __future__ import annotations

from pathlib import Path

import torch

from raypaged import LLM, SamplingParams
from tests.conftest import hf_greedy

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

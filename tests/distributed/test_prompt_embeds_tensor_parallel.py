"""Prompt embeddings under tensor parallelism over Ray actors: every shard takes the request's rows in place of its
token embeddings, and the tokens equal transformers' for the same ``inputs_embeds``."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from raypaged import LLM
from tests.conftest import make_tiny_model
from tests.entrypoints.test_prompt_embeds import GREEDY, embeds_of, hf_tokens


def test_prompt_embeds_under_tp2_equal_transformers(ray_session, tmp_path, smollm2_dir):
    model_dir = make_tiny_model(tmp_path, smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [embeds_of(hf, list(range(700, 700 + n)), seed) for seed, n in enumerate((7, 30))]
    llm = LLM(
        model=str(model_dir),
        tensor_parallel_size=2,
        enable_prompt_embeds=True,
        num_gpu_blocks_override=64,
        max_model_len=128,
        max_num_batched_tokens=16,
    )
    try:
        outputs = llm.generate([{"prompt_embeds": r} for r in rows] + ["A text prompt"], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs[:2]] == [hf_tokens(hf, r) for r in rows]

"""One local Ray instance for every distributed test (CPU shards), and a tiny 8-head Llama."""

from __future__ import annotations

from pathlib import Path

import pytest

from raypaged import LLM, SamplingParams
from tests.conftest import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_dir) -> Path:
    """8 attention heads, 2 KV heads: tp 2 splits the KV heads, tp 4 replicates them."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), smollm2_dir, "llama")


TINY_PROMPTS = [{"prompt_token_ids": [1, 17 + 5 * i, 400 + 31 * i, 2000 + 7 * i]} for i in range(16)]
TINY_PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def greedy_tokens(llm: LLM, prompts: list, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama) -> list[list[int]]:
    """tp=1, in-process: the tokens every distributed run must reproduce."""
    llm = LLM(model=str(tiny_llama), device="cpu", num_gpu_blocks_override=128)
    return greedy_tokens(llm, TINY_PROMPTS, TINY_PARAMS)

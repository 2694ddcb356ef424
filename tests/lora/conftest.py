"""A plain forward of raypaged's model over whole prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from raypaged.attention.metadata import AttentionMetadata, PrefillSpan
from raypaged.model.loader import load_model
from tests.conftest import ADAPTERS, make_peft_adapter  # noqa: F401  (the LoRA tests import them from here)


def load_raypaged(model_dir: Path, tp=None):
    from raypaged.model.parallel import TensorParallel

    config = AutoConfig.from_pretrained(model_dir)
    return load_model(model_dir, config, 256, torch.float32, torch.device("cpu"), tp or TensorParallel())


def prefill_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's logits ``[len, vocab]`` from one forward over all prompts, nothing cached."""
    ids = [t for p in prompts for t in p]
    positions = [i for p in prompts for i in range(len(p))]
    spans, start = [], 0
    for prompt in prompts:
        spans.append(PrefillSpan(start, len(prompt), len(prompt), torch.zeros(1, dtype=torch.long)))
        start += len(prompt)
    meta = AttentionMetadata(
        slot_mapping=torch.full((len(ids),), -1, dtype=torch.long),  # nothing written: no span reads the cache
        num_decode_tokens=0,
        decode_block_tables=torch.zeros((0, 1), dtype=torch.long),
        decode_context_lens=torch.zeros(0, dtype=torch.long),
        prefills=spans,
    )
    attn = model.model.layers[0].self_attn
    cache = torch.zeros(1, attn.num_kv_heads, 1, attn.head_dim)
    kv_caches = [(cache, cache) for _ in model.model.layers]
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(positions), kv_caches, meta)
        logits = model.compute_logits(hidden)
    return list(logits.split([len(p) for p in prompts]))


def peft_logits(peft_model, name: str | None, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        if name is None:
            with peft_model.disable_adapter():
                return peft_model(ids).logits[0]
        peft_model.set_adapter(name)
        return peft_model(ids).logits[0]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A random 2-layer Llama (hidden 64, 8 heads, 2 KV heads, intermediate 128)."""
    from tests.conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), smollm2_dir, "llama")

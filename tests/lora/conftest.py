"""PEFT adapters made with ``peft`` itself, and a plain forward of raypaged's model over whole prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from raypaged.attention.metadata import AttentionMetadata, PrefillSpan
from raypaged.model.loader import load_model

# name -> LoraConfig options: different ranks, target modules (short names, full paths, all-linear) and scalings
ADAPTERS = {
    "qv-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "all-r8-rslora": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "use_rslora": True},
    "kogd-r16": {"r": 16, "lora_alpha": 32, "target_modules": ["model.layers.0.self_attn.k_proj", "o_proj", "gate_proj",
                                                          "down_proj"]},
}


def make_peft_adapter(base_dir: Path, out_dir: Path, seed: int, std: float = 0.05, **options) -> Path:
    """An adapter of ``base_dir``'s model saved with ``save_pretrained``: A and B drawn from N(0, std)
    (B is zero at peft's init, which would make the adapter the identity)."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**options))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def smollm2_adapters(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_peft_adapter(smollm2_dir, root / name, seed, **options)
            for seed, (name, options) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="session")
def peft_smollm2(smollm2_dir, smollm2_adapters):
    """One PeftModel holding every adapter (``set_adapter`` picks one, ``disable_adapter`` none)."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    names = list(smollm2_adapters)
    model = PeftModel.from_pretrained(base, smollm2_adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(smollm2_adapters[name], adapter_name=name)
    return model.eval()


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

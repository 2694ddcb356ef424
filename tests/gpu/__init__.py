"""Tests that need a CUDA device and cupy; every module here sets ``pytestmark = NEEDS_CUDA_AND_CUPY``."""

import importlib.util

import pytest
import torch

NEEDS_CUDA_AND_CUPY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs cupy (pip install raypaged[cuda])"),
]


def random_llama(path, **shape):
    """A small Llama of ``shape`` with random weights (std 0.08, norms left at 1) saved as safetensors,
    with a word-level tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from raypaged.model.synthetic import write_synthetic_model

    path = write_synthetic_model(path, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(path), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.08)
    model.save_pretrained(path)
    return path

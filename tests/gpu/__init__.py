"""The CUDA device's tests. Modules that need the device itself (CUDA graphs, the engine, NCCL) set
``pytestmark = NEEDS_CUDA_AND_CUPY``; the kernels' own tests set ``NEEDS_KERNELS`` and run their tensors on
``DEVICE``: the CUDA device, or, without one, the CPU, with the kernels built for the host
(``raypaged.kernels.host``; the ``kernels_on_host`` fixture of conftest.py turns it on)."""

import importlib.util

import pytest
import torch

from raypaged.kernels import host

NEEDS_CUDA_AND_CUPY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs cupy (pip install raypaged[cuda])"),
]
ON_HOST = not torch.cuda.is_available()
DEVICE = "cpu" if ON_HOST else "cuda"
NEEDS_KERNELS = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_HOST and host.compiler() is None, reason="needs a CUDA device or a C++ compiler"),
    pytest.mark.skipif(
        not ON_HOST and importlib.util.find_spec("cupy") is None, reason="needs cupy (pip install raypaged[cuda])"
    ),
]
CUDA_ONLY = pytest.mark.skipif(ON_HOST, reason="needs a CUDA device (streams, CUDA graphs or the engine on it)")


# a small Llama for engine tests: head size 64, GQA 2:1
TINY_LLAMA = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


def ragged_prompts(vocab_size: int = TINY_LLAMA["vocab_size"]) -> list[list[int]]:
    """Eight prompts of 3 to 1,100 random tokens; 700 and 1100 take the split-context (v2) decode."""
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (3, 17, 64, 100, 250, 700, 1100, 31)]


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

"""A tiny random Llama and its checkpoints in every format the reference quantizer writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from raypaged.model.llama import LlamaForCausalLM
from raypaged.model.loader import iter_checkpoint, load_model
from raypaged.model.parallel import TensorParallel
from raypaged.quantization import resolve_quantization
from raypaged.quantization.quantizer import quantize_checkpoint
from tests.conftest import make_tiny_model

# name -> (scheme, quantizer options); group 32 divides every projection's input (64, 128) and a rank's half;
CHECKPOINTS = {
    "fp8": ("fp8", {}),
    "w8a8-int8": ("w8a8-int8", {}),
    "w8a8-fp8": ("w8a8-fp8", {}),
    # blocks that do not divide the fused parts' rows (q 64, k and v 16) or, for the second, the inputs (64, 128)
    "fp8-block": ("fp8-block", {"block": (48, 32)}),
    "w8a8-fp8-block": ("w8a8-fp8-block", {"block": (32, 48)}),
    "w4a16": ("w4a16", {"group_size": 32}),
    "w4a16-asym": ("w4a16", {"group_size": 32, "symmetric": False}),
    "gptq": ("gptq", {"group_size": 32}),
    "gptq-actorder-asym": ("gptq", {"group_size": 32, "act_order": True, "symmetric": False}),
    "gptq-channel": ("gptq", {"group_size": -1}),
    "gptq-8bit-actorder": ("gptq", {"group_size": 32, "bits": 8, "act_order": True}),
    "awq": ("awq", {"group_size": 32}),
}


@pytest.fixture(scope="session")
def tiny_float_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("float"), smollm2_dir, "llama", attention_bias=True)


@pytest.fixture(scope="session")
def quantized_dirs(tmp_path_factory, tiny_float_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    return {
        name: quantize_checkpoint(tiny_float_dir, root / name, scheme, **options)
        for name, (scheme, options) in CHECKPOINTS.items()
    }


def load(path: Path, tp: TensorParallel = TensorParallel(), quantization: str | None = None) -> LlamaForCausalLM:
    """The model of a folder, as a worker of rank ``tp.rank`` loads it (fp32 on CPU)."""
    hf = AutoConfig.from_pretrained(path)
    quant_config = resolve_quantization(quantization, getattr(hf, "quantization_config", None))
    return load_model(path, hf, 64, torch.float32, torch.device("cpu"), tp, quant_config=quant_config)


def float_weights(path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint(path))

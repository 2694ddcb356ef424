"""Mistral's own checkpoint format, as vLLM reads it with ``--config-format mistral`` and ``--load-format mistral``:
``params.json`` (the model's shape in Mistral's names) and ``consolidated*.safetensors`` (its weights in Mistral's
names, the query and key projections' rows in the interleaved rotary order of Mistral's reference code). Most of
Mistral's Hugging Face repositories hold both formats; a folder with ``params.json`` and no ``config.json`` is read in
this one unless told otherwise.

The config becomes a Hugging Face ``MistralConfig`` (``MixtralConfig`` with ``moe``), so the rest of the engine reads
one format, and each weight is renamed and, for the query and key projections, its rows put in the half-split rotary
order Hugging Face's conversion script gives them. What this reader does not know (a vision encoder, a quantized
checkpoint, rope scaling) is refused naming the key, never skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

PARAMS = "params.json"
WEIGHTS_GLOB = "consolidated*.safetensors"
CONFIG_FORMATS = ("auto", "hf", "mistral")

# params.json key -> MistralConfig field
_CONFIG_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "head_dim": "head_dim",
    "hidden_dim": "intermediate_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "norm_eps": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "rope_theta": "rope_theta",
    "sliding_window": "sliding_window",
    "max_seq_len": "max_position_embeddings",
    "max_position_embeddings": "max_position_embeddings",
    "tied_embeddings": "tie_word_embeddings",
}
_REQUIRED = ("dim", "n_layers", "hidden_dim", "n_heads", "vocab_size")
_WHY_NOT = {
    "vision_encoder": "Mistral-format image models are not read: serve the repository's Hugging Face format",
    "quantization": "Mistral-format quantized checkpoints are not read: serve the repository's Hugging Face format",
}
_MOE_KEYS = {"num_experts": "num_local_experts", "num_experts_per_tok": "num_experts_per_tok"}  # Mixtral's

# consolidated name -> Hugging Face name (a layer's: after "layers.{i}.")
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_TOP["output.weight"] = "lm_head.weight"
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
# Mixtral's: the router, and each expert's w1 (gate), w2 (down) and w3 (up) under Hugging Face's Mixtral names
_EXPERT_PART = re.compile(r"feed_forward\.(gate\.weight|experts\.\d+\.w[123]\.weight)")


def reads_mistral_config(model_path: Path, config_format: str) -> bool:
    """Whether the model's config is ``params.json``: asked for, or (``auto``) the folder has it and no ``config.json``
    (vLLM's rule)."""
    if config_format == "mistral":
        if not (model_path / PARAMS).is_file():
            raise ValueError(f"--config-format mistral: {model_path} has no {PARAMS}")
        return True
    return config_format == "auto" and not (model_path / "config.json").exists() and (model_path / PARAMS).is_file()


def mistral_config(model_path: Path) -> PretrainedConfig:
    """``params.json`` as a Hugging Face ``MistralConfig`` (``MixtralConfig`` with ``moe``); a key this reader does not
    know is refused by name."""
    from transformers import MistralConfig

    params = json.loads((model_path / PARAMS).read_text())
    if not isinstance(params, dict):
        raise ValueError(f"{model_path / PARAMS} is not a JSON object")
    moe = params.pop("moe", None)
    for key in params:
        if key in _WHY_NOT:
            raise ValueError(f"--config-format mistral: {PARAMS} has {key!r}: {_WHY_NOT[key]}")
        if key not in _CONFIG_KEYS:
            raise ValueError(f"--config-format mistral: {PARAMS} has {key!r}, which raypaged does not read")
    if missing := [key for key in _REQUIRED if key not in params]:
        raise ValueError(f"--config-format mistral: {PARAMS} lacks {', '.join(map(repr, missing))}")
    fields: dict[str, Any] = {_CONFIG_KEYS[key]: value for key, value in params.items()}
    if not isinstance(fields.get("sliding_window", 0), int | None):
        raise ValueError(
            "--config-format mistral: a sliding_window per layer is not read: serve the Hugging Face format"
        )
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    fields.setdefault("max_position_embeddings", 128_000)  # vLLM's default for params.json
    fields.setdefault("rope_theta", 10_000.0)
    fields.setdefault("sliding_window", None)  # MistralConfig's default is 4096
    fields.setdefault("tie_word_embeddings", False)
    theta = fields.pop("rope_theta")
    common = dict(rope_parameters={"rope_type": "default", "rope_theta": float(theta)}, bos_token_id=1, eos_token_id=2)
    config: PretrainedConfig
    if moe is not None:  # Mixtral: every layer's MLP is experts and a router
        from transformers import MixtralConfig

        if not isinstance(moe, dict) or set(moe) != set(_MOE_KEYS):
            raise ValueError(
                f"--config-format mistral: {PARAMS}'s 'moe' must hold num_experts and num_experts_per_tok, got "
                f"{json.dumps(moe)}"
            )
        experts = {_MOE_KEYS[key]: value for key, value in moe.items()}
        config = MixtralConfig(**fields, **experts, **common, architectures=["MixtralForCausalLM"])
    else:
        config = MistralConfig(**fields, **common, architectures=["MistralForCausalLM"])
    config.raypaged_config_format = "mistral"
    return config


def reads_mistral_weights(model_path: Path, load_format: str, config: PretrainedConfig) -> bool:
    """Whether the weights are ``consolidated*.safetensors``: asked for, or (``auto``) the config came from
    ``params.json``."""
    if load_format == "mistral":
        if not any(model_path.glob(WEIGHTS_GLOB)):
            raise ValueError(f"--load-format mistral: {model_path} has no {WEIGHTS_GLOB}")
        return True
    return load_format == "auto" and getattr(config, "raypaged_config_format", None) == "mistral"


def hf_weights(
    tensors: Iterable[tuple[str, torch.Tensor]], config: PretrainedConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Consolidated tensors under their Hugging Face names, the query and key projections' rows in Hugging Face's
    rotary order; a tensor this reader does not know is refused by name."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, tensor in tensors:
        if (hf_name := _TOP.get(name)) is not None:
            yield hf_name, tensor
            continue
        match = _LAYER_NAME.fullmatch(name)
        part = _LAYER.get(match.group(2)) if match else None
        if match is not None and (expert := _EXPERT_PART.fullmatch(match.group(2))) is not None:
            part = f"block_sparse_moe.{expert.group(1)}"
        if match is None or part is None:
            raise ValueError(f"--load-format mistral: tensor {name!r} is not one raypaged reads")
        if part == "self_attn.q_proj.weight":
            tensor = half_split_rows(tensor, heads)
        elif part == "self_attn.k_proj.weight":
            tensor = half_split_rows(tensor, kv_heads)
        yield f"model.layers.{match.group(1)}.{part}", tensor


def half_split_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A projection's rows per head from interleaved rotary pairs (0, 1), (2, 3)... to the half-split order (all
    first halves of the pairs, then all second halves), as Hugging Face's conversion script permutes them."""
    rows, columns = weight.shape
    return weight.view(num_heads, rows // num_heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)

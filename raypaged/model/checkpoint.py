"""A checkpoint's tensors into a built ``LlamaForCausalLM``: this rank's share of each, every parameter filled.

Checkpoints hold q/k/v and gate/up as separate projections (Llama, Mistral, Qwen, Granite), which load into the
model's fused ``qkv_proj`` and ``gate_up_proj`` part by part, or fused already (Phi-3: ``[q; k; v]`` and
``[gate; up]`` rows), each part's rows then read from where the part starts. Either way a rank takes its heads'
rows of q, k and v and its share of gate and of up. Each expert of a mixture of experts is such an MLP (Mixtral's
tensors are read under Qwen-MoE's names: ``moe.canonical_name``); with expert parallelism a rank takes its own
experts' tensors only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from raypaged.model.layers import Linear, Olmo2RMSNorm
from raypaged.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from raypaged.model.mla import HeadRowsLinear, KvUpProjection
from raypaged.model.moe import SparseMoeBlock, canonical_name
from raypaged.model.parallel import RowParallelLinear, VocabParallelEmbedding
from raypaged.model.stacked_experts import STACKED_EXPERT_TYPES, expert_tensors
from raypaged.pooling import classifier_head
from raypaged.quantization.linear import QuantLinear

# checkpoint name piece -> (fused parameter name piece, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
# a fused parameter's name piece -> its shards, for a checkpoint that holds it whole (Phi-3)
_FUSED = {".qkv_proj.": 3, ".gate_up_proj.": 2}

# an expert's tensor: ".mlp.experts.<index>." (Mixtral's renamed first)
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")

# a checkpoint's per-tensor fp8 KV cache scales, by the end of their names: the scales each sets
_KV_SCALE_NAMES = {
    ".self_attn.k_scale": "k",  # llm-compressor's kv_cache_scheme, and vLLM's fp8 checkpoints
    ".self_attn.v_scale": "v",
    ".self_attn.k_proj.output_scale": "k",  # AutoFP8's
    ".self_attn.v_proj.output_scale": "v",
    ".self_attn.kv_scale": "kv",  # one scale for both (older fp8 checkpoints)
}


_BASE_MODEL_NAMES = ("layers.", "embed_tokens.", "norm.")  # a base model's tensors (Qwen3Model's): no "model."


def _prefixed(name: str) -> str:
    """A base model's tensor name (an embedding model saved without its head), or an image-text checkpoint's
    language-model tensor name (``language_model.model.*``, ``model.language_model.*``), as the causal LM's."""
    if name.startswith(_BASE_MODEL_NAMES):
        return f"model.{name}"
    for wrapped, plain in _LANGUAGE_MODEL_NAMES:
        if name.startswith(wrapped):
            return plain + name[len(wrapped) :]
    return name


_LANGUAGE_MODEL_NAMES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.text_model.", "model."),  # Idefics3's
)
_VISION_NAMES = (
    "vision_model.",  # Llama 4's
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "visual.",  # Qwen-VL's
    "model.visual.",
    "image_newline",  # LLaVA-NeXT's row separator embedding
    "model.image_newline",
    "model.vision_model.",  # Idefics3's tower and connector
    "model.connector.",
)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _is_extra_layer(name: str, num_layers: int, num_mtp_layers: int) -> bool:
    """A tensor of the multi-token-prediction layers some checkpoints keep after the model's own (GLM-4.5's
    ``num_nextn_predict_layers``), which generation does not run (transformers skips them too)."""
    if not num_mtp_layers or (layer := _LAYER.match(name)) is None:
        return False
    return num_layers <= int(layer[1]) < num_layers + num_mtp_layers


def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy this rank's share of the checkpoint tensors into ``model``, fusing q/k/v and gate/up; every
    parameter must be filled, and a tensor with no place in the model is a ``ValueError`` naming it."""
    params = dict(model.named_parameters())
    if (model_type := model.config.model_type) in STACKED_EXPERT_TYPES:  # stacked (or MXFP4) experts, split
        weights = expert_tensors(weights, model_type, model.model.norm.weight.dtype, model.config.hidden_size)
    num_layers = model.config.num_hidden_layers
    multimodal = getattr(model.config, "raypaged_multimodal", None) is not None
    # a causal LM served as a classifier (classifier_from_token): its head rows, from the tied embeddings or lm_head
    score = model.score if getattr(model.config, "raypaged_classifier_token_ids", None) else None
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    # latent attention (DeepSeek) has a q_proj of its own (no fused qkv): only the MLPs' projections stack
    stacked_pieces = [p for p in _STACKED if not (model.architecture.mla and _STACKED[p][0] == ".qkv_proj.")]
    num_mtp_layers = int(getattr(model.config, "num_nextn_predict_layers", 0) or 0)
    filled: set[str] = set()
    kv_scales: dict[str, dict[str, float]] = {}  # attention module name -> its checkpoint's "k" and "v" scales
    for checkpoint_name, tensor in weights:
        if multimodal and checkpoint_name.startswith(_VISION_NAMES):
            continue  # an image-text checkpoint's vision tower and projector: text only is served
        name = canonical_name(_prefixed(checkpoint_name))
        if _is_extra_layer(name, num_layers, num_mtp_layers):
            continue
        if (layer := _LAYER.match(name)) is not None and len(model.model.layers) < num_layers:  # a pipeline stage's
            in_stage = int(layer[1]) - model.model.first_layer
            if not 0 <= in_stage < len(model.model.layers):
                continue  # another stage's layer
            name = f"model.layers.{in_stage}.{name[layer.end() :]}"
        if (expert := _EXPERT.search(name)) is not None:  # its place on this rank (expert parallel: maybe none)
            block, index = _owner(model, name, name[: expert.start()] + ".mlp"), int(expert[1])
            if not isinstance(block, SparseMoeBlock) or index >= block.spec.num_experts:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            if (local := block.local_expert(index)) is None:
                continue  # another rank's expert
            name = f"{name[: expert.start()]}.mlp.experts.{local}.{name[expert.end() :]}"
        if score is not None and name == head_name:  # the classifier's head: rows of the language-model head
            score.weight.data.copy_(classifier_head(tensor, model.config))
            filled.add("score.weight")
        if "rotary_emb.inv_freq" in name or (name.startswith("lm_head.") and model.lm_head is None):
            continue
        if name.startswith("model.embed_tokens.") and model.model.embed_tokens is None:
            continue  # a pipeline stage that does not read the embeddings
        if (kv_scale := _kv_scale_of(name)) is not None:
            attn_name, which = kv_scale
            if not isinstance(_owner(model, name, attn_name), LlamaAttention):
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            if tensor.numel() != 1:
                raise ValueError(
                    f"checkpoint tensor {name!r} holds {tuple(tensor.shape)} values: KV cache scales are "
                    "supported per tensor only (one value)"
                )
            kv_scales.setdefault(attn_name, {}).update(dict.fromkeys(which, float(tensor.float())))
            continue
        if (whole := next((piece for piece in _FUSED if piece in name), None)) is not None:
            owner, fused_linear, param_name = _fused_linear(model, name, name)
            for shard in range(_FUSED[whole]):
                first_row, offset, num_rows = owner.fused_rows(shard)
                fused_linear.load_part(param_name, tensor, owner.part_starts[shard] + first_row, offset, num_rows)
                filled.add(f"{name}#{shard}")
            continue
        if (stacked := next((piece for piece in stacked_pieces if piece in name), None)) is not None:
            fused, shard = _STACKED[stacked]
            target = name.replace(stacked, fused)
            owner, fused_linear, param_name = _fused_linear(model, name, target)
            first_row, offset, num_rows = owner.fused_rows(shard)
            fused_linear.load_part(param_name, tensor, first_row, offset, num_rows)
            filled.add(f"{target}#{shard}")
            continue
        module_name, param_name = name.rsplit(".", 1)
        module = _owner(model, name, module_name)
        if isinstance(module, LlamaAttention) and param_name == "sinks" and module.sinks is not None:
            module.load_sinks(tensor)  # gpt-oss's: this rank's heads'
        elif isinstance(module, (QuantLinear, RowParallelLinear)):  # each checks the names it holds
            module.load_shard(param_name, tensor)
        elif name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        elif isinstance(module, (VocabParallelEmbedding, Olmo2RMSNorm, KvUpProjection, HeadRowsLinear)):
            module.load_shard(tensor)
        else:
            params[name].data.copy_(tensor)
        filled.add(name)
    expected: set[str] = set()
    for name in params:
        piece = next((piece for piece in _FUSED if piece in name), None)
        expected.update([name] if piece is None else (f"{name}#{i}" for i in range(_FUSED[piece])))
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    _set_kv_scales(model, kv_scales)


def _fused_linear(
    model: LlamaForCausalLM, name: str, target: str
) -> tuple[LlamaAttention | LlamaMLP, Linear | QuantLinear, str]:
    """(the attention or MLP, its fused linear, the parameter's name) of checkpoint tensor ``name``, whose
    fused parameter is ``target`` (``...self_attn.qkv_proj.weight`` or ``...mlp.gate_up_proj.weight``)."""
    linear_name, param_name = target.rsplit(".", 1)
    owner, fused_linear = _owner(model, name, linear_name.rsplit(".", 1)[0]), _owner(model, name, linear_name)
    if not (isinstance(owner, (LlamaAttention, LlamaMLP)) and isinstance(fused_linear, (Linear, QuantLinear))):
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    return owner, fused_linear, param_name


def _kv_scale_of(name: str) -> tuple[str, str] | None:
    """(the attention module's name, the scales it sets) of a KV cache scale tensor's name, else None."""
    for suffix, which in _KV_SCALE_NAMES.items():
        if name.endswith(suffix):
            return name[: name.index(".self_attn.") + len(".self_attn")], which
    return None


def _set_kv_scales(model: LlamaForCausalLM, loaded: dict[str, dict[str, float]]) -> None:
    """The checkpoint's fp8 KV cache scales into their layers: every layer's k and v scales, or none at all."""
    model.checkpoint_kv_scales = bool(loaded)
    if not loaded:
        return
    for index, attn in enumerate(model.attentions()):
        attn_name = f"model.layers.{index}.self_attn"
        scales = loaded.get(attn_name, {})
        if set(scales) != {"k", "v"}:
            lacking = " and ".join(f"{which}_scale" for which in "kv" if which not in scales)
            raise ValueError(
                f"the checkpoint has KV cache scales for some layers but not {lacking} for {attn_name} "
                "(every layer needs both, or no layer any)"
            )
        try:
            attn.kv_scales.set(scales["k"], scales["v"])
        except ValueError as error:
            raise ValueError(f"checkpoint KV cache scales of {attn_name}: {error}") from None


def _owner(model: LlamaForCausalLM, name: str, module_name: str) -> nn.Module:
    try:
        return model.get_submodule(module_name)
    except AttributeError:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model") from None

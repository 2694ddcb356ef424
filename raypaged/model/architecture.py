"""What each supported architecture changes in the one Llama-shaped decoder of ``raypaged.model.llama``.

Every one is a pre-norm decoder of RMSNorms, rotate-half RoPE, GQA attention and a SiLU-gated MLP; they differ in
biases, Qwen3's per-head q/k norms, Granite's four multipliers and Phi-3's checkpoint, which holds q/k/v and
gate/up fused (its partial rotation and longrope are rotary options: ``layers.RotaryEmbedding``).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "GraniteForCausalLM",
)
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite")


@dataclass(frozen=True, slots=True)
class Architecture:
    """One config's decoder, as its transformers model computes it."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: an RMSNorm over each head's features of q and k, before rotary
    attention_scale: float | None  # Granite's attention_multiplier; None: head_dim ** -0.5
    embedding_multiplier: float  # Granite: the embeddings are multiplied by it
    residual_multiplier: float  # Granite: each attention and MLP output, before its residual add
    logits_scaling: float  # Granite: the logits are divided by it
    fused_checkpoint: bool  # Phi-3: the checkpoint holds qkv_proj ([q; k; v] rows) and gate_up_proj ([gate; up])


def architecture_of(config: PretrainedConfig) -> Architecture:
    """``ValueError`` for a config of a model type none of the supported architectures has."""
    model_type = config.model_type
    if model_type not in _MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(_MODEL_TYPES)}, the "
            f"model types of {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
    attention_bias = bool(getattr(config, "attention_bias", False))
    granite = model_type == "granite"
    return Architecture(
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        attention_scale=float(config.attention_multiplier) if granite else None,
        embedding_multiplier=float(config.embedding_multiplier) if granite else 1.0,
        residual_multiplier=float(config.residual_multiplier) if granite else 1.0,
        logits_scaling=float(config.logits_scaling) if granite else 1.0,
        fused_checkpoint=model_type == "phi3",
    )

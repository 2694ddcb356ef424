"""Llama-family decoder (Llama, Mistral, Qwen2) over the flattened tokens of a step.

No padding: ``input_ids`` and ``positions`` are ``[num_tokens]`` for all the
sequences of the step together; attention reads K/V through block tables.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from raypaged.attention.metadata import AttentionMetadata
from raypaged.attention.torch_ops import paged_attention, reshape_and_cache
from raypaged.model.layers import RMSNorm, RotaryEmbedding

LayerKVCache = tuple[torch.Tensor, torch.Tensor]  # key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# checkpoint name piece -> (fused parameter name piece, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        qkv_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        o_bias = config.model_type != "qwen2" and getattr(config, "attention_bias", False)
        self.shard_sizes = [
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.shard_sizes), bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.rotary = rotary

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:  # x: [num_tokens, hidden]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.shard_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        key_cache, value_cache = kv_cache
        reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = paged_attention(q, key_cache, value_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache], meta: AttentionMetadata
    ) -> torch.Tensor:  # -> [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(positions, x, kv_cache, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_seqs, hidden] -> [num_seqs, vocab]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in, fusing q/k/v and gate/up; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name.startswith("lm_head.") and self.lm_head is None):
                continue
            for piece, (fused, shard) in _STACKED.items():
                if piece in name:
                    target = name.replace(piece, fused)
                    param = params[target]
                    sizes = self._shard_sizes(target)
                    start = sum(sizes[:shard])
                    param.data[start:start + sizes[shard]].copy_(tensor)
                    filled.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                params[name].data.copy_(tensor)
                filled.add(name)
        expected = set()
        for name in params:
            if ".qkv_proj." in name:
                expected.update(f"{name}#{i}" for i in range(3))
            elif ".gate_up_proj." in name:
                expected.update(f"{name}#{i}" for i in range(2))
            else:
                expected.add(name)
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _shard_sizes(self, fused_name: str) -> list[int]:
        module = self.get_submodule(fused_name.rsplit(".", 2)[0])
        if isinstance(module, LlamaAttention):
            return module.shard_sizes
        return [module.intermediate_size, module.intermediate_size]

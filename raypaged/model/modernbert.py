"""ModernBERT (``ModernBertModel``, ``ModernBertForSequenceClassification``: gte-modernbert, modernbert-embed and the
rerankers built on it), an encoder of its own kind: pre-norm layers (LayerNorms, by default without biases, none
before the first layer's attention), rotary positions (each layer type's own base), bidirectional attention that is
global on ``full_attention`` layers and reaches ``sliding_window`` positions either way on ``sliding_attention``
ones, a GeGLU MLP (``Wi`` holds the input and the gate), and a final norm. A classifier pools the first token's or
the mean of the tokens' final states (``classifier_pooling``) through its head: a dense layer, the activation, a
norm, then the labels' projection. Prompts are computed whole, with no KV cache, as every encoder's
(``raypaged.model.encoder``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig

from raypaged.attention.metadata import AttentionMetadata
from raypaged.model.encoder import Encoder, span_attention
from raypaged.model.layers import RotaryEmbedding

_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_modernbert(config: PretrainedConfig, name: str, activations: dict) -> None:
    """``ValueError`` naming what of a ModernBERT config raypaged does not compute."""
    for key in ("hidden_activation", "classifier_activation"):
        if getattr(config, key) not in activations:
            raise ValueError(
                f"{name}: {key} {getattr(config, key)!r} is not supported (supported: {', '.join(activations)})"
            )
    if set(config.layer_types) - set(_LAYER_TYPES) or len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(f"{name}: layer_types must name {' or '.join(_LAYER_TYPES)} for each layer")
    if config.classifier_pooling not in ("cls", "mean"):
        raise ValueError(f"{name}: classifier_pooling {config.classifier_pooling!r} is not supported (cls, mean)")
    for layer_type in set(config.layer_types):
        rope_type = config.rope_parameters[layer_type].get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"{name}: rope type {rope_type!r} is not supported (default)")


def _norm(config: PretrainedConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class _Layer(nn.Module):
    def __init__(self, config: PretrainedConfig, index: int, act) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, hidden // config.num_attention_heads
        self.attn_norm = _norm(config) if index else nn.Identity()
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=config.attention_bias)
        self.attn_Wo = nn.Linear(hidden, hidden, bias=config.attention_bias)
        self.mlp_norm = _norm(config)
        self.Wi = nn.Linear(hidden, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.mlp_Wo = nn.Linear(config.intermediate_size, hidden, bias=config.mlp_bias)
        self.layer_type = config.layer_types[index]
        self.window = int(config.sliding_window) if self.layer_type == "sliding_attention" else None
        self.act = act

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, positions: torch.Tensor, spans: list[tuple[int, int]]
    ) -> torch.Tensor:  # [T, hidden]
        q, k, v = self.Wqkv(self.attn_norm(x)).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        rotary.rotate_(positions, q, k)  # in place, in the projection's output
        x = x + self.attn_Wo(span_attention(q, k, v, spans, self.window).reshape(x.shape))
        value, gate = self.Wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp_Wo(self.act(value) * gate)


class _Head(nn.Module):
    """A classifier's head over its pooled state: dense, activation, norm, then the labels' projection."""

    def __init__(self, config: PretrainedConfig, num_labels: int, act) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.norm = _norm(config)
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        self.act = act

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:  # [num_seqs, hidden] -> [num_seqs, num_labels]
        return self.classifier(self.norm(self.act(self.dense(pooled))))


class ModernBertEncoder(Encoder):
    def __init__(self, config: PretrainedConfig, num_labels: int = 0) -> None:
        super().__init__()
        from raypaged.model.encoder import _ACTIVATIONS, check_encoder

        check_encoder(config)
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_norm = _norm(config)
        act = _ACTIVATIONS[config.hidden_activation]
        self.layers = nn.ModuleList(_Layer(config, i, act) for i in range(config.num_hidden_layers))
        self.final_norm = _norm(config)
        self.score = _Head(config, num_labels, _ACTIVATIONS[config.classifier_activation]) if num_labels else None
        head_dim, max_positions = config.hidden_size // config.num_attention_heads, config.max_position_embeddings
        # each layer type's rotary base (rope_parameters per layer type, as Gemma 3's)
        self.rotary = nn.ModuleDict(
            {t: RotaryEmbedding(config, head_dim, max_positions, t) for t in sorted(set(config.layer_types))}
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: object, meta: AttentionMetadata
    ) -> torch.Tensor:  # -> [num_tokens, hidden]
        spans = self.spans(meta)
        x = self.embed_norm(self.tok_embeddings(input_ids))
        for layer in cast("list[_Layer]", self.layers):
            x = layer(x, cast(RotaryEmbedding, self.rotary[layer.layer_type]), positions, spans)
        return self.final_norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A ``ModernBertModel`` or ``*ForSequenceClassification`` checkpoint's tensors (a masked LM's head and
        decoder are not read); ``ValueError`` for a missing or unknown tensor."""
        self.fill((n, k, None, t) for n, t in weights if (k := self._target(n)) is not None)

    def _target(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        if name.startswith(("decoder.", "head.")) and self.score is None:
            return None  # a masked LM's head, or a classifier's read as an embedding model
        if name.startswith("head."):
            return "score." + name.removeprefix("head.")
        if name.startswith("classifier."):
            return None if self.score is None else "score." + name
        renames = {"embeddings.tok_embeddings.": "tok_embeddings.", "embeddings.norm.": "embed_norm."}
        for old, new in renames.items():
            if name.startswith(old):
                return new + name.removeprefix(old)
        match = re.fullmatch(r"layers\.(\d+)\.(attn|mlp)\.(Wqkv|Wo|Wi)\.(weight|bias)", name)
        if match is not None:
            index, block, linear, kind = match.groups()
            return f"layers.{index}.{linear if linear != 'Wo' else block + '_Wo'}.{kind}"
        return name

"""Encoder-only embedding models and cross-encoders: BERT, RoBERTa and XLM-RoBERTa (``--runner pooling``).

They are not decoders: every token attends to every other token of its prompt (no causal mask), the norms are
LayerNorms after each sublayer's residual add, positions are learned absolute embeddings (RoBERTa's start after
its padding index), BERT adds a token-type embedding (0 for a text, 1 for the second text of a pair), and the MLP
is one GELU projection. A prompt is therefore computed whole, in one step (the scheduler never chunks it:
``SchedulerConfig.whole_prompts``), and nothing is read from or written to the KV cache: attention runs over the
step's own keys and values, one prompt at a time, in torch's ``scaled_dot_product_attention``.

A ``*ForSequenceClassification`` checkpoint's head reads the first token's ([CLS], ``<s>``) final state: BERT's
pooler (a dense layer and tanh) and classifier, RoBERTa's ``classifier.dense``, tanh and ``classifier.out_proj``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from raypaged.attention.metadata import AttentionMetadata

ENCODER_ARCHITECTURES = (
    "BertModel",
    "BertForSequenceClassification",
    "RobertaModel",
    "RobertaForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
    "ModernBertModel",
    "ModernBertForSequenceClassification",
)
_ROBERTA_TYPES = ("roberta", "xlm-roberta")  # positions start after padding_idx; the head is classifier.dense/out_proj
ENCODER_MODEL_TYPES = ("bert", *_ROBERTA_TYPES, "modernbert")
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def is_encoder(config: PretrainedConfig) -> bool:
    return getattr(config, "model_type", None) in ENCODER_MODEL_TYPES


def position_offset(config: PretrainedConfig) -> int:
    """The position embedding of a prompt's first token: RoBERTa's count from ``padding_idx + 1`` (``pad_token_id``
    is its padding index), BERT's from 0."""
    return int(config.pad_token_id) + 1 if config.model_type in _ROBERTA_TYPES else 0


def max_prompt_len(config: PretrainedConfig) -> int:
    """The longest prompt the position embeddings hold (514 rows are 512 tokens for RoBERTa)."""
    return int(config.max_position_embeddings) - position_offset(config)


def uses_token_types(config: PretrainedConfig) -> bool:
    """Whether the second text of a pair embeds differently from the first (BERT's two token types)."""
    return int(getattr(config, "type_vocab_size", 1)) > 1


def classifier_pooling(config: PretrainedConfig) -> str:
    """The pooling type a classifier's head reads: ModernBERT's ``classifier_pooling`` (cls or mean), else CLS."""
    return "MEAN" if getattr(config, "classifier_pooling", "cls") == "mean" else "CLS"


def check_encoder(config: PretrainedConfig) -> None:
    """``ValueError`` naming what of an encoder's config raypaged does not compute."""
    name = (getattr(config, "architectures", None) or [config.model_type])[0]
    if config.model_type == "modernbert":
        from raypaged.model.modernbert import check_modernbert

        check_modernbert(config, name, _ACTIVATIONS)
        return
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"{name} configured as a decoder (is_decoder, add_cross_attention) is not supported")
    kind = getattr(config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"{name}: position_embedding_type {kind!r} is not supported (only absolute)")
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(
            f"{name}: hidden_act {config.hidden_act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})"
        )
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"{name}: hidden_size {config.hidden_size} is not a multiple of num_attention_heads "
            f"{config.num_attention_heads}"
        )


def check_encoder_options(
    config: PretrainedConfig, tensor_parallel_size: int, quantized: bool, lora: bool, attention_backend: str
) -> None:
    """``ValueError`` naming each engine option an encoder runs without."""
    name = (getattr(config, "architectures", None) or [config.model_type])[0]
    for given, what in (
        (tensor_parallel_size > 1, f"--tensor-parallel-size {tensor_parallel_size}"),
        (quantized, "--quantization"),
        (lora, "--enable-lora"),
        (attention_backend not in ("auto", "torch"), f"--attention-backend {attention_backend}"),
    ):
        if given:
            raise ValueError(
                f"{what} is not supported for {name}, an encoder: it runs on one shard, unquantized, its attention "
                "in torch over each prompt's own keys (no KV cache)"
            )


def span_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]], window: int | None = None
) -> torch.Tensor:  # [T, heads, head_dim] each -> [T, heads, head_dim]
    """Each prompt's (first row, length) tokens attending to all of its own (``window``: to those at most that many
    positions away on either side), in torch's SDPA."""
    out = torch.empty_like(q)
    for start, length in spans:
        rows = slice(start, start + length)
        mask = None
        if window is not None and length > window:
            pos = torch.arange(length, device=q.device)
            mask = (pos[None, :] - pos[:, None]).abs() <= window
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1), attn_mask=mask
        ).transpose(0, 1)
    return out


class EncoderLayer(nn.Module):
    """Self-attention over each prompt (q, k and v as one projection), then the MLP; a LayerNorm after each
    residual add."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up = nn.Linear(hidden, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:  # [T, hidden]
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        x = self.attn_norm(self.attn_out(span_attention(q, k, v, spans).view(x.shape)) + x)
        return self.mlp_norm(self.down(self.act(self.up(x))) + x)


class ClassificationHead(nn.Module):
    """A cross-encoder's head over its first token's final state: a dense layer, tanh, then the labels' projection
    (BERT's pooler and classifier, RoBERTa's classifier.dense and out_proj)."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:  # [num_seqs, hidden] -> [num_seqs, num_labels]
        return self.out_proj(torch.tanh(self.dense(first)))


class Encoder(nn.Module):
    """What the runner and the worker ask of a model, for an encoder: ``forward(input_ids, positions, kv_caches,
    meta)`` gives every token's final hidden state, ``score`` a classifier's head (None: an embedding model);
    there is no language-model head and no KV cache."""

    has_head = False  # no language-model head: nothing is sampled
    checkpoint_kv_scales = False
    score: nn.Module | None
    fused_qkv: str | None = None  # the q/k/v linear the checkpoint fills in thirds (``fill``), if any

    @staticmethod
    def spans(meta: AttentionMetadata) -> list[tuple[int, int]]:
        """The step's prompts as (first row, length): each whole (a one-token prompt is a decode row)."""
        spans = [(i, 1) for i in range(meta.num_decode_tokens)]
        for span in meta.prefills:
            if span.context_len != span.query_len:
                raise RuntimeError("an encoder computes each prompt whole, in one step; this one was cut")
            spans.append((span.query_start, span.query_len))
        return spans

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder has no language-model head: it embeds and classifies, it does not generate")

    def set_attention_backend(self, backend: Any) -> None:
        """Its attention is torch's over each prompt's own keys; the paged backends have nothing to run."""

    def kv_scales(self) -> list[Any]:
        return []

    def calculate_kv_scales_next_step(self) -> None:
        raise RuntimeError("an encoder writes no KV cache: --calculate-kv-scales does not apply")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def fill(self, targets: Iterable[tuple[str, str, int | None, torch.Tensor]]) -> None:
        """Copy each (checkpoint name, parameter name, third or None, tensor) into its parameter (a third: that
        third of its rows, one of a fused q/k/v), checking the shapes; ``ValueError`` for an unknown tensor or a
        parameter (or third) left unfilled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, key, third, tensor in targets:
            if key not in params:
                raise ValueError(f"checkpoint tensor {name} has no place in {type(self).__name__} (as {key})")
            part = params[key].data
            if third is not None:
                size = part.shape[0] // 3
                part = part[third * size : (third + 1) * size]
            if part.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name} has shape {list(tensor.shape)}, expected {list(part.shape)}"
                )
            part.copy_(tensor)
            filled.add(key if third is None else f"{key}#{third}")
        fused = {key for key in params if self.fused_qkv is not None and f".{self.fused_qkv}." in key}
        expected = {f"{key}#{i}" for key in fused for i in range(3)} | (set(params) - fused)
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors of the model, e.g. {missing[0]}")


def build_encoder(config: PretrainedConfig, num_labels: int = 0) -> Encoder:
    """The encoder of ``config``'s model type (BERT and RoBERTa's ``EncoderModel``, or ModernBERT's)."""
    if config.model_type == "modernbert":
        from raypaged.model.modernbert import ModernBertEncoder

        return ModernBertEncoder(config, num_labels)
    return EncoderModel(config, num_labels)


class EncoderModel(Encoder):
    """BERT's and RoBERTa's encoder. ``num_labels``: a classifier's, whose ``score`` head reads the first token's
    (pooling type CLS)."""

    fused_qkv = "qkv"  # the checkpoint's query, key and value fill it in thirds

    def __init__(self, config: PretrainedConfig, num_labels: int = 0) -> None:
        super().__init__()
        check_encoder(config)
        self.config = config
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(int(getattr(config, "type_vocab_size", 1)), hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.score = ClassificationHead(hidden, num_labels) if num_labels else None
        self.roberta = config.model_type in _ROBERTA_TYPES
        self.padding_idx = int(config.pad_token_id) if self.roberta else -1

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Any,
        meta: AttentionMetadata,
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:  # -> [num_tokens, hidden]
        """``kv_caches`` are not read (each prompt is whole in its step); ``token_types``: each token's type (None:
        all 0)."""
        spans = self.spans(meta)
        x = self.word_embeddings(input_ids) + self.position_embeddings(self._positions(input_ids, positions, spans))
        if token_types is None:
            token_types = torch.zeros_like(input_ids)
        x = self.embed_norm(x + self.token_type_embeddings(token_types))
        for layer in self.layers:
            x = layer(x, spans)
        return x

    def _positions(
        self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Each token's position embedding row: BERT's is its position; RoBERTa's counts the prompt's tokens that are
        not its padding token, from ``padding_idx + 1`` (a padding token's row is ``padding_idx``), as transformers'
        ``create_position_ids_from_input_ids``."""
        if not self.roberta:
            return positions
        kept = (input_ids != self.padding_idx).long()
        rows = torch.empty_like(positions)
        for start, length in spans:
            span = kept[start : start + length]
            rows[start : start + length] = torch.cumsum(span, 0) * span
        return rows + self.padding_idx

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A ``*Model`` or ``*ForSequenceClassification`` checkpoint's tensors (with or without the ``bert.``,
        ``roberta.`` prefix; TF-era ``gamma``/``beta`` LayerNorm names too); the pooler of a base model and the
        language-model head of a masked LM are not read. ``ValueError`` for a missing or unknown tensor."""
        self.fill((n, *target, t) for n, t in weights if (target := self._target(n)) is not None)

    def _target(self, name: str) -> tuple[str, int | None] | None:
        """The parameter a checkpoint tensor fills (and which third of a fused q/k/v one), None to skip it."""
        name = re.sub(r"^(bert|roberta)\.", "", name)
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if name.startswith(("lm_head.", "cls.")) or name.endswith("position_ids"):
            return None  # a masked LM's head, a buffer
        if name.startswith("pooler."):
            if self.score is None or self.roberta:
                return None  # a base model's pooler: embeddings are pooled by the pooling type instead
            return "score.dense." + name.removeprefix("pooler.dense."), None
        if name.startswith("classifier."):
            if self.score is None:
                return None
            if self.roberta:  # classifier.dense / classifier.out_proj
                return "score." + name.removeprefix("classifier."), None
            return "score.out_proj." + name.removeprefix("classifier."), None
        if name.startswith("embeddings."):
            rest = name.removeprefix("embeddings.")
            return ("embed_norm." + rest.removeprefix("LayerNorm.") if rest.startswith("LayerNorm.") else rest), None
        match = re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)", name)
        if match is None:
            return "<unknown>" + name, None
        index, module, kind = match.groups()
        qkv = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}
        if module in qkv:
            return f"layers.{index}.qkv.{kind}", qkv[module]
        local = {
            "attention.output.dense": "attn_out",
            "attention.output.LayerNorm": "attn_norm",
            "intermediate.dense": "up",
            "output.dense": "down",
            "output.LayerNorm": "mlp_norm",
        }.get(module)
        return (f"layers.{index}.{local}.{kind}" if local else f"<unknown>{name}"), None

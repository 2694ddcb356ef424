"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, Gemma 2 and 3, and Mixtral, Qwen2-MoE and
Qwen3-MoE: ``architecture``) over the flattened tokens of a step (Gemma's layer: ``gemma``; the experts that
replace the MLP: ``moe``).

No padding: ``input_ids`` and ``positions`` are ``[num_tokens]`` for all the
sequences of the step together; attention reads K/V through block tables.
Under tensor parallelism each rank holds its heads' share of QKV and O, its
share of gate/up and down, and its slice of the vocabulary; ``load_weights``
takes only that share of every checkpoint tensor. Qwen3's per-head q/k norms
(``head_dim`` weights) are the same on every rank: each holds them whole.

With an attention backend that brings fused ops (``AttentionBackend.fused_ops``: the C ones of the
``cpu`` backend; the CUDA kernels of ``raypaged.kernels.fused_ops`` with ``$RAYPAGED_FUSED_KERNELS``)
the step takes the fused path: the norms, residual adds, SiLU-mul and rotary (with the K/V cache
write) are those ops, and the residual stream is carried beside each layer's output so that the add
and the next norm are one pass. The values are those of the plain path (the torch one) within
rounding. Each layer is two halves around its attention call, ``pre_attention`` (input norm, QKV,
q/k norms, rotary, cache write) and ``post_attention`` (o_proj, residual add and norm, MLP), each
with its plain and fused branch; the forward runs them with the attention between, and so do the
piecewise CUDA graphs (``raypaged.worker.piecewise_graphs``), which record everything but the
attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig

from raypaged.attention.backend import TORCH, AttentionBackend, FusedOps, KVScales
from raypaged.attention.metadata import AttentionMetadata
from raypaged.model.architecture import Architecture, architecture_of, attention_backends, torch_attention_reason
from raypaged.model.cpu_step import CpuStep
from raypaged.model.layers import (
    GemmaRMSNorm,
    Linear,
    Olmo2RMSNorm,
    RMSNorm,
    RotaryEmbedding,
    clamped_swiglu,
    gelu_tanh_and_mul,
    silu_and_mul,
)
from raypaged.model.mla import MlaAttention, is_mla, mla_cache_head_dim
from raypaged.model.parallel import RowParallelLinear, TensorParallel, VocabParallelEmbedding
from raypaged.quantization.base import QuantizationConfig
from raypaged.quantization.linear import QuantLinear, build_linear

# key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim]
LayerKVCache = tuple[torch.Tensor, torch.Tensor]
# --calculate-kv-scales: a scale maps the first step's largest |key| to 200 and |value| to 100 (vLLM's
# K_SCALE_CONSTANT and V_SCALE_CONSTANT), leaving fp8 e4m3's range (448) headroom for later tokens
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0


def head_dim_of(config: PretrainedConfig) -> int:
    """The features of a rotated head (DeepSeek's latent attention: of its rotated part, ``qk_rope_head_dim``)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def cache_head_dim(config: PretrainedConfig) -> int:
    """The features of a KV cache head: ``head_dim_of``'s, or the latent and rotated key of DeepSeek's."""
    return mla_cache_head_dim(config) if is_mla(config) else head_dim_of(config)


def num_kv_heads_per_rank(config: PretrainedConfig, tp_size: int) -> int:
    """KV heads each rank holds: an even split, or one replicated head when there are fewer heads than ranks (and
    the one latent head of DeepSeek's attention, whole on every rank)."""
    if is_mla(config):
        return 1
    # an encoder's config (BERT's) names no KV heads: it attends with all of them (and keeps no cache)
    return max(1, getattr(config, "num_key_value_heads", config.num_attention_heads) // tp_size)


_EXPERT_SIZE_TYPES = ("mixtral", "gpt_oss", "llama4_text")  # their experts' size is the config's intermediate_size


def check_tensor_parallel(config: PretrainedConfig, tp_size: int, expert_parallel: bool = False) -> None:
    """Raise ``ValueError`` unless heads, KV heads and the MLP split evenly over ``tp_size`` ranks (with
    ``expert_parallel``, the experts themselves instead of each one's intermediate features)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp_size:
        raise ValueError(f"the model's num_attention_heads {heads} is not divisible by tensor_parallel_size {tp_size}")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"the model's num_key_value_heads {kv_heads} and tensor_parallel_size {tp_size} must divide one another"
        )
    arch = architecture_of(config)
    moe = arch.moe
    sizes = {}  # what each rank takes an even share of
    if moe is None or not all(moe.sparse_layers):  # the dense MLPs' (Llama 4's are intermediate_size_mlp)
        if arch.dense_intermediate_size is not None:
            sizes["intermediate_size_mlp"] = arch.dense_intermediate_size
        else:
            sizes["intermediate_size"] = config.intermediate_size
    if moe is not None and expert_parallel:  # whole experts: their count splits, not their features
        if moe.num_experts % tp_size:
            raise ValueError(
                f"--enable-expert-parallel: the model's {moe.num_experts} experts do not split evenly over "
                f"tensor_parallel_size {tp_size}"
            )
    elif moe is not None:  # each expert's features: Mixtral's intermediate_size, Qwen-MoE's moe_intermediate_size
        sizes["intermediate_size" if config.model_type in _EXPERT_SIZE_TYPES else "moe_intermediate_size"] = (
            moe.intermediate_size
        )
    if moe is not None and moe.shared_intermediate_size:  # Qwen2-MoE's shared expert
        sizes["shared_expert_intermediate_size"] = moe.shared_intermediate_size
    for name, size in sizes.items():
        if size % tp_size:
            raise ValueError(f"the model's {name} {size} is not divisible by tensor_parallel_size {tp_size}")


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        arch: Architecture,
        rotary: RotaryEmbedding,
        tp: TensorParallel,
        prefix: str,
        quant_config: QuantizationConfig | None,
        index: int,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = num_kv_heads_per_rank(config, tp.size)
        self.q_head_start = tp.rank * self.num_heads
        self.kv_head_start = tp.rank * config.num_key_value_heads // tp.size
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5 if arch.attention_scale is None else arch.attention_scale
        self.shard_sizes = [
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]
        # where q, k and v start in a checkpoint that holds them fused (Phi-3's qkv_proj)
        q_rows, kv_rows = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.part_starts = (0, q_rows, q_rows + kv_rows)
        self.qkv_proj = build_linear(
            config.hidden_size,
            sum(self.shard_sizes),
            arch.qkv_bias,
            tp,
            False,
            quant_config,
            (f"{prefix}.qkv_proj",) if arch.fused_checkpoint else tuple(f"{prefix}.{n}_proj" for n in "qkv"),
        )
        # Qwen3, Gemma 3: RMSNorm over each head's head_dim features of q and k, before rotary
        norm: type[RMSNorm] = GemmaRMSNorm if arch.gemma else RMSNorm
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if arch.qk_norm else None
        if arch.olmo2:  # over the whole projections: this rank's heads' share of each weight
            q_width, kv_width = self.shard_sizes[0], self.shard_sizes[1]
            self.q_norm = Olmo2RMSNorm(q_width, config.rms_norm_eps, tp, self.q_head_start * self.head_dim)
            self.k_norm = Olmo2RMSNorm(kv_width, config.rms_norm_eps, tp, self.kv_head_start * self.head_dim)
        self.rotates = not (arch.nope_layers and arch.nope_layers[index])  # SmolLM3's NoPE layers: no rotary
        self.sliding_window = arch.sliding_windows[index] if arch.sliding_windows else None
        self.attention_chunk = arch.attention_chunks[index] if arch.attention_chunks else None
        self.causal = not arch.bidirectional  # EmbeddingGemma: whole prompts, every key
        self.softcap = arch.attn_softcap
        # Llama 4: q and k of a rotary layer RMS-normed (no weight) after rotary; a NoPE layer's q temperature-tuned
        self.l2_qk = arch.qk_l2_norm and self.rotates
        self.temperature_tuning = None if self.rotates else arch.temperature_tuning
        self.norm_eps = float(config.rms_norm_eps)
        # gpt-oss: this rank's heads' sink logits (``load_sinks``)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if arch.attn_sinks else None
        self.o_proj = build_linear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            arch.o_bias,
            tp,
            True,
            quant_config,
            (f"{prefix}.o_proj",),
        )
        self.rotary = rotary
        self.attn_backend: AttentionBackend = TORCH
        self.kv_scales = KVScales()  # an fp8 KV cache's (the checkpoint's, or calculated); 1.0 otherwise
        self.calculate_kv_scales = False  # set: this layer's next step calculates them first (calculate_kv_scales)

    def fused_rows(self, shard: int) -> tuple[int, int, int]:
        """(first checkpoint row, offset in ``qkv_proj``, rows) of q (0), k (1) or v (2) on this rank; the row
        counts in the q, k or v checkpoint tensor (``part_starts[shard]`` more in a fused one)."""
        first_head = self.q_head_start if shard == 0 else self.kv_head_start
        return first_head * self.head_dim, sum(self.shard_sizes[:shard]), self.shard_sizes[shard]

    def pre_attention(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: LayerKVCache,
        slot_mapping: torch.Tensor,
        fused: FusedOps | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything before the attention proper, from the normed ``x: [num_tokens, hidden]``: the QKV
        projection, Qwen3's q/k norms, rotary, and this step's K/V written to their slots (a negative
        slot writes nothing). Returns q, k, v (``[num_tokens, heads, head_dim]`` views, q and k
        rotated but on SmolLM3's NoPE layers). ``fused``: through those ops, one call rotating q and k and writing k
        and v (a NoPE layer, or one whose rotary is interleaved, writes them as the plain path does)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.shard_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        scales = self.kv_scales
        if fused is not None and not self.calculate_kv_scales and self.rotates and not self.rotary.interleaved:
            if self.q_norm is not None and self.k_norm is not None:
                q = fused.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
                k = fused.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
            # scaled only over an fp8 cache, which the CUDA fused ops never write (cuda_backend)
            extra = {} if scales.unit else {"k_scale": scales.k, "v_scale": scales.v}
            fused.rotary_and_cache(positions, q, k, v, self.rotary.table, key_cache, value_cache, slot_mapping, **extra)
            return q, k, v
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            if self.rotates:
                self.rotary.rotate_(positions, q, k)
        elif self.rotates:  # q and k side by side in qkv: one rotation over both
            qk = qkv[:, : self.shard_sizes[0] + self.shard_sizes[1]]
            self.rotary.rotate_(positions, qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim))
        if self.l2_qk:
            q, k = _weightless_rms_norm(q, self.norm_eps), _weightless_rms_norm(k, self.norm_eps)
        elif self.temperature_tuning is not None:
            floor_scale, attn_scale = self.temperature_tuning
            tuned = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * tuned[:, None, None]).to(q.dtype)
        if self.calculate_kv_scales and num_tokens:
            self.calculate_scales(k, v)
        self.attn_backend.write_cache(k, v, key_cache, value_cache, slot_mapping, scales)
        return q, k, v

    def calculate_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """``--calculate-kv-scales``, as vLLM: this step's (rotated) keys and values set the layer's scales once,
        ``max |k| / 200`` and ``max |v| / 100`` (1.0 where the maximum is 0), before they are written."""
        k_max, v_max = float(k.abs().amax()), float(v.abs().amax())
        self.kv_scales.set(k_max / K_SCALE_RANGE if k_max > 0 else 1.0, v_max / V_SCALE_RANGE if v_max > 0 else 1.0)
        self.calculate_kv_scales = False

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:  # -> [num_tokens, num_heads, head_dim]
        """The attention over the cache (this step's K/V already in it), by the step's layout."""
        key_cache, value_cache = kv_cache
        return self.attn_backend.attend(
            q,
            k,
            v,
            key_cache,
            value_cache,
            meta,
            self.scale,
            self.kv_scales,
            self.sliding_window,
            self.softcap,
            self.sinks,  # gpt-oss's, Llama 4's chunks, EmbeddingGemma's two-way attention: the torch ops' and CPU's
            self.attention_chunk,
            self.causal,
        )

    def load_sinks(self, tensor: torch.Tensor) -> None:
        """This rank's heads' sinks of the checkpoint's ``[num_attention_heads]``."""
        assert self.sinks is not None
        self.sinks.data.copy_(tensor[self.q_head_start : self.q_head_start + self.num_heads])

    def post_attention(self, out: torch.Tensor) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] -> [.., hidden]
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


def _weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama 4's q/k norm: ``x * rsqrt(mean(x^2) + eps)`` over each head's features, in fp32 (no weight)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        arch: Architecture,
        tp: TensorParallel,
        prefix: str,
        quant_config: QuantizationConfig | None,
        intermediate_size: int | None = None,  # config.intermediate_size unless given (Qwen2-MoE's shared expert)
    ) -> None:
        super().__init__()
        total = config.intermediate_size if intermediate_size is None else intermediate_size
        self.first_row, self.intermediate_size = tp.chunk(total)
        # [T, 2 * I] (gate | up) -> [T, I]: act(gate) * up
        self.act_and_mul: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh_and_mul if arch.gemma else silu_and_mul
        if arch.moe is not None and arch.moe.clamped_swiglu is not None:  # gpt-oss's experts
            self.act_and_mul = partial(clamped_swiglu, *arch.moe.clamped_swiglu)
        self.part_starts = (0, total)  # where gate and up start in Phi-3's fused gate_up_proj
        self.gate_up_proj = build_linear(
            config.hidden_size,
            2 * self.intermediate_size,
            arch.mlp_bias,
            tp,
            False,
            quant_config,
            (f"{prefix}.gate_up_proj",) if arch.fused_gate_up else (f"{prefix}.gate_proj", f"{prefix}.up_proj"),
        )
        self.down_proj = build_linear(
            total,
            config.hidden_size,
            arch.mlp_bias,
            tp,
            True,
            quant_config,
            (f"{prefix}.down_proj",),
        )

    def fused_rows(self, shard: int) -> tuple[int, int, int]:
        """(first checkpoint row, offset in ``gate_up_proj``, rows) of gate (0) or up (1) on this rank; the row
        counts in the gate or up checkpoint tensor (``part_starts[shard]`` more in a fused one)."""
        return self.first_row, shard * self.intermediate_size, self.intermediate_size

    def forward(self, x: torch.Tensor, fused: FusedOps | None = None) -> torch.Tensor:
        return self.down_proj(self.activated(x, fused))

    def partial(self, x: torch.Tensor, fused: FusedOps | None = None) -> torch.Tensor:
        """This rank's share of the output, before the down projection's all-reduce and bias (a mixture of experts
        sums its experts' shares first: ``moe``)."""
        down = self.down_proj
        assert isinstance(down, (RowParallelLinear, QuantLinear)), "the experts' linears are not wrapped (no LoRA)"
        return down.partial(self.activated(x, fused))

    def activated(self, x: torch.Tensor, fused: FusedOps | None) -> torch.Tensor:  # [T, hidden] -> [T, I]
        """``act(gate) * up``, through the fused ops' silu_and_mul where the step runs them."""
        if fused is None:
            return self.act_and_mul(self.gate_up_proj(x))
        gate_up = self.gate_up_proj
        if isinstance(gate_up, (Linear, QuantLinear)):  # in one pass where its weight is packed gated (pack_weights)
            return gate_up.silu_and_mul(x, fused.silu_and_mul)
        return fused.silu_and_mul(gate_up(x))


class LlamaDecoderLayer(nn.Module):
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(
        self,
        config: PretrainedConfig,
        arch: Architecture,
        rotary: RotaryEmbedding,
        tp: TensorParallel,
        prefix: str,
        quant_config: QuantizationConfig | None,
        index: int,
    ) -> None:
        super().__init__()
        from raypaged.model.moe import SparseMoeBlock  # here: that module's blocks hold this one's MLPs

        self.self_attn: LlamaAttention | MlaAttention
        if arch.mla:
            self.self_attn = MlaAttention(config, rotary, tp, f"{prefix}.self_attn")
        else:
            self.self_attn = LlamaAttention(config, arch, rotary, tp, f"{prefix}.self_attn", quant_config, index)
        self.mlp: LlamaMLP | SparseMoeBlock
        if arch.moe is not None and arch.moe.sparse_layers[index]:
            self.mlp = SparseMoeBlock(config, arch, tp, f"{prefix}.mlp", quant_config)
        else:  # Llama 4's dense layers have a size of their own
            self.mlp = LlamaMLP(config, arch, tp, f"{prefix}.mlp", quant_config, arch.dense_intermediate_size)
        self.add_norms(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = arch.residual_multiplier

    def add_norms(self, hidden_size: int, eps: float) -> None:
        """The layer's norms, named as its checkpoint names them: Llama's before the attention and before the MLP
        (Gemma's and OLMo 2's layers have theirs)."""
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    # The residual stream between layers is (x, residual). Plain path: ``x`` is the stream itself,
    # ``residual`` None. Fused path: ``x`` is the previous layer's MLP output not yet added to
    # ``residual`` (for the first layer: the embeddings, ``residual`` None), so that the add and
    # the next norm are one kernel. Either way every add is rounded to the model's dtype, and the
    # attention's and the MLP's outputs are multiplied by Granite's residual_multiplier before theirs.

    def pre_attention(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: LayerKVCache,
        slot_mapping: torch.Tensor,
        fused: FusedOps | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to its attention: the input norm, then q, k, v (rotated; K/V in the cache).
        Returns (q, k, v, residual), ``residual`` the stream as :meth:`post_attention` takes it."""
        norm = self.input_layernorm
        if fused is None:
            return *self.self_attn.pre_attention(positions, norm(x), kv_cache, slot_mapping, None), x
        if residual is None:
            residual, x = x, fused.rms_norm(x, norm.weight, norm.eps)
        else:
            fused.fused_add_rms_norm(x, residual, norm.weight, norm.eps)  # residual += x; x = norm(residual)
        return *self.self_attn.pre_attention(positions, x, kv_cache, slot_mapping, fused), residual

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor, fused: FusedOps | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer after its attention (``attn_out: [num_tokens, num_heads, head_dim]``): o_proj, the
        residual add and norm, the MLP. Returns the (x, residual) the next layer takes."""
        x = self.scaled(self.self_attn.post_attention(attn_out))
        norm = self.post_attention_layernorm
        if fused is None:
            normed, x = norm.add_and_norm(x, residual)  # x: the residual stream after attention
            return self.scaled(self.mlp(normed)).add_(x), None
        fused.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.scaled(self.mlp(x, fused)), residual

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        """An attention or MLP output (a fresh tensor) times the residual multiplier, in place."""
        return x if self.residual_multiplier == 1.0 else x.mul_(self.residual_multiplier)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: LayerKVCache,
        meta: AttentionMetadata,
        fused: FusedOps | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v, residual = self.pre_attention(positions, x, residual, kv_cache, meta.slot_mapping, fused)
        return self.post_attention(self.self_attn.attend(q, k, v, kv_cache, meta), residual, fused)


@dataclass(frozen=True, slots=True)
class ImageRows:
    """A step's rows at image positions: their indices in the step, the embeddings that replace their token
    embeddings, and Qwen3-VL's deepstack features (one tensor per early layer, added to those rows' hidden state
    after that layer)."""

    indices: torch.Tensor
    embeddings: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        arch: Architecture,
        max_positions: int,
        tp: TensorParallel,
        quant_config: QuantizationConfig | None,
    ) -> None:
        super().__init__()
        from raypaged.model.gemma import GemmaDecoderLayer  # here: those modules' layers are this one's
        from raypaged.model.glm4 import Glm4DecoderLayer
        from raypaged.model.olmo2 import Olmo2DecoderLayer

        num_layers = config.num_hidden_layers
        rope_types = arch.rope_layer_types or (None,) * num_layers  # Gemma 3: a rotary per type of layer
        rotaries = {
            t: RotaryEmbedding(config, head_dim_of(config), max_positions, t, arch.interleaved_rotary)
            for t in set(rope_types)
        }
        self.rotaries = list(rotaries.values())  # not registered here: each is its layers' submodule
        # a pipeline stage holds the embeddings where it reads them: the first stage, and the last one when they
        # are its LM head too (tied)
        pp, tied = tp.pp, bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens: VocabParallelEmbedding | None = None
        if pp.first or (pp.last and tied):
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, tp, arch.embedding_multiplier, arch.gemma
            )
        layer: type[LlamaDecoderLayer] = LlamaDecoderLayer
        if arch.gemma or arch.olmo2 or arch.sandwich_norms:
            layer = GemmaDecoderLayer if arch.gemma else Olmo2DecoderLayer if arch.olmo2 else Glm4DecoderLayer
        # pipeline parallelism: this stage's layers only (``layers[j]`` is the checkpoint's layer first_layer + j)
        self.tp = tp
        stage = tp.pp.layers(num_layers)
        self.first_layer = stage.start
        self.layers = nn.ModuleList(
            layer(config, arch, rotaries[rope_types[i]], tp, f"model.layers.{i}", quant_config, i) for i in stage
        )
        final_norm: type[RMSNorm] = GemmaRMSNorm if arch.gemma else Olmo2RMSNorm if arch.olmo2 else RMSNorm
        self.norm = final_norm(config.hidden_size, config.rms_norm_eps)
        self.fused_ops: FusedOps | None = None  # the attention backend's (set_attention_backend); None: plain torch
        self.cpu_step: CpuStep | None = None  # a step's layers in one C call, where it applies
        self.kv_scales_pending = False  # the next step calculates the K/V scales (the layers' path, not the C one)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
        embeds: ImageRows | None = None,
        mrope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:  # -> [num_tokens, hidden]
        """``embeds``: the step's image rows. ``mrope_positions``: ``[3, num_tokens]``, M-RoPE's positions of a step
        with image tokens (Qwen2-VL), which then take the place of ``positions``."""
        if self.tp.pp.size > 1:
            return self._stage(input_ids, positions, kv_caches, meta, embeds, mrope_positions)
        x = self._embedded(input_ids, embeds)
        if mrope_positions is not None:  # the layers' path, each token indexing its own row of the step's table
            with self._rope_rows(mrope_positions) as steps:
                return self._layers(steps, x, kv_caches, meta, embeds)
        if embeds is not None and embeds.deepstack:
            return self._layers(positions, x, kv_caches, meta, embeds)
        step = self.cpu_step
        if self.kv_scales_pending:  # this step calculates the layers' K/V scales, one layer at a time
            step, self.kv_scales_pending = None, False
            if self.cpu_step is not None:
                self.cpu_step.cache_ptrs = []  # its layer table is filled again, with the scales, next time
        if step is not None and x.shape[0] > 0 and step.runs(meta, kv_caches[0][0].shape[2]):
            if not step.still_applies():  # its linears were wrapped since (LoRA): built again, or never more
                step = self.cpu_step = CpuStep.build(self)
            if step is not None and not step.adapters_active():
                return step.run(self, x, positions, kv_caches, meta)
        return self._layers(positions, x, kv_caches, meta)

    @contextlib.contextmanager
    def _rope_rows(self, mrope_positions: torch.Tensor) -> Iterator[torch.Tensor]:
        """M-RoPE: within, the rotary embeddings read the step's own rows (``mrope_positions``); yields the positions
        the layers take, each token's index in the step."""
        for rotary in self.rotaries:
            rotary.step_table = rotary.mrope_rows(mrope_positions)
        try:
            yield torch.arange(mrope_positions.shape[1], device=mrope_positions.device)
        finally:
            for rotary in self.rotaries:
                rotary.step_table = None

    def _embedded(self, input_ids: torch.Tensor, embeds: ImageRows | None) -> torch.Tensor:
        """The step's token embeddings, ``embeds``' rows (images, prompt embeddings) in their place."""
        x = self.embeddings(input_ids)
        if embeds is not None:
            x[embeds.indices] = embeds.embeddings.to(x.dtype)
        return x

    @property
    def embeddings(self) -> VocabParallelEmbedding:
        """The token embeddings (a pipeline stage that reads them holds them)."""
        assert self.embed_tokens is not None, "a pipeline stage without the embeddings read them"
        return self.embed_tokens

    def _stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
        embeds: ImageRows | None = None,
        mrope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A pipeline stage's part of the step: the embeddings (the first stage) or the stream the stage before sent,
        this stage's layers, then the stream to the next stage (an empty tensor returned), or the final norm (the
        last stage). ``embeds``: rows in place of token embeddings (images, prompt embeddings) and DeepStack
        features, on the first stage; ``mrope_positions`` as ``forward``'s, on every stage. The stream crosses as
        one tensor, the residual added in (the next stage's first layer starts from it, as a first layer starts
        from the embeddings)."""
        pp = self.tp.pp
        if pp.first:
            x = self._embedded(input_ids, embeds)
        else:
            weight = self.norm.weight  # the stream's width and dtype
            x = self.tp.receive_from_previous_stage(
                torch.empty(input_ids.shape[0], weight.shape[0], dtype=weight.dtype, device=input_ids.device)
            )
        rope = contextlib.nullcontext(positions) if mrope_positions is None else self._rope_rows(mrope_positions)
        with rope as layer_positions:
            x, residual = self._through_layers(layer_positions, x, kv_caches, meta, embeds)
        if not pp.last:
            stream = x if residual is None else x + residual
            self.tp.send_to_next_stage(stream)
            return stream[:0]
        return self.final_norm(x, residual)

    def _layers(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
        embeds: ImageRows | None = None,
    ) -> torch.Tensor:
        return self.final_norm(*self._through_layers(positions, x, kv_caches, meta, embeds))

    def _through_layers(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
        embeds: ImageRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stream (x, residual) after this model's layers (Qwen3-VL's deepstack features added after the first)."""
        residual = None
        deepstack = embeds.deepstack if embeds is not None else ()
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(positions, x, residual, kv_cache, meta, self.fused_ops)
            if index < len(deepstack):  # the layer's output is x + residual: added to x
                assert embeds is not None
                x[embeds.indices] += deepstack[index].to(x.dtype)
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's (x, residual) (see LlamaDecoderLayer) through the final norm."""
        fused = self.fused_ops
        if fused is None:
            return self.norm(x)
        if residual is None:  # no layers
            return fused.rms_norm(x, self.norm.weight, self.norm.eps)
        fused.fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return x


class LlamaForCausalLM(nn.Module):
    """``quant_config``: the scheme of the four projections of every layer (embeddings, norms and the
    LM head stay in the model's dtype)."""

    def __init__(
        self,
        config: PretrainedConfig,
        max_positions: int,
        tp: TensorParallel = TensorParallel(),
        quant_config: QuantizationConfig | None = None,
        head: bool = True,
        num_labels: int = 0,
    ) -> None:
        super().__init__()
        check_tensor_parallel(config, tp.size, tp.expert_parallel)
        self.has_head = head  # False: an embedding model's (--runner pooling): no logits, no lm_head weights
        # a classifier's head (*ForSequenceClassification's ``score``), whole on every rank
        self.score = nn.Linear(config.hidden_size, num_labels, bias=False) if num_labels else None
        self.config = config
        self.architecture = arch = architecture_of(config)
        self.model = LlamaModel(config, arch, max_positions, tp, quant_config)
        self.checkpoint_kv_scales = False  # whether load_weights found fp8 KV cache scales
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings or not head or not tp.pp.last:  # (only the last pipeline stage has logits)
            self.lm_head = None
        else:
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
        embeds: ImageRows | None = None,
        mrope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, embeds, mrope_positions)

    def attentions(self) -> list[LlamaAttention | MlaAttention]:
        """Each layer's attention."""
        return [cast(LlamaDecoderLayer, layer).self_attn for layer in self.model.layers]

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """The backend's paged attention in every layer, and its fused step ops (if it brings them) for
        the rest of the step. A model whose attention only some backends run (``architecture.attention_backends``)
        takes one of those only."""
        allowed = attention_backends(self.config)
        if allowed is not None and backend.name not in allowed:
            reason = torch_attention_reason(self.config)
            raise ValueError(
                f"attention_backend {backend.name!r} cannot run this model: {reason} (--attention-backend torch)"
            )
        for attn in self.attentions():
            attn.attn_backend = backend
        # OLMo 2's and GLM-4's norms after each sublayer leave no residual add to fold into the next norm: their layers
        # run plain
        arch = self.architecture
        # gpt-oss's clamped SwiGLU experts, Llama 4's post-rotary norms and temperature tuning: the plain path's
        plain = arch.olmo2 or arch.sandwich_norms or arch.mla or arch.attn_sinks or bool(arch.attention_chunks)
        plain = plain or arch.gemma  # Gemma's (1 + weight) norms and GeGLU: not the fused ops'
        self.model.fused_ops = None if plain else backend.fused_ops
        # a pipeline stage runs its layers in Python: the stream crosses to the next stage between them
        self.model.cpu_step = CpuStep.build(self.model) if self.model.tp.pp.size == 1 else None

    def calculate_kv_scales_next_step(self) -> None:
        """``--calculate-kv-scales``: the next step with tokens sets every layer's fp8 KV cache scales from its own
        keys and values (``LlamaAttention.calculate_scales``)."""
        for attn in self.attentions():
            attn.calculate_kv_scales = True
        self.model.kv_scales_pending = True

    def kv_scales(self) -> list[KVScales]:
        """Each layer's fp8 KV cache scales."""
        return [attn.kv_scales for attn in self.attentions()]

    def pack_weights(self, bf16: bool = False) -> None:
        """Every float linear's weight, the LM head's too, packed for ``layers.linear`` (after loading; fp32 on a
        CPU); the MLPs' gate | up weights gated, for their fused silu_and_mul; ``bf16``: the float linears' values
        in bf16, and the embedding rows too (``layers.bf16_linears_on_cpu``)."""
        gate_ups = {id(module.gate_up_proj) for module in self.modules() if isinstance(module, LlamaMLP)}
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(gated=id(module) in gate_ups, bf16=bf16)
            elif isinstance(module, RowParallelLinear):
                module.pack(bf16)
            elif isinstance(module, QuantLinear) and id(module) in gate_ups:
                module.method.pack_gated(module)
        if self.has_head and self.lm_head is not None:
            self.lm_head.pack_head(tied=False, bf16=bf16)
        elif self.has_head and self.model.embed_tokens is not None:  # tied (a stage before the last has no head)
            self.model.embed_tokens.pack_head(tied=True, bf16=bf16)
        if bf16 and self.model.embed_tokens is not None:
            self.model.embed_tokens.keep_rows_in_bf16()

    def stack_experts(self) -> list[bool]:
        """Each layer of experts' weights stacked for grouped GEMMs (``SparseMoeBlock.stack_experts``); whether each
        such layer's were."""
        from raypaged.model.moe import SparseMoeBlock

        return [module.stack_experts() for module in self.modules() if isinstance(module, SparseMoeBlock)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_seqs, hidden] -> [num_seqs, vocab]
        head = self.model.embeddings if self.lm_head is None else self.lm_head
        logits, arch = head.logits(hidden), self.architecture
        if arch.final_softcap is not None:  # Gemma 2's final_logit_softcapping
            logits = logits.div_(arch.final_softcap).tanh_().mul_(arch.final_softcap)
        return logits if arch.logits_scaling == 1.0 else logits.div_(arch.logits_scaling)  # Granite's logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """This rank's share of the checkpoint tensors (``checkpoint.load_weights``)."""
        from raypaged.model.checkpoint import load_weights  # here: that module reads this one's layers

        load_weights(self, weights)

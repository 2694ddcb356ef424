"""DeepSeek's multi-head latent attention (MLA, ``DeepseekV3Attention``), run over the paged cache as one shared
latent "KV head", with the key and value up-projections absorbed into the query and the output.

Per token the model keeps a latent ``c = kv_a_layernorm(x @ W_kv_a)[:kv_lora_rank]`` and one rotated key part
``k_pe`` shared by every head; head h's key is ``[c @ W_kb_h^T, k_pe]`` and its value ``c @ W_vb_h^T``
(``kv_b_proj`` = [W_kb_h; W_vb_h] per head). Since ``q_nope_h . (c W_kb_h^T) = (q_nope_h W_kb_h) . c``, the
attention is exactly multi-query attention over ``[c, k_pe]`` (``kv_lora_rank + qk_rope_head_dim`` features: the
cache's one head) with the query ``[q_nope_h W_kb_h, q_pe_h]``; the value read back is the latent, and head h's
output is ``(attention over c) @ W_vb_h^T``. So the cache holds 576 values a token per layer for DeepSeek-V3 (the
key, and the same row as its value), not 128 heads of 192 + 128, and every attention backend path of the torch ops
runs it unchanged (the softmax scale is transformers': ``qk_head_dim ** -0.5``, YaRN's ``mscale_all_dim`` folded in).

Tensor parallelism splits the heads (``q_b_proj``/``q_proj`` and ``kv_b_proj`` rows, ``o_proj`` columns); the
latent projections are whole on every rank, as is the cache's one head. The rotary over ``qk_rope_head_dim`` is
transformers' interleaved one where ``rope_interleave`` (the pairs rotate in place: the dot products equal
transformers', which reorders both q and k the same way), rotate-half otherwise.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from raypaged.attention.backend import TORCH, AttentionBackend, FusedOps, KVScales
from raypaged.attention.metadata import AttentionMetadata
from raypaged.model.layers import Linear, RMSNorm, RotaryEmbedding
from raypaged.model.parallel import TensorParallel
from raypaged.quantization.linear import build_linear

LayerKVCache = tuple[torch.Tensor, torch.Tensor]


def is_mla(config: PretrainedConfig) -> bool:
    """Whether the config's attention is DeepSeek's latent attention."""
    return getattr(config, "kv_lora_rank", None) is not None and hasattr(config, "qk_rope_head_dim")


def mla_cache_head_dim(config: PretrainedConfig) -> int:
    """The features of the cache's one head: the latent and the shared rotated key part."""
    return int(config.kv_lora_rank) + int(config.qk_rope_head_dim)


def mla_softmax_scale(config: PretrainedConfig) -> float:
    """transformers' ``yarn_apply_mscale(rope_parameters, qk_head_dim ** -0.5)``."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    return float(yarn_apply_mscale(config.rope_parameters, (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5))


class HeadRowsLinear(Linear):
    """A column-parallel projection whose checkpoint weight this rank takes its heads' rows of (the query's)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def load_shard(self, tensor: torch.Tensor) -> None:
        rows = self.weight.shape[0]
        self.weight.data.copy_(tensor[self.tp.rank * rows : (self.tp.rank + 1) * rows])


class KvUpProjection(nn.Module):
    """``kv_b_proj``'s weight (``[heads * (qk_nope + v), kv_lora_rank]``, this rank's heads' rows), read per head as
    the key part W_kb and the value part W_vb; kept a plain tensor (never packed), as the attention reads it per
    head."""

    def __init__(self, num_heads: int, nope: int, v: int, rank: int, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads, self.nope, self.v, self.tp = num_heads, nope, v, tp
        self.weight = nn.Parameter(torch.empty(num_heads * (nope + v), rank), requires_grad=False)

    def load_shard(self, tensor: torch.Tensor) -> None:
        rows = self.weight.shape[0]
        self.weight.data.copy_(tensor[self.tp.rank * rows : (self.tp.rank + 1) * rows])

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_kb ``[heads, qk_nope, rank]``, W_vb ``[heads, v, rank]``)."""
        per_head = self.weight.view(self.num_heads, self.nope + self.v, -1)
        return per_head[:, : self.nope], per_head[:, self.nope :]


class MlaAttention(nn.Module):
    """The interface of ``LlamaAttention`` (``pre_attention``, ``attend``, ``post_attention``, the backend and the
    K/V scales) over DeepSeek's latent attention; see the module's docstring."""

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, tp: TensorParallel, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = 1
        self.nope, self.rope, self.v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        self.head_dim = self.rank + self.rope  # the cache's, and the absorbed query's
        self.scale = mla_softmax_scale(config)
        hidden, qk = config.hidden_size, self.nope + self.rope
        whole = TensorParallel()
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = HeadRowsLinear(hidden, self.num_heads * qk, tp)
        else:
            self.q_a_proj = build_linear(hidden, self.q_lora_rank, bias, whole, False, None, (f"{prefix}.q_a_proj",))
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = HeadRowsLinear(self.q_lora_rank, self.num_heads * qk, tp)
        self.kv_a_proj_with_mqa = build_linear(
            hidden, self.rank + self.rope, bias, whole, False, None, (f"{prefix}.kv_a_proj_with_mqa",)
        )
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = KvUpProjection(self.num_heads, self.nope, self.v, self.rank, tp)
        self.o_proj = build_linear(
            config.num_attention_heads * self.v, hidden, bias, tp, True, None, (f"{prefix}.o_proj",)
        )
        self.rotary = rotary
        self.rotates = True
        self.q_norm = self.k_norm = None
        self.sliding_window = None
        self.softcap = None
        self.attn_backend: AttentionBackend = TORCH
        self.kv_scales = KVScales()
        self.calculate_kv_scales = False

    def pre_attention(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: LayerKVCache,
        slot_mapping: torch.Tensor,
        fused: FusedOps | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The absorbed query ``[T, heads, rank + rope]``, and the token's cache row ``[T, 1, rank + rope]`` as both
        key and value (written to its slot)."""
        if fused is not None:
            raise ValueError("latent attention has no fused path")
        num_tokens = x.shape[0]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, self.num_heads, self.nope + self.rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        q_pe, k_pe = q[..., self.nope :], k_pe.reshape(num_tokens, 1, self.rope)
        self.rotary.rotate_(positions, q_pe, k_pe)
        w_kb, _ = self.kv_b_proj.parts()
        query = torch.cat((torch.einsum("thn,hnr->thr", q[..., : self.nope], w_kb), q_pe), dim=-1)
        row = torch.cat((self.kv_a_layernorm(latent), k_pe[:, 0]), dim=-1)[:, None]  # [T, 1, rank + rope]
        key_cache, value_cache = kv_cache
        self.attn_backend.write_cache(row, row, key_cache, value_cache, slot_mapping, self.kv_scales)
        return query, row, row

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: LayerKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:  # -> [num_tokens, num_heads, rank + rope]
        key_cache, value_cache = kv_cache
        return self.attn_backend.attend(q, k, v, key_cache, value_cache, meta, self.scale, self.kv_scales, None, None)

    def post_attention(self, out: torch.Tensor) -> torch.Tensor:  # [T, heads, rank + rope] -> [T, hidden]
        """Each head's latent read back through its value projection, then ``o_proj``."""
        _, w_vb = self.kv_b_proj.parts()
        heads = torch.einsum("thr,hvr->thv", out[..., : self.rank], w_vb)
        return self.o_proj(heads.reshape(out.shape[0], self.num_heads * self.v))

"""OLMo 2's decoder layer: Llama's attention (q and k normed over their whole projections, ``Olmo2RMSNorm``) and MLP,
each followed by a norm before its residual add, with no norm before either, as transformers' ``Olmo2DecoderLayer``::

    x = x + post_attention_layernorm(attention(x))
    x = x + post_feedforward_layernorm(mlp(x))

Plain torch around any attention backend: with no norm before a sublayer there is no residual add to fold into one
(the fused ops' scheme), so ``LlamaForCausalLM.set_attention_backend`` gives these layers no fused ops.
"""

from __future__ import annotations

import torch

from raypaged.attention.backend import FusedOps
from raypaged.model.layers import Olmo2RMSNorm
from raypaged.model.llama import LayerKVCache, LlamaDecoderLayer


class Olmo2DecoderLayer(LlamaDecoderLayer):
    def add_norms(self, hidden_size: int, eps: float) -> None:
        """A norm after the attention and one after the MLP; none before either (the checkpoint has no
        input_layernorm)."""
        self.post_attention_layernorm = Olmo2RMSNorm(hidden_size, eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(hidden_size, eps)

    def pre_attention(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: LayerKVCache,
        slot_mapping: torch.Tensor,
        fused: FusedOps | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the stream ``x`` itself (no norm before the attention); the stream is the residual."""
        if fused is not None:
            raise ValueError("OLMo 2's decoder layer has no fused path")
        return *self.self_attn.pre_attention(positions, x, kv_cache, slot_mapping, None), x

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor, fused: FusedOps | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """o_proj and its norm, the residual add, then the MLP, its norm and its residual add; returns the next
        layer's (x, None)."""
        if fused is not None:
            raise ValueError("OLMo 2's decoder layer has no fused path")
        x = self.post_attention_layernorm(self.self_attn.post_attention(attn_out)).add_(residual)
        return x.add_(self.post_feedforward_layernorm(self.mlp(x))), None

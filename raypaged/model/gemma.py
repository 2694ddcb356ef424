"""Gemma 2 and Gemma 3's decoder layer: Llama's attention and gated MLP (GeGLU here) between four (1 + weight)
RMSNorms, as transformers' ``Gemma2DecoderLayer`` and ``Gemma3DecoderLayer``::

    x = x + post_attention_layernorm(attention(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

Plain torch only: the fused ops fold each residual add into the next norm, which Gemma's norm after each sublayer
does not allow (``LlamaForCausalLM.set_attention_backend`` takes the torch backend only for it, which has none).
"""

from __future__ import annotations

import torch

from raypaged.attention.backend import FusedOps
from raypaged.model.layers import GemmaRMSNorm
from raypaged.model.llama import LlamaDecoderLayer


class GemmaDecoderLayer(LlamaDecoderLayer):
    def add_norms(self, hidden_size: int, eps: float) -> None:
        """Four (1 + weight) norms: before and after the attention, before and after the MLP."""
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor, fused: FusedOps | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """o_proj and its norm, the residual add, then the MLP between its two norms and its residual add
        (``attn_out: [num_tokens, num_heads, head_dim]``); returns the next layer's (x, None)."""
        if fused is not None:
            raise ValueError("Gemma's decoder layer has no fused path (it runs with the torch attention backend)")
        x = self.post_attention_layernorm(self.self_attn.post_attention(attn_out)).add_(residual)
        out = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x.add_(out), None

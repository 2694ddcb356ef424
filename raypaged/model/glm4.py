"""GLM-4's decoder layer (``Glm4ForCausalLM``, GLM-4-0414): Llama's attention and MLP, with a norm after each of them
too, before its residual add, as transformers' ``Glm4DecoderLayer``::

    x = x + post_self_attn_layernorm(attention(input_layernorm(x)))
    x = x + post_mlp_layernorm(mlp(post_attention_layernorm(x)))

Plain torch around any attention backend: the norm after a sublayer leaves no residual add to fold into the next
norm (the fused ops' scheme), so ``LlamaForCausalLM.set_attention_backend`` gives these layers no fused ops.
"""

from __future__ import annotations

import torch

from raypaged.attention.backend import FusedOps
from raypaged.model.layers import RMSNorm
from raypaged.model.llama import LlamaDecoderLayer


class Glm4DecoderLayer(LlamaDecoderLayer):
    def add_norms(self, hidden_size: int, eps: float) -> None:
        """Llama's two norms (before the attention, before the MLP) and one after each."""
        super().add_norms(hidden_size, eps)
        self.post_self_attn_layernorm = RMSNorm(hidden_size, eps)
        self.post_mlp_layernorm = RMSNorm(hidden_size, eps)

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor, fused: FusedOps | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """o_proj and its norm, the residual add, then the MLP between its two norms and its residual add
        (``attn_out: [num_tokens, num_heads, head_dim]``); returns the next layer's (x, None)."""
        if fused is not None:
            raise ValueError("GLM-4's decoder layer has no fused path")
        x = self.post_self_attn_layernorm(self.self_attn.post_attention(attn_out)).add_(residual)
        return x.add_(self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))), None

"""GLM-4's decoder layer (``Glm4ForCausalLM``, GLM-4-0414): Llama's attention and MLP, with a norm after each of them
too, before its residual add, as transformers' ``Glm4DecoderLayer``::

    x = x + post_self_attn_layernorm(attention(input_layernorm(x)))
    x = x + post_mlp_layernorm(mlp(post_attention_layernorm(x)))

Plain torch around any attention backend: the norm after a sublayer leaves no residual add to fold into the next
norm (the fused ops' scheme), so ``LlamaForCausalLM.set_attention_backend`` gives these layers no fused ops.
``SandwichDecoderLayer`` is that step for Gemma's layer too, with its norms' names.
"""

from __future__ import annotations

import torch

from raypaged.attention.backend import FusedOps
from raypaged.model.layers import RMSNorm
from raypaged.model.llama import LlamaDecoderLayer


class SandwichDecoderLayer(LlamaDecoderLayer):
    """A layer with a norm after its attention and one after its MLP as well as before each (Gemma's, GLM-4's):
    ``sandwich`` names its norms after the attention, before the MLP and after the MLP, as its checkpoint does."""

    sandwich: tuple[str, str, str]

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor, fused: FusedOps | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """o_proj and its norm, the residual add, then the MLP between its two norms and its residual add
        (``attn_out: [num_tokens, num_heads, head_dim]``); returns the next layer's (x, None)."""
        if fused is not None:
            raise ValueError(f"{type(self).__name__} has no fused path (a norm after each sublayer)")
        after_attention, before_mlp, after_mlp = (getattr(self, name) for name in self.sandwich)
        x = after_attention(self.self_attn.post_attention(attn_out)).add_(residual)
        return x.add_(after_mlp(self.mlp(before_mlp(x)))), None


class Glm4DecoderLayer(SandwichDecoderLayer):
    sandwich = ("post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")

    def add_norms(self, hidden_size: int, eps: float) -> None:
        """Llama's two norms (before the attention, before the MLP) and one after each."""
        super().add_norms(hidden_size, eps)
        self.post_self_attn_layernorm = RMSNorm(hidden_size, eps)
        self.post_mlp_layernorm = RMSNorm(hidden_size, eps)

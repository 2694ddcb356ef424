"""Gemma 2 and Gemma 3's decoder layer: Llama's attention and gated MLP (GeGLU here) between four (1 + weight)
RMSNorms, as transformers' ``Gemma2DecoderLayer`` and ``Gemma3DecoderLayer``::

    x = x + post_attention_layernorm(attention(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

Plain torch only: the fused ops fold each residual add into the next norm, which Gemma's norm after each sublayer
does not allow (``LlamaForCausalLM.set_attention_backend`` takes the torch backend only for it, which has none).
"""

from __future__ import annotations

from raypaged.model.glm4 import SandwichDecoderLayer
from raypaged.model.layers import GemmaRMSNorm


class GemmaDecoderLayer(SandwichDecoderLayer):
    # after the attention, before and after the MLP
    sandwich = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

    def add_norms(self, hidden_size: int, eps: float) -> None:
        """Four (1 + weight) norms: before and after the attention, before and after the MLP."""
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)

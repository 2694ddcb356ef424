"""OLMo 2's decoder layer: Llama's attention (q and k normed over their whole projections, ``Olmo2RMSNorm``) and MLP,
each followed by a norm before its residual add, with no norm before either, as transformers' ``Olmo2DecoderLayer``::

    x = x + post_attention_layernorm(attention(x))
    x = x + post_feedforward_layernorm(mlp(x))

Plain torch around any attention backend: with no norm before a sublayer there is no residual add to fold into one
(the fused ops' scheme), so ``LlamaForCausalLM.set_attention_backend`` gives these layers no fused ops.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from raypaged.attention.backend import FusedOps
from raypaged.model.architecture import Architecture
from raypaged.model.layers import Olmo2RMSNorm, RotaryEmbedding
from raypaged.model.llama import LayerKVCache, LlamaDecoderLayer
from raypaged.model.parallel import TensorParallel
from raypaged.quantization.base import QuantizationConfig


class Olmo2DecoderLayer(LlamaDecoderLayer):
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
        super().__init__(config, arch, rotary, tp, prefix, quant_config, index)
        del self.input_layernorm  # none: the checkpoint has no input_layernorm
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

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

"""Static fp8 KV cache scales for the reference quantizer, as llm-compressor's ``kv_cache_scheme`` calibrates them.

Each layer's ``k_scale`` is the largest |key| (after rotary, as attention reads it) over the calibration tokens
divided by e4m3's largest value (448), ``v_scale`` the same of the values: the cache then spends fp8's whole range
on what the layer produced. The maxima come from a forward pass of transformers over the calibration text, read
inside its attention function.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from raypaged.quantization.smoothquant import CALIBRATION_TEXT
from raypaged.quantization.w8a8 import FP8_MAX

_RECORDER = "raypaged_kv_maxima"  # the attention implementation registered with transformers for the pass
_maxima: dict[int, tuple[float, float]] = {}  # layer index -> (max |key|, max |value|) of the running pass


def _record(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """transformers' SDPA attention, after noting the layer's largest |key| and |value| ([batch, kv_heads, T, D])"""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    k_max, v_max = _maxima.get(module.layer_idx, (0.0, 0.0))
    _maxima[module.layer_idx] = (max(k_max, float(key.abs().amax())), max(v_max, float(value.abs().amax())))
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


def kv_maxima(model_dir: Path, text: str = CALIBRATION_TEXT) -> list[tuple[float, float]]:
    """Per layer: (max |key|, max |value|) over the calibration tokens, the keys rotated."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    AttentionInterface.register(_RECORDER, _record)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=_RECORDER)
    tokens = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt")
    _maxima.clear()
    with torch.inference_mode():
        model.eval()(**tokens)
    found = dict(_maxima)
    _maxima.clear()
    return [found[index] for index in range(model.config.num_hidden_layers)]


def kv_scale_tensors(maxima: list[tuple[float, float]]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors: each layer's ``self_attn.k_scale`` and ``v_scale`` (float32, one value each)."""
    tensors: dict[str, torch.Tensor] = {}
    for index, (k_max, v_max) in enumerate(maxima):
        for name, largest in (("k_scale", k_max), ("v_scale", v_max)):
            scale = largest / FP8_MAX if largest > 0 else 1.0
            tensors[f"model.layers.{index}.self_attn.{name}"] = torch.tensor([scale], dtype=torch.float32)
    return tensors

"""SmoothQuant (Xiao et al., 2023) for the reference quantizer: move activation outliers into the weights.

For a linear input ``x`` shared by weights ``W`` (q/k/v, gate/up, and down), channel ``j`` is divided
by ``s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)`` and the weights' column ``j`` multiplied by it;
the division is folded into what produces ``x`` (the RMSNorm weight before q/k/v and gate/up, the
up_proj rows before down_proj), so the float model computes the same function. The maxima of ``x``
come from a forward pass of transformers over calibration text.
"""

from __future__ import annotations

from pathlib import Path

import torch

CALIBRATION_TEXT = (
    "The history of science is the study of the development of science and scientific knowledge. "
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
    "Once upon a time there was a little girl who lived in a village near the forest. "
    "Q: What is the capital of Japan? A: Tokyo. Photosynthesis converts light energy into chemical energy. "
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89. The weather today is sunny with a chance of rain in the evening."
)
# (the norm or projection producing the input, the projections reading it)
_GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)


def input_maxima(model_dir: Path, text: str = CALIBRATION_TEXT) -> dict[str, torch.Tensor]:
    """Per projection module name: max |x_j| over the calibration tokens of each input channel."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt")
    maxima: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            maxima[name] = inputs[0].detach().abs().flatten(0, -2).amax(0)

        return record

    handles = [
        m.register_forward_pre_hook(hook(n))
        for n, m in model.named_modules()
        if n.endswith(("_proj",)) and isinstance(m, torch.nn.Linear)
    ]
    with torch.inference_mode():
        model(**tokens)
    for handle in handles:
        handle.remove()
    return maxima


def smooth(
    tensors: dict[str, torch.Tensor], maxima: dict[str, torch.Tensor], num_layers: int, alpha: float
) -> dict[str, torch.Tensor]:
    """``tensors`` with every layer's three input groups smoothed (the float model's outputs unchanged)."""
    out = dict(tensors)
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        for producer, readers in _GROUPS:
            weights = [out[f"{prefix}{r}.weight"].to(torch.float32) for r in readers]
            w_max = torch.cat(weights).abs().amax(0).clamp(min=1e-5)
            x_max = maxima[f"{prefix}{readers[0]}"].clamp(min=1e-5)
            s = (x_max.pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)
            for reader, w in zip(readers, weights):
                out[f"{prefix}{reader}.weight"] = (w * s).to(tensors[f"{prefix}{reader}.weight"].dtype)
            name = f"{prefix}{producer}.weight"
            source = out[name].to(torch.float32)
            scaled = source / s if source.dim() == 1 else source / s[:, None]  # norm weight, or up_proj rows
            out[name] = scaled.to(tensors[name].dtype)
    return out

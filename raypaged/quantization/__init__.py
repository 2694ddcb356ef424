"""Quantized weights: one module per scheme, chosen by vLLM's ``--quantization`` name.

``resolve_quantization`` reads the checkpoint's ``quantization_config`` (its ``quant_method``
names the scheme) and checks it against the flag; a float checkpoint is quantized at load only
by the schemes that can (``fp8``).
"""

from __future__ import annotations

from typing import Any

from raypaged.quantization.awq import AWQConfig
from raypaged.quantization.base import QuantizationConfig
from raypaged.quantization.compressed_tensors import CompressedTensorsConfig
from raypaged.quantization.fp8 import Fp8Config
from raypaged.quantization.gptq import GPTQConfig

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    cls.name: cls for cls in (AWQConfig, CompressedTensorsConfig, Fp8Config, GPTQConfig)
}


def _supported() -> str:
    return ", ".join(sorted(QUANTIZATION_METHODS))


def resolve_quantization(flag: str | None, checkpoint_config: dict[str, Any] | None) -> QuantizationConfig | None:
    """The scheme the model runs: the checkpoint's ``quantization_config``, which ``flag``
    (``--quantization``) may repeat but not contradict; without one, ``flag`` quantizes online."""
    if flag == "gguf":  # vLLM's for a GGUF file, whose quantized weights its kernels run
        raise ValueError(
            "--quantization gguf is not supported: a GGUF file is served dequantized (drop --quantization; "
            f"--quantization fp8 quantizes it again online; supported: {_supported()})"
        )
    if flag is not None and flag not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization {flag} is not supported (supported: {_supported()})")
    if checkpoint_config is None:
        return None if flag is None else QUANTIZATION_METHODS[flag].online()
    method = checkpoint_config.get("quant_method")
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"the checkpoint's quantization_config quant_method {method!r} is not supported (supported: {_supported()})"
        )
    if flag is not None and flag != method:
        raise ValueError(
            f"--quantization {flag} contradicts the checkpoint's quantization_config (quant_method "
            f"{method!r}): drop --quantization or pass --quantization {method}"
        )
    return QUANTIZATION_METHODS[method].from_checkpoint(checkpoint_config)

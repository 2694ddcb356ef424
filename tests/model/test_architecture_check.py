"""A checkpoint whose architecture raypaged does not run, as the model or as the draft model, is
refused at startup with one message naming it and the supported ones."""

from __future__ import annotations

import json
import shutil

import pytest

from raypaged.config import EngineConfig
from tests.conftest import make_tiny_model

SUPPORTED = (
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, GraniteForCausalLM, "
    "Gemma2ForCausalLM, Gemma3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, "
    "SmolLM3ForCausalLM, Olmo2ForCausalLM, Ernie4_5ForCausalLM, GlmForCausalLM, Glm4ForCausalLM, Glm4MoeForCausalLM, "
    "DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, GptOssForCausalLM, Llama4ForCausalLM, their *Model and "
    "*ForSequenceClassification, "
    "and the encoders BertModel, BertForSequenceClassification, RobertaModel, RobertaForSequenceClassification, "
    "XLMRobertaModel, XLMRobertaForSequenceClassification, ModernBertModel, ModernBertForSequenceClassification"
)


@pytest.fixture(scope="module")
def tiny_and_gpt2(tmp_path_factory, smollm2_dir):
    """A tiny Llama folder, and a copy of it whose config claims another architecture."""
    root = tmp_path_factory.mktemp("arch")
    llama = make_tiny_model(root, smollm2_dir, "llama")
    other = root / "other"
    shutil.copytree(llama, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(config))
    return llama, other


def test_unsupported_model_architecture(tiny_and_gpt2):
    _, other = tiny_and_gpt2
    with pytest.raises(ValueError) as info:
        EngineConfig(model=str(other), device="cpu")
    assert str(info.value) == f"model architecture ['GPT2LMHeadModel'] is not supported (supported: {SUPPORTED})"


def test_unsupported_draft_model_architecture(tiny_and_gpt2):
    llama, other = tiny_and_gpt2
    spec = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ValueError) as info:
        EngineConfig(model=str(llama), device="cpu", speculative_config=spec, max_model_len=256)
    assert str(info.value) == (
        f"draft model architecture ['GPT2LMHeadModel'] is not supported (supported: {SUPPORTED})"
    )

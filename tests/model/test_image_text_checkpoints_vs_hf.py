"""Image-text checkpoints on text prompts (Gemma 3's, Mistral 3's, Llama 4's, Qwen2-VL's, Qwen2.5-VL's and
Qwen3-VL's): the language model's greedy tokens and logprobs equal transformers' whole image-text model's. Those served
for text only (Llama 4's; the others read images: tests/model/test_*_images_vs_hf.py, test_qwen2_vl_vs_hf.py) load
no vision tower, and an image in a request is refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    Gemma3Config,
    Llama4Config,
    Mistral3Config,
    Qwen2_5_VLConfig,
    Qwen2VLConfig,
    Qwen3VLConfig,
)

from raypaged import LLM
from raypaged.config import EngineConfig
from raypaged.model.synthetic import write_synthetic_model
from tests.conftest import TOKENIZER_FILES, hf_greedy
from tests.model.conftest import LOGPROB_PROMPTS, LOGPROB_TOKENS, Reference, assert_matches_transformers

TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    pad_token_id=0,
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
QWEN_TOKENS = dict(image_token_id=500, video_token_id=501, vision_start_token_id=498, vision_end_token_id=499)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
CONFIGS = {
    "gemma3": lambda: Gemma3Config(
        text_config=dict(TEXT, sliding_window=8, query_pre_attn_scalar=16),
        vision_config=dict(VISION, patch_size=14),
        mm_tokens_per_image=4,
        image_token_index=500,
        boi_token_index=498,
        eoi_token_index=499,
    ),
    "mistral3": lambda: Mistral3Config(
        text_config=dict(TEXT, model_type="mistral"),
        vision_config=dict(VISION, patch_size=14, head_dim=16),
        image_token_index=500,
    ),
    # multimodal rotary over three position axes, which are one position for text
    "qwen2_5_vl": lambda: Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_parameters=dict(MROPE)),
        vision_config=dict(QWEN_VISION, window_size=28, fullatt_block_indexes=[0]),
        **QWEN_TOKENS,
    ),
    "qwen2_vl": lambda: Qwen2VLConfig(
        text_config=dict(TEXT, rope_parameters=dict(MROPE)),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14),
        **QWEN_TOKENS,
    ),
    # experts on layer 1, chunked attention over chunks of 8 (see test_llama4_vs_hf.py)
    "llama4": lambda: Llama4Config(
        text_config=dict(
            TEXT,
            intermediate_size=32,
            intermediate_size_mlp=48,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
            floor_scale=4,
        ),
        vision_config=dict(
            VISION, patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64
        ),
        image_token_index=500,
    ),
    "qwen3_vl": lambda: Qwen3VLConfig(
        text_config=dict(TEXT, rope_parameters=dict(MROPE, mrope_interleaved=True)),
        vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[0], num_position_embeddings=16),
        **QWEN_TOKENS,
    ),
}
CAUSAL = {
    "gemma3": "Gemma3ForCausalLM",
    "mistral3": "MistralForCausalLM",
    "qwen2_5_vl": "Qwen2ForCausalLM",
    "qwen2_vl": "Qwen2ForCausalLM",
    "qwen3_vl": "Qwen3ForCausalLM",
    "llama4": "Llama4ForCausalLM",
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image_text")
    tokenizer = write_synthetic_model(root / "tokenizer", vocab_size=TEXT["vocab_size"])
    dirs = {}
    for name, make in CONFIGS.items():
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(make(), dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.2)
        dirs[name] = path = root / name
        model.save_pretrained(path)
        for file in TOKENIZER_FILES:
            if (tokenizer / file).exists():
                shutil.copy(tokenizer / file, path / file)
    return dirs


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, Reference]:
    """The whole image-text model's greedy tokens, and its log-softmax over each prompt and those tokens."""
    out = {}
    for name, path in model_dirs.items():
        hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = []
        for prompt in LOGPROB_PROMPTS:
            tokens = hf_greedy(hf, prompt, LOGPROB_TOKENS)
            with torch.inference_mode():
                logits = hf(input_ids=torch.tensor([prompt + tokens])).logits[0]
            out[name].append((tokens, logits.log_softmax(-1)))
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_text_prompts_match_the_image_text_model(name, model_dirs, references):
    config = EngineConfig(model=str(model_dirs[name]), device="cpu")
    wrapper = AutoConfig.from_pretrained(model_dirs[name]).architectures[0]
    assert config.hf_config.raypaged_multimodal == wrapper
    assert config.hf_config.architectures == [CAUSAL[name]]
    assert_matches_transformers(model_dirs[name], references[name], enable_prefix_caching=True)


def test_an_image_is_refused_and_the_vision_tower_is_not_loaded(model_dirs):
    llm = LLM(model=str(model_dirs["llama4"]), device="cpu", num_gpu_blocks_override=64, max_model_len=64)
    try:
        names = {name for name, _ in llm.llm_engine.executor.worker.model.named_parameters()}
        assert not any("vision" in n or "projector" in n for n in names)
        with pytest.raises(ValueError, match=r"reads text only \(no images\)$"):
            llm.generate({"prompt": "hi", "multi_modal_data": {"image": Image.new("RGB", (4, 4))}}, use_tqdm=False)
    finally:
        llm.shutdown()


def test_newer_tensor_names_load_the_same_weights(model_dirs):
    """Checkpoints saved by newer transformers name the language model ``model.language_model.*`` and the vision
    tower ``model.vision_tower.*``: the same weights load."""
    from safetensors.torch import load_file

    from raypaged.model.checkpoint import load_weights
    from raypaged.model.llama import LlamaForCausalLM

    config = EngineConfig(model=str(model_dirs["mistral3"]), device="cpu").hf_config
    tensors = load_file(model_dirs["mistral3"] / "model.safetensors")
    renamed = {
        name.replace("language_model.model.", "model.language_model.")
        .replace("language_model.lm_head.", "lm_head.")
        .replace("vision_tower.", "model.vision_tower.")
        .replace("multi_modal_projector.", "model.multi_modal_projector."): tensor
        for name, tensor in tensors.items()
    }
    assert any(n.startswith("model.language_model.") for n in renamed)
    assert any(n.startswith("model.vision_tower.") for n in renamed)
    old, new = LlamaForCausalLM(config, 64), LlamaForCausalLM(config, 64)
    load_weights(old, tensors.items())
    load_weights(new, renamed.items())
    for (name, a), (_, b) in zip(old.named_parameters(), new.named_parameters(), strict=True):
        assert torch.equal(a, b), name

"""Qwen2-VL's and Qwen2.5-VL's image encoder (``raypaged.model.qwen2_vl_vision``) against transformers'
``Qwen2VLForConditionalGeneration``/``Qwen2_5_VLForConditionalGeneration``: the merged embeddings equal
``get_image_features``' (its per-image tuple concatenated) for several images of different grids, videos' frames,
the real image processor's output, windows smaller than the images; loaded from a checkpoint saved by transformers
in either key layout; missing and misplaced tensors are refused by name."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from raypaged.model.qwen2_vl_vision import Qwen2VLImageEncoder, is_qwen2_vl_vision_tensor
from tests.model.vision_helpers import GRIDS, Saved, VisionEncoder, check_vision_tensor_names, save_random_model

PATCH_VALUES = 3 * 2 * 14 * 14  # channels * temporal_patch_size * patch_size**2
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
TOKENS = dict(image_token_id=999, video_token_id=998, vision_start_token_id=997, vision_end_token_id=996)
QWEN2 = VisionEncoder(Qwen2VLImageEncoder, PATCH_VALUES, deepstack=0)


def qwen2_config() -> Qwen2VLConfig:
    """Qwen2-VL: LayerNorms, quick_gelu MLP, merger out = vision hidden_size = the text hidden size."""
    vision = dict(depth=3, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14)
    return Qwen2VLConfig(vision_config=vision, text_config=TEXT, **TOKENS)


def qwen25_config() -> Qwen2_5_VLConfig:
    """Qwen2.5-VL: RMSNorms, SwiGLU MLP, windows of 56 pixels (2x2 merge units) except in block 1."""
    vision = dict(
        depth=4,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        window_size=56,
        fullatt_block_indexes=[1],
    )
    return Qwen2_5_VLConfig(vision_config=vision, text_config=TEXT, **TOKENS)


CONFIGS: dict[str, tuple[Callable[[], PretrainedConfig], type[PreTrainedModel]]] = {
    "qwen2_vl": (qwen2_config, Qwen2VLForConditionalGeneration),
    "qwen2_5_vl": (qwen25_config, Qwen2_5_VLForConditionalGeneration),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory) -> Saved:
    """A seeded random model (every parameter perturbed: no bias zero, no norm weight one), saved by transformers;
    the model and its checkpoint's tensors."""
    make_config, model_class = CONFIGS[request.param]
    return save_random_model(lambda: model_class(make_config()), tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("grids", GRIDS)
def test_matches_transformers(saved: Saved, grids: list[list[int]]) -> None:
    QWEN2.check_matches_transformers(saved, grids)


def test_image_processor_output_matches_transformers(saved: Saved) -> None:
    """The real processor (its patch order and normalization) on images of three shapes."""
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 20)
    sizes = [(84, 140), (112, 56), (90, 75)]
    QWEN2.check_image_processor_output(saved, processor, sizes, grids=[[1, 6, 10], [1, 8, 4], [1, 6, 6]])


def test_images_are_encoded_independently(saved: Saved) -> None:
    QWEN2.check_images_are_encoded_independently(saved)


def test_windows_matter_in_qwen25(saved: Saved) -> None:
    """The windowed blocks see less than the whole image: attending over the whole image instead changes the
    embeddings (so the comparisons above do check the windows)."""
    model, tensors = saved
    encoder = QWEN2.load(model.config, tensors)
    if model.config.model_type != "qwen2_5_vl":
        assert encoder.window_blocks == frozenset()
        return
    assert encoder.window_blocks == {0, 2, 3} and encoder.window_units == 2
    pixels, grid = QWEN2.pixels([[1, 8, 12]])
    with torch.no_grad():
        windowed = encoder(pixels, grid)
        encoder.window_blocks = frozenset()
        whole = encoder(pixels, grid)
    assert (windowed - whole).abs().max() > 1e-2


def _transformers4_layout(name: str) -> str:
    """transformers 4.52 to 4.x's names: ``model.visual.X``, ``model.language_model.X``, ``lm_head.X``."""
    if name.startswith("visual."):
        return "model." + name
    return re.sub(r"^model\.", "model.language_model.", name)


def test_checkpoint_layouts(saved: Saved) -> None:
    """transformers 5's ``save_pretrained`` writes the published layout (``visual.X``, ``model.X``, ``lm_head``); the
    ``model.visual.X`` layout and a stray saved ``inv_freq`` load the same."""
    _, tensors = saved
    assert any(name.startswith("visual.blocks.0.") for name in tensors)
    assert not any(name.startswith("model.visual.") for name in tensors)
    QWEN2.check_loads_the_same(saved, _transformers4_layout, {"model.visual.rotary_pos_emb.inv_freq": torch.ones(4)})


def test_missing_tensors_are_named(saved: Saved) -> None:
    QWEN2.assert_load_refused_without(
        saved,
        "visual.blocks.1.attn.qkv.bias",
        "checkpoint lacks 1 tensors of Qwen2VLImageEncoder: blocks.1.attn.qkv.bias",
    )
    expected = "merger.mlp.0.bias, merger.mlp.0.weight, merger.mlp.2.bias, merger.mlp.2.weight"
    QWEN2.assert_load_refused_without(
        saved, "visual.merger.mlp.", f"checkpoint lacks 4 tensors of Qwen2VLImageEncoder: {expected}"
    )


def test_misplaced_tensors_are_named(saved: Saved) -> None:
    model, tensors = saved
    depth = model.config.vision_config.depth
    # the other model's MLP names: fc1 in Qwen2.5-VL, gate_proj in Qwen2-VL
    other = "gate_proj" if model.config.model_type == "qwen2_vl" else "fc1"
    for name, key, tensor in [
        (f"model.visual.blocks.{depth}.attn.qkv.bias", f"blocks.{depth}.attn.qkv.bias", torch.zeros(96)),
        (f"visual.blocks.0.mlp.{other}.weight", f"blocks.0.mlp.{other}.weight", torch.zeros(64, 32)),
    ]:
        QWEN2.assert_load_refused(
            model.config,
            dict(tensors, **{name: tensor}),
            f"checkpoint tensor {name} has no place in Qwen2VLImageEncoder (as {key})",
        )
    QWEN2.assert_load_refused(
        model.config,
        dict(tensors, **{"visual.patch_embed.proj.weight": torch.zeros(32, 3, 1, 14, 14)}),
        "checkpoint tensor visual.patch_embed.proj.weight has shape [32, 3, 1, 14, 14], expected [32, 3, 2, 14, 14]",
    )


def test_is_qwen2_vl_vision_tensor(saved: Saved) -> None:
    check_vision_tensor_names(
        is_qwen2_vl_vision_tensor,
        saved[1],
        vision=(
            "visual.blocks.0.attn.qkv.weight",
            "model.visual.merger.mlp.0.bias",
            "visual.patch_embed.proj.weight",
            "model.visual.blocks.3.mlp.gate_proj.bias",
        ),
        other=(
            "model.layers.0.self_attn.q_proj.weight",
            "model.language_model.embed_tokens.weight",
            "lm_head.weight",
            "visual_extra.weight",
            "model.language_model.visual.weight",
        ),
        language_prefixes=("model.", "lm_head."),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_runs_in_the_parameters_dtype(saved: Saved, dtype: torch.dtype) -> None:
    QWEN2.check_runs_in_the_parameters_dtype(saved, dtype)


def test_bad_inputs_are_refused(saved: Saved) -> None:
    """A patch too few ([23, 1176] for 24), a grid not whole merge units, a grid not [num_images, 3]."""
    QWEN2.check_bad_inputs_are_refused(saved)


def test_configs_it_cannot_serve_are_refused() -> None:
    config: Any = qwen2_config()
    config.vision_config.hidden_size = 48
    with pytest.raises(
        ValueError, match="vision_config.hidden_size 48 differs from the language model's hidden_size 64"
    ):
        Qwen2VLImageEncoder(config)
    config = qwen25_config()
    config.vision_config.window_size = 14
    with pytest.raises(ValueError, match="window_size 14 is smaller than a merge unit"):
        Qwen2VLImageEncoder(config)

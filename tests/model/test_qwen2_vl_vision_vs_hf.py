"""Qwen2-VL's and Qwen2.5-VL's image encoder (``raypaged.model.qwen2_vl_vision``) against transformers'
``Qwen2VLForConditionalGeneration``/``Qwen2_5_VLForConditionalGeneration``: the merged embeddings equal
``get_image_features``' (its per-image tuple concatenated) for several images of different grids, videos' frames,
the real image processor's output, windows smaller than the images; loaded from a checkpoint saved by transformers
in either key layout; missing and misplaced tensors are refused by name."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from raypaged.model.loader import iter_checkpoint
from raypaged.model.qwen2_vl_vision import Qwen2VLImageEncoder, is_qwen2_vl_vision_tensor

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
Saved = tuple[PreTrainedModel, dict[str, torch.Tensor]]


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory) -> Saved:
    """A seeded random model (every parameter perturbed: no bias zero, no norm weight one), saved by transformers;
    the model and its checkpoint's tensors."""
    make_config, model_class = CONFIGS[request.param]
    torch.manual_seed(0)
    model = model_class(make_config()).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, dict(iter_checkpoint(path))


def encoder_for(config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> Qwen2VLImageEncoder:
    encoder = Qwen2VLImageEncoder(config).eval()
    encoder.load_weights(iter(tensors.items()))
    return encoder


def pixels_for(grids: list[list[int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grids)
    return torch.randn(int(grid.prod(-1).sum()), PATCH_VALUES, generator=torch.Generator().manual_seed(seed)), grid


def hf_features(model: PreTrainedModel, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """transformers' merged embeddings: a tuple of one ``[tokens, text_hidden]`` tensor per image, concatenated."""
    with torch.no_grad():
        out = model.model.get_image_features(pixels, grid)
    assert isinstance(out.pooler_output, tuple) and len(out.pooler_output) == len(grid)
    return torch.cat(out.pooler_output)


def assert_matches(encoder: Qwen2VLImageEncoder, model: PreTrainedModel, pixels: torch.Tensor, grid: torch.Tensor):
    with torch.no_grad():
        ours = encoder(pixels, grid)
    theirs = hf_features(model, pixels, grid)
    assert ours.shape == theirs.shape == (int(grid.prod(-1).sum()) // 4, 64)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "grids",
    [
        [[1, 4, 4], [1, 8, 12], [1, 12, 8]],  # windows: 1, 2x3 (last column cut), 3x2 (last row cut)
        [[1, 6, 10]],  # a single image: one attention segment
        [[2, 4, 6], [1, 6, 10]],  # a two-frame video first: each frame attends to itself only
        [[1, 2, 2], [1, 16, 2]],  # one merge unit; a column of windows
    ],
)
def test_matches_transformers(saved: Saved, grids: list[list[int]]) -> None:
    model, tensors = saved
    encoder = encoder_for(model.config, tensors)
    assert encoder.spatial_merge_size == 2
    assert_matches(encoder, model, *pixels_for(grids))


def test_image_processor_output_matches_transformers(saved: Saved) -> None:
    """The real processor (its patch order and normalization) on images of three shapes."""
    model, tensors = saved
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        for height, width in [(84, 140), (112, 56), (90, 75)]
    ]
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 20)
    inputs = processor(images=images, return_tensors="pt")
    grid = inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 6, 10], [1, 8, 4], [1, 6, 6]]
    assert inputs["pixel_values"].shape == (60 + 32 + 36, PATCH_VALUES)
    assert_matches(encoder_for(model.config, tensors), model, inputs["pixel_values"], grid)


def test_images_are_encoded_independently(saved: Saved) -> None:
    model, tensors = saved
    encoder = encoder_for(model.config, tensors)
    pixels, grid = pixels_for([[1, 4, 4], [1, 8, 12]])
    with torch.no_grad():
        both = encoder(pixels, grid)
        second = encoder(pixels[16:], grid[1:])
    torch.testing.assert_close(both[4:], second, atol=1e-5, rtol=0)


def test_windows_matter_in_qwen25(saved: Saved) -> None:
    """The windowed blocks see less than the whole image: attending over the whole image instead changes the
    embeddings (so the comparisons above do check the windows)."""
    model, tensors = saved
    encoder = encoder_for(model.config, tensors)
    if model.config.model_type != "qwen2_5_vl":
        assert encoder.window_blocks == frozenset()
        return
    assert encoder.window_blocks == {0, 2, 3} and encoder.window_units == 2
    pixels, grid = pixels_for([[1, 8, 12]])
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
    model, tensors = saved
    assert any(name.startswith("visual.blocks.0.") for name in tensors)
    assert not any(name.startswith("model.visual.") for name in tensors)
    renamed = {_transformers4_layout(name): tensor for name, tensor in tensors.items()}
    renamed["model.visual.rotary_pos_emb.inv_freq"] = torch.ones(4)
    pixels, grid = pixels_for([[1, 4, 4], [1, 8, 12]])
    with torch.no_grad():
        expected = encoder_for(model.config, tensors)(pixels, grid)
        got = encoder_for(model.config, renamed)(pixels, grid)
    assert torch.equal(got, expected)


def _message(text: str) -> str:
    return "^" + re.escape(text) + "$"


def test_missing_tensors_are_named(saved: Saved) -> None:
    model, tensors = saved
    partial = {n: t for n, t in tensors.items() if n != "visual.blocks.1.attn.qkv.bias"}
    with pytest.raises(
        ValueError, match=_message("checkpoint lacks 1 tensors of Qwen2VLImageEncoder: blocks.1.attn.qkv.bias")
    ):
        encoder_for(model.config, partial)
    no_merger = {n: t for n, t in tensors.items() if not n.startswith("visual.merger.mlp.")}
    expected = "merger.mlp.0.bias, merger.mlp.0.weight, merger.mlp.2.bias, merger.mlp.2.weight"
    with pytest.raises(ValueError, match=_message(f"checkpoint lacks 4 tensors of Qwen2VLImageEncoder: {expected}")):
        encoder_for(model.config, no_merger)


def test_misplaced_tensors_are_named(saved: Saved) -> None:
    model, tensors = saved
    depth = model.config.vision_config.depth
    extra = dict(tensors, **{f"model.visual.blocks.{depth}.attn.qkv.bias": torch.zeros(96)})
    with pytest.raises(
        ValueError,
        match=_message(
            f"checkpoint tensor model.visual.blocks.{depth}.attn.qkv.bias has no place in Qwen2VLImageEncoder "
            f"(as blocks.{depth}.attn.qkv.bias)"
        ),
    ):
        encoder_for(model.config, extra)
    # the other model's MLP names: fc1 in Qwen2.5-VL, gate_proj in Qwen2-VL
    other = "gate_proj" if model.config.model_type == "qwen2_vl" else "fc1"
    extra = dict(tensors, **{f"visual.blocks.0.mlp.{other}.weight": torch.zeros(64, 32)})
    with pytest.raises(
        ValueError,
        match=_message(
            f"checkpoint tensor visual.blocks.0.mlp.{other}.weight has no place in Qwen2VLImageEncoder "
            f"(as blocks.0.mlp.{other}.weight)"
        ),
    ):
        encoder_for(model.config, extra)
    wrong = dict(tensors, **{"visual.patch_embed.proj.weight": torch.zeros(32, 3, 1, 14, 14)})
    with pytest.raises(
        ValueError,
        match=_message(
            "checkpoint tensor visual.patch_embed.proj.weight has shape [32, 3, 1, 14, 14], expected [32, 3, 2, 14, 14]"
        ),
    ):
        encoder_for(model.config, wrong)


def test_is_qwen2_vl_vision_tensor(saved: Saved) -> None:
    _, tensors = saved
    for name in (
        "visual.blocks.0.attn.qkv.weight",
        "model.visual.merger.mlp.0.bias",
        "visual.patch_embed.proj.weight",
        "model.visual.blocks.3.mlp.gate_proj.bias",
    ):
        assert is_qwen2_vl_vision_tensor(name), name
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.language_model.embed_tokens.weight",
        "lm_head.weight",
        "visual_extra.weight",
        "model.language_model.visual.weight",
    ):
        assert not is_qwen2_vl_vision_tensor(name), name
    language = {n for n in tensors if n.startswith("model.") or n.startswith("lm_head.")}
    assert language and {n for n in tensors if not is_qwen2_vl_vision_tensor(n)} == language


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_runs_in_the_parameters_dtype(saved: Saved, dtype: torch.dtype) -> None:
    model, tensors = saved
    encoder = encoder_for(model.config, tensors)
    pixels, grid = pixels_for([[1, 4, 4], [1, 8, 12]])
    with torch.no_grad():
        fp32 = encoder(pixels, grid)
        half = encoder.to(dtype)(pixels, grid)  # fp32 pixels, cast to the parameters' dtype
    assert half.dtype == dtype
    torch.testing.assert_close(half.float(), fp32, atol=0.15, rtol=0.05)


def test_bad_inputs_are_refused(saved: Saved) -> None:
    model, tensors = saved
    encoder = encoder_for(model.config, tensors)
    pixels, grid = pixels_for([[1, 4, 6]])
    with pytest.raises(
        ValueError, match=_message("pixel_values of shape [23, 1176], expected [24, 1176] for [(1, 4, 6)]")
    ):
        encoder(pixels[1:], grid)
    with pytest.raises(ValueError, match=re.escape("image grid (t, h, w) = (1, 3, 8) is not a positive grid of 2x2")):
        encoder(pixels, torch.tensor([[1, 3, 8]]))
    with pytest.raises(ValueError, match=re.escape("grid_thw of shape [3], expected [num_images, 3]")):
        encoder(pixels, grid[0])


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

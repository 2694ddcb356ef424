"""Qwen3-VL's image encoder (``raypaged.model.qwen3_vl_vision``) against transformers'
``Qwen3VLForConditionalGeneration``: the merged embeddings and the DeepStack embeddings equal ``get_image_features``'
(``pooler_output`` and ``deepstack_features``, their per-image tuples concatenated) for several images of different
grids, a video's frames, the real image processor's output, learned positions interpolated from a 4x4 table; loaded
from a checkpoint saved by transformers in either key layout; missing and misplaced tensors are refused by name."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

from raypaged.model.qwen3_vl_vision import Qwen3VLImageEncoder, is_qwen3_vl_vision_tensor
from tests.model.vision_helpers import (
    GRIDS,
    Saved,
    VisionEncoder,
    check_vision_tensor_names,
    message,
    perturb,
    save_random_model,
)

PATCH_VALUES = 3 * 2 * 16 * 16  # channels * temporal_patch_size * patch_size**2
TEXT_HIDDEN = 64
TEXT = dict(
    hidden_size=TEXT_HIDDEN,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1000,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
)
VISION = dict(
    depth=3,
    hidden_size=32,
    num_heads=4,
    intermediate_size=64,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=16,  # a 4x4 table: interpolated for every grid but 4x4
    out_hidden_size=TEXT_HIDDEN,
    deepstack_visual_indexes=[0, 1],
)
TOKENS = dict(image_token_id=999, video_token_id=998, vision_start_token_id=997, vision_end_token_id=996)
QWEN3 = VisionEncoder(Qwen3VLImageEncoder, PATCH_VALUES, deepstack=2, text_hidden=TEXT_HIDDEN)


def make_config(**vision: Any) -> Qwen3VLConfig:
    return Qwen3VLConfig(vision_config=dict(VISION, **vision), text_config=TEXT, **TOKENS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    """A seeded random model (every parameter perturbed: no bias zero, no norm weight one), saved by transformers;
    the model and its checkpoint's tensors."""
    return save_random_model(
        lambda: Qwen3VLForConditionalGeneration(make_config()), tmp_path_factory.mktemp("qwen3_vl")
    )


@pytest.mark.parametrize("grids", GRIDS)
def test_matches_transformers(saved: Saved, grids: list[list[int]]) -> None:
    """The merged embeddings and both DeepStack embeddings."""
    QWEN3.check_matches_transformers(saved, grids)


def test_image_processor_output_matches_transformers(saved: Saved) -> None:
    """The real processor with Qwen3-VL's settings (patch 16, merge 2, mean and std 0.5) on images of three shapes."""
    processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        min_pixels=32 * 32,
        max_pixels=32 * 32 * 20,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    sizes = [(96, 160), (128, 64), (100, 90)]
    QWEN3.check_image_processor_output(saved, processor, sizes, grids=[[1, 6, 10], [1, 8, 4], [1, 6, 6]])


def test_learned_positions_are_the_table_stretched_bilinearly(saved: Saved) -> None:
    """Independently of transformers: the positions added to a frame are the 4x4 table resized to h x w by
    ``F.interpolate(bilinear, align_corners=True)``, in merge-unit order."""
    model, tensors = saved
    encoder = QWEN3.load(model.config, tensors)
    table = encoder.pos_embed.weight.detach().T.reshape(1, 32, 4, 4)
    for h, w in [(4, 4), (8, 12), (2, 2), (6, 10)]:
        resized = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        expected = resized.reshape(h // 2, 2, w // 2, 2, 32).transpose(1, 2).reshape(-1, 32)
        coords = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)
        coords = coords.reshape(h // 2, 2, w // 2, 2, 2).transpose(1, 2).reshape(-1, 2)
        sizes = torch.tensor([h, w]).expand(h * w, 2)
        with torch.no_grad():
            got = encoder._learned_positions(coords, sizes)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_images_are_encoded_independently(saved: Saved) -> None:
    QWEN3.check_images_are_encoded_independently(saved)


def _other_layout(name: str) -> str:
    """``model.visual.X`` <-> ``visual.X`` (the language model's names left as they are)."""
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    if name.startswith("visual."):
        return "model." + name
    return name


def test_checkpoint_layouts(saved: Saved) -> None:
    """transformers 5's ``save_pretrained`` writes ``model.visual.X`` (the published Qwen3-VL layout); ``visual.X`` and
    a stray saved ``inv_freq`` load the same."""
    _, tensors = saved
    assert "model.visual.deepstack_merger_list.1.norm.weight" in tensors
    assert "model.visual.pos_embed.weight" in tensors and "model.visual.patch_embed.proj.bias" in tensors
    assert not any(name.startswith("visual.") for name in tensors)
    QWEN3.check_loads_the_same(saved, _other_layout, {"visual.rotary_pos_emb.inv_freq": torch.ones(2)})


def test_missing_tensors_are_named(saved: Saved) -> None:
    QWEN3.assert_load_refused_without(
        saved, "model.visual.pos_embed.weight", "checkpoint lacks 1 tensors of Qwen3VLImageEncoder: pos_embed.weight"
    )
    expected = ", ".join(
        f"deepstack_merger_list.1.{name}"
        for name in ("linear_fc1.bias", "linear_fc1.weight", "linear_fc2.bias", "linear_fc2.weight")
    )
    expected += ", deepstack_merger_list.1.norm.bias, deepstack_merger_list.1.norm.weight"
    QWEN3.assert_load_refused_without(
        saved, "model.visual.deepstack_merger_list.1.", f"checkpoint lacks 6 tensors of Qwen3VLImageEncoder: {expected}"
    )


def test_misplaced_tensors_are_named(saved: Saved) -> None:
    model, tensors = saved
    for name, key in [
        ("model.visual.blocks.3.attn.qkv.bias", "blocks.3.attn.qkv.bias"),  # depth 3
        ("visual.blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc1.weight"),  # Qwen2-VL's MLP names
        ("model.visual.deepstack_merger_list.2.norm.weight", "deepstack_merger_list.2.norm.weight"),  # a third one
        ("model.visual.merger.ln_q.weight", "merger.ln_q.weight"),  # Qwen2-VL's merger names
    ]:
        QWEN3.assert_load_refused(
            model.config,
            dict(tensors, **{name: torch.zeros(8)}),
            f"checkpoint tensor {name} has no place in Qwen3VLImageEncoder (as {key})",
        )
    QWEN3.assert_load_refused(
        model.config,
        dict(tensors, **{"model.visual.patch_embed.proj.weight": torch.zeros(32, 3, 1, 16, 16)}),
        "checkpoint tensor model.visual.patch_embed.proj.weight has shape [32, 3, 1, 16, 16], "
        "expected [32, 3, 2, 16, 16]",
    )


def test_is_qwen3_vl_vision_tensor(saved: Saved) -> None:
    check_vision_tensor_names(
        is_qwen3_vl_vision_tensor,
        saved[1],
        vision=(
            "model.visual.blocks.0.attn.qkv.weight",
            "visual.merger.linear_fc1.bias",
            "model.visual.pos_embed.weight",
            "model.visual.deepstack_merger_list.0.norm.weight",
        ),
        other=(
            "model.language_model.layers.0.self_attn.q_proj.weight",
            "model.language_model.embed_tokens.weight",
            "lm_head.weight",
            "visual_extra.weight",
            "model.language_model.visual.weight",
        ),
        language_prefixes=("model.language_model.", "lm_head."),
    )


def test_moe_models_vision_tower() -> None:
    """Qwen3-VL-MoE's vision tower is the same module: its state dict loads and its outputs match."""
    config = Qwen3VLMoeConfig(vision_config=dict(VISION), text_config=TEXT, **TOKENS)
    torch.manual_seed(1)
    visual = Qwen3VLMoeVisionModel._from_config(config.vision_config).eval()
    perturb(visual)
    encoder = QWEN3.load(config, {f"model.visual.{n}": t for n, t in visual.state_dict().items()})
    pixels, grid = QWEN3.pixels([[1, 4, 4], [1, 6, 10]])
    with torch.no_grad():
        ours, ours_deep = encoder(pixels, grid)
        theirs = visual(pixels, grid_thw=grid)
    torch.testing.assert_close(ours, theirs.pooler_output, atol=1e-5, rtol=0)
    assert len(ours_deep) == len(theirs.deepstack_features) == 2
    for mine, reference in zip(ours_deep, theirs.deepstack_features):
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_runs_in_the_parameters_dtype(saved: Saved, dtype: torch.dtype) -> None:
    """The merged embeddings and both DeepStack embeddings."""
    QWEN3.check_runs_in_the_parameters_dtype(saved, dtype)


def test_bad_inputs_are_refused(saved: Saved) -> None:
    """A patch too few ([23, 1536] for 24), a grid not whole merge units, a grid not [num_images, 3]."""
    QWEN3.check_bad_inputs_are_refused(saved)


def test_configs_it_cannot_serve_are_refused() -> None:
    with pytest.raises(
        ValueError, match="vision_config.out_hidden_size 48 differs from the language model's hidden_size 64"
    ):
        Qwen3VLImageEncoder(make_config(out_hidden_size=48))
    with pytest.raises(ValueError, match=message("num_position_embeddings 20 is not a square grid's")):
        Qwen3VLImageEncoder(make_config(num_position_embeddings=20))
    for indexes in ([1, 0], [1, 1], [0, 3]):
        with pytest.raises(ValueError, match=re.escape(f"deepstack_visual_indexes {indexes} are not increasing")):
            Qwen3VLImageEncoder(make_config(deepstack_visual_indexes=indexes))
    config: Any = make_config()
    config.model_type = "qwen2_vl"
    with pytest.raises(ValueError, match="model_type 'qwen2_vl' is not Qwen3-VL's"):
        Qwen3VLImageEncoder(config)

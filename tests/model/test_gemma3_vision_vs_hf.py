"""Gemma 3's image encoder (``raypaged.model.gemma3_vision``) against transformers' ``Gemma3ForConditionalGeneration``:
the projected image embeddings equal ``get_image_features``' ``pooler_output`` for a batch of images and for the real
image processor's output (pan-and-scan crops included), in float32 and bfloat16; loaded from a checkpoint saved by
transformers and from the same tensors under the published (google/gemma-3-4b-it) and the in-memory names; missing,
misplaced and wrong-shape tensors are refused by name."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import (
    AutoImageProcessor,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    SiglipVisionConfig,
)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from raypaged.model.gemma3_vision import Gemma3ImageEncoder, is_gemma3_vision_tensor
from raypaged.model.loader import iter_checkpoint
from tests.model.vision_helpers import Saved, check_vision_tensor_names, message, refusers, save_random_model

IMAGE_SIZE = 56  # 14-pixel patches: a 4x4 grid, pooled over 2x2 blocks to 2x2 tokens
TOKENS = 4
TEXT_HIDDEN = 64


def make_config(**vision: Any) -> Gemma3Config:
    return Gemma3Config(
        vision_config=SiglipVisionConfig(
            **{
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "image_size": IMAGE_SIZE,
                "patch_size": 14,
                "vision_use_head": False,  # as google/gemma-3-*-it's
                **vision,
            }
        ),
        text_config=Gemma3TextConfig(
            hidden_size=TEXT_HIDDEN,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=300,
        ),
        mm_tokens_per_image=TOKENS,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    return save_random_model(lambda: Gemma3ForConditionalGeneration(make_config()), tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    return torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(1))


def load(config: Gemma3Config, tensors: dict[str, torch.Tensor]) -> Gemma3ImageEncoder:
    encoder = Gemma3ImageEncoder(config).eval()
    encoder.load_weights(iter(tensors.items()))
    return encoder


def encode(encoder: Gemma3ImageEncoder, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return encoder(pixels)


def hf_features(model: Gemma3ForConditionalGeneration, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.model.get_image_features(pixels).pooler_output


def test_saved_key_layout(saved) -> None:
    """transformers 5.25's ``save_pretrained`` writes the tower without ``vision_model.`` and nothing under
    ``model.``: ``vision_tower.X``, ``multi_modal_projector.X``, ``language_model.model.X``."""
    _, tensors = saved
    vision = {n for n in tensors if is_gemma3_vision_tensor(n)}
    assert "vision_tower.embeddings.patch_embedding.bias" in vision
    assert "vision_tower.post_layernorm.weight" in vision
    assert {n for n in vision if n.startswith("multi_modal_projector.")} == {
        "multi_modal_projector.mm_input_projection_weight",
        "multi_modal_projector.mm_soft_emb_norm.weight",
    }
    assert all(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in vision)
    assert all(n.startswith("language_model.model.") for n in set(tensors) - vision)


def test_matches_transformers(saved, pixels) -> None:
    model, tensors = saved
    encoder = load(model.config, tensors)
    assert encoder.tokens_per_image() == TOKENS
    ours, theirs = encode(encoder, pixels), hf_features(model, pixels)
    assert ours.shape == theirs.shape == (3, TOKENS, TEXT_HIDDEN)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_images_of_a_batch_are_encoded_independently(saved, pixels) -> None:
    model, tensors = saved
    encoder = load(model.config, tensors)
    torch.testing.assert_close(encode(encoder, pixels[1:2])[0], encode(encoder, pixels)[1], atol=1e-6, rtol=0)


def _processor(path: Path) -> Any:
    """The image processor ``AutoImageProcessor`` makes of google/gemma-3-4b-it's ``preprocessor_config.json``, the
    image size ours."""
    settings = {
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_pan_and_scan": None,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Gemma3ImageProcessor",
        "image_seq_length": TOKENS,
        "image_std": [0.5, 0.5, 0.5],
        "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None,
        "processor_class": "Gemma3Processor",
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    }
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    return AutoImageProcessor.from_pretrained(path)


@pytest.mark.parametrize(
    "pan_and_scan, crops",
    [
        ({}, [0, 0, 0, 0]),  # the default: each image resized whole to 56x56
        # pan-and-scan (min_crop_size scaled down to ours): crops as many as the long side is times the short one,
        # rounded half up, at least 2, at most max_num_crops; a square image (ratio under 1.2) gets none
        (
            {
                "do_pan_and_scan": True,
                "pan_and_scan_min_crop_size": 16,
                "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2,
            },
            [3, 3, 0, 4],
        ),
    ],
)
def test_image_processor_output_matches_transformers(saved, tmp_path, pan_and_scan, crops) -> None:
    model, tensors = saved
    processor = _processor(tmp_path)
    assert type(processor) is Gemma3ImageProcessorPil  # torchvision is not installed
    rng = np.random.default_rng(0)
    sizes = [(30, 90), (100, 40), (56, 56), (30, 200)]  # (height, width)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    inputs = processor(images=images, return_tensors="pt", **pan_and_scan)
    assert inputs["num_crops"].tolist() == crops
    # each image, then its crops, each resized to 56x56
    assert inputs["pixel_values"].shape == (len(images) + sum(crops), 3, IMAGE_SIZE, IMAGE_SIZE)
    ours = encode(load(model.config, tensors), inputs["pixel_values"])
    torch.testing.assert_close(ours, hf_features(model, inputs["pixel_values"]), atol=1e-5, rtol=0)


def test_runs_in_bfloat16(saved, pixels) -> None:
    model, tensors = saved
    encoder = load(model.config, tensors)
    fp32 = encode(encoder, pixels)
    bf16 = encode(encoder.to(torch.bfloat16), pixels)  # fp32 pixels, cast to the parameters' dtype
    assert bf16.dtype == torch.bfloat16 and bf16.shape == fp32.shape
    torch.testing.assert_close(bf16.float(), fp32, atol=0.1, rtol=0.05)
    theirs = hf_features(copy.deepcopy(model).to(torch.bfloat16), pixels.to(torch.bfloat16))
    assert theirs.dtype == torch.bfloat16
    torch.testing.assert_close(bf16, theirs, atol=0.05, rtol=0.02)


def _published(name: str) -> str:
    """google/gemma-3-4b-it's layout: ``vision_tower.vision_model.X``, ``multi_modal_projector.X``,
    ``language_model.model.X``."""
    return re.sub(r"^vision_tower\.", "vision_tower.vision_model.", name)


def _in_memory(name: str) -> str:
    """transformers 5's module names: ``model.vision_tower.X``, ``model.multi_modal_projector.X``,
    ``model.language_model.X``."""
    return "model." + re.sub(r"^language_model\.model\.", "language_model.", name)


def _in_memory_nested(name: str) -> str:
    """``model.vision_tower.vision_model.X`` (the in-memory names of transformers 4's ``SiglipVisionModel``)."""
    return _in_memory(_published(name))


def test_published_layout_is_what_transformers_reads(saved, tmp_path, pixels) -> None:
    """The renaming ``_published`` does gives names transformers loads (so the layout tested below is real)."""
    model, tensors = saved
    model.config.save_pretrained(tmp_path)
    save_file({_published(n): t.contiguous() for n, t in tensors.items()}, str(tmp_path / "model.safetensors"))
    reloaded = Gemma3ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert torch.equal(hf_features(reloaded, pixels), hf_features(model, pixels))
    published = dict(iter_checkpoint(tmp_path))
    assert "vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.bias" in published
    assert torch.equal(encode(load(model.config, published), pixels), encode(load(model.config, tensors), pixels))


@pytest.mark.parametrize("rename", [_published, _in_memory, _in_memory_nested])
def test_other_key_layouts_load_the_same(saved, pixels, rename: Callable[[str], str]) -> None:
    model, tensors = saved
    renamed = {rename(name): tensor for name, tensor in tensors.items()}
    assert renamed.keys() != tensors.keys()
    assert torch.equal(encode(load(model.config, renamed), pixels), encode(load(model.config, tensors), pixels))


def test_head_and_position_ids_are_skipped(saved, pixels) -> None:
    """SigLIP's attention-pooling head (in a checkpoint saved with ``vision_use_head``) and an old checkpoint's
    ``position_ids`` buffer are not read."""
    model, tensors = saved
    extra = {
        "vision_tower.vision_model.head.probe": torch.zeros(1, 1, 32),
        "model.vision_tower.head.attention.in_proj_weight": torch.zeros(96, 32),
        "vision_tower.vision_model.embeddings.position_ids": torch.arange(16)[None],
    }
    got = encode(load(model.config, tensors | extra), pixels)
    assert torch.equal(got, encode(load(model.config, tensors), pixels))


def test_missing_tensors_are_named(saved) -> None:
    refused_without, _ = refusers(load, saved)

    refused_without(
        "vision_tower.encoder.layers.1.mlp.fc2.bias",
        "checkpoint lacks 1 tensors of Gemma3ImageEncoder: vision_tower.encoder.layers.1.mlp.fc2.bias",
    )
    refused_without(
        "vision_tower.post_layernorm.",
        "checkpoint lacks 2 tensors of Gemma3ImageEncoder: vision_tower.post_layernorm.bias, "
        "vision_tower.post_layernorm.weight",
    )
    refused_without(
        "multi_modal_projector.mm_soft_emb_norm.",
        "checkpoint lacks 1 tensors of Gemma3ImageEncoder: multi_modal_projector.mm_soft_emb_norm.weight",
    )


def test_misplaced_and_wrong_shape_tensors_are_named(saved) -> None:
    _, refused_with = refusers(load, saved)

    refused_with(  # the tower has 2 layers
        "vision_tower.vision_model.encoder.layers.2.mlp.fc1.weight",
        torch.zeros(64, 32),
        "checkpoint tensor vision_tower.vision_model.encoder.layers.2.mlp.fc1.weight has no place in "
        "Gemma3ImageEncoder (as vision_tower.encoder.layers.2.mlp.fc1.weight)",
    )
    refused_with(  # CLIP's, not SigLIP's
        "model.vision_tower.embeddings.class_embedding",
        torch.zeros(32),
        "checkpoint tensor model.vision_tower.embeddings.class_embedding has no place in Gemma3ImageEncoder "
        "(as vision_tower.embeddings.class_embedding)",
    )
    refused_with(
        "multi_modal_projector.mm_input_projection_weight",
        torch.zeros(TEXT_HIDDEN, 32),
        "checkpoint tensor multi_modal_projector.mm_input_projection_weight has shape [64, 32], expected [32, 64]",
    )


def test_is_gemma3_vision_tensor(saved) -> None:
    _, tensors = saved
    check_vision_tensor_names(
        is_gemma3_vision_tensor,
        tensors,
        vision=[
            "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
            "vision_tower.vision_model.embeddings.patch_embedding.bias",
            "vision_tower.vision_model.head.probe",
            "model.vision_tower.post_layernorm.bias",
            "model.vision_tower.vision_model.embeddings.position_embedding.weight",
            "multi_modal_projector.mm_input_projection_weight",
            "model.multi_modal_projector.mm_soft_emb_norm.weight",
        ],
        other=[
            "language_model.model.embed_tokens.weight",
            "model.language_model.layers.0.self_attn.q_proj.weight",
            "language_model.lm_head.weight",
            "lm_head.weight",
            "vision_tower_extra.weight",
            "model.vision_towers.0.weight",
        ],
        language_prefixes=("language_model.",),
    )


def test_image_of_another_size_is_refused(saved) -> None:
    model, tensors = saved
    with pytest.raises(ValueError, match=message("image of 42x56 pixels, the vision tower takes 56x56")):
        load(model.config, tensors)(torch.zeros(1, 3, 42, IMAGE_SIZE))


@pytest.mark.parametrize("tokens", [8, 9])
def test_tokens_per_image_must_pool_the_grid(tokens) -> None:
    config = make_config()
    config.mm_tokens_per_image = tokens
    text = f"mm_tokens_per_image {tokens} is not the square of a divisor of the 4x4 patch grid"
    with pytest.raises(ValueError, match=message(text)):
        Gemma3ImageEncoder(config)


def test_unsupported_activation_is_named() -> None:
    with pytest.raises(ValueError, match=r"^Gemma 3 vision hidden_act 'relu' is not supported"):
        Gemma3ImageEncoder(make_config(hidden_act="relu"))


def test_published_sizes() -> None:
    """google/gemma-3-4b-it's vision config: 896-pixel images in 14-pixel patches (64x64), pooled 4x4 to 256."""
    config = make_config(
        hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=896
    )
    config.mm_tokens_per_image = 256
    config.text_config.hidden_size = 2560
    with torch.device("meta"):
        encoder = Gemma3ImageEncoder(config)
    assert encoder.tokens_per_image() == 256
    assert encoder.multi_modal_projector.block == 4
    assert encoder.vision_tower.embeddings.position_embedding.weight.shape == (4096, 1152)
    assert encoder.multi_modal_projector.mm_input_projection_weight.shape == (1152, 2560)
    out = encoder.to("meta")(torch.zeros(2, 3, 896, 896, device="meta"))
    assert out.shape == (2, 256, 2560)

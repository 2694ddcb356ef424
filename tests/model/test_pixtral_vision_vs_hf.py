"""Mistral 3's image encoder (``raypaged.model.pixtral_vision``: the Pixtral tower and the projector) against
transformers' ``Mistral3ForConditionalGeneration``: the merged embeddings equal ``get_image_features``' (its per-image
tuple concatenated) for padded batches of images of different sizes and for the real image processor's output; the
padding is never read; loaded from a checkpoint saved by transformers in either key layout; missing, misplaced and
wrongly shaped tensors are refused by name."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, Mistral3Config, Mistral3ForConditionalGeneration

from raypaged.model.pixtral_vision import Mistral3ImageEncoder, is_pixtral_vision_tensor
from tests.model.vision_helpers import Saved, check_vision_tensor_names, message, save_random_model

TEXT_HIDDEN = 64
TEXT = dict(
    hidden_size=TEXT_HIDDEN,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1000,
)
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=8,
    patch_size=14,
    image_size=112,
    hidden_act="silu",
)


def published_config() -> Mistral3Config:
    """As Mistral Small 3.1: SiLU tower, the last layer's features, projector without biases, GELU."""
    return Mistral3Config(vision_config=VISION, text_config=dict(TEXT, rms_norm_eps=1e-5), spatial_merge_size=2)


def variant_config() -> Mistral3Config:
    """What else a config may say: the features after the first layer (of two) as a list of one, projector biases,
    a GELU tower, another rotary theta and projector norm eps."""
    vision = dict(VISION, hidden_act="gelu", rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
    return Mistral3Config(
        vision_config=vision,
        text_config=dict(TEXT, rms_norm_eps=1e-3),
        spatial_merge_size=2,
        vision_feature_layer=[-2],
        multimodal_projector_bias=True,
    )


CONFIGS: dict[str, Callable[[], Mistral3Config]] = {"published": published_config, "variant": variant_config}


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory) -> Saved:
    """A seeded random model (every parameter perturbed), saved by transformers; the model and its tensors."""
    make_config = CONFIGS[request.param]
    return save_random_model(
        lambda: Mistral3ForConditionalGeneration(make_config()), tmp_path_factory.mktemp(request.param)
    )


def load(config: Any, tensors: dict[str, torch.Tensor]) -> Mistral3ImageEncoder:
    encoder = Mistral3ImageEncoder(config).eval()
    encoder.load_weights(iter(tensors.items()))
    return encoder


def padded_batch(sizes: list[tuple[int, int]], seed: int = 1, pad: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images of ``sizes`` (height, width in pixels) in one batch padded to the largest, as the processor pads
    (with ``pad`` instead of its zeros); the pixels and the sizes."""
    generator = torch.Generator().manual_seed(seed)
    height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
    pixels = torch.full((len(sizes), 3, height, width), pad)
    for i, (h, w) in enumerate(sizes):
        pixels[i, :, :h, :w] = torch.randn(3, h, w, generator=generator)
    return pixels, torch.tensor(sizes, dtype=torch.int64)


def expected_tokens(sizes: torch.Tensor, merge: int = 28) -> int:
    return sum((h // merge) * (w // merge) for h, w in sizes.tolist())


def hf_features(model: Any, pixels: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(pixels, sizes)
    assert isinstance(out.pooler_output, tuple) and len(out.pooler_output) == len(sizes)
    return torch.cat(out.pooler_output)


def assert_matches(encoder: Mistral3ImageEncoder, model: Any, pixels: torch.Tensor, sizes: torch.Tensor) -> None:
    with torch.no_grad():
        ours = encoder(pixels, sizes)
    theirs = hf_features(model, pixels, sizes)
    assert ours.shape == theirs.shape == (expected_tokens(sizes), TEXT_HIDDEN)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


BATCHES = [
    [(56, 84), (112, 56), (28, 28)],  # three shapes, one merge block the smallest
    [(112, 112)],  # a single image: one attention segment
    [(56, 56), (84, 56), (56, 56)],  # two images of one patch count batched into one attention call
    [(70, 42), (42, 98)],  # grids of odd patch counts: the last row/column of patches is not merged
]


@pytest.mark.parametrize("sizes", BATCHES)
def test_matches_transformers(saved: Saved, sizes: list[tuple[int, int]]) -> None:
    model, tensors = saved
    encoder = load(model.config, tensors)
    assert encoder.spatial_merge_size == 2 and encoder.patch_size == 14
    assert_matches(encoder, model, *padded_batch(sizes))


def test_padding_is_not_read(saved: Saved) -> None:
    """Whatever fills the padding, each image's embeddings are the same."""
    model, tensors = saved
    encoder = load(model.config, tensors)
    sizes = [(56, 84), (112, 56), (28, 28)]
    with torch.no_grad():
        zeros = encoder(*padded_batch(sizes))
        other = encoder(*padded_batch(sizes, pad=7.0))
    assert torch.equal(zeros, other)


def test_images_are_encoded_independently(saved: Saved) -> None:
    """A 56x56 image before a 112x84 one changes none of the 112x84 one's embeddings."""
    model, tensors = saved
    encoder = load(model.config, tensors)
    pixels, sizes = padded_batch([(56, 56), (112, 84)])
    with torch.no_grad():
        both = encoder(pixels, sizes)
        second = encoder(pixels[1:], sizes[1:])
    assert len(both) == 4 + 12
    torch.testing.assert_close(both[4:], second, atol=1e-5, rtol=0)


def test_feature_layer_is_selected(saved: Saved) -> None:
    """The published config runs both layers, the variant only the first (the hidden state after it); running the
    other number changes the embeddings (so the comparisons above do check the selection)."""
    model, tensors = saved
    encoder = load(model.config, tensors)
    assert encoder.num_layers == (2 if model.config.vision_feature_layer == -1 else 1)
    pixels, sizes = padded_batch([(56, 84)])
    with torch.no_grad():
        selected = encoder(pixels, sizes)
        encoder.num_layers = 3 - encoder.num_layers
        other = encoder(pixels, sizes)
    assert (selected - other).abs().max() > 1e-2


def image_processor(tmp_path: Path) -> Any:
    """The class ``AutoImageProcessor`` gives for Mistral 3's ``preprocessor_config.json`` (``PixtralImageProcessor``
    with this test's sizes): the PIL one where torchvision is missing."""
    config = {"image_processor_type": "PixtralImageProcessor", "patch_size": {"height": 14, "width": 14}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(dict(config, size={"longest_edge": 112})))
    processor = AutoImageProcessor.from_pretrained(tmp_path)
    assert type(processor).__name__ in ("PixtralImageProcessorPil", "PixtralImageProcessor")
    return processor


@pytest.mark.parametrize(
    "patch, sizes",
    [
        # as PixtralProcessor asks (patch_size * spatial_merge_size): whole merge blocks
        (28, [[84, 112], [112, 56], [56, 56], [112, 56]]),
        # the image processor's own patch_size: odd patch counts, whose last row/column is not merged
        (14, [[70, 112], [112, 56], [42, 42], [112, 42]]),
    ],
)
def test_image_processor_output_matches_transformers(
    saved: Saved, tmp_path: Path, patch: int, sizes: list[list[int]]
) -> None:
    """The real processor on PIL images of four shapes (the last one shrunk to fit 112 pixels): its padded batch, its
    normalization, its sizes."""
    model, tensors = saved
    rng = np.random.default_rng(0)
    shapes = [(60, 100), (112, 50), (30, 30), (224, 84)]
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in shapes]
    inputs = image_processor(tmp_path)(images=images, patch_size={"height": patch, "width": patch}, return_tensors="pt")
    assert inputs["image_sizes"].tolist() == sizes and inputs["image_sizes"].dtype == torch.int64
    assert inputs["pixel_values"].shape == (4, 3, 112, 112)
    assert_matches(load(model.config, tensors), model, inputs["pixel_values"], inputs["image_sizes"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_runs_in_the_parameters_dtype(saved: Saved, dtype: torch.dtype) -> None:
    model, tensors = saved
    encoder = load(model.config, tensors)
    pixels, sizes = padded_batch([(56, 84), (112, 56), (28, 28)])
    with torch.no_grad():
        full = encoder(pixels, sizes)
        low = encoder.to(dtype)(pixels, sizes)  # fp32 pixels, cast to the parameters' dtype
    assert low.dtype == dtype
    torch.testing.assert_close(low.float(), full, atol=0.15, rtol=0.05)


def _transformers4_layout(name: str) -> str:
    """transformers 4.52 to 4.x's names: ``model.vision_tower.X``, ``model.multi_modal_projector.X``,
    ``model.language_model.X``, ``lm_head.X``."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name


def test_checkpoint_layouts(saved: Saved) -> None:
    """transformers 5's ``save_pretrained`` writes the published layout (``vision_tower.X``,
    ``multi_modal_projector.X``, ``language_model.model.X``); the ``model.``-prefixed layout and a stray saved
    ``inv_freq`` load the same."""
    model, tensors = saved
    assert "vision_tower.transformer.layers.0.attention.q_proj.weight" in tensors
    assert "multi_modal_projector.patch_merger.merging_layer.weight" in tensors
    assert any(name.startswith("language_model.model.layers.0.") for name in tensors)
    assert not any(name.startswith("model.") for name in tensors)
    renamed = {_transformers4_layout(n): t for n, t in tensors.items()}
    renamed["model.vision_tower.patch_positional_embedding.inv_freq"] = torch.ones(4)
    pixels, sizes = padded_batch([(56, 84), (112, 56)])
    with torch.no_grad():
        expected = load(model.config, tensors)(pixels, sizes)
        got = load(model.config, renamed)(pixels, sizes)
    assert torch.equal(got, expected)


def assert_load_refused(config: Any, tensors: dict[str, torch.Tensor], text: str) -> None:
    with pytest.raises(ValueError, match=message(text)):
        load(config, tensors)


def test_missing_tensors_are_named(saved: Saved) -> None:
    model, tensors = saved
    lacks = "checkpoint lacks 1 tensors of Mistral3ImageEncoder: "
    for prefix, missing in [
        (
            "vision_tower.transformer.layers.1.attention.q_proj.weight",
            "vision_tower.transformer.layers.1.attention.q_proj.weight",
        ),
        ("multi_modal_projector.patch_merger.", "multi_modal_projector.patch_merger.merging_layer.weight"),
    ]:
        kept = {n: t for n, t in tensors.items() if not n.startswith(prefix)}
        assert_load_refused(model.config, kept, lacks + missing)


def test_misplaced_tensors_are_named(saved: Saved) -> None:
    model, tensors = saved
    layer = "vision_tower.transformer.layers.2.attention.q_proj.weight"  # a third layer of two
    misplaced = [("model." + layer, layer, torch.zeros(32, 32))]
    if not model.config.multimodal_projector_bias:
        bias = "multi_modal_projector.linear_1.bias"
        misplaced.append((bias, bias, torch.zeros(TEXT_HIDDEN)))
    for name, key, tensor in misplaced:
        assert_load_refused(
            model.config,
            dict(tensors, **{name: tensor}),
            f"checkpoint tensor {name} has no place in Mistral3ImageEncoder (as {key})",
        )
    assert_load_refused(
        model.config,
        dict(tensors, **{"vision_tower.patch_conv.weight": torch.zeros(32, 3, 16, 16)}),
        "checkpoint tensor vision_tower.patch_conv.weight has shape [32, 3, 16, 16], expected [32, 3, 14, 14]",
    )


def test_is_pixtral_vision_tensor(saved: Saved) -> None:
    check_vision_tensor_names(
        is_pixtral_vision_tensor,
        saved[1],
        vision=(
            "vision_tower.patch_conv.weight",
            "model.vision_tower.transformer.layers.0.feed_forward.gate_proj.weight",
            "multi_modal_projector.linear_1.weight",
            "model.multi_modal_projector.patch_merger.merging_layer.weight",
        ),
        other=(
            "language_model.model.layers.0.self_attn.q_proj.weight",
            "model.language_model.embed_tokens.weight",
            "language_model.lm_head.weight",
            "lm_head.weight",
            "vision_tower_extra.weight",
            "language_model.model.vision_tower.weight",
            # Mistral's own consolidated.safetensors names, not read
            "vision_encoder.transformer.layers.0.attention.wq.weight",
            "vision_language_adapter.w_in.weight",
            "patch_merger.merging_layer.weight",
        ),
        language_prefixes=("language_model.", "lm_head."),
    )


def test_bad_inputs_are_refused(saved: Saved) -> None:
    model, tensors = saved
    encoder = load(model.config, tensors)
    pixels, sizes = padded_batch([(56, 84), (28, 28)])
    for bad_pixels, bad_sizes, text in [
        (pixels[:, :2], sizes, "pixel_values of shape [2, 2, 56, 84], expected [num_images, 3, H, W]"),
        (pixels[0], sizes, "pixel_values of shape [3, 56, 84], expected [num_images, 3, H, W]"),
        (pixels, sizes[:1], "image_sizes of shape [1, 2], expected [2, 2]"),
        (pixels, sizes.flatten(), "image_sizes of shape [4], expected [2, 2]"),
    ]:
        with pytest.raises(ValueError, match=message(text)):
            encoder(bad_pixels, bad_sizes)
    for size, text in [
        ((56, 80), "image size (height, width) = (56, 80) is not whole 14-pixel patches, at least 28 pixels a side"),
        ((14, 84), "image size (height, width) = (14, 84) is not whole 14-pixel patches, at least 28 pixels a side"),
        ((70, 84), "image size (height, width) = (70, 84) exceeds pixel_values' 56x84"),
    ]:
        with pytest.raises(ValueError, match=message(text)):
            encoder(pixels, torch.tensor([list(size), [28, 28]]))


def test_configs_it_cannot_serve_are_refused() -> None:
    for change, text in [
        (
            dict(vision_feature_layer=[-1, -2]),
            "vision_feature_layer [-1, -2]: only one layer's features are supported",
        ),
        (dict(vision_feature_layer=3), "vision_feature_layer 3 is not one of the tower's 3 hidden states"),
        (dict(vision_feature_layer=-4), "vision_feature_layer -4 is not one of the tower's 3 hidden states"),
    ]:
        config: Any = published_config()
        for key, value in change.items():
            setattr(config, key, value)
        with pytest.raises(ValueError, match=message(text)):
            Mistral3ImageEncoder(config)
    config = published_config()
    config.vision_config.head_dim = 16
    with pytest.raises(ValueError, match="vision hidden_size 32 over 4 heads is not the head_dim 16"):
        Mistral3ImageEncoder(config)
    config = published_config()
    config.vision_config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=message("vision rope_type 'default' is not Pixtral's axial 2-D rotary")):
        Mistral3ImageEncoder(config)

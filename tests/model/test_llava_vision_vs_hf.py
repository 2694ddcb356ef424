"""LLaVA-1.5's image encoder (``raypaged.model.llava_vision``) against transformers' ``LlavaForConditionalGeneration``:
the projected image features equal ``get_image_features``' for each feature layer and select strategy, loaded from
a checkpoint saved by transformers in either key layout; missing and misplaced tensors are refused by name."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from raypaged.model.llava_vision import LlavaImageEncoder, is_vision_tensor
from raypaged.model.loader import iter_checkpoint

NUM_VISION_LAYERS = 3


def make_config(**options: Any) -> LlavaConfig:
    return LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=NUM_VISION_LAYERS,
            num_attention_heads=4,
            image_size=28,
            patch_size=14,
        ),
        text_config=LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
        ),
        image_token_index=999,
        **options,
    )


def save_model(config: LlavaConfig, path: Path) -> LlavaForConditionalGeneration:
    """A seeded random model saved to ``path``; every parameter perturbed, so that no bias is zero and no norm
    weight is one."""
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    return model


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint(path))


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[LlavaForConditionalGeneration, dict[str, torch.Tensor]]:
    """The default LLaVA-1.5 config (feature layer -2, "default" strategy) and its saved tensors."""
    path = tmp_path_factory.mktemp("llava")
    model = save_model(make_config(), path)
    return model, read_checkpoint(path)


@pytest.fixture(scope="module")
def layer_list(tmp_path_factory) -> tuple[LlavaForConditionalGeneration, dict[str, torch.Tensor]]:
    """Feature layers [-2, -1]: the projector takes two layers' features (64) side by side."""
    path = tmp_path_factory.mktemp("llava_layers")
    model = save_model(make_config(vision_feature_layer=[-2, -1]), path)
    return model, read_checkpoint(path)


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    return torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))


def encoder_for(config: LlavaConfig, tensors: dict[str, torch.Tensor], **options: Any) -> LlavaImageEncoder:
    """Our encoder for ``config`` with ``options`` (its feature layer, strategy) set, loaded from ``tensors``."""
    config = copy.deepcopy(config)
    for key, value in options.items():
        setattr(config, key, value)
    encoder = LlavaImageEncoder(config).eval()
    encoder.load_weights(iter(tensors.items()))
    return encoder


def hf_features(model: LlavaForConditionalGeneration, pixels: torch.Tensor, layer: Any, strategy: str) -> torch.Tensor:
    """transformers' projected features, one ``[tokens, text_hidden]`` tensor per image, stacked."""
    with torch.no_grad():
        out = model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=layer,
            vision_feature_select_strategy=strategy,
            # all hidden states: transformers reads feature layer 0 as "output none of them"
            output_hidden_states=True,
        )
    return torch.stack(list(out.pooler_output))


@pytest.mark.parametrize(
    "layer, strategy, tokens, layers_built",
    [(-2, "default", 4, 2), (-2, "full", 5, 2), (-1, "default", 4, 3), (0, "full", 5, 0), (1, "default", 4, 1)],
)
def test_single_layer_matches_transformers(single, pixels, layer, strategy, tokens, layers_built) -> None:
    model, tensors = single
    encoder = encoder_for(model.config, tensors, vision_feature_layer=layer, vision_feature_select_strategy=strategy)
    assert len(encoder.vision_tower.encoder.layers) == layers_built  # only the layers up to the one selected
    with torch.no_grad():
        ours = encoder(pixels)
    theirs = hf_features(model, pixels, layer, strategy)
    assert ours.shape == theirs.shape == (2, tokens, 64)
    assert encoder.tokens_per_image() == tokens == theirs.shape[1]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy, tokens", [("default", 4), ("full", 5)])
def test_layer_list_matches_transformers(layer_list, pixels, strategy, tokens) -> None:
    model, tensors = layer_list
    encoder = encoder_for(model.config, tensors, vision_feature_select_strategy=strategy)
    assert encoder.multi_modal_projector.linear_1.in_features == 64
    with torch.no_grad():
        ours = encoder(pixels)
    theirs = hf_features(model, pixels, [-2, -1], strategy)
    assert ours.shape == theirs.shape == (2, tokens, 64)
    assert encoder.tokens_per_image() == tokens
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_images_of_a_batch_are_encoded_independently(single, pixels) -> None:
    model, tensors = single
    encoder = encoder_for(model.config, tensors)
    with torch.no_grad():
        batch = encoder(pixels)
        alone = encoder(pixels[1:])
    torch.testing.assert_close(alone[0], batch[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(alone, hf_features(model, pixels[1:], -2, "default"), atol=1e-5, rtol=0)


def test_default_config_tokens_per_image(single) -> None:
    model, _ = single
    assert LlavaImageEncoder(model.config).tokens_per_image() == 4  # (28 // 14) ** 2, the class token dropped
    full = copy.deepcopy(model.config)
    full.vision_feature_select_strategy = "full"
    assert LlavaImageEncoder(full).tokens_per_image() == 5


def _with_model_prefix(name: str) -> str:
    """The layout of checkpoints saved by transformers 4.52 to 4.x: ``model.vision_tower.vision_model.…``,
    ``model.multi_modal_projector.…``, ``model.language_model.…``, ``lm_head``."""
    name = _with_vision_model(name)
    name = re.sub(r"^language_model\.lm_head\.", "lm_head.", name)
    name = re.sub(r"^language_model\.model\.", "model.language_model.", name)
    return re.sub(r"^(vision_tower|multi_modal_projector)\.", r"model.\1.", name)


def _with_vision_model(name: str) -> str:
    """The layout of the older hub checkpoints (llava-hf/llava-1.5-7b-hf): ``vision_tower.vision_model.…``."""
    return re.sub(r"^vision_tower\.(?!vision_model\.)", "vision_tower.vision_model.", name)


def _with_model_prefix_flat(name: str) -> str:
    """transformers 5's in-memory names: ``model.vision_tower.embeddings.…`` (no ``vision_model``)."""
    return _with_model_prefix(name).replace("vision_tower.vision_model.", "vision_tower.")


@pytest.mark.parametrize("rename", [_with_vision_model, _with_model_prefix, _with_model_prefix_flat])
def test_other_key_layouts_load_the_same(single, pixels, rename: Callable[[str], str]) -> None:
    model, tensors = single
    renamed = {rename(name): tensor for name, tensor in tensors.items()}
    assert renamed.keys() != tensors.keys()
    with torch.no_grad():
        expected = encoder_for(model.config, tensors)(pixels)
        got = encoder_for(model.config, renamed)(pixels)
    assert torch.equal(got, expected)


def test_missing_tensor_is_named(single) -> None:
    model, tensors = single
    name = next(n for n in tensors if n.endswith("encoder.layers.1.mlp.fc2.bias"))
    partial = {n: t for n, t in tensors.items() if n != name}
    with pytest.raises(ValueError, match=r"lacks 1 tensors .*vision_tower\.encoder\.layers\.1\.mlp\.fc2\.bias"):
        encoder_for(model.config, partial)
    projector = {n: t for n, t in tensors.items() if "multi_modal_projector.linear_2" not in n}
    with pytest.raises(ValueError, match=r"lacks 2 tensors .*linear_2\.bias, multi_modal_projector\.linear_2\.weight"):
        encoder_for(model.config, projector)


def test_unused_tensors_are_skipped_and_only_those(single) -> None:
    """Layer 2 and ``post_layernorm`` are not read for feature layer -2: a checkpoint without them loads; for
    feature layer -1 layer 2 is needed."""
    model, tensors = single
    pruned = {n: t for n, t in tensors.items() if "encoder.layers.2." not in n and "post_layernorm" not in n}
    encoder_for(model.config, pruned)
    with pytest.raises(ValueError, match=r"lacks 16 tensors .*vision_tower\.encoder\.layers\.2\.layer_norm1\.bias"):
        encoder_for(model.config, pruned, vision_feature_layer=-1)


def test_misplaced_tensor_is_named(single) -> None:
    model, tensors = single
    extra = dict(tensors)
    extra["vision_tower.encoder.layers.3.mlp.fc1.weight"] = torch.zeros(64, 32)  # the tower has 3 layers
    with pytest.raises(ValueError, match=r"vision_tower\.encoder\.layers\.3\.mlp\.fc1\.weight has no place"):
        encoder_for(model.config, extra)
    extra = dict(tensors)
    extra["multi_modal_projector.linear_3.weight"] = torch.zeros(64, 64)
    with pytest.raises(ValueError, match=r"multi_modal_projector\.linear_3\.weight has no place"):
        encoder_for(model.config, extra)
    name = next(n for n in tensors if n.endswith("multi_modal_projector.linear_1.weight"))
    wrong = dict(tensors, **{name: torch.zeros(64, 33)})
    with pytest.raises(ValueError, match=rf"{re.escape(name)} has shape \[64, 33\], expected \[64, 32\]"):
        encoder_for(model.config, wrong)


def test_is_vision_tensor(single) -> None:
    _, tensors = single
    for name in (
        "model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
        "vision_tower.vision_model.embeddings.class_embedding",
        "vision_tower.embeddings.patch_embedding.weight",
        "model.vision_tower.post_layernorm.bias",
        "model.multi_modal_projector.linear_1.weight",
        "multi_modal_projector.linear_2.bias",
    ):
        assert is_vision_tensor(name), name
    for name in (
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
        "lm_head.weight",
        "vision_tower_extra.weight",
        "model.vision_towers.0.weight",
    ):
        assert not is_vision_tensor(name), name
    assert {n for n in tensors if not is_vision_tensor(n)} == {n for n in tensors if n.startswith("language_model.")}


def test_runs_in_the_parameters_dtype(single, pixels) -> None:
    model, tensors = single
    encoder = encoder_for(model.config, tensors)
    with torch.no_grad():
        fp32 = encoder(pixels)
        bf16 = encoder.to(torch.bfloat16)(pixels)  # fp32 pixels, cast to bf16
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, atol=0.1, rtol=0.05)


def test_image_of_another_size_is_refused(single) -> None:
    model, tensors = single
    with pytest.raises(ValueError, match=r"image of 42x28 pixels, the vision tower takes 28x28"):
        encoder_for(model.config, tensors)(torch.zeros(1, 3, 42, 28))

"""LLaVA-NeXT's image encoder (``raypaged.model.llava_next_vision``) against transformers'
``LlavaNextForConditionalGeneration``: for images of several aspect ratios, as ``LlavaNextProcessor`` makes their
pixels, each image's features equal transformers' (``get_image_features``, packed) and the rows its own merge puts
into the prompt's placeholder tokens, one row per placeholder; ``num_patches`` counts the processor's patches;
checkpoints load in either key layout and a missing ``image_newline`` is refused by name."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    PreTrainedTokenizerFast,
)
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches, unpad_image

from raypaged.model.llava_next_vision import (
    LlavaNextImageEncoder,
    _unpad,
    is_next_vision_tensor,
    num_patches,
)
from raypaged.model.loader import iter_checkpoint

PINPOINTS = [[28, 56], [56, 28], [56, 56], [56, 112], [112, 56]]
# (height, width) -> the grid's feature map after unpadding (rows x columns, 2 x 2 features a 28-pixel tile)
IMAGES = {
    "wide": (30, 90),  # a 2 x 4 grid (56 x 112); 4 x 8 map, 2 rows left
    "tall": (150, 40),  # 4 x 2 grid; 8 x 4 map, 2 columns left
    "square": (50, 50),  # 2 x 2 grid; 4 x 4 map, nothing cut
    "odd_excess": (16, 120),  # 1 row of image in 4: one row cut each side, one row of padding kept
    "small_wide": (14, 30),  # a 1 x 2 grid (28 x 56): 3 patches, fewer than the others
    "thin": (13, 120),  # 0.87 of a row rounds down to none: the base image's features alone
    "tall_cut": (61, 37),  # 8 x 4 map, 6 rows left
}
WORDS = ["<unk>", "<s>", "</s>", "USER:", "ASSISTANT:", "and", "look"]
TEXT_HIDDEN = 48


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built here (nothing downloaded), ``<image>`` an added special token so that the
    processor's runs of placeholders split into one token each."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.add_tokens(["<image>"], special_tokens=True)
    return fast


def make_config(image_token_index: int, vocab_size: int) -> LlavaNextConfig:
    return LlavaNextConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=28,
            patch_size=14,
        ),
        text_config=LlamaConfig(
            hidden_size=TEXT_HIDDEN,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=vocab_size,
        ),
        image_token_index=image_token_index,
        image_grid_pinpoints=PINPOINTS,
    )


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint(path))


@pytest.fixture(scope="module")
def processor() -> LlavaNextProcessor:
    image_processor = LlavaNextImageProcessor(
        crop_size={"height": 28, "width": 28}, size={"shortest_edge": 28}, image_grid_pinpoints=PINPOINTS
    )
    return LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=make_tokenizer(),
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, processor) -> tuple[LlavaNextForConditionalGeneration, dict[str, torch.Tensor]]:
    """A seeded random model, every parameter perturbed (no zero bias, no unit norm weight), saved by transformers,
    and the tensors of its safetensors."""
    tokenizer = processor.tokenizer
    config = make_config(tokenizer.convert_tokens_to_ids("<image>"), len(tokenizer))
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    path = tmp_path_factory.mktemp("llava_next")
    model.save_pretrained(path)
    return model, read_checkpoint(path)


def load_encoder(config: LlavaNextConfig, tensors: dict[str, torch.Tensor]) -> LlavaNextImageEncoder:
    encoder = LlavaNextImageEncoder(config).eval()
    encoder.load_weights(iter(tensors.items()))
    return encoder


@pytest.fixture(scope="module")
def encoder(checkpoint) -> LlavaNextImageEncoder:
    model, tensors = checkpoint
    return load_encoder(model.config, tensors)


@pytest.fixture(scope="module")
def hf_run(checkpoint, processor) -> dict[str, Any]:
    """All of ``IMAGES`` in one prompt through the processor (pixel_values padded to the most patches), and
    transformers' features for them: ``get_image_features``' packed per-image rows, and the ``inputs_embeds`` its
    forward hands the language model after merging them into the placeholders."""
    model, _ = checkpoint
    images = [image(seed, size) for seed, size in enumerate(IMAGES.values())]
    prompt = "USER: " + " and ".join("look <image>" for _ in images) + " ASSISTANT:"
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    captured: dict[str, torch.Tensor] = {}

    def capture(_module, _args, kwargs):
        captured["inputs_embeds"] = kwargs["inputs_embeds"]

    handle = model.model.language_model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            packed = model.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"]).pooler_output
            model(**inputs)
    finally:
        handle.remove()
    return {"inputs": inputs, "packed": list(packed), "inputs_embeds": captured["inputs_embeds"][0]}


def placeholder_runs(input_ids: torch.Tensor, image_token_id: int) -> list[torch.Tensor]:
    """The positions of each image's placeholder tokens: the runs of consecutive image tokens, in order (words
    separate the images in ``hf_run``'s prompt)."""
    positions = (input_ids == image_token_id).nonzero().flatten().tolist()
    runs: list[list[int]] = []
    for position in positions:
        if runs and runs[-1][-1] == position - 1:
            runs[-1].append(position)
        else:
            runs.append([position])
    return [torch.tensor(run) for run in runs]


@pytest.mark.parametrize("index, name", list(enumerate(IMAGES)))
def test_image_features_match_transformers(checkpoint, encoder, hf_run, index, name) -> None:
    model, _ = checkpoint
    inputs = hf_run["inputs"]
    size = tuple(inputs["image_sizes"][index].tolist())
    assert size == IMAGES[name]
    patches = num_patches(model.config, size)
    assert not inputs["pixel_values"][index][patches:].any()  # the rest is the batch's zero padding
    with torch.no_grad():
        ours = encoder(inputs["pixel_values"][index][:patches], size)
    theirs = hf_run["packed"][index]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    # one row per placeholder the processor put in the prompt for this image, the rows the model merged there
    run = placeholder_runs(inputs["input_ids"][0], model.config.image_token_index)[index]
    assert len(run) == len(ours)
    torch.testing.assert_close(ours, hf_run["inputs_embeds"][run], atol=1e-5, rtol=0)


def test_feature_rows_per_image(checkpoint, hf_run) -> None:
    """The layout's row counts (``IMAGES``' maps): 4 base features, then (map rows) x (map columns + the newline),
    in transformers' features and in the processor's placeholders alike."""
    model, _ = checkpoint
    rows = [4 + 2 * 9, 4 + 8 * 3, 4 + 4 * 5, 4 + 2 * 9, 4 + 2 * 5, 4, 4 + 6 * 5]
    assert [len(features) for features in hf_run["packed"]] == rows
    runs = placeholder_runs(hf_run["inputs"]["input_ids"][0], model.config.image_token_index)
    assert [len(run) for run in runs] == rows


def test_image_newline_ends_each_row(checkpoint, encoder, hf_run) -> None:
    model, _ = checkpoint
    inputs = hf_run["inputs"]
    with torch.no_grad():
        ours = encoder(inputs["pixel_values"][0][:9], IMAGES["wide"])  # a 2 x 8 map after the 4 base features
    newline = model.model.image_newline.detach()
    assert torch.equal(ours[4 + 8], newline) and torch.equal(ours[4 + 17], newline)
    assert not any(torch.equal(row, newline) for i, row in enumerate(ours) if i not in (12, 21))


def test_num_patches_counts_the_processors_patches(checkpoint, encoder, processor) -> None:
    model, _ = checkpoint
    for seed, size in enumerate(IMAGES.values()):
        alone = processor.image_processor([image(seed, size)], return_tensors="pt")["pixel_values"]
        assert num_patches(model.config, size) == encoder.num_patches(size) == alone.shape[1]
    # and transformers' own count, for the real LLaVA-NeXT resolutions and tiles of 336 pixels
    real = copy.deepcopy(model.config)
    real.image_grid_pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    real.vision_config.image_size = 336
    for size in [(480, 640), (640, 480), (500, 500), (300, 1200), (1200, 300), (100, 2000), (1080, 1920)]:
        assert num_patches(real, size) == image_size_to_num_patches(size, real.image_grid_pinpoints, 336)


# sizes whose kept side, before rounding to 7 decimals, falls just short of a whole number for some map below
# (e.g. 55 x 88 on a 24 x 48 map: 55 * 48 / 88 = 29.999999999999996): truncating alone would cut one more
ROUNDING_SENSITIVE = [(98, 784), (196, 49), (49, 196), (103, 412), (88, 55), (110, 352), (47, 376), (55, 88)]


def test_unpad_matches_transformers() -> None:
    """``unpad_image``'s rounding (to 7 decimals, then truncated) and odd excess, on maps up to LLaVA-NeXT's."""
    sizes = [(h, w) for h in range(1, 200, 7) for w in range(1, 200, 5)] + ROUNDING_SENSITIVE
    rounding_mattered = 0
    for map_height, map_width in [(4, 8), (8, 4), (4, 4), (24, 48), (48, 24), (48, 48), (72, 24)]:
        features = torch.randn(2, map_height, map_width)
        for height, width in sizes:
            ours = _unpad(features, (height, width))
            assert torch.equal(ours, unpad_image(features, (height, width))), (map_height, map_width, height, width)
            if width / height > map_width / map_height:
                truncated = map_height - (map_height - int(height * (map_width / width))) // 2 * 2
                rounding_mattered += truncated != ours.shape[1]
            else:
                truncated = map_width - (map_width - int(width * (map_height / height))) // 2 * 2
                rounding_mattered += truncated != ours.shape[2]
    assert rounding_mattered >= 5


def test_wrong_patch_count_is_refused(encoder, hf_run) -> None:
    pixels = hf_run["inputs"]["pixel_values"][0]
    with pytest.raises(ValueError, match=r"expected \[9, 3, 28, 28\]"):
        encoder(pixels[:8], IMAGES["wide"])


def test_full_strategy_is_refused_as_transformers_cannot_pack_it(checkpoint, hf_run) -> None:
    model, _ = checkpoint
    full = copy.deepcopy(model.config)
    full.vision_feature_select_strategy = "full"
    with pytest.raises(ValueError, match="'full' is not supported"):
        LlavaNextImageEncoder(full)
    inputs = hf_run["inputs"]
    with pytest.raises(RuntimeError), torch.no_grad():  # the class token does not fit transformers' feature map
        model.model.get_image_features(
            inputs["pixel_values"], inputs["image_sizes"], vision_feature_select_strategy="full"
        )


def _model_prefixed(name: str) -> str:
    """The layout of checkpoints saved by transformers 4.52 to 4.x: ``model.image_newline``,
    ``model.vision_tower.vision_model.…``, ``model.multi_modal_projector.…``, ``model.language_model.…``,
    ``lm_head.…`` (transformers 5.25 saves top-level ``image_newline``, ``vision_tower.…``, ``language_model.…``)."""
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
    return "model." + name


def test_both_layouts_load_the_same(checkpoint, encoder, hf_run) -> None:
    model, tensors = checkpoint
    assert "image_newline" in tensors
    prefixed = {_model_prefixed(name): tensor for name, tensor in tensors.items()}
    assert "model.image_newline" in prefixed and "image_newline" not in prefixed
    pixels = hf_run["inputs"]["pixel_values"][1][:9]
    with torch.no_grad():
        got = load_encoder(model.config, prefixed)(pixels, IMAGES["tall"])
        assert torch.equal(got, encoder(pixels, IMAGES["tall"]))


def test_vision_tensor_names(checkpoint) -> None:
    _, tensors = checkpoint
    for names, newline in (
        (list(tensors), "image_newline"),
        ([_model_prefixed(n) for n in tensors], "model.image_newline"),
    ):
        vision = {name for name in names if is_next_vision_tensor(name)}
        assert newline in vision
        assert all(("language_model" in name or name.startswith("lm_head")) for name in set(names) - vision)
        assert any("vision_tower" in name for name in vision) and any(
            "multi_modal_projector" in name for name in vision
        )
    assert not is_next_vision_tensor("language_model.image_newline")
    assert not is_next_vision_tensor("model.language_model.embed_tokens.weight")


def test_missing_image_newline_is_named(checkpoint) -> None:
    model, tensors = checkpoint
    without = {name: tensor for name, tensor in tensors.items() if name != "image_newline"}
    with pytest.raises(ValueError, match="lacks image_newline"):
        load_encoder(model.config, without)
    # with a projector tensor missing too, both are named
    fewer = {name: tensor for name, tensor in without.items() if name != "multi_modal_projector.linear_2.bias"}
    with pytest.raises(ValueError, match=r"multi_modal_projector\.linear_2\.bias.*lacks image_newline"):
        load_encoder(model.config, fewer)
    wrong = {**tensors, "image_newline": torch.zeros(TEXT_HIDDEN + 1)}
    with pytest.raises(ValueError, match=r"tensor image_newline has shape \[49\], expected \[48\]"):
        load_encoder(model.config, wrong)

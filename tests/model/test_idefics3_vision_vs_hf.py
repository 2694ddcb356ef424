"""Idefics3's image encoder (``raypaged.model.idefics3_vision``) against transformers'
``Idefics3ForConditionalGeneration``: the embeddings of a batch of tiles equal ``get_image_features``' ``pooler_output``
with every tile whole, with partially padded tiles, and for the real image processor's output (images split into
tiles, padding tiles between the batch's samples), in float32 and bfloat16; the position ids equal transformers' for
every real extent of a tile; loaded from a checkpoint saved by transformers (the published SmolVLM layout) and from an
``Idefics3Model`` saved alone; missing, misplaced and wrong-shape tensors are refused by name. The processor's prompt
expansion is pinned down for the model runner."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoProcessor,
    AutoTokenizer,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3Processor,
    LlamaConfig,
)
from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

from raypaged.model.idefics3_vision import Idefics3ImageEncoder, _Embeddings, is_idefics3_vision_tensor
from raypaged.model.loader import iter_checkpoint
from tests.model.vision_helpers import Saved, check_vision_tensor_names, message, refusers, save_random_model

IMAGE_SIZE = 56  # 14-pixel patches: a 4x4 grid, pixel-shuffled by 2 into 2x2 tokens
TOKENS = 4
TEXT_HIDDEN = 64
IMAGE_TOKEN_ID = 299


def make_config(**vision: Any) -> Idefics3Config:
    return Idefics3Config(
        vision_config=Idefics3VisionConfig(
            **{
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "image_size": IMAGE_SIZE,
                "patch_size": 14,
                **vision,
            }
        ),
        text_config=LlamaConfig(
            hidden_size=TEXT_HIDDEN,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
        ),
        scale_factor=2,
        image_token_id=IMAGE_TOKEN_ID,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    return save_random_model(
        lambda: Idefics3ForConditionalGeneration(make_config()), tmp_path_factory.mktemp("idefics3")
    )


def _pixels(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


def _padded(pixels: torch.Tensor, extents: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles with only their top-left ``extents`` (height, width in pixels) real, as the processor pads: the
    rest of the pixels zero, and the ``[n, H, W]`` bool mask of the real ones."""
    mask = torch.zeros(len(pixels), IMAGE_SIZE, IMAGE_SIZE, dtype=torch.bool)
    for tile, (height, width) in enumerate(extents):
        mask[tile, :height, :width] = True
    return pixels * mask[:, None], mask


def load(config: Idefics3Config, tensors: dict[str, torch.Tensor]) -> Idefics3ImageEncoder:
    encoder = Idefics3ImageEncoder(config).eval()
    encoder.load_weights(iter(tensors.items()))
    return encoder


def encode(encoder: Idefics3ImageEncoder, pixels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return encoder(pixels, mask)


def hf_features(
    model: Idefics3ForConditionalGeneration, pixels: torch.Tensor, mask: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """transformers' ``pooler_output`` for ``[batch, max_tiles, 3, H, W]`` pixels (all-zero tiles are padding):
    a list of one ``[real_tiles * tokens, text_hidden]`` tensor per sample, here reshaped per tile."""
    with torch.no_grad():
        out = model.model.get_image_features(pixels, mask).pooler_output
    assert isinstance(out, list) and len(out) == len(pixels)
    return [features.view(-1, TOKENS, TEXT_HIDDEN) for features in out]


def test_saved_key_layout(saved) -> None:
    """transformers 5.25's ``save_pretrained`` writes the published HuggingFaceTB/SmolVLM-*-Instruct layout:
    ``model.vision_model.X``, ``model.connector.modality_projection.proj.weight``, ``model.text_model.X``,
    ``lm_head.weight``."""
    _, tensors = saved
    vision = {n for n in tensors if is_idefics3_vision_tensor(n)}
    assert "model.vision_model.embeddings.patch_embedding.bias" in vision
    assert "model.vision_model.embeddings.position_embedding.weight" in vision
    assert "model.vision_model.encoder.layers.1.self_attn.q_proj.bias" in vision
    assert "model.vision_model.post_layernorm.weight" in vision
    assert {n for n in vision if not n.startswith("model.vision_model.")} == {
        "model.connector.modality_projection.proj.weight"
    }
    others = set(tensors) - vision
    assert "lm_head.weight" in others
    assert all(n.startswith("model.text_model.") for n in others - {"lm_head.weight"})


def test_matches_transformers(saved) -> None:
    model, tensors = saved
    encoder = load(model.config, tensors)
    assert encoder.tokens_per_tile() == TOKENS == model.model.image_seq_len
    pixels = _pixels(4)
    ours = encode(encoder, pixels)
    (theirs,) = hf_features(model, pixels[None])
    assert ours.shape == theirs.shape == (4, TOKENS, TEXT_HIDDEN)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    whole = torch.ones(4, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.bool)
    torch.testing.assert_close(encode(encoder, pixels, whole), ours, atol=0, rtol=0)


@pytest.mark.parametrize(
    "extents",
    [
        # whole; the lower right padded (3x3 real patches: a patch with a real pixel is real); the bottom padded;
        # one real patch
        [(56, 56), (40, 30), (42, 56), (5, 9)],
        [(56, 56), (56, 56), (28, 56)],  # a single padded tile among whole ones
        [(56, 15)],  # alone: the whole batch padded, two columns real
    ],
)
def test_partially_padded_tiles_match_transformers(saved, extents) -> None:
    model, tensors = saved
    pixels, mask = _padded(_pixels(len(extents), seed=2), extents)
    ours = encode(load(model.config, tensors), pixels, mask)
    (theirs,) = hf_features(model, pixels[None], mask[None])
    assert ours.shape == theirs.shape == (len(extents), TOKENS, TEXT_HIDDEN)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_tiles_are_encoded_independently(saved) -> None:
    """A whole tile's embeddings are the same alone (no mask) and beside a padded tile (the masked attention)."""
    model, tensors = saved
    encoder = load(model.config, tensors)
    pixels, mask = _padded(_pixels(2, seed=3), [(56, 56), (20, 35)])
    both = encode(encoder, pixels, mask)
    torch.testing.assert_close(both[0], encode(encoder, pixels[:1])[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(both[1], encode(encoder, pixels[1:], mask[1:])[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("side", [4, 19, 26, 32])
def test_position_ids_match_transformers(side) -> None:
    """Every real extent (rows x cols of real patches from the top left) on a ``side``-wide grid: our position ids
    are the ones transformers' embeddings look up (read off an embedding table holding each id, the patches' own
    embeddings zero). 26 and 32: Idefics3-8B's and SmolVLM's grids; 19: a grid where float32 rounding puts a whole
    tile's 13th row and column in the 12th's bucket."""
    config = Idefics3VisionConfig(hidden_size=4, image_size=side, patch_size=1, num_attention_heads=1)
    theirs_module = Idefics3VisionEmbeddings(config)
    ours_module = _Embeddings(config)
    with torch.no_grad():
        for module in (theirs_module, ours_module):
            module.patch_embedding.weight.zero_()
            module.patch_embedding.bias.zero_()
            module.position_embedding.weight.copy_(
                torch.arange(side * side, dtype=torch.float32)[:, None].expand(-1, 4)
            )
    extents = [(rows, cols) for rows in range(1, side + 1) for cols in range(1, side + 1)]
    mask = torch.zeros(len(extents), side, side, dtype=torch.bool)
    for tile, (rows, cols) in enumerate(extents):
        mask[tile, :rows, :cols] = True
    pixels = torch.zeros(len(extents), 3, side, side)
    with torch.no_grad():
        expected = theirs_module(pixels, mask)[..., 0].long()
        ids = ours_module.position_ids(mask)
        assert torch.equal(ids, expected)
        assert torch.equal(ours_module(pixels, mask), theirs_module(pixels, mask))
    whole = ids[-1]
    assert torch.equal(whole, torch.arange(side * side)) == (side != 19)


def _image_processor(path: Path) -> Any:
    """The image processor ``AutoImageProcessor`` makes of HuggingFaceTB/SmolVLM-256M-Instruct's
    ``preprocessor_config.json`` (Lanczos, mean and std 0.5), the sizes ours: the longest edge resized to 112, then
    to multiples of 56 and cut into 56-pixel tiles, the whole image resized to 56x56 after them."""
    settings = {
        "do_convert_rgb": True,
        "do_image_splitting": True,
        "do_normalize": True,
        "do_pad": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Idefics3ImageProcessor",
        "image_std": [0.5, 0.5, 0.5],
        "max_image_size": {"longest_edge": IMAGE_SIZE},
        "processor_class": "Idefics3Processor",
        "resample": 1,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": 2 * IMAGE_SIZE},
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    return AutoImageProcessor.from_pretrained(path)


def _images(sizes: list[tuple[int, int]]) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def test_image_processor_output_matches_transformers(saved, tmp_path) -> None:
    model, tensors = saved
    processor = _image_processor(tmp_path)
    assert type(processor) is Idefics3ImageProcessorPil  # torchvision is not installed
    # (height, width): wide, 1x2 tiles; tall, 2x1; square (upscaled to 112x112), 2x2; tall, 2x1
    images = _images([(30, 90), (100, 40), (50, 50), (200, 60)])
    samples = [images[:2], images[2:]]  # two prompts' images
    inputs = processor(images=samples, return_tensors="pt", return_row_col_info=True)
    assert inputs["rows"] == [[1, 2], [2, 2]] and inputs["cols"] == [[2, 1], [2, 1]]
    tiles = [sum(r * c + 1 for r, c in zip(rows, cols)) for rows, cols in zip(inputs["rows"], inputs["cols"])]
    assert tiles == [6, 8]
    pixels, mask = inputs["pixel_values"], inputs["pixel_attention_mask"]
    assert pixels.shape == (2, 8, 3, IMAGE_SIZE, IMAGE_SIZE) and pixels.dtype == torch.float32
    assert mask.shape == (2, 8, IMAGE_SIZE, IMAGE_SIZE) and mask.dtype == torch.int64
    # the first sample's last two tiles pad it to 8: all zero, masked out; every real tile whole
    assert not pixels[0, 6:].any() and not mask[0, 6:].any()
    assert mask[0, :6].all() and mask[1].all()
    encoder = load(model.config, tensors)
    theirs = hf_features(model, pixels, mask)
    for sample, count in enumerate(tiles):
        ours = encode(encoder, pixels[sample, :count], mask[sample, :count])
        assert ours.shape == theirs[sample].shape == (count, TOKENS, TEXT_HIDDEN)
        torch.testing.assert_close(ours, theirs[sample], atol=1e-5, rtol=0)


def test_processor_prompt_expansion(tmp_path, smollm2_dir) -> None:
    """What the model runner must reproduce: ``AutoProcessor`` (an ``Idefics3Processor`` over the PIL image
    processor, no torchvision needed) replaces each ``<image>`` of the prompt by, for each row of tiles, each tile's
    ``<fake_token_around_image><row_i_col_j>`` and ``image_seq_len`` ``<image>``s, the row ended by a newline; then a
    newline and the whole image's ``<fake_token_around_image><global-img>``, ``<image>``s and a closing
    ``<fake_token_around_image>``. An image that is not split (rows = cols = 0) gets the global part alone, without
    the newlines. The tiles in ``pixel_values`` are in that order (the grid row by row, then the whole image)."""
    folder = tmp_path / "processor"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    grid_tokens = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    special = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *grid_tokens]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    Idefics3Processor(_image_processor(tmp_path / "image"), tokenizer, image_seq_len=TOKENS).save_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    assert type(processor) is Idefics3Processor and type(processor.image_processor) is Idefics3ImageProcessorPil
    wide, tall = _images([(30, 90), (100, 40)])
    inputs = processor(text=["A <image> B <image>."], images=[[wide, tall]], return_tensors="pt")
    fake, image = "<fake_token_around_image>", "<image>" * TOKENS
    glob = f"\n{fake}<global-img>{image}{fake}"
    expected = (
        f"A {fake}<row_1_col_1>{image}{fake}<row_1_col_2>{image}\n{glob}"
        f" B {fake}<row_1_col_1>{image}\n{fake}<row_2_col_1>{image}\n{glob}."
    )
    assert processor.tokenizer.decode(inputs["input_ids"][0]) == expected
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == 6 * TOKENS
    assert inputs["pixel_values"].shape == (1, 6, 3, IMAGE_SIZE, IMAGE_SIZE)
    # not split: max_image_size as large as the resized image
    whole = processor(text=["<image>"], images=[[wide]], max_image_size={"longest_edge": 112})
    assert processor.tokenizer.decode(whole["input_ids"][0]) == f"{fake}<global-img>{'<image>' * TOKENS}{fake}"


def test_runs_in_bfloat16(saved) -> None:
    model, tensors = saved
    encoder = load(model.config, tensors)
    pixels, mask = _padded(_pixels(3, seed=4), [(56, 56), (40, 30), (56, 56)])
    fp32 = encode(encoder, pixels, mask)
    bf16 = encode(encoder.to(torch.bfloat16), pixels, mask)  # fp32 pixels, cast to the parameters' dtype
    assert bf16.dtype == torch.bfloat16 and bf16.shape == fp32.shape
    torch.testing.assert_close(bf16.float(), fp32, atol=0.1, rtol=0.05)
    (theirs,) = hf_features(copy.deepcopy(model).to(torch.bfloat16), pixels[None].to(torch.bfloat16), mask[None])
    assert theirs.dtype == torch.bfloat16
    torch.testing.assert_close(bf16, theirs, atol=0.05, rtol=0.02)


def test_base_model_layout_loads_the_same(saved, tmp_path) -> None:
    """An ``Idefics3Model`` saved alone: ``vision_model.X``, ``connector.X``, ``text_model.X``."""
    model, tensors = saved
    model.model.save_pretrained(tmp_path)
    bare = dict(iter_checkpoint(tmp_path))
    assert "vision_model.post_layernorm.bias" in bare and "connector.modality_projection.proj.weight" in bare
    assert all(n.startswith(("vision_model.", "connector.", "text_model.")) for n in bare)
    pixels, mask = _padded(_pixels(2, seed=5), [(56, 56), (30, 50)])
    assert torch.equal(
        encode(load(model.config, bare), pixels, mask), encode(load(model.config, tensors), pixels, mask)
    )


def test_position_ids_buffer_is_skipped(saved) -> None:
    model, tensors = saved
    extra = {"model.vision_model.embeddings.position_ids": torch.arange(16)[None]}
    pixels = _pixels(2)
    assert torch.equal(encode(load(model.config, tensors | extra), pixels), encode(load(model.config, tensors), pixels))


def test_missing_tensors_are_named(saved) -> None:
    refused_without, _ = refusers(load, saved)

    refused_without(
        "model.vision_model.encoder.layers.1.mlp.fc2.bias",
        "checkpoint lacks 1 tensors of Idefics3ImageEncoder: vision_model.encoder.layers.1.mlp.fc2.bias",
    )
    refused_without(
        "model.vision_model.post_layernorm.",
        "checkpoint lacks 2 tensors of Idefics3ImageEncoder: vision_model.post_layernorm.bias, "
        "vision_model.post_layernorm.weight",
    )
    refused_without(
        "model.connector.",
        "checkpoint lacks 1 tensors of Idefics3ImageEncoder: connector.modality_projection.proj.weight",
    )


def test_misplaced_and_wrong_shape_tensors_are_named(saved) -> None:
    _, refused_with = refusers(load, saved)

    refused_with(  # the tower has 2 layers
        "model.vision_model.encoder.layers.2.mlp.fc1.weight",
        torch.zeros(64, 32),
        "checkpoint tensor model.vision_model.encoder.layers.2.mlp.fc1.weight has no place in Idefics3ImageEncoder "
        "(as vision_model.encoder.layers.2.mlp.fc1.weight)",
    )
    refused_with(  # the projection has no bias
        "model.connector.modality_projection.proj.bias",
        torch.zeros(TEXT_HIDDEN),
        "checkpoint tensor model.connector.modality_projection.proj.bias has no place in Idefics3ImageEncoder "
        "(as connector.modality_projection.proj.bias)",
    )
    refused_with(
        "model.connector.modality_projection.proj.weight",
        torch.zeros(128, TEXT_HIDDEN),
        "checkpoint tensor model.connector.modality_projection.proj.weight has shape [128, 64], expected [64, 128]",
    )


def test_is_idefics3_vision_tensor(saved) -> None:
    _, tensors = saved
    check_vision_tensor_names(
        is_idefics3_vision_tensor,
        tensors,
        vision=[
            "model.vision_model.encoder.layers.0.mlp.fc1.weight",
            "model.vision_model.embeddings.patch_embedding.bias",
            "model.connector.modality_projection.proj.weight",
            "vision_model.post_layernorm.bias",
            "connector.modality_projection.proj.weight",
        ],
        other=[
            "model.text_model.embed_tokens.weight",
            "model.text_model.layers.0.self_attn.q_proj.weight",
            "text_model.norm.weight",
            "lm_head.weight",
            "model.vision_model_extra.weight",
            "model.connectors.0.weight",
        ],
        language_prefixes=("model.text_model.", "lm_head."),
    )


def test_bad_inputs_are_refused(saved) -> None:
    model, tensors = saved
    encoder = load(model.config, tensors)
    pixels = _pixels(2)
    with pytest.raises(
        ValueError, match=message("pixel_values of shape [2, 3, 42, 56], expected [num_tiles, 3, 56, 56]")
    ):
        encoder(pixels[:, :, :42])
    with pytest.raises(ValueError, match=message("pixel_values of shape [3, 56, 56], expected [num_tiles, 3, 56, 56]")):
        encoder(pixels[0])
    mask = torch.ones(2, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.bool)
    with pytest.raises(ValueError, match=message("pixel_attention_mask of shape [1, 56, 56], expected [2, 56, 56]")):
        encoder(pixels, mask[:1])
    mask[1] = False
    with pytest.raises(ValueError, match=message("tiles [1] have no real pixel in pixel_attention_mask")):
        encoder(pixels, mask)


def test_scale_factor_must_divide_the_grid() -> None:
    config = make_config()
    config.scale_factor = 3
    with pytest.raises(ValueError, match=message("scale_factor 3 does not divide the 4x4 patch grid")):
        Idefics3ImageEncoder(config)


def test_unsupported_activation_is_named() -> None:
    with pytest.raises(ValueError, match=r"^Idefics3 vision hidden_act 'relu' is not supported"):
        Idefics3ImageEncoder(make_config(hidden_act="relu"))


@pytest.mark.parametrize(
    "vision, scale, text_hidden, tokens",
    [
        # HuggingFaceTB/SmolVLM-256M-Instruct: 512-pixel tiles in 16-pixel patches (32x32), shuffled by 4: 64 tokens
        (
            dict(
                hidden_size=768,
                intermediate_size=3072,
                num_hidden_layers=12,
                num_attention_heads=12,
                image_size=512,
                patch_size=16,
            ),
            4,
            576,
            64,
        ),  # fmt: skip
        # HuggingFaceM4/Idefics3-8B-Llama3: 364-pixel tiles in 14-pixel patches (26x26), shuffled by 2: 169 tokens
        (
            dict(
                hidden_size=1152,
                intermediate_size=4304,
                num_hidden_layers=27,
                num_attention_heads=16,
                image_size=364,
                patch_size=14,
            ),
            2,
            4096,
            169,
        ),  # fmt: skip
    ],
)
def test_published_sizes(vision, scale, text_hidden, tokens) -> None:
    config = make_config(**vision)
    config.scale_factor = scale
    config.text_config.hidden_size = text_hidden
    with torch.device("meta"):
        encoder = Idefics3ImageEncoder(config)
    assert encoder.tokens_per_tile() == tokens
    in_features = vision["hidden_size"] * scale * scale
    assert encoder.connector.modality_projection.proj.weight.shape == (text_hidden, in_features)
    size = vision["image_size"]
    out = encoder(torch.zeros(2, 3, size, size, device="meta"))
    assert out.shape == (2, tokens, text_hidden)

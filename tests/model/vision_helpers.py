"""What the image encoders' tests against transformers share (``test_qwen2_vl_vision_vs_hf``,
``test_qwen3_vl_vision_vs_hf``): a seeded random model saved by transformers, random patches, our encoder's outputs
and transformers' ``get_image_features`` as one list each (the merged embeddings, then the DeepStack embeddings if the
encoder has any), and the checks that are the same test whichever encoder runs them."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import PretrainedConfig, PreTrainedModel

from raypaged.model.loader import iter_checkpoint

Saved = tuple[PreTrainedModel, dict[str, torch.Tensor]]

# the grids the encoders are compared with transformers on; what each tests of Qwen2.5-VL's windows (2x2 merge units)
# and of Qwen3-VL's learned positions (a 4x4 table)
GRIDS = [
    # windows: 1, 2x3 (last column cut), 3x2 (last row cut); positions: the table's own size, stretched wide and tall
    [[1, 4, 4], [1, 8, 12], [1, 12, 8]],
    [[1, 6, 10]],  # a single image: one attention segment
    [[2, 4, 6], [1, 6, 10]],  # a two-frame video first: each frame attends to itself only
    # one merge unit (positions: the table's corners only); a column of windows, of merge units
    [[1, 2, 2], [1, 16, 2]],
]


def message(text: str) -> str:
    """A ``pytest.raises(match=...)`` pattern for exactly ``text``."""
    return "^" + re.escape(text) + "$"


def load_refused(
    load: Callable[..., Any], config: PretrainedConfig, tensors: dict[str, torch.Tensor], text: str
) -> None:
    """``load(config, tensors)`` raises a ValueError saying exactly ``text``."""
    with pytest.raises(ValueError, match=message(text)):
        load(config, tensors)


def refusers(load: Callable[..., Any], saved: Saved) -> tuple[Callable[..., None], Callable[..., None]]:
    """Two checks on the saved checkpoint's tensors: ``without(prefix, text)`` (those whose names start with
    ``prefix`` dropped) and ``with_(name, tensor, text)`` (one more tensor, or one replaced), each refused by
    ``load`` saying exactly ``text``."""
    model, tensors = saved

    def without(prefix: str, text: str) -> None:
        load_refused(load, model.config, {n: t for n, t in tensors.items() if not n.startswith(prefix)}, text)

    def with_(name: str, tensor: torch.Tensor, text: str) -> None:
        load_refused(load, model.config, tensors | {name: tensor}, text)

    return without, with_


def perturb(module: torch.nn.Module) -> None:
    """Every parameter moved off its initial value: no bias zero, no norm weight one."""
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.1 * torch.randn_like(param))


def save_random_model(build: Callable[[], PreTrainedModel], path: Path) -> Saved:
    """The model ``build`` makes after seeding 0, perturbed and saved by transformers to ``path``; the model and its
    checkpoint's tensors."""
    torch.manual_seed(0)
    model = build().eval()
    perturb(model)
    model.save_pretrained(path)
    return model, dict(iter_checkpoint(path))


def check_vision_tensor_names(
    is_vision_tensor: Callable[[str], bool],
    tensors: dict[str, torch.Tensor],
    vision: Iterable[str],
    other: Iterable[str],
    language_prefixes: tuple[str, ...],
) -> None:
    """``is_vision_tensor`` takes each of ``vision`` and none of ``other``; of the saved checkpoint's tensors it leaves
    exactly the language model's (the names starting with one of ``language_prefixes``), and there are some."""
    for name in vision:
        assert is_vision_tensor(name), name
    for name in other:
        assert not is_vision_tensor(name), name
    language = {n for n in tensors if n.startswith(language_prefixes)}
    assert language and {n for n in tensors if not is_vision_tensor(n)} == language


@dataclass(frozen=True)
class VisionEncoder:
    """One image encoder under test: its class, the values in one patch (channels * temporal_patch_size *
    patch_size**2), and how many DeepStack embeddings it returns besides the merged ones (0: it returns the merged
    embeddings alone, a tensor; otherwise a tuple of them and a list of the DeepStack ones)."""

    encoder_class: type[torch.nn.Module]
    patch_values: int
    deepstack: int
    text_hidden: int = 64

    def load(self, config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> Any:
        encoder = self.encoder_class(config).eval()
        encoder.load_weights(iter(tensors.items()))
        return encoder

    def pixels(self, grids: list[list[int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        grid = torch.tensor(grids)
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(int(grid.prod(-1).sum()), self.patch_values, generator=generator), grid

    def outputs(self, encoder: Any, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        """The encoder's merged embeddings, then its DeepStack embeddings."""
        with torch.no_grad():
            out = encoder(pixels, grid)
        if not self.deepstack:
            assert isinstance(out, torch.Tensor)
            return [out]
        merged, deep = out
        assert len(deep) == encoder.num_deepstack == self.deepstack
        return [merged, *deep]

    def hf_features(self, model: PreTrainedModel, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        """transformers' merged embeddings (``pooler_output``: a tuple of one ``[tokens, text_hidden]`` tensor per
        image, concatenated), then its DeepStack embeddings (``deepstack_features``: a list, one per deepstack index,
        of such tuples, each concatenated)."""
        with torch.no_grad():
            out = model.model.get_image_features(pixels, grid)
        assert isinstance(out.pooler_output, tuple) and len(out.pooler_output) == len(grid)
        deep = getattr(out, "deepstack_features", None) or []
        indexes = getattr(model.config.vision_config, "deepstack_visual_indexes", None) or []
        assert len(deep) == len(indexes) == self.deepstack
        for per_image in deep:
            assert isinstance(per_image, tuple) and len(per_image) == len(grid)
        return [torch.cat(per_image) for per_image in (out.pooler_output, *deep)]

    def assert_matches(self, encoder: Any, model: PreTrainedModel, pixels: torch.Tensor, grid: torch.Tensor) -> None:
        ours = self.outputs(encoder, pixels, grid)
        theirs = self.hf_features(model, pixels, grid)
        tokens = int(grid.prod(-1).sum()) // 4
        assert len(ours) == len(theirs) == 1 + self.deepstack
        for mine, reference in zip(ours, theirs):
            assert mine.shape == reference.shape == (tokens, self.text_hidden)
            torch.testing.assert_close(mine, reference, atol=1e-5, rtol=0)

    def assert_load_refused(self, config: PretrainedConfig, tensors: dict[str, torch.Tensor], text: str) -> None:
        """Loading ``tensors`` raises a ValueError saying exactly ``text``."""
        with pytest.raises(ValueError, match=message(text)):
            self.load(config, tensors)

    def assert_load_refused_without(self, saved: Saved, prefix: str, text: str) -> None:
        """Loading the saved tensors but those whose names start with ``prefix`` raises a ValueError saying exactly
        ``text``."""
        model, tensors = saved
        self.assert_load_refused(model.config, {n: t for n, t in tensors.items() if not n.startswith(prefix)}, text)

    def check_matches_transformers(self, saved: Saved, grids: list[list[int]]) -> None:
        model, tensors = saved
        encoder = self.load(model.config, tensors)
        assert encoder.spatial_merge_size == 2
        self.assert_matches(encoder, model, *self.pixels(grids))

    def check_image_processor_output(
        self, saved: Saved, processor: Any, sizes: list[tuple[int, int]], grids: list[list[int]]
    ) -> None:
        """Random images of ``sizes`` (height, width) through the real image processor: patched into ``grids``, and
        the encoder matches transformers on its output."""
        model, tensors = saved
        rng = np.random.default_rng(0)
        images = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for height, width in sizes]
        inputs = processor(images=images, return_tensors="pt")
        grid = inputs["image_grid_thw"]
        assert grid.tolist() == grids
        assert inputs["pixel_values"].shape == (sum(t * h * w for t, h, w in grids), self.patch_values)
        self.assert_matches(self.load(model.config, tensors), model, inputs["pixel_values"], grid)

    def check_images_are_encoded_independently(self, saved: Saved) -> None:
        """A 4x4 image before an 8x12 one changes none of the 8x12 one's embeddings."""
        model, tensors = saved
        encoder = self.load(model.config, tensors)
        pixels, grid = self.pixels([[1, 4, 4], [1, 8, 12]])
        both = self.outputs(encoder, pixels, grid)
        second = self.outputs(encoder, pixels[16:], grid[1:])
        for whole, alone in zip(both, second, strict=True):
            torch.testing.assert_close(whole[4:], alone, atol=1e-5, rtol=0)

    def check_loads_the_same(self, saved: Saved, rename: Callable[[str], str], extra: dict[str, torch.Tensor]) -> None:
        """The saved tensors under the names ``rename`` gives them, and the ``extra`` ones besides, load into an
        encoder whose outputs are exactly those of the encoder loaded from the saved tensors."""
        model, tensors = saved
        renamed = {rename(name): tensor for name, tensor in tensors.items()} | extra
        pixels, grid = self.pixels([[1, 4, 4], [1, 8, 12]])
        expected = self.outputs(self.load(model.config, tensors), pixels, grid)
        got = self.outputs(self.load(model.config, renamed), pixels, grid)
        assert len(got) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))

    def check_runs_in_the_parameters_dtype(self, saved: Saved, dtype: torch.dtype) -> None:
        model, tensors = saved
        encoder = self.load(model.config, tensors)
        pixels, grid = self.pixels([[1, 4, 4], [1, 8, 12]])
        fp32 = self.outputs(encoder, pixels, grid)
        half = self.outputs(encoder.to(dtype), pixels, grid)  # fp32 pixels, cast to the parameters' dtype
        assert all(t.dtype == dtype for t in half)
        for low, full in zip(half, fp32, strict=True):
            torch.testing.assert_close(low.float(), full, atol=0.15, rtol=0.05)

    def check_bad_inputs_are_refused(self, saved: Saved) -> None:
        model, tensors = saved
        encoder = self.load(model.config, tensors)
        pixels, grid = self.pixels([[1, 4, 6]])
        values = self.patch_values
        shape = f"pixel_values of shape [23, {values}], expected [24, {values}] for [(1, 4, 6)]"
        with pytest.raises(ValueError, match=message(shape)):
            encoder(pixels[1:], grid)
        with pytest.raises(
            ValueError, match=re.escape("image grid (t, h, w) = (1, 3, 8) is not a positive grid of 2x2")
        ):
            encoder(pixels, torch.tensor([[1, 3, 8]]))
        with pytest.raises(ValueError, match=re.escape("grid_thw of shape [3], expected [num_images, 3]")):
            encoder(pixels, grid[0])

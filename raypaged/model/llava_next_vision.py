"""LLaVA-NeXT's image encoder (``LlavaNextForConditionalGeneration``'s vision side): LLaVA-1.5's CLIP tower and
projector (``raypaged.model.llava_vision``) run on every patch of an "anyres" image, the patches' features laid out
as transformers' ``pack_image_features`` lays them out.

The processor picks, among ``image_grid_pinpoints`` ((height, width) pairs), the resolution that keeps the most of
the image's pixels (then wastes the fewest), resizes the image into it (padding the rest) and cuts it into a grid of
tower-sized tiles; before them comes the whole image resized to one tile (the base image). Each tile gives
``(image_size // patch_size) ** 2`` features (the class token dropped: the "default" strategy). An image's features
are the base image's, then the grid's as one feature map (the tiles' patches side by side) with the rows or columns
that only cover padding cut off (``unpad_image``: the image's aspect ratio, a rounding to 7 decimals, half the excess
on each side, rounded down) and ``image_newline`` after each row of the map, the map read row by row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from raypaged.model.llava_vision import LlavaImageEncoder, is_vision_tensor

# the checkpoint names of the newline embedding: older hub layout, then transformers 4.52+'s
_NEWLINE_NAMES = ("image_newline", "model.image_newline")


def is_next_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the vision tower, the projector or ``image_newline`` (either layout)."""
    return is_vision_tensor(name) or name in _NEWLINE_NAMES


def _image_size(image_size: Sequence[int] | torch.Tensor) -> tuple[int, int]:
    """``(height, width)`` as Python ints (a tensor or array of two is read as transformers reads it)."""
    values = image_size.tolist() if isinstance(image_size, torch.Tensor) else list(image_size)
    if len(values) != 2:
        raise ValueError(f"image size {values} is not a (height, width) pair")
    height, width = (int(v) for v in values)
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {(height, width)} is not positive")
    return height, width


def _pinpoints(config: PretrainedConfig) -> list[tuple[int, int]]:
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    if not isinstance(pinpoints, (list, tuple)) or not pinpoints:
        raise ValueError(f"image_grid_pinpoints {pinpoints!r} is not a list of (height, width) resolutions")
    out = []
    for point in pinpoints:
        if len(point) != 2 or min(point) <= 0:
            raise ValueError(f"image_grid_pinpoints entry {point!r} is not a positive (height, width) resolution")
        out.append((int(point[0]), int(point[1])))
    return out


def _best_resolution(image_size: tuple[int, int], pinpoints: list[tuple[int, int]]) -> tuple[int, int]:
    """The pinpoint ``(height, width)`` transformers' ``select_best_resolution`` picks: the most of the image's
    pixels kept after fitting it inside (downscaled sides truncated to ints), then the fewest pixels wasted; the
    first such in order."""
    height, width = image_size
    best: tuple[int, int] | None = None
    most_kept, least_wasted = 0, math.inf
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_width * pin_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (pin_height, pin_width), kept, wasted
    if best is None:
        raise ValueError(f"no image_grid_pinpoints resolution keeps any pixel of an image of {height}x{width}")
    return best


def _num_patches(pinpoints: list[tuple[int, int]], tile: int, image_size: tuple[int, int]) -> int:
    height, width = _best_resolution(image_size, pinpoints)
    return -(-height // tile) * -(-width // tile) + 1  # the tiles starting inside the resolution, and the base image


def num_patches(config: PretrainedConfig, image_size: tuple[int, int]) -> int:
    """How many ``[3, S, S]`` rows of ``pixel_values`` the processor makes of one image of ``(height, width)``
    ``image_size``: the base image, then the grid's tiles (transformers' ``image_size_to_num_patches``)."""
    return _num_patches(_pinpoints(config), config.vision_config.image_size, _image_size(image_size))


def _unpad(features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
    """``[dim, H, W]`` features of the padded resolution to those covering the image (transformers' ``unpad_image``):
    the longer side, relative to the map's aspect ratio, fills the map; of the other, half the excess, rounded down,
    is cut off each side (an odd excess leaves one row or column of padding)."""
    height, width = image_size
    map_height, map_width = features.shape[1:]
    if width / height > map_width / map_height:
        new_height = int(round(height * (map_width / width), 7))
        cut = (map_height - new_height) // 2
        return features[:, cut : map_height - cut, :]
    new_width = int(round(width * (map_height / height), 7))
    cut = (map_width - new_width) // 2
    return features[:, :, cut : map_width - cut]


class LlavaNextImageEncoder(nn.Module):
    """One image's patches to the embeddings that replace its placeholder tokens in the prompt, as transformers'
    ``get_image_features`` (with ``pack_image_features``) makes them. Built from the whole ``LlavaNextConfig``;
    parameters are filled by ``load_weights``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.vision_feature_select_strategy != "default":
            # transformers lays each tile's features out as a (side x side) map, which the class token "full" keeps
            # does not fit: its pack_image_features fails (or mixes features across tokens) for any anyres image
            raise ValueError(
                f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} is not supported for "
                "LLaVA-NeXT (default): transformers cannot pack a tile's class token into the anyres feature map"
            )
        self.image_encoder = LlavaImageEncoder(config)
        vision = config.vision_config
        self.pinpoints = _pinpoints(config)
        self.tile = vision.image_size
        self.side = vision.image_size // vision.patch_size  # a tile's features are a side x side map
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))

    def num_patches(self, image_size: tuple[int, int]) -> int:
        """``num_patches`` of this encoder's config."""
        return _num_patches(self.pinpoints, self.tile, _image_size(image_size))

    def forward(self, pixel_values: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """One image's ``[num_patches, 3, S, S]`` pixels (the base image, then the grid's tiles row by row, as the
        processor makes them, no batch padding) and its original ``(height, width)`` to
        ``[num_tokens, text_hidden_size]``: the base image's features, then the grid's, unpadded, each row of the
        map followed by ``image_newline``."""
        size = _image_size(image_size)
        expected = self.num_patches(size)
        if pixel_values.dim() != 4 or pixel_values.shape[0] != expected:
            raise ValueError(
                f"pixel_values of shape {list(pixel_values.shape)} for an image of {size[0]}x{size[1]}: expected "
                f"[{expected}, 3, {self.tile}, {self.tile}] (the base image and the grid's tiles)"
            )
        features = self.image_encoder(pixel_values)  # [patches, side * side, dim]
        base, tiles = features[0], features[1:]
        best_height, best_width = _best_resolution(size, self.pinpoints)
        rows, cols = best_height // self.tile, best_width // self.tile
        if rows * cols != len(tiles):
            raise ValueError(
                f"image_grid_pinpoints resolution {best_height}x{best_width} is not a whole grid of {self.tile}-pixel "
                f"tiles ({len(tiles)} tiles, {rows}x{cols} grid)"
            )
        dim, side = features.shape[-1], self.side
        # tile (r, c)'s feature (i, j) goes to row r * side + i, column c * side + j of one [dim, H, W] map
        grid = tiles.reshape(rows, cols, side, side, dim).permute(4, 0, 2, 1, 3).reshape(dim, rows * side, cols * side)
        grid = _unpad(grid, size)
        newline = self.image_newline.to(grid.dtype)[:, None, None].expand(dim, grid.shape[1], 1)
        grid = torch.cat([grid, newline], dim=2).flatten(1).t()
        return torch.cat([base, grid], dim=0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the vision tower's, the projector's (as ``LlavaImageEncoder.load_weights``) and ``image_newline``'s
        (``image_newline`` or ``model.image_newline``) tensors out of all of a checkpoint's tensors; the others are
        not read. ``ValueError`` naming a tensor with no place or of the wrong shape, or the parameters left
        unfilled (``image_newline`` among them)."""
        newline_loaded = exhausted = False

        def vision_weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal newline_loaded, exhausted
            for name, tensor in weights:
                if name not in _NEWLINE_NAMES:
                    yield name, tensor
                    continue
                if tensor.shape != self.image_newline.shape:
                    raise ValueError(
                        f"checkpoint tensor {name} has shape {list(tensor.shape)}, "
                        f"expected {list(self.image_newline.shape)}"
                    )
                with torch.no_grad():
                    self.image_newline.copy_(tensor)
                newline_loaded = True
            exhausted = True

        lacks_newline = "checkpoint lacks image_newline of LlavaNextImageEncoder (image_newline or model.image_newline)"
        try:
            self.image_encoder.load_weights(vision_weights())
        except ValueError as error:
            if exhausted and not newline_loaded:  # the tower's or projector's tensors missing, and the newline
                raise ValueError(f"{error}; {lacks_newline}") from error
            raise
        if not newline_loaded:
            raise ValueError(lacks_newline)

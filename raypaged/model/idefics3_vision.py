"""Idefics3's image encoder (``Idefics3ForConditionalGeneration``'s vision side: SmolVLM-256M/500M/2B-Instruct,
Idefics3-8B): a SigLIP vision transformer that takes partially padded tiles, and the connector that folds its patch
grid into fewer, wider tokens and projects them to the language model's hidden size.

The image processor cuts an image into square tiles of ``image_size`` pixels (a grid of crops, then the whole image
resized), and marks each tile's real pixels in ``pixel_attention_mask``. A tile is cut into ``patch_size`` patches
(a ``num_patches_per_side`` square grid); a patch is real when any of its pixels is. The tower embeds the patches (a
convolution with bias) and adds a learned position embedding to each, looked up by a position id made from the
tile's real extent: the tile has ``rows`` real patches down its first column and ``cols`` along its first row, patch
``(i, j)`` sits at the fractional coordinates ``(i / rows, j / cols)`` (float32, clamped below 1), each coordinate
bucketed into ``num_patches_per_side`` equal intervals, and the id is ``bucket_i * num_patches_per_side +
bucket_j``; a padding patch takes id 0. A tile without padding gets ids ``0 .. num_patches - 1`` row by row on the
published grids (26 and 32 patches a side), not on every grid (float32 rounding moves a few on some sizes). The
pre-norm layers are SigLIP's (LLaVA's CLIP layers, the same maths and tensor names), with the padding patches hidden
as keys (every patch, padding or not, is still a query), and ``post_layernorm`` normalizes the last one's output.

The connector's pixel shuffle gathers each ``scale_factor`` square block of the patch grid into one token, the block's
features concatenated row by row (the block's patch ``(r, c)`` at offset ``(r * scale_factor + c) * vision_hidden``),
the tokens row by row over the smaller grid; ``modality_projection.proj`` (no bias) maps the
``vision_hidden * scale_factor ** 2`` features to the text hidden size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from raypaged.model.llava_vision import EncoderLayers
from raypaged.model.vision_common import activation, load_named_weights


def _module_name(name: str) -> str | None:
    """A checkpoint tensor's name inside ``Idefics3ImageEncoder``, None for a tensor outside the vision transformer
    and the connector (the language model's ``model.text_model.X``, ``lm_head.weight``). transformers 5.25's
    ``save_pretrained``, its in-memory names and the published checkpoints agree: ``model.vision_model.X`` and
    ``model.connector.X``; the same without ``model.`` (an ``Idefics3Model`` saved alone) is taken too."""
    name = name.removeprefix("model.")
    if name.startswith(("vision_model.", "connector.")):
        return name
    return None


def is_idefics3_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the vision transformer or the connector; the others are the language
    model's."""
    return _module_name(name) is not None


class _Embeddings(nn.Module):
    """Patch embeddings (a convolution of stride ``patch_size``, with bias) plus the learned position embedding of
    each patch's position id (see the module's docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.side = config.image_size // patch  # num_patches_per_side
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, patch, stride=patch)
        self.position_embedding = nn.Embedding(self.side * self.side, hidden)

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """``[n, side, side]`` bool (real patches) -> ``[n, side * side]`` position ids."""
        n, grid_h, grid_w = patch_mask.shape
        device = patch_mask.device
        # interval edges 1/side, 2/side, ... below 1, as float32 arange makes them (its rounding included)
        edges = torch.arange(1 / self.side, 1.0, 1 / self.side, dtype=torch.float32, device=device)
        rows = patch_mask[:, :, 0].sum(dim=1).to(torch.float32)  # real patches down the first column
        cols = patch_mask[:, 0, :].sum(dim=1).to(torch.float32)  # real patches along the first row
        below_one = 1.0 - 1e-6
        frac_h = (torch.arange(grid_h, dtype=torch.float32, device=device)[None] * (1.0 / rows)[:, None]).clamp(
            max=below_one
        )
        frac_w = (torch.arange(grid_w, dtype=torch.float32, device=device)[None] * (1.0 / cols)[:, None]).clamp(
            max=below_one
        )
        bucket_h = torch.bucketize(frac_h, edges, right=True)  # [n, grid_h]
        bucket_w = torch.bucketize(frac_w, edges, right=True)  # [n, grid_w]
        ids = (bucket_h[:, :, None] * self.side + bucket_w[:, None, :]).reshape(n, -1)
        return torch.where(patch_mask.reshape(n, -1), ids, torch.zeros_like(ids))

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """``[n, C, H, W]`` pixels and their ``[n, side, side]`` real patches -> ``[n, side * side, hidden]``."""
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # row by row over the grid
        # not ``position_embedding.weight`` in order even for a whole tile: float32 rounding sends some patches to
        # a neighbour's bucket for some grid sizes (19: the 13th row and column to the 12th's), as transformers does
        return patches + self.position_embedding(self.position_ids(patch_mask))


def _layer_with_key_mask(layer: Any, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One of ``EncoderLayers``' layers (``x + attn(layer_norm1(x))``, then ``x + mlp(layer_norm2(x))``) with the
    tokens where ``keys`` ``[n, T]`` is False hidden as keys and values; ``x`` ``[n, T, hidden]``."""
    attn = layer.self_attn
    h = layer.layer_norm1(x)
    n, t, _ = h.shape
    q, k, v = (p(h).view(n, t, attn.num_heads, -1).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keys[:, None, None, :])  # scale head_dim ** -0.5
    x = x + attn.out_proj(out.transpose(1, 2).reshape(n, t, -1))
    return x + layer.mlp(layer.layer_norm2(x))


class _VisionTransformer(nn.Module):
    """SigLIP's vision transformer over padded tiles: embeddings, every encoder layer, ``post_layernorm``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embeddings = _Embeddings(config)
        self.encoder = EncoderLayers(config, config.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor, padded: bool) -> torch.Tensor:
        """``[n, C, H, W]`` and ``[n, side, side]`` real patches (``padded``: some are not) ->
        ``[n, side * side, hidden]``."""
        x = self.embeddings(pixel_values, patch_mask)
        if not padded:
            for layer in self.encoder.layers:
                x = layer(x)
        else:
            keys = patch_mask.flatten(1)
            for layer in self.encoder.layers:
                x = _layer_with_key_mask(layer, x, keys)
        return self.post_layernorm(x)


class _ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _Connector(nn.Module):
    """Pixel shuffle of the patch grid by ``scale_factor``, then ``modality_projection``."""

    def __init__(self, config: PretrainedConfig, side: int) -> None:
        super().__init__()
        self.scale, self.side = config.scale_factor, side
        vision_hidden = config.vision_config.hidden_size
        self.modality_projection = _ModalityProjection(
            vision_hidden * self.scale * self.scale, config.text_config.hidden_size
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [n, side * side, hidden] -> [n, tokens, text]
        n, _, hidden = features.shape
        s, blocks = self.scale, self.side // self.scale
        # [n, block_row, r, block_col, c, hidden] -> [n, block_row, block_col, r, c, hidden]
        grid = features.reshape(n, blocks, s, blocks, s, hidden).permute(0, 1, 3, 2, 4, 5)
        return self.modality_projection(grid.reshape(n, blocks * blocks, s * s * hidden))


class Idefics3ImageEncoder(nn.Module):
    """Image tiles to the embeddings that replace their ``<image>`` tokens in the prompt: the vision transformer's
    normalized last hidden state through the connector. Built from the whole ``Idefics3Config``; parameters are
    filled by ``load_weights``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        vision = config.vision_config
        # checked here so that an unsupported one is named as Idefics3's (the shared layers would call it LLaVA's)
        activation(vision.hidden_act, "Idefics3 vision hidden_act")
        self.image_size, self.patch_size = vision.image_size, vision.patch_size
        self.num_channels = vision.num_channels
        side = vision.image_size // vision.patch_size
        scale = config.scale_factor
        if side % scale:
            raise ValueError(f"scale_factor {scale} does not divide the {side}x{side} patch grid")
        self.num_tokens = (side // scale) ** 2
        self.vision_model = _VisionTransformer(vision)
        self.connector = _Connector(config, side)

    def tokens_per_tile(self) -> int:
        """Embeddings per tile, the ``<image>`` tokens a tile has in the prompt (transformers' ``image_seq_len``):
        ``(image_size // patch_size) ** 2 // scale_factor ** 2``."""
        return self.num_tokens

    def _patch_mask(self, pixel_attention_mask: torch.Tensor, num_tiles: int) -> tuple[torch.Tensor, bool]:
        """The ``[n, side, side]`` real patches (a patch with any real pixel) of a ``[n, H, W]`` pixel mask, and
        whether some patch is not real. ``ValueError`` for a mask of another shape or a tile without a real patch."""
        size, patch = self.image_size, self.patch_size
        if tuple(pixel_attention_mask.shape) != (num_tiles, size, size):
            raise ValueError(
                f"pixel_attention_mask of shape {list(pixel_attention_mask.shape)}, expected [{num_tiles}, {size}, "
                f"{size}]"
            )
        side = size // patch
        pixels = pixel_attention_mask[:, : side * patch, : side * patch].to(torch.bool)
        mask = pixels.reshape(num_tiles, side, patch, side, patch).any(dim=4).any(dim=2)
        real = mask.flatten(1).sum(dim=1).tolist()
        empty = [i for i, count in enumerate(real) if count == 0]
        if empty:
            raise ValueError(f"tiles {empty} have no real pixel in pixel_attention_mask")
        return mask, min(real) < side * side

    def forward(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[num_tiles, 3, image_size, image_size]`` pixels of the real tiles only (the processor's all-zero padding
        tiles dropped; cast to the parameters' dtype and device) and their ``[num_tiles, image_size, image_size]``
        real-pixel mask (any dtype, nonzero: real; None: all real) -> ``[num_tiles, tokens_per_tile,
        text_hidden_size]``, the tiles in their order, each tile's tokens row by row."""
        weight = self.connector.modality_projection.proj.weight
        pixel_values = pixel_values.to(weight)
        size, channels = self.image_size, self.num_channels
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (channels, size, size):
            raise ValueError(
                f"pixel_values of shape {list(pixel_values.shape)}, expected [num_tiles, {channels}, {size}, {size}]"
            )
        num_tiles, side = len(pixel_values), size // self.patch_size
        if pixel_attention_mask is None:
            patch_mask, padded = torch.ones(num_tiles, side, side, dtype=torch.bool, device=weight.device), False
        else:
            patch_mask, padded = self._patch_mask(pixel_attention_mask.to(weight.device), num_tiles)
        return self.connector(self.vision_model(pixel_values, patch_mask, padded))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the vision transformer's and the connector's tensors out of all of a checkpoint's tensors; the others
        are not read, nor is a saved ``position_ids`` buffer. ``ValueError`` naming a vision or connector tensor with
        no place or of the wrong shape, or the parameters left unfilled."""

        load_named_weights(self, weights, _module_name, (".position_ids",))

"""Gemma 3's image encoder (``Gemma3ForConditionalGeneration``'s vision side): a SigLIP vision tower and the
multi-modal projector that turns its patch features into ``mm_tokens_per_image`` embeddings of the language model's
hidden size.

An image of ``image_size`` pixels square is cut into ``patch_size`` patches; the tower embeds them (a convolution
with bias; there is no class token), adds a learned position embedding per patch, runs pre-norm transformer layers
in which every patch attends to every other (LLaVA's CLIP layers, the same maths and tensor names), and normalizes
the last layer's output with ``post_layernorm``. SigLIP's attention-pooling head is not used. The projector averages
the grid of patch features over square blocks down to a ``sqrt(mm_tokens_per_image)``-wide grid (896 pixels, 14-pixel
patches: 64x64 patches, blocks of 4x4, 256 tokens), normalizes each token with Gemma's RMS norm (scale
``1 + weight``, in float32) and multiplies it by ``mm_input_projection_weight`` ``[vision_hidden, text_hidden]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from raypaged.model.llava_vision import EncoderLayers, tower_name
from raypaged.model.vision_common import activation, load_named_weights


def is_gemma3_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the vision tower (the unused attention-pooling head included) or the
    projector, in any layout (LLaVA's names); the others are the language model's."""
    return tower_name(name) is not None


class _Embeddings(nn.Module):
    """Patch embeddings (a convolution of stride ``patch_size``, with bias) plus each patch's learned position."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.image_size = config.image_size
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, patch, stride=patch)
        self.position_embedding = nn.Embedding((config.image_size // patch) ** 2, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [n, C, H, W] -> [n, patches, hidden]
        height, width = pixel_values.shape[-2:]
        if height != self.image_size or width != self.image_size:
            raise ValueError(
                f"image of {height}x{width} pixels, the vision tower takes {self.image_size}x{self.image_size}"
            )
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # row by row over the grid
        return patches + self.position_embedding.weight


class _VisionTower(nn.Module):
    """SigLIP's vision transformer: embeddings, every encoder layer, ``post_layernorm``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embeddings = _Embeddings(config)
        self.encoder = EncoderLayers(config, config.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [n, C, H, W] -> [n, patches, hidden]
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class _SoftEmbNorm(nn.Module):
    """Gemma's RMS norm: ``x / rms(x) * (1 + weight)`` worked out in float32, returned in ``x``'s dtype."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class _Projector(nn.Module):
    """The patch grid average-pooled over ``block``-wide squares, each pooled token normalized and projected."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        vision = config.vision_config
        self.side = vision.image_size // vision.patch_size  # patches along each side of the grid
        tokens = config.mm_tokens_per_image
        tokens_side = math.isqrt(tokens)
        if tokens_side * tokens_side != tokens or self.side % tokens_side:
            raise ValueError(
                f"mm_tokens_per_image {tokens} is not the square of a divisor of the {self.side}x{self.side} patch grid"
            )
        self.block = self.side // tokens_side
        self.mm_soft_emb_norm = _SoftEmbNorm(vision.hidden_size, vision.layer_norm_eps)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, config.text_config.hidden_size))

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [n, patches, vision_hidden] -> [n, tokens, text]
        n, _, hidden = features.shape
        grid = features.transpose(1, 2).reshape(n, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.block).flatten(2).transpose(1, 2)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).to(features.dtype)


class Gemma3ImageEncoder(nn.Module):
    """Images to the embeddings that replace their image tokens in the prompt: the SigLIP tower's normalized last
    hidden state through the pooling projector. Built from the whole ``Gemma3Config``; parameters are filled by
    ``load_weights``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        vision = config.vision_config
        # checked here so that an unsupported one is named as Gemma 3's (the shared layers would call it LLaVA's)
        activation(vision.hidden_act, "Gemma 3 vision hidden_act")
        self.num_tokens = config.mm_tokens_per_image
        self.vision_tower = _VisionTower(vision)
        self.multi_modal_projector = _Projector(config)

    def tokens_per_image(self) -> int:
        """Embeddings per image (``mm_tokens_per_image``), whatever the image's size before processing."""
        return self.num_tokens

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[num_images, 3, image_size, image_size]`` pixels (cast to the parameters' dtype and device) to
        ``[num_images, tokens_per_image, text_hidden_size]``."""
        pixel_values = pixel_values.to(self.multi_modal_projector.mm_input_projection_weight)
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the vision tower's and the projector's tensors (any layout) out of all of a checkpoint's tensors;
        the others are not read, nor are the tower's attention-pooling head and a saved ``position_ids`` buffer.
        ``ValueError`` naming a vision or projector tensor with no place or of the wrong shape, or the parameters
        left unfilled."""

        def key_of(name: str) -> str | None:
            key = tower_name(name)
            return None if key is None or key.startswith("vision_tower.head.") else key

        load_named_weights(self, weights, key_of, (".position_ids",))

"""The image encoder of Mistral 3 (Mistral Small 3.1 and 3.2): the Pixtral vision tower and the multimodal projector
of transformers' ``Mistral3ForConditionalGeneration`` (``vision_tower`` and ``multi_modal_projector``).

Input. The image processor resizes each image to fit ``longest_edge`` and rounds each side up to whole patches (the
processor asks for ``patch_size * spatial_merge_size`` pixels, so whole merge blocks), normalizes it, and pads the
batch with zeros at the bottom and right to the largest height and width; ``image_sizes`` holds each image's own
(height, width) in pixels. Only that top-left part of each image is read: the padding never reaches the encoder.

Patch embedding. A convolution whose kernel and stride are one patch, without bias: a linear map of each flattened
patch by the kernel flattened the same way, computed so here. The patches of an image go row by row over its
``h x w`` grid (h, w in patches), then the images one after the other, as one sequence, normed by ``ln_pre``.

Rotary positions. Each patch has its (row, column) on its image's grid. A head of ``d`` values has the ``d/2``
frequencies ``f_j = theta ** (-2j / d)`` (``theta`` = ``rope_parameters["rope_theta"]``); its first quarter is rotated
by ``row * f_j`` for the even ``j``, its second by ``column * f_j`` for the odd ``j``, the second half by the same
angles again (rotate-half pairing: value i with value i + d/2). q and k are rotated in float32.

Layers. Pre-norm, RMSNorms (eps 1e-5, normalized in float32): ``x + attention(attention_norm(x))``, then
``x + feed_forward(ffn_norm(x))``. Attention has q, k, v and o projections without biases, ``head_dim ** -0.5``
scaling, and never crosses an image: each image attends only to itself. The feed-forward is gated,
``down_proj(act(gate_proj(x)) * up_proj(x))`` without biases (``hidden_act``, silu in the published models).
transformers' ``hidden_states`` are the sequence before the first layer (index 0) and after each layer (1 to
``num_hidden_layers``); ``vision_feature_layer`` picks one (-1: after the last layer), so only the layers before it
run.

Projector. An RMSNorm ``norm`` (eps ``text_config.rms_norm_eps``) on every patch; the patch merger cuts each image's
grid into ``m x m`` blocks (m = ``spatial_merge_size``; a last row or column of patches that does not fill a block is
dropped, as transformers' ``unfold`` does), blocks row by row, and puts each block's patches side by side channel by
channel (the ``m*m`` patches of channel 0, row by row, then those of channel 1, ...), through ``merging_layer`` (no
bias) back to the vision width; then ``linear_1``, ``projector_hidden_act``, ``linear_2`` to the language model's
hidden size (biases if ``multimodal_projector_bias``). One embedding per block, images in order, blocks row by row:
the order of the image's ``[IMG]`` tokens in the prompt (which has a break token after each row of blocks).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from raypaged.model.layers import RMSNorm
from raypaged.model.qwen2_vl_vision import Groups, group_segments, rotate, segment_attention
from raypaged.model.vision_common import activation, load_named_weights

VISION_NORM_EPS = 1e-5
DEFAULT_ROPE_THETA = 10000.0
PREFIXES = ("vision_tower.", "multi_modal_projector.")
# a buffer some checkpoints may hold: the frequencies are recomputed from the config, never read
DERIVED_SUFFIXES = ("inv_freq",)


def pixtral_name(name: str) -> str | None:
    """A checkpoint tensor's name inside ``Mistral3ImageEncoder``, None for a tensor outside the image encoder. Both
    layouts: ``vision_tower.X`` and ``multi_modal_projector.X`` (the published Mistral checkpoints and transformers
    5's ``save_pretrained``) and the same under ``model.`` (transformers 4.52 to 4.x)."""
    name = name.removeprefix("model.")
    return name if name.startswith(PREFIXES) else None


def is_pixtral_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the image encoder: the vision tower or the projector (either layout)."""
    return pixtral_name(name) is not None


class _Attention(nn.Module):
    """Multi-head attention inside each image; q, k, v, o without biases."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, width // num_heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: Groups) -> torch.Tensor:
        n = len(x)
        q, k, v = (proj(x).view(n, self.num_heads, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = segment_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, groups)  # each image to itself
        return self.o_proj(out.reshape(n, -1))


class _FeedForward(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``, no biases."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = activation(act, "Pixtral vision hidden_act")
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """``x + attention(attention_norm(x))``, then ``x + feed_forward(ffn_norm(x))``."""

    def __init__(self, vision: PretrainedConfig) -> None:
        super().__init__()
        width = vision.hidden_size
        self.attention_norm = RMSNorm(width, VISION_NORM_EPS)
        self.attention = _Attention(width, vision.num_attention_heads)
        self.ffn_norm = RMSNorm(width, VISION_NORM_EPS)
        self.feed_forward = _FeedForward(width, vision.intermediate_size, vision.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: Groups) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, groups)
        return x + self.feed_forward(self.ffn_norm(x))


class _Transformer(nn.Module):
    def __init__(self, vision: PretrainedConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(vision) for _ in range(vision.num_hidden_layers))


class _VisionTower(nn.Module):
    """Pixtral's tower (``PixtralVisionModel``): the patch convolution, ``ln_pre``, the layers."""

    def __init__(self, vision: PretrainedConfig) -> None:
        super().__init__()
        p = vision.patch_size
        self.patch_conv = nn.Conv2d(vision.num_channels, vision.hidden_size, kernel_size=p, stride=p, bias=False)
        self.ln_pre = RMSNorm(vision.hidden_size, VISION_NORM_EPS)
        self.transformer = _Transformer(vision)


class _PatchMerger(nn.Module):
    """Each image's ``m x m`` blocks of patches (channel-major inside a block) through ``merging_layer``."""

    def __init__(self, width: int, merge_size: int) -> None:
        super().__init__()
        self.merge_size = merge_size
        self.merging_layer = nn.Linear(width * merge_size**2, width, bias=False)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        m, width = self.merge_size, x.shape[-1]
        blocks = []
        for image, (h, w) in zip(x.split([h * w for h, w in grids]), grids):
            bh, bw = h // m, w // m
            grid = image.view(h, w, width)[: bh * m, : bw * m]
            # (block row, row in block, block column, column in block, channel) -> (blocks, channel, row, column)
            blocks.append(grid.reshape(bh, m, bw, m, width).permute(0, 2, 4, 1, 3).reshape(bh * bw, width * m * m))
        return self.merging_layer(torch.cat(blocks))


class _Projector(nn.Module):
    """``Mistral3MultiModalProjector``: ``norm``, the patch merger, ``linear_1``, act, ``linear_2``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        width, text = config.vision_config.hidden_size, config.text_config
        bias = bool(config.multimodal_projector_bias)
        self.norm = RMSNorm(width, text.rms_norm_eps)
        self.patch_merger = _PatchMerger(width, config.spatial_merge_size)
        self.act = activation(config.projector_hidden_act, "projector_hidden_act")
        self.linear_1 = nn.Linear(width, text.hidden_size, bias=bias)
        self.linear_2 = nn.Linear(text.hidden_size, text.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.patch_merger(self.norm(x), grids))))


def _feature_layer(config: PretrainedConfig) -> int:
    """How many of the tower's layers run: ``vision_feature_layer`` (an index into the ``num_hidden_layers + 1``
    hidden states, or a list of one) as a count of layers."""
    layer = config.vision_feature_layer
    if isinstance(layer, (list, tuple)):
        if len(layer) != 1:
            raise ValueError(f"vision_feature_layer {list(layer)}: only one layer's features are supported")
        layer = layer[0]
    states = config.vision_config.num_hidden_layers + 1
    if not isinstance(layer, int) or not -states <= layer < states:
        raise ValueError(f"vision_feature_layer {layer!r} is not one of the tower's {states} hidden states")
    return layer % states


class Mistral3ImageEncoder(nn.Module):
    """Images (as ``PixtralImageProcessor`` makes them) to the embeddings that replace their ``[IMG]`` tokens, for
    Mistral 3. Built from the whole ``Mistral3Config``; parameters are filled by ``load_weights``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        vision = config.vision_config
        width, num_heads = vision.hidden_size, vision.num_attention_heads
        head_dim = getattr(vision, "head_dim", None) or width // max(num_heads, 1)
        if width % num_heads or head_dim != width // num_heads or head_dim % 4:
            raise ValueError(
                f"vision hidden_size {width} over {num_heads} heads is not the head_dim {head_dim}, "
                "or that is not a multiple of 4"
            )
        rope = dict(getattr(vision, "rope_parameters", None) or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type {rope['rope_type']!r} is not Pixtral's axial 2-D rotary")
        self.rope_theta = float(rope.get("rope_theta", getattr(vision, "rope_theta", DEFAULT_ROPE_THETA)))
        self.spatial_merge_size: int = config.spatial_merge_size
        self.patch_size: int = vision.patch_size
        self.channels: int = vision.num_channels
        self.head_dim = head_dim
        self.num_layers = _feature_layer(config)  # the layers before the selected hidden state
        self.vision_tower = _VisionTower(vision)
        self.multi_modal_projector = _Projector(config)

    def _grids(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> list[tuple[int, int]]:
        """Each image's (rows, columns) of patches, after checking the inputs."""
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.channels:
            raise ValueError(
                f"pixel_values of shape {list(pixel_values.shape)}, expected [num_images, {self.channels}, H, W]"
            )
        if list(image_sizes.shape) != [len(pixel_values), 2]:
            raise ValueError(f"image_sizes of shape {list(image_sizes.shape)}, expected [{len(pixel_values)}, 2]")
        p, m = self.patch_size, self.spatial_merge_size
        height, width = pixel_values.shape[2:]
        grids = []
        for h, w in image_sizes.tolist():
            if h % p or w % p or h < p * m or w < p * m:
                raise ValueError(
                    f"image size (height, width) = ({h}, {w}) is not whole {p}-pixel patches, "
                    f"at least {p * m} pixels a side"
                )
            if h > height or w > width:
                raise ValueError(f"image size (height, width) = ({h}, {w}) exceeds pixel_values' {height}x{width}")
            grids.append((h // p, w // p))
        return grids

    def _patches(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """Every image's patches [sum of h*w, channels * p * p], row by row, flattened as the kernel is."""
        p, c = self.patch_size, self.channels
        out = []
        for image, (h, w) in zip(pixels, grids):
            crop = image[:, : h * p, : w * p].reshape(c, h, p, w, p)
            out.append(crop.permute(1, 3, 0, 2, 4).reshape(h * w, c * p * p))
        return torch.cat(out)

    def _rotary(self, grids: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim] (float32) of each patch's (row, column) angles, images in order."""
        positions = []
        for h, w in grids:
            rows = torch.arange(h, device=device)[:, None].expand(h, w)
            cols = torch.arange(w, device=device)[None, :].expand(h, w)
            positions.append(torch.stack([rows, cols], dim=-1).reshape(-1, 2))
        rc = torch.cat(positions).float()
        d = self.head_dim
        freqs = 1.0 / self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d)  # [d/2]
        angles = torch.cat([rc[:, :1] * freqs[0::2], rc[:, 1:] * freqs[1::2]], dim=-1)  # [N, d/2]: rows', columns'
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` [num_images, channels, H, W] (padded to the batch's largest; cast to the parameters' dtype
        and device) and ``image_sizes`` [num_images, 2] (each image's height and width in pixels) to the merged
        embeddings [sum over images of (h / p // m) * (w / p // m), text hidden size], images in order, each row by
        row."""
        grids = self._grids(pixel_values, image_sizes)
        tower = self.vision_tower
        weight = tower.patch_conv.weight
        x = F.linear(self._patches(pixel_values.to(weight), grids), weight.flatten(1))
        x = tower.ln_pre(x)
        cos, sin = self._rotary(grids, weight.device)
        groups = group_segments([h * w for h, w in grids], None, weight.device)
        for layer in tower.transformer.layers[: self.num_layers]:
            x = layer(x, cos, sin, groups)
        return self.multi_modal_projector(x, grids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the image encoder's tensors (either layout) out of all of a checkpoint's tensors; the others are not
        read. ``ValueError`` naming an encoder tensor with no place or of the wrong shape, or the parameters left
        unfilled."""
        load_named_weights(self, weights, pixtral_name, DERIVED_SUFFIXES)

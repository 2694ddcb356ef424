"""The image encoder of Qwen3-VL (the ``visual`` module of transformers' ``Qwen3VLForConditionalGeneration``, the
same in ``Qwen3VLMoeForConditionalGeneration``).

Input: as for Qwen2-VL (see ``raypaged.model.qwen2_vl_vision``): ``t x h x w`` patches of ``channels *
temporal_patch_size * patch_size**2`` values (patch_size 16 in the published models), in merge-unit order
(``spatial_merge_size x spatial_merge_size`` blocks row by row over the block grid, each block's patches row by row,
one frame after the other). Every step keeps that order.

Patch embedding: the 3-D convolution whose kernel and stride are one patch, here WITH a bias, computed as a linear
map of each flattened patch.

Learned positions: ``pos_embed`` holds a square ``s x s`` table (``s**2`` = ``num_position_embeddings``) that is
stretched bilinearly over each frame's ``h x w`` grid, corners on corners: patch (row, col) reads the table at the
fractional point ``(row * (s-1) / (h-1), col * (s-1) / (w-1))`` (0 on a side of one patch), a weighted sum of the four
table entries around that point (indices past the last row or column fall back on it, with weight 0). The weights and
the sum are float32; the result is cast to the hidden dtype and added to the patch embeddings. Every frame of an image
gets the same positions.

Rotary positions: those of Qwen2-VL (the "axial" rope): with head size ``d``, the row index rotates the first quarter
and the column index the second by the ``d/4`` frequencies ``theta ** (-4i/d)``, repeated on the second half
(rotate-half pairing), in float32.

Blocks: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``; LayerNorms (eps 1e-6), attention (``qkv`` and ``proj``
with biases) only inside each frame, MLP ``linear_fc2(act(linear_fc1(x)))`` (``hidden_act``, gelu_pytorch_tanh).

Merger (``merger``): LayerNorm on each token, each merge unit's ``m*m`` tokens side by side, ``linear_fc1``, exact
GELU, ``linear_fc2`` to ``out_hidden_size`` (the language model's hidden size). One embedding per merge unit, in the
order of the image's placeholder tokens.

DeepStack: after block ``deepstack_visual_indexes[k]`` the hidden states also go through
``deepstack_merger_list[k]``, a merger whose LayerNorm comes after the merge-unit concatenation (over ``m*m*width``
values). Its output, one more ``[merge units, out_hidden_size]`` tensor, is what transformers adds to the language
model's hidden states at the image's placeholder positions after decoder layer ``k``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from raypaged.model.qwen2_vl_vision import (
    DEFAULT_ROPE_THETA,
    DERIVED_SUFFIXES,
    NORM_EPS,
    Grid,
    PatchEmbed,
    VisionBlock,
    group_segments,
    visual_name,
)
from raypaged.model.vision_common import activation, load_named_weights

_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


def is_qwen3_vl_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the vision encoder (``model.visual.X`` or ``visual.X``)."""
    return visual_name(name) is not None


class _Mlp(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))``, both with biases."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = activation(act, "Qwen3-VL vision hidden_act")
        self.linear_fc1 = nn.Linear(width, hidden)
        self.linear_fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Merger(nn.Module):
    """A LayerNorm, each merge unit's tokens concatenated, ``linear_fc1``, GELU, ``linear_fc2``; ``after_concat``: the
    norm over the concatenated vector (DeepStack's mergers) instead of over each token (the final merger)."""

    def __init__(self, width: int, merge_size: int, out_size: int, after_concat: bool) -> None:
        super().__init__()
        self.merged = merged = width * merge_size**2
        self.after_concat = after_concat
        self.norm = nn.LayerNorm(merged if after_concat else width, eps=NORM_EPS)
        self.linear_fc1 = nn.Linear(merged, merged)
        self.linear_fc2 = nn.Linear(merged, out_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, width] -> [N / m**2, out_size]
        units = self.norm(x.reshape(-1, self.merged)) if self.after_concat else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(units)))


def _patch_positions(grids: list[Grid], merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) on its frame and its frame's (height, width), both [N, 2] int64, in the processor's
    merge-unit order."""
    coords, sizes = [], []
    for t, h, w in grids:
        rows = torch.arange(h, device=device)[:, None].expand(h, w)
        cols = torch.arange(w, device=device)[None, :].expand(h, w)
        # row-major (h, w) into merge units: (h/m, m, w/m, m) -> (h/m, w/m, m, m)
        frame = torch.stack([rows, cols], dim=-1).view(h // merge, merge, w // merge, merge, 2).transpose(1, 2)
        coords.append(frame.reshape(-1, 2).repeat(t, 1))
        sizes.append(torch.tensor([h, w], device=device).expand(t * h * w, 2))
    return torch.cat(coords), torch.cat(sizes)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Along one axis: the two table indices around each patch's corner-aligned point on a ``side``-long table, and
    their float32 weights."""
    point = index.float() * (side - 1) / (size - 1).clamp(min=1)
    low = point.floor()
    frac = point - low
    below = low.long()
    return [below, (below + 1).clamp(max=side - 1)], [1 - frac, frac]


class Qwen3VLImageEncoder(nn.Module):
    """Images (as ``Qwen2VLImageProcessor`` makes them with Qwen3-VL's settings) to the embeddings that replace their
    placeholder tokens, and the DeepStack embeddings of the same tokens. Built from the whole ``Qwen3VLConfig`` (or
    ``Qwen3VLMoeConfig``); parameters are filled by ``load_weights``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.model_type not in _MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not Qwen3-VL's ({' or '.join(_MODEL_TYPES)})")
        vision = config.vision_config
        width, num_heads, depth = vision.hidden_size, vision.num_heads, vision.depth
        text_hidden = config.text_config.hidden_size
        if vision.out_hidden_size != text_hidden:
            raise ValueError(
                f"vision_config.out_hidden_size {vision.out_hidden_size} differs from the language model's "
                f"hidden_size {text_hidden}"
            )
        if width % num_heads or (width // num_heads) % 4:
            raise ValueError(f"vision width {width} over {num_heads} heads is not a head size that is a multiple of 4")
        activation(vision.hidden_act, "Qwen3-VL vision hidden_act")  # refused here, before any block is built
        self.table_side = round(vision.num_position_embeddings**0.5)
        if self.table_side**2 != vision.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {vision.num_position_embeddings} is not a square grid's")
        indexes = [int(i) for i in vision.deepstack_visual_indexes]
        if any(not 0 <= i < depth for i in indexes) or indexes != sorted(set(indexes)):
            # transformers emits the features in block order: only an increasing list keeps list order = block order
            raise ValueError(f"deepstack_visual_indexes {indexes} are not increasing block indices below depth {depth}")
        rope = getattr(vision, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise ValueError(f"Qwen3-VL vision rope_type {rope['rope_type']!r} is not supported (axial only)")
        self.rope_theta = float(rope.get("rope_theta", DEFAULT_ROPE_THETA))
        self.spatial_merge_size: int = vision.spatial_merge_size
        self.num_deepstack: int = len(indexes)
        self.deepstack_slots = {block: slot for slot, block in enumerate(indexes)}
        self.patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        self.head_dim = width // num_heads
        m, out_size = self.spatial_merge_size, vision.out_hidden_size

        self.patch_embed = PatchEmbed(vision, vision.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(vision.num_position_embeddings, width)
        self.blocks = nn.ModuleList(
            VisionBlock(width, num_heads, _Mlp(width, vision.intermediate_size, vision.hidden_act), rms=False)
            for _ in range(depth)
        )
        self.merger = _Merger(width, m, out_size, after_concat=False)
        self.deepstack_merger_list = nn.ModuleList(
            _Merger(width, m, out_size, after_concat=True) for _ in range(self.num_deepstack)
        )

    def _grids(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[Grid]:
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw of shape {list(grid_thw.shape)}, expected [num_images, 3]")
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        m = self.spatial_merge_size
        for t, h, w in grids:
            if t < 1 or h < 1 or w < 1 or h % m or w % m:
                raise ValueError(f"image grid (t, h, w) = {(t, h, w)} is not a positive grid of {m}x{m} merge units")
        expected = [sum(t * h * w for t, h, w in grids), self.patch_values]
        if list(pixel_values.shape) != expected:
            raise ValueError(f"pixel_values of shape {list(pixel_values.shape)}, expected {expected} for {grids}")
        return grids

    def _learned_positions(self, coords: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """The table interpolated at each patch, float32 [N, width]."""
        side, table = self.table_side, self.pos_embed.weight
        row_taps, row_weights = _bilinear_taps(coords[:, 0], sizes[:, 0], side)
        col_taps, col_weights = _bilinear_taps(coords[:, 1], sizes[:, 1], side)
        total = torch.zeros(len(coords), table.shape[1], dtype=torch.float, device=table.device)
        for row, row_weight in zip(row_taps, row_weights):
            for col, col_weight in zip(col_taps, col_weights):
                total += table[row * side + col].float() * (row_weight * col_weight)[:, None]
        return total

    def _rotary(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim] (float32) of each patch's row angles, then column angles, twice."""
        half = self.head_dim // 2
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=coords.device) / half)
        angles = (coords[..., None].float() * inv_freq).flatten(1)  # [N, d/2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``pixel_values`` [total_patches, channels * temporal_patch_size * patch_size**2] (cast to the parameters'
        dtype and device) and ``grid_thw`` [num_images, 3] (t, h, w in patches) to the merged embeddings
        [sum of t*h*w / spatial_merge_size**2, text_hidden_size] and the DeepStack embeddings: one tensor of that
        shape per ``deepstack_visual_indexes`` entry, in that order. Images in order, each in transformers' order."""
        grids = self._grids(pixel_values, grid_thw)
        weight = self.patch_embed.proj.weight
        x = self.patch_embed(pixel_values.to(weight))
        coords, sizes = _patch_positions(grids, self.spatial_merge_size, weight.device)
        x = x + self._learned_positions(coords, sizes).to(x.dtype)
        cos, sin = self._rotary(coords)
        frames = group_segments([h * w for t, h, w in grids for _ in range(t)], None, weight.device)
        deepstack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            slot = self.deepstack_slots.get(i)
            if slot is not None:
                deepstack.append(self.deepstack_merger_list[slot](x))
        return self.merger(x), deepstack

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the vision encoder's tensors (either layout) out of all of a checkpoint's tensors; the others are not
        read. ``ValueError`` naming a vision tensor with no place or of the wrong shape, or the parameters left
        unfilled."""
        load_named_weights(self, weights, visual_name, DERIVED_SUFFIXES)

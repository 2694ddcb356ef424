"""The image encoder of Qwen2-VL and Qwen2.5-VL (the ``visual`` module of transformers'
``Qwen2VLForConditionalGeneration`` and ``Qwen2_5_VLForConditionalGeneration``).

Input. The image processor resizes an image to a multiple of ``patch_size * spatial_merge_size`` pixels on each side,
repeats a still image ``temporal_patch_size`` times along time, and cuts the result into ``t x h x w`` patches of
``channels * temporal_patch_size * patch_size**2`` values each (``grid_thw`` = (t, h, w)). The patches do not come
row by row: they come in ``spatial_merge_size x spatial_merge_size`` blocks ("merge units"), the blocks row by row
over the ``h/m x w/m`` block grid, each block's patches row by row inside it (m = ``spatial_merge_size``), one
frame after the other. Every step below keeps that order.

Patch embedding. A 3-D convolution whose kernel and stride both equal the patch, without bias, meets each patch
exactly once: it is a linear map of the flattened patch by the kernel flattened the same way, computed so here.

Rotary positions. Each patch has a row and a column index on its frame's ``h x w`` grid. A head of ``d`` values is
rotated by angles ``row * f`` on its first quarter and ``col * f`` on its second, with the ``d/4`` frequencies
``f_i = theta ** (-4i / d)`` (``theta`` = ``rope_parameters["rope_theta"]``, 10000), the same angles again on the
second half (rotate-half pairing: value i with value i + d/2). q and k are rotated in float32.

Blocks. Pre-norm: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``. Attention has one ``qkv`` projection with
bias, ``head_dim ** -0.5`` scaling, a ``proj`` output with bias, and never crosses a frame: each frame of each
image attends only to itself.
- Qwen2-VL: LayerNorms (eps 1e-6), width ``embed_dim``, MLP ``fc2(act(fc1(x)))`` of ``embed_dim * mlp_ratio``
  (``hidden_act``, quick_gelu in the published models).
- Qwen2.5-VL: RMSNorms without bias (eps 1e-6, computed in float32), width ``hidden_size``, gated MLP
  ``down(act(gate(x)) * up(x))`` with biases (``hidden_act``, silu). Blocks listed in ``fullatt_block_indexes``
  attend over the whole frame; the others only inside windows of ``window_size`` pixels: squares of
  ``window_size // patch_size // m`` merge units tiling each frame's block grid from its top-left corner (the last
  row and column of windows cut short). transformers reorders the tokens window by window before the blocks and
  undoes the order after the merger; here the tokens stay in the processor's order and each window's attention
  gathers its tokens (in the same order transformers has them), which gives the same result.

Merger. A last norm (LayerNorm for Qwen2-VL, RMSNorm for Qwen2.5-VL, eps 1e-6) on every token, then each merge unit's
``m*m`` tokens side by side (one vector of ``m*m*width``) through ``Linear, GELU (exact), Linear`` to the output
size: ``vision_config.hidden_size`` for Qwen2-VL, ``vision_config.out_hidden_size`` for Qwen2.5-VL, which must be the
language model's hidden size. One embedding per merge unit, in the processor's order: frame by frame, block row by
block row, which is the order of the image's placeholder tokens in the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from raypaged.model.layers import RMSNorm
from raypaged.model.vision_common import activation, load_named_weights

NORM_EPS = 1e-6
DEFAULT_ROPE_THETA = 10000.0
# a buffer some checkpoints may hold: the frequencies are recomputed from the config, never read
DERIVED_SUFFIXES = ("rotary_pos_emb.inv_freq",)

Grid = tuple[int, int, int]
# attention groups: each tensor [segments, length] holds the token indices of equally long segments, each segment
# attending only to itself; None: the whole sequence is one segment
Groups = list[torch.Tensor] | None


def visual_name(name: str) -> str | None:
    """A checkpoint tensor's name inside ``Qwen2VLImageEncoder``, None for a tensor outside the vision encoder. Both
    layouts: ``model.visual.X`` (transformers 4.52+ and 5) and ``visual.X`` (the published Qwen checkpoints)."""
    name = name.removeprefix("model.")
    if name.startswith("visual."):
        return name.removeprefix("visual.")
    return None


def is_qwen2_vl_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the vision encoder (either layout)."""
    return visual_name(name) is not None


def _norm(size: int, rms: bool) -> nn.Module:
    return RMSNorm(size, NORM_EPS) if rms else nn.LayerNorm(size, eps=NORM_EPS)


class PatchEmbed(nn.Module):
    """The patch convolution (kernel = stride = one patch; Qwen2-VL's without a bias, Qwen3-VL's with one) as a
    matmul over the flattened patches."""

    def __init__(self, vision: PretrainedConfig, width: int, bias: bool = False) -> None:
        super().__init__()
        kernel = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.proj = nn.Conv3d(vision.in_channels, width, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [N, C*T*P*P] -> [N, width]
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [N, heads, d] by the float32 ``cos``/``sin`` [N, d], rotate-half pairing."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    return (x32 * cos[:, None] + torch.cat((-second, first), dim=-1) * sin[:, None]).to(x.dtype)


class _Attention(nn.Module):
    """Multi-head attention inside segments of tokens (frames or windows); ``qkv`` and ``proj`` with biases."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, width // num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: Groups) -> torch.Tensor:
        n = len(x)
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, heads, d]
        out = segment_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, groups)
        return self.proj(out.reshape(n, -1))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Attention of ``q, k, v: [N, heads, d]`` inside each segment of ``groups`` (one batched call for all the segments
    of one length; None: the whole sequence), scaled by ``d ** -0.5``."""
    if groups is None:
        whole = [t.transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, N, d]
        return F.scaled_dot_product_attention(whole[0], whole[1], whole[2])[0].transpose(0, 1)
    out = torch.empty_like(q)
    heads = q.shape[1]
    for index in groups:  # [segments, length]
        segments, length = index.shape
        flat = index.reshape(-1)
        qs, ks, vs = (t[flat].view(segments, length, heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(qs, ks, vs)
        out[flat] = attended.transpose(1, 2).reshape(segments * length, heads, -1)
    return out


class _Mlp(nn.Module):
    """Qwen2-VL's ``fc2(act(fc1(x)))``."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = activation(act, "Qwen2-VL vision hidden_act")
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _GatedMlp(nn.Module):
    """Qwen2.5-VL's ``down_proj(act(gate_proj(x)) * up_proj(x))``, all three with biases."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = activation(act, "Qwen2-VL vision hidden_act")
        self.gate_proj = nn.Linear(width, hidden)
        self.up_proj = nn.Linear(width, hidden)
        self.down_proj = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, width: int, num_heads: int, mlp: nn.Module, rms: bool) -> None:
        super().__init__()
        self.norm1 = _norm(width, rms)
        self.attn = _Attention(width, num_heads)
        self.norm2 = _norm(width, rms)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: Groups) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """``ln_q`` on each token, each merge unit's tokens concatenated, ``mlp`` = Linear, GELU, Linear."""

    def __init__(self, width: int, merge_size: int, out_size: int, rms: bool) -> None:
        super().__init__()
        self.merged = merged = width * merge_size**2
        self.ln_q = _norm(width, rms)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, out_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, width] -> [N / m**2, out_size]
        return self.mlp(self.ln_q(x).reshape(-1, self.merged))


def group_segments(lengths: list[int], order: torch.Tensor | None, device: torch.device) -> Groups:
    """Attention groups for consecutive segments of ``lengths`` tokens of ``order`` (token indices; None: the
    tokens in their own order); segments of one length are batched into one ``[segments, length]`` index."""
    if order is None and len(lengths) == 1:
        return None
    starts_by_length: dict[int, list[int]] = {}
    start = 0
    for length in lengths:
        starts_by_length.setdefault(length, []).append(start)
        start += length
    groups = []
    for length, starts in starts_by_length.items():
        index = torch.tensor(starts)[:, None] + torch.arange(length)
        groups.append((index if order is None else order[index]).to(device))
    return groups


class Qwen2VLImageEncoder(nn.Module):
    """Images (as ``Qwen2VLImageProcessor`` makes them) to the embeddings that replace their placeholder tokens, for
    Qwen2-VL and Qwen2.5-VL. Built from the whole ``Qwen2VLConfig``/``Qwen2_5_VLConfig``; parameters are filled by
    ``load_weights``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        vision = config.vision_config
        self.kind = config.model_type
        if self.kind == "qwen2_vl":
            width, out_size, rms = vision.embed_dim, vision.hidden_size, False
            out_name = "vision_config.hidden_size"
        elif self.kind == "qwen2_5_vl":
            width, out_size, rms = vision.hidden_size, vision.out_hidden_size, True
            out_name = "vision_config.out_hidden_size"
        else:
            raise ValueError(f"model_type {self.kind!r} is not Qwen2-VL's (qwen2_vl) nor Qwen2.5-VL's (qwen2_5_vl)")
        text_hidden = config.text_config.hidden_size
        if out_size != text_hidden:
            raise ValueError(f"{out_name} {out_size} differs from the language model's hidden_size {text_hidden}")
        num_heads = vision.num_heads
        if width % num_heads or (width // num_heads) % 4:
            raise ValueError(f"vision width {width} over {num_heads} heads is not a head size that is a multiple of 4")
        self.spatial_merge_size: int = vision.spatial_merge_size
        self.patch_size: int = vision.patch_size
        self.patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        self.head_dim = width // num_heads
        self.rope_theta = float((getattr(vision, "rope_parameters", None) or {}).get("rope_theta", DEFAULT_ROPE_THETA))
        self.window_units = 0  # merge units on a window's side; 0: no window attention
        self.window_blocks: frozenset[int] = frozenset()
        if self.kind == "qwen2_5_vl":
            self.window_units = vision.window_size // self.spatial_merge_size // self.patch_size
            if self.window_units < 1:
                raise ValueError(
                    f"window_size {vision.window_size} is smaller than a merge unit "
                    f"({self.spatial_merge_size} x {self.patch_size} pixels)"
                )
            full = set(vision.fullatt_block_indexes)
            self.window_blocks = frozenset(i for i in range(vision.depth) if i not in full)

        def mlp() -> nn.Module:
            if rms:
                return _GatedMlp(width, vision.intermediate_size, vision.hidden_act)
            return _Mlp(width, int(width * vision.mlp_ratio), vision.hidden_act)

        self.patch_embed = PatchEmbed(vision, width)
        self.blocks = nn.ModuleList(VisionBlock(width, num_heads, mlp(), rms) for _ in range(vision.depth))
        self.merger = _Merger(width, self.spatial_merge_size, out_size, rms)

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

    def _rotary(self, grids: list[Grid], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim] (float32) of each patch's (row, column) angles, in the processor's order."""
        m = self.spatial_merge_size
        positions = []
        for t, h, w in grids:
            rows = torch.arange(h, device=device)[:, None].expand(h, w)
            cols = torch.arange(w, device=device)[None, :].expand(h, w)
            # row-major (h, w) to the merge-unit order (h/m, w/m, m, m)
            rc = torch.stack([rows, cols], dim=-1).view(h // m, m, w // m, m, 2).transpose(1, 2).reshape(-1, 2)
            positions.append(rc.repeat(t, 1))
        half = self.head_dim // 2
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=device) / half)
        angles = (torch.cat(positions)[..., None].float() * inv_freq).flatten(1)  # [N, d/2]: row's, then column's
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _frame_groups(self, grids: list[Grid], device: torch.device) -> Groups:
        """Each frame of each image attends to itself."""
        return group_segments([h * w for t, h, w in grids for _ in range(t)], None, device)

    def _window_groups(self, grids: list[Grid], device: torch.device) -> Groups:
        """Qwen2.5-VL's windows: per frame, squares of ``window_units`` merge units from the top-left corner, window
        rows top to bottom, windows left to right; inside a window its merge units row by row, each unit's tokens in
        their order (as transformers' reordered sequence has them)."""
        m2, side = self.spatial_merge_size**2, self.window_units
        orders, lengths, offset = [], [], 0
        for t, h, w in grids:
            gh, gw = h // self.spatial_merge_size, w // self.spatial_merge_size
            across = math.ceil(gw / side)
            frame = torch.arange(t)[:, None, None]
            y = torch.arange(gh)[None, :, None]
            x = torch.arange(gw)[None, None, :]
            window = ((frame * math.ceil(gh / side) + y // side) * across + x // side).expand(t, gh, gw).reshape(-1)
            units = torch.argsort(window * (gh * gw) + (y * gw + x).expand(t, gh, gw).reshape(-1))
            orders.append(offset + (units[:, None] * m2 + torch.arange(m2)).reshape(-1))
            counts = torch.bincount(window)
            lengths += (counts[counts > 0] * m2).tolist()
            offset += t * h * w
        return group_segments(lengths, torch.cat(orders), device)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` [total_patches, channels * temporal_patch_size * patch_size**2] (cast to the parameters'
        dtype and device) and ``grid_thw`` [num_images, 3] (t, h, w in patches) to the merged embeddings
        [sum of t*h*w / spatial_merge_size**2, text_hidden_size], images in order, each in transformers' order."""
        grids = self._grids(pixel_values, grid_thw)
        weight = self.patch_embed.proj.weight
        x = self.patch_embed(pixel_values.to(weight))
        cos, sin = self._rotary(grids, weight.device)
        frames = self._frame_groups(grids, weight.device)
        windows = self._window_groups(grids, weight.device) if self.window_blocks else None
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, windows if i in self.window_blocks else frames)
        return self.merger(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the vision encoder's tensors (either layout) out of all of a checkpoint's tensors; the others are not
        read. ``ValueError`` naming a vision tensor with no place or of the wrong shape, or the parameters left
        unfilled."""
        load_named_weights(self, weights, visual_name, DERIVED_SUFFIXES)

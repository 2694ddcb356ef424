"""MXFP4 (OCP microscaling FP4), the format of gpt-oss's published expert weights: each block of 32 values along a
row is 16 bytes of FP4 E2M1 codes (two per byte, the low nibble first) and one E8M0 scale byte (a power of two,
biased by 127). raypaged dequantizes such tensors at load to the model's dtype (``dequantize``); ``quantize`` is
the reference quantizer that writes that exact layout (for tests and for making checkpoints)."""

from __future__ import annotations

import torch

# the 16 E2M1 codes' values: sign bit 3, exponent bits 2-1, mantissa bit 0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` ``[..., G, 16]`` uint8 and ``scales`` ``[..., G]`` uint8 as the ``[..., G * 32]`` values they
    code, in ``dtype``: each code's E2M1 value times 2^(scale - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
            "([..., G, 16] and [..., G])"
        )
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = table[codes].flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[..., K]`` (K a multiple of 32) as MXFP4 (blocks ``[..., K/32, 16]``, scales ``[..., K/32]``):
    each block's scale the power of two that brings its largest magnitude within 6 (E2M1's largest), each value
    rounded to the nearest code (ties to the even code, as round-to-nearest-even on E2M1)."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 rows are whole blocks of {BLOCK} values, got {weight.shape[-1]}")
    x = weight.float().unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    amax = x.abs().amax(-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = x / torch.exp2(exponent)
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    distance = (scaled.abs()[..., None] - magnitudes).abs()  # [..., G, 32, 8]
    nearest = distance.argmin(-1)
    # a tie between two codes goes to the even one (its mantissa bit clear)
    tie = (
        (
            distance.gather(-1, (nearest + 1).clamp(max=7)[..., None])[..., 0]
            == distance.gather(-1, nearest[..., None])[..., 0]
        )
        & (nearest % 2 == 1)
        & (nearest < 7)
    )
    nearest = torch.where(tie, nearest + 1, nearest)
    codes = (nearest | ((scaled < 0) & (nearest > 0)).long() << 3).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent[..., 0] + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()

"""Sub-byte integers packed into int32 words, lowest bits first, as GPTQ, AWQ and compressed-tensors store them."""

from __future__ import annotations

import torch

# AWQ's GEMM layout: nibble i of a word holds column AWQ_ORDER[i] of its 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned ``values`` (each < 2**bits) packed ``32 // bits`` to an int32 along ``dim``.

    Entry ``i`` of a word's run sits at bits ``[i * bits, (i + 1) * bits)``; with ``order`` it holds
    element ``order[i]`` of the run instead of element ``i``.
    """
    per_word = 32 // bits
    moved = values.to(torch.int64).movedim(dim, -1)
    runs = moved.unflatten(-1, (-1, per_word))  # [..., words, per_word]
    if order is not None:
        runs = runs[..., list(order)]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (runs << shifts).sum(-1)  # disjoint bit ranges: the sum is the bitwise or
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of :func:`pack`: int32 words -> unsigned values (int32), ``32 // bits`` times longer on ``dim``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    moved = words.movedim(dim, -1)
    runs = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per_word]
    if order is not None:
        runs = runs[..., [order.index(i) for i in range(len(order))]]
    return runs.flatten(-2).movedim(-1, dim)

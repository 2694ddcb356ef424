"""CUDA W4A16 kernels (``kernels/w4a16.cu``) for 4-bit GPTQ, AWQ and compressed-tensors pack-quantized
weights, and the repacking of each on-disk layout into the kernels' one layout (pure torch, any device).

The layout (:class:`W4A16Weight`) is built once at load (``raypaged.quantization.wna16``): ``qweight``
int32 ``[K' / 8, N4]`` holds 8 consecutive input features of one output column per word (feature
``8r + i`` in bits ``4i .. 4i+3``, unsigned), ``scales`` ``[G, N4]`` (fp16 where every scale is an
fp16 value, else fp32) and ``zeros`` uint8 ``[G, N4]``, layout feature ``j`` in group
``j // group_size``; ``w = float(q - zero) * scale``, bit for bit every format's ``dequantize()``.
GPTQ's act-order features are permuted at load by a stable argsort of ``g_idx`` so each group's
features are contiguous; ``perm[j]`` names the input feature at layout position ``j``, and the
kernels gather x through it. Groups of unequal sizes (a row-parallel rank's share of act-order
groups) or sizes that are not a multiple of 8 are padded to one size (``perm[j] == in_features``:
the kernels read x there as 0 and the dequantized matrix has no row for it). ``N4`` is ``N`` rounded
up to 4 (padding columns are never written out).

:func:`w4a16_linear` runs the GEMV kernel for up to 8 rows of x, else dequantizes the weight into
x's dtype (one kernel) and multiplies with ``torch.matmul`` (cuBLAS). No kernel syncs the host, so
CUDA graphs record them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from raypaged.kernels import loader
from raypaged.kernels.checks import (
    FLOAT_DTYPES,
    check_aligned,
    check_contiguous,
    check_cuda,
    check_shape,
    check_tensor,
)
from raypaged.quantization.packing import AWQ_ORDER

GEMV_MAX_ROWS = 8  # more rows of x: dequantize + torch.matmul
ROW_TIERS = (1, 2, 4, 8)  # the GEMV kernel's instantiations (a kernel takes up to its number of rows)
GEMV_THREADS, GEMV_WARPS, BLOCK_COLUMNS = 256, 8, 128  # kernels/w4a16.cu
REDUCE_THREADS = 256
DEQUANT_BLOCK = (64, 4)  # 64 vectors of 4 columns x 4 word rows
SHARED_BYTES = 48 * 1024  # dynamic shared memory without an opt-in
MIN_SPLIT_WORDS = 64  # word rows a GEMV block takes at least (8 per warp), where K has them
BLOCKS_PER_SM = 2  # the GEMV's launch bounds: 256 threads x up to 128 registers
SCALE_DTYPES = (torch.float16, torch.float32)
_SCALE_SUFFIX = {torch.float16: "f16", torch.float32: "f32"}


@dataclass(frozen=True, eq=False)
class W4A16Weight:
    """One 4-bit layer in the kernels' layout (module docstring); checked when built, so the kernels'
    wrappers check only ``x``. ``in_features``/``out_features``: the layer's K and N.

    ``perm`` is trusted to be a permutation of ``range(in_features)`` with ``in_features`` at padding
    positions (checking it would sync the device); :func:`build_w4a16` makes it so.
    """

    qweight: torch.Tensor  # int32 [K' / 8, N4]
    scales: torch.Tensor  # fp16 or fp32 [G, N4]
    zeros: torch.Tensor  # uint8 [G, N4]
    perm: torch.Tensor | None  # int32 [K'], or None: layout feature j is input feature j
    group_size: int
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        qweight = check_tensor("qweight", self.qweight, (torch.int32,), 2)
        words, n4 = qweight.shape
        if n4 % 4 or not n4 - 4 < self.out_features <= n4:
            raise ValueError(
                f"qweight must have out_features ({self.out_features}) rounded up to a multiple of 4 columns, got {n4}"
            )
        layout_features = 8 * words
        if self.group_size <= 0 or self.group_size % 8 or layout_features % self.group_size:
            raise ValueError(
                f"group_size must be a positive multiple of 8 dividing the layout's {layout_features} input features, "
                f"got {self.group_size}"
            )
        num_groups = layout_features // self.group_size
        check_tensor("scales", self.scales, SCALE_DTYPES, 2)
        check_shape("scales", self.scales, (num_groups, n4))
        check_tensor("zeros", self.zeros, (torch.uint8,), 2)
        check_shape("zeros", self.zeros, (num_groups, n4))
        if self.perm is None:
            if self.in_features != layout_features:
                raise ValueError(
                    f"in_features {self.in_features} must be the layout's {layout_features} input features "
                    "when there is no perm"
                )
        else:
            check_tensor("perm", self.perm, (torch.int32,), 1)
            check_shape("perm", self.perm, (layout_features,))
            if not 0 < self.in_features <= layout_features:
                raise ValueError(
                    f"in_features {self.in_features} must be positive and at most the layout's {layout_features}"
                )
        names, tensors = self.named_tensors()
        if len({t.device for t in tensors}) > 1:
            found = ", ".join(f"{n}={t.device}" for n, t in zip(names, tensors))
            raise ValueError(f"{', '.join(names)} must be on one device; got {found}")
        for name, tensor in zip(names, tensors):
            check_contiguous(name, tensor)
            check_aligned(name, tensor)

    def named_tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        """The layout's tensors by name (``perm`` where there is one)."""
        names, tensors = ["qweight", "scales", "zeros"], [self.qweight, self.scales, self.zeros]
        if self.perm is not None:
            names.append("perm")
            tensors.append(self.perm)
        return names, tensors

    @property
    def layout_features(self) -> int:
        """K': the input features of the layout, padding included."""
        return 8 * self.qweight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.qweight.device


# ---------------------------------------------------------------------------------------------------
# repacking (pure torch, on the tensors' device)


def nibbles(words: torch.Tensor, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """The 4-bit values (uint8) of int32 ``words`` packed 8 to a word along ``dim``, lowest bits first
    (``order``: nibble ``i`` holds element ``order[i]`` of its run, as ``packing.pack`` writes it):
    8 times longer along ``dim``."""
    moved = words.movedim(dim, -1)
    values = torch.empty((*moved.shape, 8), dtype=torch.uint8, device=words.device)
    for i in range(8):
        values[..., i if order is None else order[i]] = ((moved >> (4 * i)) & 15).to(torch.uint8)
    return values.flatten(-2).movedim(-1, dim)


def _pack_words(values: torch.Tensor) -> torch.Tensor:
    """uint8 ``[K', N]`` values < 16 -> int32 ``[K' / 8, N]``: feature ``8r + i`` in bits ``4i .. 4i+3`` of word ``r``
    (int32 arithmetic only: the top nibble enters as its two's-complement value times 2**28)."""
    runs = values.unflatten(0, (-1, 8))  # [K' / 8, 8, N], a view
    words = runs[:, 0].to(torch.int32)
    for i in range(1, 7):
        words |= runs[:, i].to(torch.int32) << (4 * i)
    top = runs[:, 7].to(torch.int32)
    words |= torch.where(top >= 8, top - 16, top) * (1 << 28)
    return words.contiguous()


def _scale_storage(scales: torch.Tensor) -> torch.Tensor:
    """fp16 where every scale is exactly an fp16 value (GPTQ and AWQ store fp16), else fp32."""
    scales = scales.to(torch.float32)
    half = scales.to(torch.float16)
    return half if torch.equal(half.to(torch.float32), scales) else scales


def build_w4a16(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_ids: torch.Tensor) -> W4A16Weight:
    """The layout of ``w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]`` with ``g = group_ids[k]``:
    ``q`` ``[K, N]`` (values 0..15), ``zeros`` ``[G, N]`` (0..16), ``scales`` float ``[G, N]``, ``group_ids``
    ``[K]`` (0..G-1). Not sorted: features are reordered by a stable argsort of ``group_ids``."""
    k, n = q.shape
    num_groups = scales.shape[0]
    if zeros.shape != (num_groups, n) or scales.shape != (num_groups, n) or group_ids.shape != (k,):
        raise ValueError(
            f"q {tuple(q.shape)}, zeros {tuple(zeros.shape)}, scales {tuple(scales.shape)} and group ids "
            f"{tuple(group_ids.shape)} do not describe one [K, N] weight in [G, N] groups"
        )
    device = q.device
    group_ids = group_ids.to(device=device, dtype=torch.long)
    if k == 0 or bool(group_ids.min() < 0) or bool(group_ids.max() >= num_groups):
        raise ValueError(f"every input feature's group must be one of the {num_groups} groups")
    ordered = bool((group_ids[1:] >= group_ids[:-1]).all())
    order = None if ordered else torch.argsort(group_ids, stable=True)
    ids = group_ids if order is None else group_ids[order]
    rows = q if order is None else q[order]
    counts = torch.bincount(ids, minlength=num_groups)
    size = -(-int(counts.max()) // 8) * 8
    zeros = zeros.to(torch.uint8)
    perm: torch.Tensor | None
    if bool((counts == size).all()):
        layout_q = rows
        perm = None if order is None else order.to(torch.int32)
    else:  # every group padded to `size` features, which read x as 0 (their q is 0)
        starts = torch.cumsum(counts, 0) - counts
        position = ids * size + torch.arange(k, device=device) - starts[ids]
        source = torch.arange(k, device=device) if order is None else order
        perm = torch.full((num_groups * size,), k, dtype=torch.int32, device=device)
        perm[position] = source.to(torch.int32)
        layout_q = torch.zeros(num_groups * size, n, dtype=torch.uint8, device=device)
        layout_q[position] = rows.to(torch.uint8)
    pad = -n % 4
    return W4A16Weight(
        qweight=_pack_words(F.pad(layout_q.to(torch.uint8), (0, pad))),
        scales=F.pad(_scale_storage(scales), (0, pad)).contiguous(),
        zeros=F.pad(zeros, (0, pad)).contiguous(),
        perm=perm,
        group_size=size,
        in_features=k,
        out_features=n,
    )


def w4a16_from_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_ids: torch.Tensor, zero_offset: int
) -> W4A16Weight:
    """GPTQ 4-bit: ``qweight`` [K / 8, N] packed along K, ``qzeros`` [G, N / 8] along N (stored zero minus
    ``zero_offset``: 1 in checkpoint format v1), ``scales`` [G, N], each feature's group ``group_ids`` [K]."""
    zeros = nibbles(qzeros, 1) + zero_offset
    return build_w4a16(nibbles(qweight, 0), zeros, scales, group_ids)


def w4a16_from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> W4A16Weight:
    """AWQ (GEMM layout): ``qweight`` [K, N / 8] and ``qzeros`` [G, N / 8] packed along N in AWQ's order,
    ``scales`` [G, N], groups of ``group_size`` consecutive features."""
    q = nibbles(qweight, 1, AWQ_ORDER)
    group_ids = torch.arange(q.shape[0], device=q.device) // group_size
    return build_w4a16(q, nibbles(qzeros, 1, AWQ_ORDER), scales, group_ids)


def w4a16_from_packed(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None, group_size: int
) -> W4A16Weight:
    """compressed-tensors pack-quantized 4-bit: ``weight_packed`` [N, K / 8] (values offset by 8),
    ``weight_scale`` [N, G], ``weight_zero_point`` [N / 8, G] (asymmetric; None: symmetric, zero 8)."""
    q = nibbles(weight_packed, 1).t()  # [K, N]
    k, n = q.shape
    num_groups = weight_scale.shape[1]
    if weight_zero_point is None:
        zeros = torch.full((num_groups, n), 8, dtype=torch.uint8, device=q.device)
    else:
        zeros = nibbles(weight_zero_point, 0).t()
    group_ids = torch.arange(k, device=q.device) // group_size
    return build_w4a16(q, zeros, weight_scale.t(), group_ids)


def w4a16_reference(weight: W4A16Weight) -> torch.Tensor:
    """The layer's weight ``[out_features, in_features]`` in float32 from the layout, in torch: the kernels'
    formula (``float(q - zero) * scale``, one rounding), rows put back in input-feature order."""
    q = nibbles(weight.qweight, 0).to(torch.int32)  # [K', N4]
    groups = torch.arange(weight.layout_features, device=weight.device) // weight.group_size
    w = (q - weight.zeros.to(torch.int32)[groups]).to(torch.float32) * weight.scales.to(torch.float32)[groups]
    w = w[:, : weight.out_features]
    if weight.perm is None:
        return w.t()
    perm = weight.perm.to(torch.long)
    real = perm < weight.in_features
    out = torch.zeros(weight.in_features, weight.out_features, dtype=torch.float32, device=weight.device)
    out[perm[real]] = w[real]
    return out.t()


# ---------------------------------------------------------------------------------------------------
# kernels


def _check_x(x: object, weight: W4A16Weight, max_rows: int | None = None) -> torch.device:
    if not isinstance(weight, W4A16Weight):
        raise TypeError(f"weight must be a W4A16Weight, got {type(weight).__name__}")
    x = check_tensor("x", x, FLOAT_DTYPES, 2)
    check_shape("x", x, (None, weight.in_features))
    check_contiguous("x", x)
    if max_rows is not None and x.shape[0] > max_rows:
        raise ValueError(
            f"x has {x.shape[0]} rows; the GEMV kernel takes at most {max_rows} (w4a16_linear dequantizes "
            "and multiplies for more)"
        )
    names, tensors = weight.named_tensors()
    return check_cuda(["x", *names], [x, *tensors])


def _perm_pointer(weight: W4A16Weight) -> np.uint64:
    return np.uint64(0) if weight.perm is None else loader.device_pointer(weight.perm)


def gemv_splits(rows: int, words: int, padded_out: int, sm_count: int) -> tuple[int, int]:
    """(splits of K, word rows per split) for a GEMV of ``rows`` rows over ``words`` word rows: about
    ``BLOCKS_PER_SM`` blocks per SM, a split's x rows within the shared memory."""
    column_blocks = -(-padded_out // BLOCK_COLUMNS)
    target = -(-BLOCKS_PER_SM * sm_count // column_blocks)
    per_split = max(-(-words // target), MIN_SPLIT_WORDS)
    per_split = min(per_split, SHARED_BYTES // (32 * rows), words)
    return -(-words // per_split), per_split


def w4a16_gemv(x: torch.Tensor, weight: W4A16Weight) -> torch.Tensor:
    """``x @ W^T`` for ``x`` ``[M, in_features]`` with ``M <= 8`` (fp32/fp16/bf16): ``[M, out_features]`` in
    x's dtype, fp32 accumulation."""
    return _gemv(x, weight, _check_x(x, weight, GEMV_MAX_ROWS))


def _gemv(x: torch.Tensor, weight: W4A16Weight, device: torch.device) -> torch.Tensor:
    rows, n = x.shape[0], weight.out_features
    y = torch.empty(rows, n, dtype=x.dtype, device=device)
    if rows == 0:
        return y
    words, padded_out = weight.qweight.shape
    splits, per_split = gemv_splits(rows, words, padded_out, loader.multiprocessors(device))
    tier = next(t for t in ROW_TIERS if t >= rows)
    suffix = loader.DTYPE_SUFFIX[x.dtype]
    kernel = loader.function("w4a16.cu", f"w4a16_gemv_{suffix}_s{_SCALE_SUFFIX[weight.scales.dtype]}_r{tier}", device)
    partial = torch.empty(splits, rows, n, dtype=torch.float32, device=device) if splits > 1 else None
    shared = max(rows * 8 * per_split * 4, GEMV_WARPS * rows * BLOCK_COLUMNS * 4)
    args = (
        loader.device_pointer(y),
        np.uint64(0) if partial is None else loader.device_pointer(partial),
        loader.device_pointer(x),
        loader.device_pointer(weight.qweight),
        loader.device_pointer(weight.scales),
        loader.device_pointer(weight.zeros),
        _perm_pointer(weight),
        np.int32(rows),
        np.int32(weight.in_features),
        np.int32(words),
        np.int32(n),
        np.int32(padded_out),
        np.int32(weight.group_size // 8),
        np.int32(per_split),
    )
    grid = (-(-padded_out // BLOCK_COLUMNS), splits)
    loader.launch(kernel, device, grid, (GEMV_THREADS,), args, shared_mem=shared)
    if partial is not None:
        reduce = loader.function("w4a16.cu", f"w4a16_reduce_{suffix}", device)
        sums = (loader.device_pointer(y), loader.device_pointer(partial), np.int32(splits), np.int32(rows), np.int32(n))
        loader.launch(reduce, device, (-(-n // REDUCE_THREADS), rows), (REDUCE_THREADS,), sums)
    return y


def w4a16_dequantize(weight: W4A16Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense ``[in_features, out_features]`` matrix of ``dtype`` (fp32/fp16/bf16), input
    features in their own order: ``W^T``, ready for ``x @ W^T``. In fp32 bit for bit ``w4a16_reference(weight).t()``;
    in fp16/bf16 those values rounded once."""
    if not isinstance(weight, W4A16Weight):
        raise TypeError(f"weight must be a W4A16Weight, got {type(weight).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(str(d) for d in FLOAT_DTYPES)}; got {dtype}")
    device = check_cuda(*weight.named_tensors())
    return _dequantize(weight, dtype, device)


def _dequantize(weight: W4A16Weight, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    k, n = weight.in_features, weight.out_features
    out = torch.empty(k, n, dtype=dtype, device=device)
    words, padded_out = weight.qweight.shape
    name = f"w4a16_dequant_{loader.DTYPE_SUFFIX[dtype]}_s{_SCALE_SUFFIX[weight.scales.dtype]}"
    kernel = loader.function("w4a16.cu", name, device)
    args = (
        loader.device_pointer(out),
        loader.device_pointer(weight.qweight),
        loader.device_pointer(weight.scales),
        loader.device_pointer(weight.zeros),
        _perm_pointer(weight),
        np.int32(k),
        np.int32(words),
        np.int32(n),
        np.int32(padded_out),
        np.int32(weight.group_size // 8),
    )
    vectors, rows_per_block = DEQUANT_BLOCK
    grid = (-(-(padded_out // 4) // vectors), -(-words // rows_per_block))
    loader.launch(kernel, device, grid, DEQUANT_BLOCK, args)
    return out


def w4a16_linear(x: torch.Tensor, weight: W4A16Weight) -> torch.Tensor:
    """``x @ W^T`` (``x`` ``[M, in_features]``, fp32/fp16/bf16, contiguous): the GEMV kernel for ``M <= 8``,
    else the weight dequantized into x's dtype and ``torch.matmul`` (cuBLAS)."""
    device = _check_x(x, weight)
    if x.shape[0] <= GEMV_MAX_ROWS:
        return _gemv(x, weight, device)
    return torch.matmul(x, _dequantize(weight, x.dtype, device))

"""8-bit weights and 8-bit activations: int8 or fp8 e4m3, per-channel weight scales, per-token
(dynamic) or per-tensor (static) activation scales.

int8 runs through ``torch._int_mm`` (exact int32 accumulation), on a 2-core AVX-512-VNNI EPYC
1.2-1.9x the fp32 oneDNN GEMM on packed weights at SmolLM2's shapes from 32 to 2,048 rows, 0.9x at
8 (benchmarks/results/quant_bench.md). fp8 runs through ``torch._scaled_mm`` on GPUs with fp8 tensor
cores (compute capability 8.9+); elsewhere through the dequantize-then-matmul reference.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from raypaged.attention import cpu_ops
from raypaged.model.layers import gated_rows, linear, ungated_rows
from raypaged.quantization.base import LinearMethod, LinearShape, TensorSpec, layer_tensor

INT8_MAX = 127.0
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12


def quantize_int8(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 x, float32 scale [num_tokens, 1] or [1, 1]): per token when ``scale`` is None, symmetric."""
    x32 = x.to(torch.float32)
    if scale is None:
        scale = x32.abs().amax(-1, keepdim=True).clamp_(min=MIN_SCALE).div_(INT8_MAX)
    else:
        scale = scale.reshape(1, 1)
    return x32.div(scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 x, float32 scale [num_tokens, 1] or [1, 1]): per token when ``scale`` is None."""
    x32 = x.to(torch.float32)
    if scale is None:
        scale = x32.abs().amax(-1, keepdim=True).clamp_(min=MIN_SCALE).div_(FP8_MAX)
    else:
        scale = scale.reshape(1, 1)
    return x32.div(scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def _cpu_kernels() -> Any | None:
    """The C library of ``raypaged.attention.cpu_ops`` (its ``cpu_int8.c``), or None where it cannot be built."""
    return cpu_ops.library() if cpu_ops.builds() else None


INT8_SCRATCH_ERROR = "the CPU int8 GEMM could not allocate its scratch memory"


class PackedInt8Weight(nn.Parameter):
    """An int8 CPU weight ``[out_features, in_features]`` packed for ``cpu_int8.c``'s VNNI GEMM:
    ``[ceil(out / panel), ceil(in / 4), panel, 4]``, with ``colsum`` (int32, each packed column's sum, which
    the kernel takes back after reading the activations as unsigned). :meth:`unpack` gives the weight back.
    ``gated``: an MLP's ``gate | up`` weight in the gated layout of ``layers.PackedWeight`` (each panel half
    gate rows, half the same up rows), for :func:`int8_silu_and_mul_linear`; ``colsum`` is then in the packed
    order."""

    out_features: int
    in_features: int
    colsum: torch.Tensor
    gated: bool

    @staticmethod
    def pack(lib: Any, weight: torch.Tensor, gated: bool = False) -> PackedInt8Weight:
        """``lib``: the CPU kernels, built with VNNI (``raypaged_int8_gemm_panel_width() > 0``)."""
        out_features, in_features = weight.shape
        width = lib.raypaged_int8_gemm_panel_width()
        weight = weight.detach().contiguous()
        if gated:
            weight = gated_rows(weight, width)
        rows = weight.shape[0]
        data = torch.empty(-(-rows // width), -(-in_features // 4), width, 4, dtype=torch.int8)
        colsum = torch.empty(rows, dtype=torch.int32)
        lib.raypaged_pack_weight_int8(
            weight.data_ptr(), rows, in_features, in_features, data.data_ptr(), colsum.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        packed = PackedInt8Weight(data, requires_grad=False)
        packed.out_features, packed.in_features, packed.colsum, packed.gated = out_features, in_features, colsum, gated
        return packed

    def unpack(self) -> torch.Tensor:  # -> [out_features, in_features] int8
        panels, groups, width, _ = self.shape
        columns = self.detach().permute(0, 2, 1, 3).reshape(panels * width, groups * 4)[:, : self.in_features]
        if self.gated:
            return ungated_rows(columns, width, self.out_features)
        return columns[: self.out_features].clone()


def _int8_gemm_lib() -> Any | None:
    """The CPU kernels where they build with the VNNI int8 GEMM (``cpu_int8.c``), else None."""
    lib = _cpu_kernels()
    return lib if lib is not None and lib.raypaged_int8_gemm_panel_width() > 0 else None


def pack_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """An int8 CPU weight ``[N, K]`` as :func:`int8_linear` runs it fastest: a :class:`PackedInt8Weight`
    where the kernels have the VNNI GEMM, else as it is (``torch._int_mm``)."""
    if weight.dtype == torch.int8 and weight.device.type == "cpu" and (lib := _int8_gemm_lib()) is not None:
        return PackedInt8Weight.pack(lib, weight)
    return weight


def _int8_linear_cpu(
    lib: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    silu: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``int8_linear`` for a float32 ``x`` with contiguous rows on CPU, its float ends in C: the same bits.
    A :class:`PackedInt8Weight` runs the VNNI GEMM, the rest ``torch._int_mm`` (the same int32 sums).
    ``silu`` (a gated packed weight): the result is ``silu_and_mul(y + bias)``; ``bias`` is read only then."""
    num_tokens, k = x.shape
    threads = torch.get_num_threads()
    xq = torch.empty(num_tokens, k, dtype=torch.int8)
    if input_scale is None:
        x_scale = torch.empty(num_tokens, 1, dtype=torch.float32)
        fixed = 0.0
    else:
        x_scale = input_scale.reshape(1, 1).to(torch.float32)
        fixed = float(x_scale)
    lib.raypaged_quantize_int8_f32(
        x.data_ptr(), x.stride(0), num_tokens, k, fixed, xq.data_ptr(), x_scale.data_ptr(), threads
    )
    weight_scale = weight_scale.to(torch.float32).contiguous()
    if isinstance(weight, PackedInt8Weight):
        n = weight.out_features
        bias = bias.to(torch.float32).contiguous() if silu and bias is not None else None
        outputs = n // 2 if silu else n
        out = torch.empty(num_tokens, outputs, dtype=torch.float32)
        status = lib.raypaged_int8_linear_f32(
            xq.data_ptr(), num_tokens, k, k, weight.data_ptr(), weight.colsum.data_ptr(), n, x_scale.data_ptr(),
            0 if input_scale is not None else 1, weight_scale.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), outputs, 2 if silu else int(weight.gated), threads,
        )  # fmt: skip
        if status == -1:
            raise MemoryError(INT8_SCRATCH_ERROR)
        return out
    acc = torch._int_mm(xq, weight.t())  # [T, N] int32, exact
    out = torch.empty(acc.shape, dtype=torch.float32)
    lib.raypaged_int8_scale_f32(
        acc.data_ptr(),
        num_tokens,
        acc.shape[1],
        x_scale.data_ptr(),
        0 if input_scale is not None else 1,
        weight_scale.data_ptr(),
        out.data_ptr(),
        threads,
    )
    return out


def int8_silu_and_mul_linear(
    x: torch.Tensor,
    weight: PackedInt8Weight,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``silu_and_mul(int8_linear(x, ...) + bias)`` in one pass for a gated :class:`PackedInt8Weight` and a float32
    CPU ``x`` with contiguous rows: the same bits as those three calls (the C silu_and_mul's)."""
    lib = _cpu_kernels()
    if not weight.gated or lib is None or not _takes_c_path(x, weight.in_features, input_scale):
        raise ValueError(
            "int8_silu_and_mul_linear takes a gated packed int8 weight and float32 CPU inputs of "
            f"{weight.in_features} features with contiguous rows, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    return _int8_linear_cpu(lib, x, weight, weight_scale.view(-1), input_scale, silu=True, bias=bias)


def _takes_c_path(x: torch.Tensor, in_features: int, input_scale: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.stride(1) == 1
        and x.shape[1] == in_features
        and (input_scale is None or float(input_scale) > 0)
    )


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W^T``, W = ``weight`` [N, K] int8 x ``weight_scale`` [N] float32; x quantized to int8. On CPU
    for float32 ``x`` the quantization and the scaling run in C (``cpu_int8.c``), with the same result."""
    out_features, in_features = (
        (weight.out_features, weight.in_features) if isinstance(weight, PackedInt8Weight) else weight.shape
    )
    if (
        _takes_c_path(x, in_features, input_scale)
        and weight_scale.numel() == out_features
        and (lib := _cpu_kernels()) is not None
    ):
        return _int8_linear_cpu(lib, x, weight, weight_scale, input_scale)
    if isinstance(weight, PackedInt8Weight):
        raise ValueError(
            f"a packed int8 weight takes float32 CPU inputs of {in_features} features with contiguous rows, "
            f"got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    xq, x_scale = quantize_int8(x, input_scale)
    num_tokens = xq.shape[0]
    if xq.device.type == "cuda" and num_tokens <= 16:  # cuBLASLt's int8 GEMM wants more than 16 rows
        xq = torch.cat([xq, xq.new_zeros(17 - num_tokens, xq.shape[1])])
    acc = torch._int_mm(xq, weight.t())[:num_tokens]  # [T, N] int32, exact
    return acc.to(torch.float32).mul_(x_scale).mul_(weight_scale).to(x.dtype)


def fake_quantize_fp8(x: torch.Tensor, group: int, scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """float32 ``x`` [rows, K] quantized to fp8 per row and group of ``group`` inputs (``scale``: one per-tensor
    scale instead), then dequantized: what the fp8 linears multiply, in C on CPU (``cpu_fused.c``), bit for bit
    :func:`quantize_fp8` followed by ``xq.float() * x_scale``; None where the C path does not take ``x``."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.stride(1) != 1
        or (scale is not None and not float(scale) > 0)
        or (lib := _cpu_kernels()) is None
    ):
        return None
    rows, k = x.shape
    out = torch.empty(rows, k, dtype=torch.float32)
    lib.raypaged_fake_quantize_fp8_f32(
        x.data_ptr(), rows, k, x.stride(0), group, 0.0 if scale is None else float(scale), MIN_SCALE,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def expand_columns(scale: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """[rows, ceil(k / group)] -> [rows, k]: each group's scale over its inputs."""
    return scale.repeat_interleave(group, 1)[:, :k]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float32 ``weight * scale`` for an fp8 e4m3 ``weight`` [rows, K] and a float ``scale`` [rows or 1,
    ceil(K / group)] (each group of ``group`` inputs of a row scaled by its own; one row: every row by it):
    torch's ``weight.to(torch.float32) * scale`` expanded, bit for bit. On CPU in C (``cpu_fused.c``: the
    widening vectorized; a [3,072 x 576] weight on 2 cores 101 us against torch's 2,530), else in torch."""
    rows, k = weight.shape
    groups = -(-k // group)
    if scale.dim() != 2 or scale.shape[1] != groups or scale.shape[0] not in (1, rows):
        raise ValueError(
            f"an fp8 weight of {rows} x {k} in groups of {group} takes scales [{rows} or 1, {groups}], "
            f"got {list(scale.shape)}"
        )
    scale = scale.to(torch.float32)
    if weight.device.type == "cpu" and weight.is_contiguous() and (lib := _cpu_kernels()) is not None:
        scale = scale.contiguous()
        out = torch.empty(rows, k, dtype=torch.float32)
        row_stride = groups if scale.shape[0] == rows else 0
        lib.raypaged_dequantize_fp8_f32(
            weight.data_ptr(), rows, k, scale.data_ptr(), row_stride, group, out.data_ptr(), torch.get_num_threads()
        )
        return out
    if k % group == 0:
        return (weight.to(torch.float32).view(rows, groups, group) * scale[..., None]).view(rows, k)
    return weight.to(torch.float32) * expand_columns(scale, group, k)


@functools.cache
def _has_fp8_gemm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W^T``, W = ``weight`` [N, K] fp8 x ``weight_scale`` [N] float32; x quantized to fp8."""
    xd = fake_quantize_fp8(x, x.shape[-1], input_scale)  # on CPU: quantized and back in one C pass
    if xd is None:
        xq, x_scale = quantize_fp8(x, input_scale)
        if _has_fp8_gemm(x.device):
            out = torch._scaled_mm(
                xq,
                weight.t(),
                scale_a=x_scale.expand(xq.shape[0], 1).contiguous(),
                scale_b=weight_scale.view(1, -1),
                out_dtype=torch.bfloat16,
            )
            return out.to(x.dtype)
        xd = xq.to(x.dtype) * x_scale.to(x.dtype)
    if x.dtype == torch.float32:
        w = dequantize_fp8(weight, weight_scale.view(-1, 1), weight.shape[1])
    else:
        w = weight.to(x.dtype) * weight_scale.to(x.dtype)[:, None]
    return linear(xd, w)


class W8A8Method(LinearMethod):
    """int8 or fp8 weights as on disk (``weight`` [N, K], ``weight_scale`` [N, 1] or one per tensor);
    ``static``: a per-tensor ``input_scale`` from the checkpoint, else per-token scales at run time."""

    def __init__(self, dtype: torch.dtype, static: bool) -> None:
        self.dtype, self.static = dtype, static
        self.kernel = int8_linear if dtype == torch.int8 else fp8_linear
        self.quantize = quantize_int8 if dtype == torch.int8 else quantize_fp8

    def tensors(self, shape: LinearShape) -> dict[str, TensorSpec]:
        specs = {
            "weight": TensorSpec((shape.out_features, shape.in_features), self.dtype, out_dim=0, in_dim=1),
            "weight_scale": TensorSpec((shape.out_features, 1), torch.float32, out_dim=0, broadcast=True),
        }
        if self.static:
            specs["input_scale"] = TensorSpec((1,), torch.float32, merge="max")
        return specs

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        input_scale = layer.input_scale if self.static else None
        weight, weight_scale = layer.weight, layer.weight_scale
        assert isinstance(weight, torch.Tensor) and isinstance(weight_scale, torch.Tensor)
        assert input_scale is None or isinstance(input_scale, torch.Tensor)
        return self.kernel(x, weight, weight_scale.view(-1), input_scale)

    def finish(self, layer: nn.Module) -> None:
        """int8 weights on CPU, where the kernels build with VNNI: packed for its GEMM (:class:`PackedInt8Weight`)."""
        packed = pack_int8_weight(layer_tensor(layer, "weight"))
        if isinstance(packed, PackedInt8Weight):
            layer.weight = packed

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        weight = layer_tensor(layer, "weight")
        if isinstance(weight, PackedInt8Weight):
            weight = weight.unpack()
        return weight.to(torch.float32) * layer_tensor(layer, "weight_scale")

    def pack_gated(self, layer: nn.Module) -> None:
        """A VNNI-packed int8 gate | up weight packed again, gated."""
        weight = layer_tensor(layer, "weight")
        if isinstance(weight, PackedInt8Weight) and not weight.gated and (lib := _int8_gemm_lib()) is not None:
            layer.weight = PackedInt8Weight.pack(lib, weight.unpack(), gated=True)

    def silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        weight = layer_tensor(layer, "weight")
        input_scale = layer_tensor(layer, "input_scale") if self.static else None
        if (
            not isinstance(weight, PackedInt8Weight)
            or not weight.gated
            or not _takes_c_path(x, weight.in_features, input_scale)
            or (lib := _cpu_kernels()) is None
        ):
            return None
        weight_scale = layer_tensor(layer, "weight_scale").view(-1)
        return _int8_linear_cpu(lib, x, weight, weight_scale, input_scale, silu=True, bias=getattr(layer, "bias", None))


class Fp8OnlineMethod(W8A8Method):
    """vLLM's ``--quantization fp8`` on a float checkpoint: the float ``weight`` is loaded, then
    quantized to fp8 with one scale per output channel; activations get per-token scales."""

    def __init__(self) -> None:
        super().__init__(FP8, static=False)

    def tensors(self, shape: LinearShape) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec((shape.out_features, shape.in_features), torch.float32, out_dim=0, in_dim=1)}

    def finish(self, layer: nn.Module) -> None:
        weight = layer_tensor(layer, "weight").data.to(torch.float32)
        scale = weight.abs().amax(1, keepdim=True).clamp_(min=MIN_SCALE).div_(FP8_MAX)  # [N, 1]
        layer.weight = nn.Parameter((weight / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

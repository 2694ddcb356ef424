"""Packed 4- or 8-bit integer weights with per-group scales (and zeros), 16/32-bit activations:
the tensors of GPTQ, AWQ and compressed-tensors' pack-quantized format, as they lie on disk.

Without a kernel (8 bits, or a float dtype other than float32 on CPU, or a CUDA device without cupy or
``$RAYPAGED_W4A16_KERNELS=1``) every call dequantizes the weight into the activations' dtype and runs the
float GEMM (the reference itself). 4-bit layers are repacked once at load (``finish``) into the one layout of
the CuPy W4A16 kernels (``raypaged.kernels.quant_ops``; act-order features sorted by group):
- on CPU, where the C kernels build, beside the on-disk tensors and with fp32 scales: each float32 call
  dequantizes it in C straight into ``cpu_gemm.c``'s panels for the C GEMM (``packed_w4``);
- on a CUDA device with the switch on, in place of the on-disk tensors: ``apply`` runs the GEMV kernel for up
  to 8 rows, else the weight dequantized by a kernel and cuBLAS.
``dequantize`` gives the same float32 weight as the on-disk formula either way.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod

import torch
from torch import nn

from raypaged import envs
from raypaged.attention import cpu_ops
from raypaged.kernels import loader, quant_ops
from raypaged.model.layers import PackedWeight, linear
from raypaged.model.parallel import TensorParallel
from raypaged.quantization.base import LinearMethod, LinearShape, TensorSpec, layer_tensor
from raypaged.quantization.packing import AWQ_ORDER, unpack


def _shape(layer: nn.Module) -> LinearShape:
    """The features of ``layer`` (a ``QuantLinear``'s ``shape``)."""
    shape = layer.shape
    assert isinstance(shape, LinearShape)
    return shape


def check_split(scheme: str, what: str, features: int, size: int, shape: LinearShape) -> None:
    if features % size:
        total = f" (tensor parallelism splits the layer's {shape.in_total})" if shape.row_sharded else ""
        raise ValueError(f"{scheme}: {what} {size} does not divide a layer's {features} input features{total}")


KERNEL_WEIGHT = "w4a16"  # the layer attribute holding its quant_ops.W4A16Weight


def w4a16_kernels_usable(device: torch.device) -> bool:
    """Whether 4-bit layers on ``device`` run the CuPy W4A16 kernels: a CUDA device where cupy is installed, with
    ``$RAYPAGED_W4A16_KERNELS=1`` (off by default until ``benchmarks/gpu_check.py`` has run their tests on a
    device; replaced in tests to compare with the dequantize-then-matmul path)."""
    return envs.w4a16_kernels() and loader.runs_on(device)


def kernel_weight(layer: nn.Module) -> quant_ops.W4A16Weight | None:
    """The layer's weight in the W4A16 kernels' layout, where ``finish`` built one."""
    weight = getattr(layer, KERNEL_WEIGHT, None)
    assert weight is None or isinstance(weight, quant_ops.W4A16Weight)
    return weight


CPU_WEIGHT = "w4a16_cpu"  # the layer attribute holding, on CPU, its weight in the same layout with fp32 scales


def packed_w4(weight: quant_ops.W4A16Weight) -> PackedWeight:
    """A CPU layer's 4-bit weight (the W4A16 layout, fp32 scales) dequantized by ``cpu_gemm.c`` straight into the
    column panels of a :class:`PackedWeight`, for the C GEMM: the same float32 values as ``w4a16_reference``."""
    lib = cpu_ops.library()
    width = lib.raypaged_gemm_panel_width()
    k, n = weight.in_features, weight.out_features
    data = torch.empty(-(-n // width), k, width)
    lib.raypaged_dequantize_w4_packed_f32(
        weight.qweight.data_ptr(), weight.scales.data_ptr(), weight.zeros.data_ptr(),
        None if weight.perm is None else weight.perm.data_ptr(), k, weight.qweight.shape[0], n,
        weight.qweight.shape[1], weight.group_size, data.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    packed = PackedWeight(data, requires_grad=False)
    packed.out_features, packed.in_features, packed.gated = n, k, False
    return packed


def four_bits_only(bits: int) -> None:
    if bits != 4:
        raise ValueError(f"the W4A16 kernels take 4-bit weights, not {bits}-bit")


class WNA16Method(LinearMethod):
    """Shared forward: the W4A16 kernels where ``finish`` built their layout, else dequantize, then the float GEMM."""

    bits: int
    derived: tuple[str, ...] = ()  # buffers ``finish`` builds from the on-disk tensors (dropped with them)

    def finish(self, layer: nn.Module) -> None:
        """4-bit: the kernels' layout, built once; on CPU where the C kernels build, kept (with fp32 scales) beside
        the on-disk tensors; on a CUDA device with the kernels usable, in their place."""
        device = layer_tensor(layer, next(iter(self.tensors(_shape(layer))))).device
        on_cpu = device.type == "cpu" and cpu_ops.builds()
        on_gpu = w4a16_kernels_usable(device)
        if self.bits != 4 or not (on_cpu or on_gpu):
            return
        weight = self.kernel_layout(layer)
        if on_cpu:
            setattr(layer, CPU_WEIGHT, dataclasses.replace(weight, scales=weight.scales.to(torch.float32)))
        if on_gpu:
            for name in (*self.tensors(_shape(layer)), *self.derived):
                delattr(layer, name)
            setattr(layer, KERNEL_WEIGHT, weight)

    @abstractmethod
    def kernel_layout(self, layer: nn.Module) -> quant_ops.W4A16Weight:
        """The layer's 4-bit weight repacked from its on-disk tensors into the kernels' layout."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight = kernel_weight(layer)
        if weight is not None:
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return quant_ops.w4a16_linear(rows, weight).reshape(*x.shape[:-1], weight.out_features)
        cpu_weight = getattr(layer, CPU_WEIGHT, None)
        if cpu_weight is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return linear(x, packed_w4(cpu_weight))
        return linear(x, self.dequantize(layer).to(x.dtype))

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        weight = kernel_weight(layer)
        return self.dequantize_stored(layer) if weight is None else quant_ops.w4a16_reference(weight)

    @abstractmethod
    def dequantize_stored(self, layer: nn.Module) -> torch.Tensor:
        """The float32 ``[out_features, in_features]`` weight from the on-disk tensors."""


class GPTQMethod(WNA16Method):
    """GPTQ: ``qweight`` [K / pack, N] packed along input features, ``qzeros`` [G, N / pack] (stored
    minus one in checkpoint format v1), ``scales`` [G, N], ``g_idx`` [K] (each input feature's group:
    a permutation's groups under act-order). With act-order a row-parallel rank keeps every group's
    scales and zeros (its features' groups are anywhere) and its own slice of ``g_idx``."""

    def __init__(self, bits: int, group_size: int, desc_act: bool, zero_offset: int) -> None:
        self.bits, self.group_size, self.desc_act, self.zero_offset = bits, group_size, desc_act, zero_offset
        self.pack = 32 // bits

    derived = ("group_ids",)

    def _group(self, shape: LinearShape) -> int:
        return shape.in_total if self.group_size == -1 else self.group_size

    def tensors(self, shape: LinearShape) -> dict[str, TensorSpec]:
        k, n, g, pack = shape.in_features, shape.out_features, self._group(shape), self.pack
        check_split("gptq", "the packing of", k, pack, shape)
        replicated = self.desc_act and shape.row_sharded
        if not replicated:
            check_split("gptq", "group size", k, g, shape)
        num_groups = -(-shape.in_total // g) if replicated else k // g
        group_dim = None if replicated else 0
        return {
            "qweight": TensorSpec((k // pack, n), torch.int32, out_dim=1, in_dim=0, in_pack=pack),
            "qzeros": TensorSpec(
                (num_groups, n // pack), torch.int32, out_dim=1, out_pack=pack, in_dim=group_dim, in_pack=g
            ),
            "scales": TensorSpec((num_groups, n), torch.float32, out_dim=1, in_dim=group_dim, in_pack=g),
            "g_idx": TensorSpec((k,), torch.int32, in_dim=0, merge="same"),
        }

    def finish(self, layer: nn.Module) -> None:
        # without act-order a row-parallel rank holds only its own groups: index them from its first
        first_group = 0
        shape = _shape(layer)
        if shape.row_sharded and not self.desc_act:
            tp = layer.tp
            assert isinstance(tp, TensorParallel)
            first_group = tp.rank * shape.in_features // self._group(shape)
        layer.register_buffer(
            "group_ids", layer_tensor(layer, "g_idx").data.to(torch.long) - first_group, persistent=False
        )
        super().finish(layer)

    def kernel_layout(self, layer: nn.Module) -> quant_ops.W4A16Weight:
        four_bits_only(self.bits)
        return quant_ops.w4a16_from_gptq(
            layer_tensor(layer, "qweight").data,
            layer_tensor(layer, "qzeros").data,
            layer_tensor(layer, "scales").data,
            layer_tensor(layer, "group_ids"),
            self.zero_offset,
        )

    def dequantize_stored(self, layer: nn.Module) -> torch.Tensor:
        q = unpack(layer_tensor(layer, "qweight"), self.bits, 0)  # [K, N]
        zeros = unpack(layer_tensor(layer, "qzeros"), self.bits, 1) + self.zero_offset  # [G, N]
        ids = layer_tensor(layer, "group_ids")
        return ((q - zeros[ids]).to(torch.float32) * layer_tensor(layer, "scales")[ids]).t()


class AWQMethod(WNA16Method):
    """AWQ (GEMM layout): ``qweight`` [K, N / 8] and ``qzeros`` [G, N / 8] packed along output features
    in AWQ's interleaved order, ``scales`` [G, N]."""

    bits = 4

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def _group(self, shape: LinearShape) -> int:
        return shape.in_total if self.group_size == -1 else self.group_size

    def tensors(self, shape: LinearShape) -> dict[str, TensorSpec]:
        k, n, g = shape.in_features, shape.out_features, self._group(shape)
        check_split("awq", "group size", k, g, shape)
        return {
            "qweight": TensorSpec((k, n // 8), torch.int32, out_dim=1, out_pack=8, in_dim=0),
            "qzeros": TensorSpec((k // g, n // 8), torch.int32, out_dim=1, out_pack=8, in_dim=0, in_pack=g),
            "scales": TensorSpec((k // g, n), torch.float32, out_dim=1, in_dim=0, in_pack=g),
        }

    def kernel_layout(self, layer: nn.Module) -> quant_ops.W4A16Weight:
        return quant_ops.w4a16_from_awq(
            layer_tensor(layer, "qweight").data,
            layer_tensor(layer, "qzeros").data,
            layer_tensor(layer, "scales").data,
            self._group(_shape(layer)),
        )

    def dequantize_stored(self, layer: nn.Module) -> torch.Tensor:
        g = self._group(_shape(layer))
        q = unpack(layer_tensor(layer, "qweight"), 4, 1, AWQ_ORDER)  # [K, N]
        zeros = unpack(layer_tensor(layer, "qzeros"), 4, 1, AWQ_ORDER).repeat_interleave(g, 0)
        return ((q - zeros).to(torch.float32) * layer_tensor(layer, "scales").repeat_interleave(g, 0)).t()


class PackedMethod(WNA16Method):
    """compressed-tensors pack-quantized: ``weight_packed`` [N, K / pack] of values offset by
    2**(bits-1), ``weight_scale`` [N, G], ``weight_zero_point`` [N / pack, G] (asymmetric only),
    ``weight_shape`` (checked against the layer, not kept)."""

    def __init__(self, bits: int, group_size: int | None, symmetric: bool) -> None:
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.pack, self.offset = 32 // bits, 1 << (bits - 1)

    def _group(self, shape: LinearShape) -> int:
        return shape.in_total if self.group_size is None else self.group_size

    def tensors(self, shape: LinearShape) -> dict[str, TensorSpec]:
        k, n, g, pack = shape.in_features, shape.out_features, self._group(shape), self.pack
        check_split("compressed-tensors", "the packing of", k, pack, shape)
        check_split("compressed-tensors", "group size", k, g, shape)
        specs = {
            "weight_packed": TensorSpec((n, k // pack), torch.int32, out_dim=0, in_dim=1, in_pack=pack),
            "weight_scale": TensorSpec((n, k // g), torch.float32, out_dim=0, in_dim=1, in_pack=g),
        }
        if not self.symmetric:
            specs["weight_zero_point"] = TensorSpec(
                (n // pack, k // g), torch.int32, out_dim=0, out_pack=pack, in_dim=1, in_pack=g
            )
        return specs

    def checked(self, name: str, tensor: torch.Tensor, rows_read: int, shape: LinearShape) -> bool:
        if name != "weight_shape":
            return False
        rows, columns = tensor.tolist()
        if columns != shape.in_total or rows < rows_read:
            raise ValueError(
                f"weight_shape {[rows, columns]} does not hold the layer's {rows_read} rows of "
                f"{shape.in_total} input features"
            )
        return True

    def kernel_layout(self, layer: nn.Module) -> quant_ops.W4A16Weight:
        four_bits_only(self.bits)
        return quant_ops.w4a16_from_packed(
            layer_tensor(layer, "weight_packed").data,
            layer_tensor(layer, "weight_scale").data,
            None if self.symmetric else layer_tensor(layer, "weight_zero_point").data,
            self._group(_shape(layer)),
        )

    def dequantize_stored(self, layer: nn.Module) -> torch.Tensor:
        g = self._group(_shape(layer))
        q = unpack(layer_tensor(layer, "weight_packed"), self.bits, 1) - self.offset  # [N, K] signed
        if not self.symmetric:
            q = q - (unpack(layer_tensor(layer, "weight_zero_point"), self.bits, 0) - self.offset).repeat_interleave(
                g, 1
            )
        return q.to(torch.float32) * layer_tensor(layer, "weight_scale").repeat_interleave(g, 1)

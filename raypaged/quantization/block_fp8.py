"""fp8 e4m3 weights with block-wise scales: one scale per ``[block_n, block_k]`` tile of the weight, and
activations quantized at run time per token and group of ``block_k`` inputs (vLLM's W8A8 block fp8: the
format of DeepSeek-V3's and Qwen3's FP8 checkpoints, ``quant_method: fp8`` with ``weight_block_size``,
and of compressed-tensors' ``FP8_BLOCK`` scheme).

On disk the scale is ``[ceil(N / block_n), ceil(K / block_k)]``; the layer keeps it expanded to one row per
output feature (``TensorSpec.out_block``), so fused parts (q/k/v, gate/up) and a rank's rows need not start on
a block boundary. Every call dequantizes the weight and the activations and runs the float GEMM: the
reference of vLLM's block-scaled GEMM, on every device.
"""

from __future__ import annotations

import torch
from torch import nn

from raypaged import envs
from raypaged.model.layers import linear
from raypaged.quantization.base import LinearMethod, LinearShape, TensorSpec, layer_tensor
from raypaged.quantization.w8a8 import FP8, FP8_MAX, MIN_SCALE, dequantize_fp8, fake_quantize_fp8
from raypaged.quantization.wna16 import check_split


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 x, float32 scales [num_tokens, ceil(K / group)]): one scale per token and run of ``group``
    inputs (the last run may be shorter), amax / 448."""
    x32 = x.to(torch.float32)
    tokens, k = x32.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x32, (0, groups * group - k)).view(tokens, groups, group)
    scale = padded.abs().amax(-1).clamp_(min=MIN_SCALE).div_(FP8_MAX)
    xq = padded.div(scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return xq.view(tokens, groups * group)[:, :k], scale


def block_shape(value: object) -> tuple[int, int] | None:
    """A checkpoint's ``[block_n, block_k]`` (fp8 ``weight_block_size``, compressed-tensors ``block_structure``)
    when it is two positive integers, else None."""
    if isinstance(value, list) and len(value) == 2 and all(type(b) is int and b > 0 for b in value):
        return value[0], value[1]
    return None


def scaled_mm_takes(x: torch.Tensor, weight: torch.Tensor, block_k: int) -> bool:
    """Whether ``torch._scaled_mm`` runs this product with its 1 x 128 block scales on both sides (groups of
    128 inputs, a scale per token and per output feature): ``$RAYPAGED_BLOCK_FP8_SCALED_MM`` on, a Hopper GPU
    (compute capability 9.0+), block_k 128 and both of the weight's dims multiples of 16."""
    return (
        x.device.type == "cuda"
        and envs.block_fp8_scaled_mm()
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and block_k == 128
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 16 == 0
    )


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """``x @ W^T``, W = ``weight`` [N, K] fp8 x ``scale`` [N, ceil(K / block_k)] (a row per output feature);
    x quantized to fp8 per token and group of ``block_k`` inputs. Where :func:`scaled_mm_takes`, the fp8
    product runs on the tensor cores with both scales applied per group as it accumulates; elsewhere both
    sides are dequantized into x's dtype and multiplied."""
    xd = fake_quantize_fp8(x, block_k)  # on CPU: quantized and back in one C pass
    if xd is None:
        xq, x_scale = quantize_fp8_groups(x, block_k)
        if scaled_mm_takes(x, weight, block_k):
            # cuBLASLt reads 1 x 128 scales outer-dim-major: the tokens' [M, G] with M fastest, the weight's [G, N]
            return torch._scaled_mm(
                xq.contiguous(),
                weight.t(),
                scale_a=x_scale.t().contiguous().t(),
                scale_b=scale.to(torch.float32).t().contiguous(),
                out_dtype=x.dtype,
            )
        xd = dequantize_fp8(xq, x_scale, block_k).to(x.dtype)
    return linear(xd, dequantize_fp8(weight, scale, block_k).to(x.dtype))


class BlockFp8Method(LinearMethod):
    """``weight`` [N, K] fp8 e4m3 and ``scale_name`` [ceil(N / block_n), ceil(K / block_k)] on disk
    (``weight_scale_inv`` in fp8 checkpoints, ``weight_scale`` in compressed-tensors); dynamic activations.
    Under row parallelism a rank's inputs must be whole blocks (``block_k`` divides them), as in vLLM."""

    def __init__(self, block_n: int, block_k: int, scale_name: str) -> None:
        self.block_n, self.block_k, self.scale_name = block_n, block_k, scale_name

    def tensors(self, shape: LinearShape) -> dict[str, TensorSpec]:
        n, k = shape.out_features, shape.in_features
        if shape.row_sharded:
            check_split("fp8", "the weight block size", k, self.block_k, shape)
        return {
            "weight": TensorSpec((n, k), FP8, out_dim=0, in_dim=1),
            self.scale_name: TensorSpec(
                (n, -(-k // self.block_k)),
                torch.float32,
                out_dim=0,
                in_dim=1,
                in_pack=self.block_k,
                out_block=self.block_n,
            ),  # fmt: skip
        }

    def checked(self, name: str, tensor: torch.Tensor, rows_read: int, shape: LinearShape) -> bool:
        """The scale's tiles must cover the layer's inputs and the rows read (it is loaded, not only checked)."""
        if name == self.scale_name:
            columns, rows = -(-shape.in_total // self.block_k), -(-rows_read // self.block_n)
            if tensor.dim() != 2 or tensor.shape[1] != columns or tensor.shape[0] < rows:
                raise ValueError(
                    f"{name} of shape {list(tensor.shape)} does not fit weight_block_size [{self.block_n}, "
                    f"{self.block_k}]: a weight of {rows_read} rows and {shape.in_total} inputs needs "
                    f"[{rows}, {columns}]"
                )
        return False

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block_fp8_linear(x, layer_tensor(layer, "weight"), layer_tensor(layer, self.scale_name), self.block_k)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_fp8(layer_tensor(layer, "weight"), layer_tensor(layer, self.scale_name), self.block_k)

"""fp8 linears on a CUDA device against their float64 references: per-channel weights through
``torch._scaled_mm`` (fp8 tensor cores, compute capability 8.9+) and block-wise weights (vLLM's W8A8
block fp8) through the dequantize-then-matmul path, the same code as on CPU."""

import pytest
import torch

from raypaged.quantization.block_fp8 import block_fp8_linear, quantize_fp8_groups, scaled_mm_takes
from raypaged.quantization.w8a8 import FP8, expand_columns, fp8_linear, quantize_fp8
from tests.gpu import NEEDS_CUDA_AND_CUPY

pytestmark = NEEDS_CUDA_AND_CUPY


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="fp8 tensor cores (compute capability 8.9+) only",
)
def test_scaled_mm_path_equals_the_reference_on_gpu():
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(128, 256, device="cuda").clamp(-448, 448).to(FP8)
    weight_scale = torch.rand(128, device="cuda") / 10
    xq, x_scale = quantize_fp8(x, None)
    expected = (xq.cpu().double() * x_scale.cpu().double()) @ (
        weight.cpu().double() * weight_scale.cpu().double()[:, None]
    ).t()
    torch.testing.assert_close(fp8_linear(x, weight, weight_scale, None).double().cpu(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 40])
def test_block_fp8_linear_on_gpu_equals_the_reference(dtype, num_tokens, monkeypatch):
    """576 inputs in groups of 128: the last group holds 64. The dequantize-then-matmul path."""
    monkeypatch.delenv("RAYPAGED_BLOCK_FP8_SCALED_MM", raising=False)
    x = torch.randn(num_tokens, 576, device="cuda").to(dtype)
    weight = (torch.randn(300, 576, device="cuda") * 100).clamp(-448, 448).to(FP8)
    scale = torch.rand(300, 5, device="cuda") / 100
    xq, x_scale = quantize_fp8_groups(x, 128)
    assert x_scale.shape == (num_tokens, 5)
    expected = (xq.cpu().double() * expand_columns(x_scale.cpu(), 128, 576).double()) @ (
        weight.cpu().double() * expand_columns(scale.cpu(), 128, 576).double()
    ).t()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    out = block_fp8_linear(x, weight, scale, 128)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), expected, rtol=tolerance, atol=tolerance * 10)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="block-scaled fp8 GEMMs (compute capability 9.0+) only",
)
@pytest.mark.parametrize("num_tokens", [1, 40])
@pytest.mark.parametrize("in_features", [512, 576])  # 576: a last group of 64 inputs
def test_block_fp8_scaled_mm_equals_the_reference(num_tokens, in_features, monkeypatch):
    monkeypatch.setenv("RAYPAGED_BLOCK_FP8_SCALED_MM", "1")
    x = torch.randn(num_tokens, in_features, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(304, in_features, device="cuda") * 100).clamp(-448, 448).to(FP8)
    groups = -(-in_features // 128)
    scale = torch.rand(304, groups, device="cuda") / 100
    assert scaled_mm_takes(x, weight, 128)
    xq, x_scale = quantize_fp8_groups(x, 128)
    expected = (xq.cpu().double() * expand_columns(x_scale.cpu(), 128, in_features).double()) @ (
        weight.cpu().double() * expand_columns(scale.cpu(), 128, in_features).double()
    ).t()
    out = block_fp8_linear(x, weight, scale, 128)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double().cpu(), expected, rtol=3e-2, atol=0.3)

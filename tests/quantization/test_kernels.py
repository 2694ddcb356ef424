"""Each scheme's matmul against the dequantize-then-matmul reference in float64."""

import pytest
import torch

from raypaged.quantization.w8a8 import FP8, fp8_linear, int8_linear, quantize_fp8, quantize_int8
from tests.quantization.conftest import load

GEN = torch.Generator().manual_seed(0)


def reference(
    xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    return (xq.double() * x_scale.double()) @ (weight.double() * weight_scale.double()[:, None]).t()


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("static", [False, True])
def test_int8_linear_equals_its_reference(num_tokens, static):
    x = torch.randn(num_tokens, 96, generator=GEN) * 3
    weight = torch.randint(-128, 128, (40, 96), dtype=torch.int8, generator=GEN)
    weight_scale = torch.rand(40, generator=GEN) / 100
    input_scale = torch.tensor([0.05]) if static else None
    xq, x_scale = quantize_int8(x, input_scale)
    assert x_scale.shape == ((1, 1) if static else (num_tokens, 1))
    assert bool((xq.abs() <= 127).all()) and (static or bool((xq.abs().amax(1) == 127).all()))
    out = int8_linear(x, weight, weight_scale, input_scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(xq, x_scale, weight, weight_scale), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 33])
def test_fp8_linear_equals_its_reference(num_tokens):
    x = torch.randn(num_tokens, 96, generator=GEN)
    weight = (torch.randn(40, 96, generator=GEN) * 100).clamp(-448, 448).to(FP8)
    weight_scale = torch.rand(40, generator=GEN) / 100
    xq, x_scale = quantize_fp8(x, None)
    assert xq.dtype == FP8 and bool((xq.float().abs().amax(1) == 448).all())
    torch.testing.assert_close(
        fp8_linear(x, weight, weight_scale, None).double(),
        reference(xq, x_scale, weight, weight_scale),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("name", ["w4a16-asym", "gptq-actorder-asym", "awq"])
def test_4bit_layers_multiply_by_their_dequantized_weight(name, quantized_dirs):
    linear = load(quantized_dirs[name]).model.layers[1].mlp.down_proj
    x = torch.randn(5, 128, generator=GEN)
    expected = x.double() @ linear.dequantize().double().t()
    torch.testing.assert_close(linear(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="fp8 tensor cores (compute capability 8.9+) only",
)
def test_scaled_mm_path_equals_the_reference_on_gpu():
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(128, 256, device="cuda").clamp(-448, 448).to(FP8)
    weight_scale = torch.rand(128, device="cuda") / 10
    xq, x_scale = quantize_fp8(x, None)
    expected = reference(xq.cpu(), x_scale.cpu(), weight.cpu(), weight_scale.cpu())
    torch.testing.assert_close(fp8_linear(x, weight, weight_scale, None).double().cpu(), expected, rtol=2e-2, atol=2e-2)


def torch_int8_linear(x, weight, weight_scale, input_scale):
    """``int8_linear``'s torch path, the reference of its C path on CPU."""
    xq, x_scale = quantize_int8(x, input_scale)
    return torch._int_mm(xq, weight.t()).to(torch.float32).mul_(x_scale).mul_(weight_scale)


@pytest.mark.parametrize("num_tokens", [1, 8, 300])
@pytest.mark.parametrize("static", [False, True])
def test_int8_linear_on_cpu_is_its_torch_path_bit_for_bit(num_tokens, static):
    """The C quantization and scaling (strided rows, many rows on several threads) give the torch path's bits."""
    wide = torch.randn(num_tokens, 300, generator=GEN) * 4
    x = wide[:, 10:266]  # rows at a stride of 300
    weight = torch.randint(-128, 128, (48, 256), dtype=torch.int8, generator=GEN)
    weight_scale = torch.rand(48, generator=GEN) / 100
    input_scale = torch.tensor([0.03]) if static else None
    assert torch.equal(
        int8_linear(x, weight, weight_scale, input_scale), torch_int8_linear(x, weight, weight_scale, input_scale)
    )


def test_int8_quantization_rounds_ties_to_even_as_torch():
    """A row whose largest magnitude is 127 has scale 1: x.5 values round to the even neighbour, and the
    products come back exactly."""
    x = torch.tensor([[127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -127.0]])
    weight = torch.eye(8, dtype=torch.int8)
    out = int8_linear(x, weight, torch.ones(8), None)
    assert out.tolist() == [[127.0, 2.0, -4.0, 0.0, -0.0, 2.0, 126.0, -127.0]]
    assert torch.equal(out, torch_int8_linear(x, weight, torch.ones(8), None))

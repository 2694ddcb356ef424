"""Each scheme's matmul against the dequantize-then-matmul reference in float64."""

import pytest
import torch
from safetensors.torch import load_file

from raypaged.attention import cpu_fused, cpu_ops
from raypaged.attention.backend import CPU
from raypaged.model import cpu_step
from raypaged.quantization import w8a8
from raypaged.quantization.block_fp8 import block_fp8_linear, quantize_fp8_groups
from raypaged.quantization.linear import QuantLinear
from raypaged.quantization.w8a8 import (
    FP8,
    dequantize_fp8,
    expand_columns,
    fake_quantize_fp8,
    fp8_linear,
    int8_linear,
    quantize_fp8,
    quantize_int8,
)
from tests import fused_reference as ref
from tests.conftest import use_kernels_without_avx512
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


@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("in_features", [96, 100])  # 100: a last group of 4 inputs
def test_block_fp8_linear_equals_its_reference(num_tokens, in_features):
    x = torch.randn(num_tokens, in_features, generator=GEN) * torch.linspace(0.1, 10, in_features)
    weight = (torch.randn(40, in_features, generator=GEN) * 100).clamp(-448, 448).to(FP8)
    scale = torch.rand(40, -(-in_features // 32), generator=GEN) / 100
    xq, x_scale = quantize_fp8_groups(x, 32)
    assert x_scale.shape == (num_tokens, -(-in_features // 32))
    groups = [xq[:, g : g + 32].float().abs().amax(1) for g in range(0, in_features, 32)]
    assert bool((torch.stack(groups, 1) == 448).all())  # each group's largest input at fp8's top
    expected = (xq.double() * expand_columns(x_scale, 32, in_features).double()) @ (
        weight.double() * expand_columns(scale, 32, in_features).double()
    ).t()
    torch.testing.assert_close(block_fp8_linear(x, weight, scale, 32).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["fp8-block", "w8a8-fp8-block"])
def test_block_fp8_layers_multiply_by_their_dequantized_weight(name, quantized_dirs):
    """The layer quantizes its input per token and group of block_k (32 / 48) inputs, then multiplies
    by its dequantized weight."""
    linear = load(quantized_dirs[name]).model.layers[1].mlp.down_proj
    block_k = 32 if name == "fp8-block" else 48
    x = torch.randn(5, 128, generator=GEN)
    xq, x_scale = quantize_fp8_groups(x, block_k)
    expected = (xq.double() * expand_columns(x_scale, block_k, 128).double()) @ linear.dequantize().double().t()
    torch.testing.assert_close(linear(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["w4a16-asym", "gptq-actorder-asym", "awq"])
def test_4bit_layers_multiply_by_their_dequantized_weight(name, quantized_dirs):
    linear = load(quantized_dirs[name]).model.layers[1].mlp.down_proj
    x = torch.randn(5, 128, generator=GEN)
    expected = x.double() @ linear.dequantize().double().t()
    torch.testing.assert_close(linear(x).double(), expected, rtol=1e-5, atol=1e-5)


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


@pytest.fixture(params=["native", "avx2"])
def vnni(request, monkeypatch):
    """The CPU kernels with their VNNI int8 GEMM as built for this machine (AVX512-VNNI: 48-column panels of
    8-row tiles) and built without AVX-512 (AVX-VNNI: 24 and 4); skipped where that build has no VNNI."""
    if cpu_ops.unavailable_reason() is not None:
        pytest.skip("the CPU kernels do not build")
    if request.param == "avx2":
        use_kernels_without_avx512(monkeypatch)
    lib = cpu_ops.library()
    if lib.raypaged_int8_gemm_panel_width() == 0:
        pytest.skip(f"no VNNI in the {request.param} build here")
    return lib


@pytest.mark.parametrize("out_features", [1, 23, 48, 49])
@pytest.mark.parametrize("in_features", [4, 7, 96])
def test_int8_packing_lays_out_groups_of_four_in_column_panels(vnni, out_features, in_features):
    width = vnni.raypaged_int8_gemm_panel_width()
    weight = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=GEN)
    packed = w8a8.PackedInt8Weight.pack(vnni, weight)
    assert tuple(packed.shape) == (-(-out_features // width), -(-in_features // 4), width, 4)
    assert (packed.out_features, packed.in_features) == (out_features, in_features)
    assert packed[0, 0, 0].tolist() == weight[0, :4].tolist() + [0] * (4 - min(4, in_features))
    last = out_features - 1
    assert torch.equal(packed[last // width, :, last % width].reshape(-1)[:in_features], weight[last])
    assert torch.equal(packed.colsum, weight.sum(1, dtype=torch.int32))
    assert torch.equal(packed.unpack(), weight)
    columns = packed.detach().permute(0, 2, 1, 3).reshape(-1, packed.shape[1] * 4)
    assert not columns[out_features:].any() and not columns[:, in_features:].any()


@pytest.mark.parametrize(("num_tokens", "in_features", "out_features"), [(1, 96, 48), (3, 5, 1), (8, 259, 49),
                         (13, 96, 100), (17, 576, 23), (22, 7, 48), (515, 36, 50)])  # fmt: skip
@pytest.mark.parametrize("static", [False, True])
def test_the_vnni_gemm_is_int_mm_and_its_scaling_bit_for_bit(vnni, num_tokens, in_features, out_features, static):
    """Rows around the tiles and past the 512-row chunk, columns around the panels, inputs not a multiple of
    four, the extreme weights -128 and 127 and activations of +-127: the exact int32 sums, scaled alike."""
    x = torch.randn(num_tokens, in_features, generator=GEN) * 4
    x[0, 0] = 1000.0  # quantizes to 127; a static scale saturates it
    weight = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=GEN)
    weight[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)[: min(2, in_features)]
    weight_scale = torch.rand(out_features, generator=GEN) / 100
    input_scale = torch.tensor([0.03]) if static else None
    packed = w8a8.PackedInt8Weight.pack(vnni, weight)
    expected = torch_int8_linear(x, weight, weight_scale, input_scale)
    assert torch.equal(int8_linear(x, packed, weight_scale, input_scale), expected)
    wide = torch.zeros(num_tokens, in_features + 9)
    wide[:, 3 : 3 + in_features] = x  # rows apart: quantized in place
    assert torch.equal(int8_linear(wide[:, 3 : 3 + in_features], packed, weight_scale, input_scale), expected)


@pytest.mark.parametrize(("num_tokens", "half"), [(1, 1), (5, 23), (9, 24), (3, 25), (17, 70)])
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_a_gated_int8_weight_gives_the_plain_bits_and_its_silu_those_of_the_three_calls(vnni, num_tokens, half, static):
    """The gated layout (an MLP's gate | up: each panel half gate rows, half the same up rows): int8_linear on it
    gives the plain weight's bits; int8_silu_and_mul_linear gives silu_and_mul(int8_linear + bias)'s."""
    in_features = 40
    x = torch.randn(num_tokens, in_features, generator=GEN)
    weight = torch.randint(-128, 128, (2 * half, in_features), dtype=torch.int8, generator=GEN)
    weight_scale = torch.rand(2 * half, generator=GEN) / 100
    bias = torch.randn(2 * half, generator=GEN)
    input_scale = torch.tensor([0.03]) if static else None
    gated = w8a8.PackedInt8Weight.pack(vnni, weight, gated=True)
    assert gated.gated and torch.equal(gated.unpack(), weight)
    width = vnni.raypaged_int8_gemm_panel_width()
    assert tuple(gated.shape) == (-(-half // (width // 2)), in_features // 4, width, 4)
    plain = torch_int8_linear(x, weight, weight_scale, input_scale)
    assert torch.equal(int8_linear(x, gated, weight_scale, input_scale), plain)
    expected = cpu_fused.silu_and_mul(plain + bias)
    threads = torch.get_num_threads()
    try:
        for count in (threads, 7):
            torch.set_num_threads(count)
            torch.full(expected.shape, float("nan"))  # freed at once: what an output row left unwritten would hold
            fused = w8a8.int8_silu_and_mul_linear(x, gated, weight_scale, input_scale, bias)
            assert torch.equal(fused, expected)
    finally:
        torch.set_num_threads(threads)
    no_bias = w8a8.int8_silu_and_mul_linear(x, gated, weight_scale, input_scale, None)
    assert torch.equal(no_bias, cpu_fused.silu_and_mul(plain))
    message = (
        "int8_silu_and_mul_linear takes a gated packed int8 weight and float32 CPU inputs of 40 features with "
        r"contiguous rows, got torch.float32 \(1, 40\) on cpu"
    )
    with pytest.raises(ValueError, match=message):
        w8a8.int8_silu_and_mul_linear(x[:1], w8a8.PackedInt8Weight.pack(vnni, weight), weight_scale, None, None)


def test_a_packed_int8_weight_refuses_inputs_the_c_path_cannot_take(vnni):
    packed = w8a8.PackedInt8Weight.pack(vnni, torch.ones(8, 16, dtype=torch.int8))
    message = r"a packed int8 weight takes float32 CPU inputs of 16 features with contiguous rows, got torch.bfloat16"
    with pytest.raises(ValueError, match=message):
        int8_linear(torch.ones(2, 16, dtype=torch.bfloat16), packed, torch.ones(8), None)
    with pytest.raises(ValueError, match=r"got torch.float32 \(2, 15\) on cpu"):
        int8_linear(torch.ones(2, 15), packed, torch.ones(8), None)


def test_an_int8_checkpoint_on_cpu_runs_packed_where_the_kernels_have_vnni(quantized_dirs):
    """Loading packs every int8 projection once; its dequantized weight is the checkpoint's, and a layer's
    output is the unpacked path's bit for bit."""
    lib = w8a8._int8_gemm_lib()
    if lib is None:
        pytest.skip("no VNNI int8 GEMM here")
    model = load(quantized_dirs["w8a8-int8"])
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down.weight, w8a8.PackedInt8Weight) and not down.weight.gated
    gate_up = model.model.layers[1].mlp.gate_up_proj
    assert isinstance(gate_up.weight, w8a8.PackedInt8Weight) and gate_up.weight.gated  # its SiLU from its tiles
    checkpoint = load_file(quantized_dirs["w8a8-int8"] / "model.safetensors")
    on_disk = [checkpoint[f"model.layers.1.mlp.{name}_proj.weight"] for name in ("gate", "up")]
    assert torch.equal(gate_up.weight.unpack(), torch.cat(on_disk))
    plain = down.weight.unpack()
    x = torch.randn(5, down.weight.in_features, generator=GEN)
    scale = down.weight_scale.view(-1)
    assert torch.equal(down(x), torch_int8_linear(x, plain, scale, None))
    assert torch.equal(down.dequantize(), plain.float() * down.weight_scale)


def test_the_vnni_gemm_gives_the_same_bits_on_any_thread_count(vnni):
    """More threads than panels split the rows as well; each output is still one tile's sum."""
    x = torch.randn(37, 96, generator=GEN)
    weight = torch.randint(-128, 128, (50, 96), dtype=torch.int8, generator=GEN)
    weight_scale = torch.rand(50, generator=GEN) / 100
    packed = w8a8.PackedInt8Weight.pack(vnni, weight)
    expected = torch_int8_linear(x, weight, weight_scale, None)
    threads = torch.get_num_threads()
    try:
        for count in (1, 7, 16):
            torch.set_num_threads(count)
            torch.full(expected.shape, float("nan"))  # freed at once: what an output row left unwritten would hold
            assert torch.equal(int8_linear(x, packed, weight_scale, None), expected)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_int8_steps_in_one_c_call_give_the_layer_paths_bits(quantized_dirs, static, one_call_runs, monkeypatch):
    """model.cpu_step runs a W8A8 int8 model's steps (prefills, decodes and both; qkv and o biases here) with
    the same bits as its layer-by-layer path; with a static input scale as well."""
    if w8a8._int8_gemm_lib() is None:
        pytest.skip("no VNNI int8 GEMM here")
    model = load(quantized_dirs["w8a8-int8"])
    if static:
        for module in model.modules():
            if isinstance(module, QuantLinear):
                module.method = w8a8.W8A8Method(torch.int8, static=True)
                module.input_scale = torch.nn.Parameter(torch.tensor([0.05]), requires_grad=False)
    got = ref.run_steps(model, CPU, "cpu")
    assert one_call_runs == [15, 4, 2, 2] and cpu_step.unsupported_reason(model.model) is None
    expected = ref.run_steps_layer_by_layer(monkeypatch, model, CPU)
    assert one_call_runs == [15, 4, 2, 2]
    ref.assert_same_steps(got, expected)
    down = model.model.layers[0].mlp.down_proj
    down.method = w8a8.W8A8Method(w8a8.FP8, static=False)
    reason = "a linear is quantized as W8A8 torch.float8_e4m3fn, not W8A8 int8"
    assert cpu_step.unsupported_reason(model.model) == reason


@pytest.mark.parametrize(
    ("rows", "cols", "group", "scale_rows"),
    [(256, 96, 96, 256), (256, 100, 32, 256), (40, 576, 128, 40), (33, 64, 64, 1)],
    ids=["per-row", "groups-last-of-4", "block-128", "one-scale"],
)
def test_fp8_dequantization_in_c_is_torchs_bit_for_bit(rows, cols, group, scale_rows):
    """Every fp8 byte (NaN, subnormals, both zeros included) widened and scaled as torch's
    ``weight.to(float32) * scale`` does; a transposed weight takes the torch path, with the same values."""
    if not cpu_ops.builds():
        pytest.skip("the CPU kernels do not build here")
    weight = torch.arange(rows * cols, dtype=torch.int64).remainder(256).to(torch.uint8).view(FP8).view(rows, cols)
    scale = torch.rand(scale_rows, -(-cols // group), generator=GEN) * 4 + 2**-7
    expected = weight.to(torch.float32) * scale.repeat_interleave(group, 1)[:, :cols]
    torch.testing.assert_close(dequantize_fp8(weight, scale, group), expected, rtol=0, atol=0, equal_nan=True)
    transposed = weight.t().contiguous().t()
    assert not transposed.is_contiguous()
    torch.testing.assert_close(dequantize_fp8(transposed, scale, group), expected, rtol=0, atol=0, equal_nan=True)


def test_fp8_dequantization_refuses_scales_that_do_not_cover_the_weight():
    weight = torch.zeros(8, 100, dtype=FP8)
    with pytest.raises(
        ValueError, match=r"^an fp8 weight of 8 x 100 in groups of 32 takes scales \[8 or 1, 4\], got \[8, 3\]$"
    ):
        dequantize_fp8(weight, torch.ones(8, 3), 32)


@pytest.mark.parametrize(
    ("cols", "group", "static"),
    [(96, 96, False), (96, 96, True), (100, 32, False), (576, 128, False)],
    ids=["per-token", "static", "groups", "block"],
)
def test_fp8_activation_quantization_in_c_is_torchs_bit_for_bit(cols, group, static):
    """x quantized to fp8 and back in one C pass: the values of quantize_fp8 / quantize_fp8_groups then
    ``xq.float() * scale``, also for a row holding a NaN, one holding an infinity, an all-zero row, values at
    fp8's ties and far beyond 448 (static: clamped), and a row read through a stride."""
    if not cpu_ops.builds():
        pytest.skip("the CPU kernels do not build here")
    x = torch.randn(9, cols + 3, generator=GEN) * torch.logspace(-6, 6, cols + 3)
    x[1, 5], x[2, 7], x[3] = float("nan"), float("inf"), 0.0
    x[4, :4] = torch.tensor([1.0625, -1.1875, 2.0**-10, 3 * 2.0**-10])
    x = x[:, :cols]  # rows 3 floats apart beyond their length
    input_scale = torch.tensor([0.37]) if static else None
    if group == cols:
        xq, x_scale = quantize_fp8(x, input_scale)
        expected = xq.to(torch.float32) * x_scale
    else:  # block-wise fp8 takes dynamic activations only
        xq, x_scale = quantize_fp8_groups(x, group)
        expected = xq.to(torch.float32) * expand_columns(x_scale, group, cols)
    got = fake_quantize_fp8(x, group, input_scale)
    assert got is not None
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert bool((got[3] == 0).all())
    nan = got[1].isnan()
    if static:  # only the NaN itself; the infinity clamps to 448 steps of the scale
        assert int(nan.sum()) == 1 and float(got[2, 7]) == float(torch.tensor(448.0) * 0.37)
    else:  # the NaN's (and the infinity's) group: its amax, so its scale, is NaN (inf / inf, 0 * inf)
        assert bool(nan[:group].all()) and not bool(nan[group:].any()) and bool(got[2, :group].isnan().all())

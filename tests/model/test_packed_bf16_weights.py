"""bf16 weights of a bf16 model on CPU (layers.PackedWeight's bf16, cpu_gemm.c's raypaged_linear_bf16): packed
once at load, half the bytes, inputs and outputs fp32. With AVX512-BF16 the inputs are rounded to bf16 and the
products summed in pairs (vdpbf16ps); without it each panel is widened to fp32, which gives the fp32 linear's bits
on the rounded weight."""

import pytest
import torch
from transformers import AutoConfig

from raypaged.attention import cpu_fused, cpu_ops
from raypaged.model.layers import Linear, PackedWeight, linear, pack_weight, silu_and_mul_linear
from raypaged.model.loader import load_model
from raypaged.model.parallel import RowParallelLinear
from tests.conftest import make_tiny_model, use_kernels_without_avx512
from tests.model.test_packed_weights import assert_rows_alike_in_any_batch_and_thread_count, integer_case

HAS_BF16 = "avx512_bf16" in open("/proc/cpuinfo").read()


@pytest.fixture(params=["native", "avx2", "avx512-without-bf16"])
def build(request, monkeypatch):
    """The kernels as built for this machine; built without AVX-512 (4-row tiles of 24-column panels, widened);
    and, where the machine has AVX512-BF16, built without it (8-row tiles of 48 columns, widened)."""
    if cpu_ops.unavailable_reason() is not None:
        pytest.skip("the CPU kernels do not build")
    if request.param == "avx2":
        use_kernels_without_avx512(monkeypatch)
    elif request.param == "avx512-without-bf16":
        if not HAS_BF16:
            pytest.skip("no AVX512-BF16 here: the native build is this one")
        library = cpu_ops.library
        monkeypatch.setattr(cpu_ops, "library", lambda: library(("-mno-avx512bf16",)))
    lib = cpu_ops.library()
    return lib.raypaged_gemm_panel_width(), bool(lib.raypaged_gemm_bf16_pairs())


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).view(torch.int16)


def test_the_native_build_pairs_inputs_exactly_where_the_cpu_has_avx512_bf16():
    if cpu_ops.unavailable_reason() is not None:
        pytest.skip("the CPU kernels do not build")
    assert bool(cpu_ops.library().raypaged_gemm_bf16_pairs()) == HAS_BF16


@pytest.mark.parametrize(("out_features", "in_features"), [(1, 9), (23, 8), (49, 9), (130, 33)])
def test_packing_rounds_to_torchs_bf16_and_lays_out_panels_padded_with_zeros(build, out_features, in_features):
    width, pairs = build
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, in_features) * 3
    weight[0, :4] = torch.tensor([float("nan"), float("inf"), 3.4e38, -0.0])  # NaN, inf, rounds to inf, -0
    weight[-1, -1] = 1 + 2**-8  # halfway between two bf16 values: to the even one
    packed = pack_weight(weight, bf16=True)
    assert isinstance(packed, PackedWeight) and packed.bf16 and packed.dtype == torch.bfloat16
    panels = -(-out_features // width)
    if pairs:
        assert tuple(packed.shape) == (panels, -(-in_features // 2), width, 2)
        assert packed[0, 0, 0, 0].item() != packed[0, 0, 0, 0].item()  # feature 0 of column 0: the NaN
        assert packed[0, 0, 0, 1] == float("inf")  # its feature 1 beside it
    else:
        assert tuple(packed.shape) == (panels, in_features, width)
        assert packed[0, 1, 0] == float("inf")
    assert torch.equal(bits(packed.unpack()), bits(weight))
    assert packed.unpack()[-1, -1] == 1.0
    assert int((packed.detach().float() != 0).sum()) == int((weight.bfloat16() != 0).sum())  # padding: zeros


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [(1, 5, 1), (3, 64, 96), (4, 64, 48), (5, 7, 49), (8, 80, 130), (9, 80, 130), (17, 576, 72), (515, 33, 50)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_products_of_small_integers_are_exact_for_every_tile_and_panel_edge(
    build, rows, in_features, out_features, bias
):
    """Small integers are bf16 values and every sum of their products is exact, paired or not; odd feature counts
    end their last pair with a zero."""
    x, weight, b, exact = integer_case(rows, in_features, out_features, bias)
    assert torch.equal(linear(x, pack_weight(weight, bf16=True), b), exact)


@pytest.mark.parametrize("rows", [3, 8, 9, 37])
def test_without_bf16_instructions_a_product_has_the_fp32_linears_bits_on_the_rounded_weight(build, rows):
    """Up to 2 tiles of rows (8 or 16) widen the weight as the tiles load it, more widen each panel once first."""
    _, pairs = build
    if pairs:
        pytest.skip("this build pairs the inputs for vdpbf16ps (the next test)")
    torch.manual_seed(0)
    weight, x, b = torch.randn(200, 577), torch.randn(rows, 577), torch.randn(200)
    rounded = weight.bfloat16().float()
    assert torch.equal(linear(x, pack_weight(weight, bf16=True), b), linear(x, pack_weight(rounded), b))


def test_with_bf16_instructions_a_product_is_the_rounded_inputs_product_within_fp32_rounding(build):
    _, pairs = build
    if not pairs:
        pytest.skip("this build widens the weight (the test before)")
    torch.manual_seed(0)
    weight, x, b = torch.randn(200, 577), torch.randn(37, 577), torch.randn(200)
    reference = x.bfloat16().double() @ weight.bfloat16().double().T + b.double()
    got = linear(x, pack_weight(weight, bf16=True), b)
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, x @ weight.bfloat16().float().T + b)  # the inputs were rounded: not fp32's product


def test_a_row_gets_the_same_bits_in_any_batch_and_with_any_thread_count(build):
    torch.manual_seed(1)
    weight, x, b = torch.randn(200, 576), torch.randn(37, 576), torch.randn(200)
    assert_rows_alike_in_any_batch_and_thread_count(x, pack_weight(weight, bf16=True), b)


@pytest.mark.parametrize(("rows", "in_features", "half"), [(1, 5, 1), (4, 64, 24), (9, 81, 25), (515, 33, 37)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_gated_weight_gives_the_plain_bits_and_its_silu_those_of_the_separate_pass(
    build, rows, in_features, half, bias
):
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, in_features), torch.randn(2 * half, in_features)
    b = torch.randn(2 * half) if bias else None
    gated = pack_weight(weight, gated=True, bf16=True)
    assert gated.gated and torch.equal(bits(gated.unpack()), bits(weight))
    plain = linear(x, pack_weight(weight, bf16=True), b)
    assert torch.equal(linear(x, gated, b), plain)
    fused = silu_and_mul_linear(x, gated, b)
    assert fused.shape == (rows, half) and torch.equal(fused, cpu_fused.silu_and_mul(plain))


def test_a_bf16_weight_refuses_other_inputs_by_shape_and_dtype(build):
    packed = pack_weight(torch.randn(8, 16), bf16=True)
    message = (
        r"a packed \[8 x 16\] bf16 CPU weight takes float32 CPU inputs of 16 features, got torch.bfloat16 \(2, 16\)"
    )
    with pytest.raises(ValueError, match=message):
        linear(torch.randn(2, 16, dtype=torch.bfloat16), packed)


@pytest.mark.parametrize("tied", [False, True])
def test_a_bf16_model_on_cpu_loads_in_fp32_with_every_float_linear_the_head_and_the_embeddings_in_bf16(
    build, tmp_path, smollm2_dir, tied
):
    path = make_tiny_model(tmp_path, smollm2_dir, "llama", tie_word_embeddings=tied)
    config = AutoConfig.from_pretrained(path)
    model = load_model(path, config, 64, torch.float32, torch.device("cpu"), bf16_linears=True)
    reference = load_model(path, config, 64, torch.float32, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, (Linear, RowParallelLinear))]
    assert len(linears) == 2 * 4 and all(m.weight.bf16 for m in linears)
    for got, fp32 in zip(linears, (m for m in reference.modules() if isinstance(m, (Linear, RowParallelLinear)))):
        assert got.weight.gated == fp32.weight.gated
        assert torch.equal(bits(got.weight.unpack()), bits(fp32.weight.unpack()))
    embed = model.model.embed_tokens  # rows kept in bf16, each looked up widened
    assert embed.weight.dtype == torch.bfloat16 and torch.equal(
        bits(embed.weight), bits(reference.model.embed_tokens.weight)
    )
    ids = torch.tensor([0, 5, 511])
    assert torch.equal(embed(ids), reference.model.embed_tokens.weight[ids].bfloat16().float())
    head = embed.head_weight if tied else model.lm_head.weight
    expected = reference.model.embed_tokens.weight if tied else reference.lm_head.weight.unpack()
    assert head.bf16 and torch.equal(bits(head.unpack()), bits(expected))
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n)


def test_a_bf16_model_is_built_in_bf16_and_each_weight_packed_from_its_bf16_values(tmp_path, smollm2_dir, monkeypatch):
    """No fp32 copy of a bf16 model's weights is ever held whole (for a 7B model, 28 GB at load): the model is built
    and loaded in bf16, each float linear's weight widened only as it is packed, the rest cast to fp32 after. Loading
    SmolLM2's bf16 checkpoint peaked at 849 MB resident, as torch's bf16 model does, against 1,112 built in fp32."""
    if cpu_ops.unavailable_reason() is not None:
        pytest.skip("the CPU kernels do not build")
    path = make_tiny_model(tmp_path, smollm2_dir, "llama")
    packed, pack = [], PackedWeight.pack
    monkeypatch.setattr(PackedWeight, "pack", lambda weight, *args: packed.append(weight.dtype) or pack(weight, *args))
    config = AutoConfig.from_pretrained(path)
    model = load_model(path, config, 64, torch.float32, torch.device("cpu"), bf16_linears=True)
    assert packed == [torch.bfloat16] * (2 * 4 + 1)  # the layers' linears and the head
    rest = {name: p for name, p in model.named_parameters() if not isinstance(p, PackedWeight)}
    assert sorted({p.dtype for p in rest.values()}, key=str) == [torch.bfloat16, torch.float32]
    assert [name for name, p in rest.items() if p.dtype == torch.bfloat16] == ["model.embed_tokens.weight"]

"""fp32 CPU linears run on weights packed once at load: into cpu_gemm.c's column panels (layers.PackedWeight)
where the C kernels build, else into oneDNN's layout (layers.pack_weight_onednn)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from raypaged.attention import cpu_fused, cpu_ops
from raypaged.model.layers import (
    Linear,
    PackedWeight,
    linear,
    pack_weight,
    pack_weight_onednn,
    silu_and_mul_linear,
)
from raypaged.model.loader import load_model
from raypaged.model.parallel import RowParallelLinear
from tests.conftest import make_tiny_model, use_kernels_without_avx512

needs_kernels = pytest.mark.skipif(cpu_ops.unavailable_reason() is not None, reason="the CPU kernels do not build")
needs_onednn = pytest.mark.skipif(
    not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not torch.backends.mkldnn.is_available(),
    reason="this torch has no oneDNN linear",
)


def integer_case(rows: int, in_features: int, out_features: int, bias: bool, seed: int = 0):
    """Small integers: every product and sum is exact in fp32, so any summation order gives the exact result."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (rows, in_features), generator=gen).float()
    weight = torch.randint(-8, 9, (out_features, in_features), generator=gen).float()
    b = torch.randint(-100, 101, (out_features,), generator=gen).float() if bias else None
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    return x, weight, b, exact.float()


@pytest.fixture(params=["native", "avx2"])
def build(request, monkeypatch):
    """The kernels as built for this machine, and (where it has AVX-512) built without it: 4-row tiles of
    24-column panels instead of 8 of 48, as AVX2-only machines run."""
    if cpu_ops.unavailable_reason() is not None:
        pytest.skip("the CPU kernels do not build")
    if request.param == "avx2":
        use_kernels_without_avx512(monkeypatch)
    return cpu_ops.library().raypaged_gemm_panel_width()


@pytest.mark.parametrize("out_features", [1, 23, 24, 48, 49, 130])
def test_packing_lays_out_column_panels_padded_with_zeros(build, out_features):
    width = build
    weight = torch.randn(out_features, 9)
    packed = pack_weight(weight)
    assert isinstance(packed, PackedWeight) and not packed.requires_grad
    panels = -(-out_features // width)
    assert tuple(packed.shape) == (panels, 9, width)
    assert (packed.out_features, packed.in_features) == (out_features, 9)
    for column in (0, out_features - 1):
        assert torch.equal(packed[column // width, :, column % width], weight[column])
    assert not packed.detach().transpose(1, 2).reshape(-1, 9)[out_features:].any()
    assert torch.equal(packed.unpack(), weight)


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [(1, 5, 1), (3, 64, 96), (4, 64, 48), (5, 7, 49), (8, 80, 130), (9, 80, 130), (17, 576, 72), (515, 33, 50)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_are_exact_for_every_tile_and_panel_edge(build, rows, in_features, out_features, bias):
    """Row counts around the 4- and 8-row tiles and past the 512-row chunk, columns around the 24- and
    48-column panels."""
    x, weight, b, exact = integer_case(rows, in_features, out_features, bias)
    assert torch.equal(linear(x, pack_weight(weight), b), exact)


def test_strided_and_batched_inputs(build):
    x, weight, b, exact = integer_case(6, 40, 30, bias=True)
    packed = pack_weight(weight)
    wide = torch.zeros(6, 100)
    wide[:, 10:50] = x  # rows 100 apart: read in place
    assert torch.equal(linear(wide[:, 10:50], packed, b), exact)
    assert torch.equal(linear(x.T.contiguous().T, packed, b), exact)  # columns apart: copied first
    assert torch.equal(linear(x.view(2, 3, 40), packed, b), exact.view(2, 3, 30))
    assert linear(x[:0], packed, b).shape == (0, 30)


def test_a_row_gets_the_same_bits_in_any_batch_and_with_any_thread_count(build):
    torch.manual_seed(0)
    weight, x, b = torch.randn(200, 576), torch.randn(37, 576), torch.randn(200)
    packed = pack_weight(weight)
    torch.testing.assert_close(linear(x, packed, b), x @ weight.T + b, rtol=1e-5, atol=1e-4)
    assert_rows_alike_in_any_batch_and_thread_count(x, packed, b)


def assert_rows_alike_in_any_batch_and_thread_count(x: torch.Tensor, packed: PackedWeight, b: torch.Tensor) -> None:
    """x [37, in]: each row's product the same bits alone, in a slice of the batch, and with 1, 7 or 16 threads"""
    batched = linear(x, packed, b)
    for row in (0, 9, 36):
        assert torch.equal(linear(x[row : row + 1], packed, b), batched[row : row + 1])
    assert torch.equal(linear(x[5:21], packed, b), batched[5:21])
    threads = torch.get_num_threads()
    try:
        for count in (1, 7, 16):  # more threads than the 5 (native) or 9 (AVX2) panels: the rows are split too
            torch.set_num_threads(count)
            torch.full(batched.shape, float("nan"))  # freed at once: what an output row left unwritten would hold
            assert torch.equal(linear(x, packed, b), batched)
            assert torch.equal(linear(x[:3], packed, b), batched[:3])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("half", [1, 11, 12, 24, 25, 70])
def test_the_gated_layout_puts_each_panels_gate_rows_beside_the_same_up_rows(build, half):
    width = build
    weight = torch.randn(2 * half, 9)
    packed = pack_weight(weight, gated=True)
    assert packed.gated and (packed.out_features, packed.in_features) == (2 * half, 9)
    panels = -(-half // (width // 2))
    assert tuple(packed.shape) == (panels, 9, width)
    columns = packed.detach().transpose(1, 2).reshape(panels, 2, width // 2, 9)
    for j in (0, half - 1):  # gate row j and up row j: the same panel, the same place in its halves
        assert torch.equal(columns[j // (width // 2), 0, j % (width // 2)], weight[j])
        assert torch.equal(columns[j // (width // 2), 1, j % (width // 2)], weight[half + j])
    halves = columns.transpose(0, 1).reshape(2, panels * (width // 2), 9)  # gate rows, up rows: zeros past half
    assert torch.equal(halves[:, :half], weight.view(2, half, 9)) and not halves[:, half:].any()
    assert torch.equal(packed.unpack(), weight)


@pytest.mark.parametrize(("rows", "in_features", "half"), [(1, 5, 1), (4, 64, 24), (9, 80, 25), (515, 33, 37)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_gated_weight_gives_the_plain_bits_and_its_silu_those_of_the_separate_pass(
    build, rows, in_features, half, bias
):
    x, weight, b, exact = integer_case(rows, in_features, 2 * half, bias)
    gated = pack_weight(weight, gated=True)
    assert torch.equal(linear(x, gated, b), exact)
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, in_features), torch.randn(2 * half, in_features)
    b = torch.randn(2 * half) if bias else None
    plain = linear(x, pack_weight(weight), b)
    assert torch.equal(linear(x, pack_weight(weight, gated=True), b), plain)
    fused = silu_and_mul_linear(x, pack_weight(weight, gated=True), b)
    assert fused.shape == (rows, half) and torch.equal(fused, cpu_fused.silu_and_mul(plain))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(7)
        torch.full(fused.shape, float("nan"))  # freed at once: what an output row left unwritten would hold
        assert torch.equal(silu_and_mul_linear(x, pack_weight(weight, gated=True), b), fused)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_a_gated_weight_needs_even_rows_and_the_fused_silu_a_gated_weight():
    with pytest.raises(ValueError, match="a gated \\(gate \\| up\\) weight has an even number of rows, got 7"):
        PackedWeight.pack(torch.randn(7, 16), gated=True)
    message = r"silu_and_mul_linear takes a weight packed gated \(PackedWeight.pack\(weight, gated=True\)\)"
    with pytest.raises(ValueError, match=message):
        silu_and_mul_linear(torch.randn(2, 16), PackedWeight.pack(torch.randn(8, 16)))


@needs_kernels
def test_a_packed_weight_refuses_other_inputs_by_shape_and_dtype():
    packed = pack_weight(torch.randn(8, 16))
    message = (
        r"a packed \[8 x 16\] float32 CPU weight takes float32 CPU inputs of 16 features, "
        r"got torch.float32 \(2, 15\) on cpu"
    )
    with pytest.raises(ValueError, match=message):
        linear(torch.randn(2, 15), packed)
    with pytest.raises(ValueError, match=r"got torch.bfloat16 \(2, 16\) on cpu"):
        linear(torch.randn(2, 16, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match=r"with contiguous rows packs, got torch.float16 \(8, 16\) on cpu"):
        PackedWeight.pack(torch.randn(8, 16, dtype=torch.float16))


@needs_onednn
@pytest.mark.parametrize("rows", [2, 3, 32, 129])
def test_onednn_packed_products_equal_the_plain_weights_bit_for_bit(rows):
    torch.manual_seed(0)
    weight, x = torch.randn(96, 80), torch.randn(rows, 80)
    packed = pack_weight_onednn(weight)
    assert packed.is_mkldnn and not packed.requires_grad and tuple(packed.shape) == (96, 80)
    assert torch.equal(packed.to_dense(), weight)
    assert torch.equal(linear(x, packed), linear(x, weight))


@needs_onednn
def test_a_single_row_through_the_onednn_packed_weight_is_the_product_within_rounding():
    torch.manual_seed(0)
    weight, x = torch.randn(96, 80), torch.randn(1, 80)
    torch.testing.assert_close(linear(x, pack_weight_onednn(weight)), x @ weight.T, rtol=1e-5, atol=1e-5)


def _load(path, dtype=torch.float32):
    return load_model(path, AutoConfig.from_pretrained(path), 64, dtype, torch.device("cpu"))


@needs_kernels
@pytest.mark.parametrize("tied", [False, True])
def test_loading_an_fp32_model_on_cpu_packs_every_float_linear_and_the_head(tmp_path, smollm2_dir, tied):
    path = make_tiny_model(tmp_path, smollm2_dir, "llama", tie_word_embeddings=tied)
    checkpoint = load_file(path / "model.safetensors")
    model = _load(path)
    linears = [m for m in model.modules() if isinstance(m, (Linear, RowParallelLinear))]
    assert len(linears) == 2 * 4 and all(isinstance(m.weight, PackedWeight) for m in linears)
    layer = model.model.layers[1]
    assert torch.equal(layer.self_attn.o_proj.weight.unpack(), checkpoint["model.layers.1.self_attn.o_proj.weight"])
    assert [m.weight.gated for m in linears] == [False, False, True, False] * 2  # qkv, o, gate_up, down
    gate_up = torch.cat([checkpoint[f"model.layers.1.mlp.{name}_proj.weight"] for name in ("gate", "up")])
    assert torch.equal(layer.mlp.gate_up_proj.weight.unpack(), gate_up)
    embed = model.model.embed_tokens
    assert not isinstance(embed.weight, PackedWeight)  # looked up by row
    assert torch.equal(embed.weight, checkpoint["model.embed_tokens.weight"])
    if tied:  # the head is a packed copy beside the embedding's rows
        assert model.lm_head is None and isinstance(embed.head_weight, PackedWeight)
        assert torch.equal(embed.head_weight.unpack(), checkpoint["model.embed_tokens.weight"])
    else:
        assert embed.head_weight is None and model.lm_head.head_weight is None
        assert isinstance(model.lm_head.weight, PackedWeight)
        assert torch.equal(model.lm_head.weight.unpack(), checkpoint["lm_head.weight"])
    hidden = torch.randn(3, 64)
    head = checkpoint["model.embed_tokens.weight" if tied else "lm_head.weight"]
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ head.T, rtol=1e-5, atol=1e-5)


def test_other_dtypes_keep_plain_weights(tmp_path, smollm2_dir):
    model = _load(make_tiny_model(tmp_path, smollm2_dir, "llama"), torch.bfloat16)
    assert not any(isinstance(p, PackedWeight) or p.is_mkldnn for p in model.parameters())
    assert model.model.embed_tokens.head_weight is None

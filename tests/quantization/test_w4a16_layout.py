"""The W4A16 kernels' layout (raypaged.kernels.quant_ops), built on CPU from every 4-bit checkpoint format.

Each layer's on-disk tensors are repacked exactly as ``finish`` repacks them on CUDA; the layout is then
read back by a plain-torch emulation of the kernels' formula (the nibble under the exponent of 2**23
minus 2**23 + zero, times the scale, in fp32) and must give the method's ``dequantize()`` bit for bit:
(q - zero) is exact in either formula and both round its product with the same fp32 scale once.
A matmul of x gathered through the layout's permutation (padding reads 0) with the layout-order weight
equals ``x @ dequantize().T`` within fp32 rounding (the sums run in another order)."""

import pytest
import torch
import torch.nn.functional as F

from raypaged.kernels import quant_ops
from raypaged.kernels.quant_ops import W4A16Weight, build_w4a16, nibbles
from raypaged.model.parallel import TensorParallel
from raypaged.quantization import wna16
from raypaged.quantization.linear import QuantLinear
from raypaged.quantization.packing import AWQ_ORDER, pack, unpack
from raypaged.quantization.quantizer import quantize_checkpoint
from tests.quantization.conftest import load

FORMATS = ["gptq", "gptq-asym", "gptq-actorder-asym", "gptq-channel", "awq", "w4a16", "w4a16-asym"]
MAGIC = 0x4B000000  # the float 2**23


@pytest.fixture(scope="module")
def checkpoints(quantized_dirs, tiny_float_dir, tmp_path_factory):
    """The shared 4-bit checkpoints, and GPTQ asymmetric without act-order."""
    root = tmp_path_factory.mktemp("w4a16_layout")
    extra = {
        "gptq-asym": quantize_checkpoint(tiny_float_dir, root / "gptq-asym", "gptq", group_size=32, symmetric=False)
    }
    return {**quantized_dirs, **extra}


def quant_linears(model):
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def as_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def emulate(weight: W4A16Weight) -> torch.Tensor:
    """The layout-order weight ``[K', N]`` (fp32) as the kernels compute it, from the words' bits."""
    words = weight.qweight.to(torch.int64) & 0xFFFFFFFF  # unsigned
    q = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=1).flatten(0, 1)  # row 8r + i: nibble i of row r
    groups = torch.arange(q.shape[0]) // weight.group_size
    zeros = weight.zeros.to(torch.int64)[groups]
    difference = as_float(MAGIC | q) - as_float(MAGIC | zeros)  # (2**23 + q) - (2**23 + zero), exact
    return (difference * weight.scales.to(torch.float32)[groups])[:, : weight.out_features]


def in_input_order(weight: W4A16Weight, layout_rows: torch.Tensor) -> torch.Tensor:
    """``[N, K]``: layout rows put back at their input features (padding rows dropped)."""
    if weight.perm is None:
        return layout_rows.t()
    perm = weight.perm.long()
    padding = perm == weight.in_features
    assert sorted(perm[~padding].tolist()) == list(range(weight.in_features))  # a permutation
    out = torch.full((weight.in_features, weight.out_features), float("nan"))
    out[perm[~padding]] = layout_rows[~padding]
    return out.t()


def emulated_matmul(x: torch.Tensor, weight: W4A16Weight) -> torch.Tensor:
    """x gathered through perm (as the GEMV kernel loads it: index ``in_features`` reads 0) times the layout."""
    if weight.perm is not None:
        x = F.pad(x, (0, 1))[:, weight.perm.long()]
    return x @ emulate(weight)


def check_layout(linear: QuantLinear) -> W4A16Weight:
    method = linear.method
    assert isinstance(method, wna16.WNA16Method)
    weight = method.kernel_layout(linear)
    expected = linear.dequantize()  # the on-disk formula (a CPU layer keeps its on-disk tensors)
    assert weight.in_features == expected.shape[1] and weight.out_features == expected.shape[0]
    assert torch.equal(in_input_order(weight, emulate(weight)), expected)
    assert torch.equal(quant_ops.w4a16_reference(weight), expected)
    x = torch.randn(5, weight.in_features, generator=torch.Generator().manual_seed(weight.in_features))
    torch.testing.assert_close(emulated_matmul(x, weight), x @ expected.t(), rtol=1e-5, atol=1e-5)
    return weight


@pytest.mark.parametrize("name", FORMATS)
def test_every_layer_repacks_to_its_dequantized_weight(name, checkpoints):
    for linear in quant_linears(load(checkpoints[name])):
        weight = check_layout(linear)
        # GPTQ and AWQ store fp16 scales (kept in fp16); the fp32 tiny model's compressed-tensors scales are fp32
        assert weight.scales.dtype == (torch.float32 if name.startswith("w4a16") else torch.float16)
        if name == "gptq-actorder-asym":
            assert weight.perm is not None and weight.group_size == 32
            assert weight.layout_features == weight.in_features  # whole groups: no padding
            assert not torch.equal(weight.perm, torch.arange(weight.in_features, dtype=torch.int32))
        else:
            assert weight.perm is None
            assert weight.group_size == (weight.in_features if name == "gptq-channel" else 32)


@pytest.mark.parametrize("name", ["gptq-actorder-asym", "gptq", "awq", "w4a16-asym"])
def test_a_ranks_share_repacks_to_its_dequantized_weight(name, checkpoints):
    """Under tensor parallelism; a row-parallel rank of act-order GPTQ holds parts of every group, of unequal
    sizes: each group is padded to one size (a multiple of 8), its padding reading x as 0."""
    padded = 0
    for rank in range(2):
        for linear in quant_linears(load(checkpoints[name], TensorParallel(rank, 2))):
            weight = check_layout(linear)
            if weight.layout_features > weight.in_features:
                padded += 1
                assert weight.perm is not None and weight.group_size % 8 == 0
    assert padded > 0 if name == "gptq-actorder-asym" else padded == 0


def test_the_kernel_path_builds_the_layout_at_load_and_drops_the_on_disk_tensors(checkpoints, monkeypatch):
    """``finish`` where the kernels are usable (forced here on CPU): every 4-bit layer holds the layout only,
    its ``dequantize()`` is the plain load's bit for bit, and ``apply`` goes to the kernel's wrapper (whose
    device check refuses CPU tensors: no silent fallback to the torch path)."""
    plain = quant_linears(load(checkpoints["gptq-actorder-asym"]))
    monkeypatch.setattr(wna16, "w4a16_kernels_usable", lambda device: True)
    kernel = quant_linears(load(checkpoints["gptq-actorder-asym"]))
    for a, b in zip(plain, kernel):
        assert isinstance(wna16.kernel_weight(b), W4A16Weight) and wna16.kernel_weight(a) is None
        assert not hasattr(b, "qweight") and not hasattr(b, "group_ids") and not hasattr(b, "scales")
        assert torch.equal(b.dequantize(), a.dequantize())
    with pytest.raises(ValueError, match="^x must be on a CUDA device, got cpu$"):
        kernel[0](torch.zeros(2, kernel[0].shape.in_features))


def test_eight_bit_gptq_keeps_the_dequantize_path(checkpoints, monkeypatch):
    monkeypatch.setattr(wna16, "w4a16_kernels_usable", lambda device: True)
    for linear in quant_linears(load(checkpoints["gptq-8bit-actorder"])):
        assert wna16.kernel_weight(linear) is None and hasattr(linear, "qweight")
        with pytest.raises(ValueError, match="^the W4A16 kernels take 4-bit weights, not 8-bit$"):
            linear.method.kernel_layout(linear)


@pytest.mark.parametrize("order", [None, AWQ_ORDER])
@pytest.mark.parametrize("dim", [0, 1])
def test_nibbles_unpack_as_packing_does(order, dim):
    values = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(1))
    words = pack(values, 4, dim, order)
    assert torch.equal(nibbles(words, dim, order), values.to(torch.uint8))
    assert torch.equal(nibbles(words, dim, order).to(torch.int32), unpack(words, 4, dim, order))


def test_unequal_shuffled_groups_and_a_column_count_not_a_multiple_of_4():
    """Straight from ``build_w4a16``: 5 groups of 3 to 13 features in a shuffled order over 40 features, 10
    output columns (padded to 12, never read back)."""
    gen = torch.Generator().manual_seed(2)
    sizes = [3, 13, 8, 9, 7]
    group_ids = torch.cat([torch.full((s,), g) for g, s in enumerate(sizes)])[torch.randperm(40, generator=gen)]
    q = torch.randint(0, 16, (40, 10), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 17, (5, 10), generator=gen)
    scales = torch.rand(5, 10, generator=gen) / 50
    weight = build_w4a16(q, zeros, scales, group_ids)
    assert (weight.group_size, weight.layout_features, tuple(weight.qweight.shape)) == (16, 80, (10, 12))
    assert weight.scales.dtype == torch.float32  # random fp32 scales are not fp16 values
    expected = ((q.to(torch.int32) - zeros[group_ids]).float() * scales[group_ids]).t()
    assert torch.equal(in_input_order(weight, emulate(weight)), expected)
    assert torch.equal(quant_ops.w4a16_reference(weight), expected)
    x = torch.randn(3, 40, generator=gen)
    torch.testing.assert_close(emulated_matmul(x, weight), x @ expected.t(), rtol=1e-5, atol=1e-5)


def test_a_group_id_outside_the_scales_is_refused():
    q, zeros, scales = torch.zeros(16, 4, dtype=torch.uint8), torch.zeros(2, 4), torch.ones(2, 4)
    with pytest.raises(ValueError, match="^every input feature's group must be one of the 2 groups$"):
        build_w4a16(q, zeros, scales, torch.full((16,), 2))


def test_the_kernels_run_only_with_the_switch_on_a_cuda_device_with_cupy(monkeypatch):
    """Off by default ($RAYPAGED_W4A16_KERNELS) until a device has run tests/gpu/test_w4a16.py."""
    import importlib.util

    from raypaged.quantization import wna16

    find_spec = importlib.util.find_spec
    fake = lambda name, *args: object() if name == "cupy" else find_spec(name, *args)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", fake)
    monkeypatch.delenv("RAYPAGED_W4A16_KERNELS", raising=False)
    assert not wna16.w4a16_kernels_usable(torch.device("cuda"))
    monkeypatch.setenv("RAYPAGED_W4A16_KERNELS", "1")
    assert wna16.w4a16_kernels_usable(torch.device("cuda"))
    assert not wna16.w4a16_kernels_usable(torch.device("cpu"))


FORMATS_4BIT = ["gptq", "gptq-asym", "gptq-actorder-asym", "awq", "w4a16", "w4a16-asym"]


@pytest.mark.parametrize(
    ("name", "tp_rank"),
    [(name, rank) for name in FORMATS_4BIT for rank in (None, 0, 1)] + [("gptq-channel", None)],
    ids=lambda value: value if isinstance(value, str) else {None: "tp1", 0: "rank0", 1: "rank1"}[value],
)
def test_cpu_layers_dequantize_into_the_c_gemms_panels_bit_for_bit(name, tp_rank, checkpoints):
    """On CPU a 4-bit layer keeps the layout beside its on-disk tensors; each float32 call dequantizes it in C
    straight into cpu_gemm.c's panels: the unpacked panels are the on-disk dequantize() bit for bit, and the
    layer's product is the C GEMM's over those (rank 1 of an act-order row-parallel layer: padded groups)."""
    from raypaged.attention import cpu_ops
    from raypaged.model.layers import linear

    if not cpu_ops.builds():
        pytest.skip("the CPU kernels do not build here")
    tp = TensorParallel() if tp_rank is None else TensorParallel(tp_rank, 2)
    for layer in quant_linears(load(checkpoints[name], tp)):
        weight = getattr(layer, wna16.CPU_WEIGHT)
        assert weight.scales.dtype == torch.float32
        assert hasattr(layer, "weight_scale" if name.startswith("w4a16") else "scales")  # the on-disk tensors kept
        packed = wna16.packed_w4(weight)
        assert torch.equal(packed.unpack(), layer.method.dequantize_stored(layer))
        x = torch.randn(3, layer.shape.in_features, generator=torch.Generator().manual_seed(0))
        assert torch.equal(layer.partial(x), linear(x, packed))

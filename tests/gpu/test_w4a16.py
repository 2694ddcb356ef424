"""kernels/w4a16.cu (raypaged.kernels.quant_ops) against each 4-bit format's reference: random on-disk tensors
of GPTQ (v1 symmetric and asymmetric, act-order, v2), AWQ and compressed-tensors pack-quantized (symmetric,
asymmetric) in a QuantLinear on the device, repacked by its ``finish``; the reference is a twin layer with
the kernels turned off (the method's ``dequantize()`` from the on-disk tensors, in torch).

The dequantize kernel is the reference bit for bit (fp32; fp16/bf16: the reference rounded once); the GEMV
(up to 8 rows) and dequantize + matmul (more) match ``x @ W^T`` in float64 within the output dtype's
rounding. Outputs are poisoned with NaN first. A GPTQ model's greedy tokens through ``raypaged.LLM`` on CUDA
equal its tokens with the kernels off (fp32: the same weights, only the sums' order differs)."""

import gc

import pytest
import torch

from raypaged import LLM, SamplingParams
from raypaged.kernels.quant_ops import W4A16Weight, w4a16_dequantize, w4a16_gemv, w4a16_linear
from raypaged.model.parallel import TensorParallel
from raypaged.quantization import wna16
from raypaged.quantization.base import LinearShape
from raypaged.quantization.linear import QuantLinear
from raypaged.quantization.packing import AWQ_ORDER, pack
from raypaged.quantization.quantizer import quantize_checkpoint
from raypaged.quantization.wna16 import AWQMethod, GPTQMethod, PackedMethod
from tests.gpu import CUDA_ONLY, DEVICE, NEEDS_KERNELS, ON_HOST, TINY_LLAMA, random_llama

pytestmark = NEEDS_KERNELS


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    """The kernels are off by default ($RAYPAGED_W4A16_KERNELS): on for every test here, which turns them off
    itself where it wants the dequantize path."""
    monkeypatch.setenv("RAYPAGED_W4A16_KERNELS", "1")


FORMATS = ("gptq", "gptq-asym", "gptq-actorder", "gptq-v2", "awq", "ct-sym", "ct-asym")
# on the host, where the kernels run thread by thread, a smaller third shape (still split over K)
SHAPES = [(576, 1536), (1536, 576), (1024, 2752) if ON_HOST else (4096, 11008)]
GROUPS = (32, 128, -1)
CASES = [(k, n, g) for k, n in SHAPES for g in GROUPS if g == -1 or k % g == 0]
ROWS = (1, 3, 8, 9, 64)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # of the output's largest value


def poison(num_bytes: int) -> None:
    """Free a block of 0xFF bytes (NaN in every float dtype) of the next output's size."""
    torch.full((num_bytes,), 255, dtype=torch.uint8, device=DEVICE)


def fp16_scales(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.rand(*shape, generator=gen, device=DEVICE) * 0.02 + 0.002).half().float()


def nibbles(*shape: int, gen: torch.Generator, high: int = 16) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=gen, device=DEVICE)


def on_disk(name: str, k: int, n: int, group: int, seed: int = 0) -> tuple[object, dict[str, torch.Tensor]]:
    """(method, checkpoint tensors) of one random layer of format ``name``."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    size = k if group == -1 else group
    groups = k // size
    q = nibbles(k, n, gen=gen)  # [K, N]
    zeros = nibbles(groups, n, gen=gen)  # [G, N]
    if name.startswith("gptq"):
        zero_offset = 0 if name == "gptq-v2" else 1  # v1 stores zero - 1 (zeros 1..16)
        stored = torch.full_like(zeros, 8 - zero_offset) if name == "gptq" else zeros
        g_idx = torch.arange(k, device=DEVICE) // size
        if name == "gptq-actorder":
            g_idx = g_idx[torch.randperm(k, generator=gen, device=DEVICE)]
        method = GPTQMethod(4, group, name == "gptq-actorder", zero_offset)
        tensors = {
            "qweight": pack(q, 4, 0),
            "qzeros": pack(stored, 4, 1),
            "scales": fp16_scales(groups, n, gen=gen),
            "g_idx": g_idx.to(torch.int32),
        }
    elif name == "awq":
        method = AWQMethod(group)
        tensors = {
            "qweight": pack(q, 4, 1, AWQ_ORDER),
            "qzeros": pack(zeros, 4, 1, AWQ_ORDER),
            "scales": fp16_scales(groups, n, gen=gen),
        }
    else:  # compressed-tensors: fp32 scales of no particular precision (kept in fp32)
        symmetric = name == "ct-sym"
        method = PackedMethod(4, None if group == -1 else group, symmetric)
        tensors = {
            "weight_packed": pack(q.t(), 4, 1),
            "weight_scale": torch.rand(n, groups, generator=gen, device=DEVICE) * 0.02 + 0.002,
        }
        if not symmetric:
            tensors["weight_zero_point"] = pack(zeros.t(), 4, 0)
    return method, tensors


def make_layer(method, tensors, shape: LinearShape, tp: TensorParallel = TensorParallel()) -> QuantLinear:
    with torch.device(DEVICE):
        layer = QuantLinear(shape, False, method, tp, row_parallel=shape.row_sharded)
    for name, tensor in tensors.items():
        getattr(layer, name).data.copy_(tensor)
    layer.finish()
    return layer


def kernel_and_reference(method, tensors, shape: LinearShape, tp: TensorParallel = TensorParallel()):
    """(the layer on the kernels, its weight's float32 reference [N, K] from the on-disk tensors)."""
    layer = make_layer(method, tensors, shape, tp)
    assert isinstance(wna16.kernel_weight(layer), W4A16Weight)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wna16, "w4a16_kernels_usable", lambda device: False)
        twin = make_layer(method, tensors, shape, tp)
    assert wna16.kernel_weight(twin) is None
    return layer, twin.dequantize()


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected).abs().max() / expected.abs().max()).item()


def check_products(layer: QuantLinear, reference: torch.Tensor, seed: int) -> None:
    weight = wna16.kernel_weight(layer)
    assert weight is not None
    k, n = weight.in_features, weight.out_features
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        poison(k * n * dtype.itemsize)
        dense = w4a16_dequantize(weight, dtype)
        assert torch.equal(dense, reference.t().to(dtype)), dtype  # one rounding of the exact fp32 weight
        for rows in ROWS if dtype != torch.float32 else (1, 9):
            x = torch.randn(rows, k, generator=gen, device=DEVICE).to(dtype)
            expected = x.double() @ reference.double().t()
            poison(rows * n * dtype.itemsize)
            y = layer.partial(x)  # the method's apply: w4a16_linear
            assert y.dtype == dtype and y.shape == (rows, n)
            assert not y.isnan().any(), f"an output element was not written ({dtype}, {rows} rows)"
            error = relative_error(y, expected)
            assert error <= TOLERANCE[dtype], (dtype, rows, error)
            if rows <= 8:
                assert torch.equal(w4a16_gemv(x, weight), y), (dtype, rows)  # deterministic: no atomics


@pytest.mark.pairwise
@pytest.mark.parametrize(("k", "n", "group"), CASES, ids=[f"{k}x{n}-g{g}" for k, n, g in CASES])
@pytest.mark.parametrize("name", FORMATS)
def test_kernels_equal_the_formats_reference(name, k, n, group):
    method, tensors = on_disk(name, k, n, group, seed=k + n + group)
    layer, reference = kernel_and_reference(method, tensors, LinearShape(k, n, k))
    weight = wna16.kernel_weight(layer)
    assert weight is not None
    assert weight.scales.dtype == (torch.float32 if name.startswith("ct") else torch.float16)
    assert (weight.perm is not None) == (name == "gptq-actorder" and group != -1)
    assert torch.equal(layer.dequantize(), reference)  # the layout read back in torch
    check_products(layer, reference, seed=k)


def test_an_act_order_ranks_unequal_groups_are_padded():
    """Row-parallel rank 1 of 2 of an act-order GPTQ layer (1024 inputs, groups of 128): its 512 features
    hold parts of all 8 groups, of unequal sizes, each padded to one size in the layout."""
    k_total, n, group = 1024, 768, 128
    method, whole = on_disk("gptq-actorder", k_total, n, group, seed=7)
    tensors = dict(whole, qweight=whole["qweight"][k_total // 16 :], g_idx=whole["g_idx"][k_total // 2 :])
    layer, reference = kernel_and_reference(
        method, tensors, LinearShape(k_total // 2, n, k_total), TensorParallel(1, 2)
    )
    weight = wna16.kernel_weight(layer)
    assert weight is not None and weight.layout_features > weight.in_features
    check_products(layer, reference, seed=1)


def test_output_features_not_a_multiple_of_4():
    """compressed-tensors symmetric allows any N: the layout pads to 4 columns, never written out."""
    method, tensors = on_disk("ct-sym", 256, 90, 32, seed=3)
    layer, reference = kernel_and_reference(method, tensors, LinearShape(256, 90, 256))
    check_products(layer, reference, seed=2)


@CUDA_ONLY
@pytest.mark.parametrize("rows", [1, 8, 9])
def test_cuda_graphs_record_the_kernels(rows):
    """The GEMV (split over K, then reduced) and dequantize + matmul replay on fresh inputs as they run eagerly."""
    method, tensors = on_disk("gptq-actorder", 4096, 4096, 128, seed=11)
    layer = make_layer(method, tensors, LinearShape(4096, 4096, 4096))
    weight = wna16.kernel_weight(layer)
    assert weight is not None
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and load outside the capture
        w4a16_linear(x, weight)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16_linear(x, weight)
    for seed in range(2):
        x.copy_(torch.randn(rows, 4096, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        eager = w4a16_linear(x, weight)
        if rows <= 8:
            assert torch.equal(y, eager)
        else:  # cuBLAS may pick another algorithm under capture
            torch.testing.assert_close(y, eager, rtol=1e-3, atol=1e-3)


SHAPE = TINY_LLAMA


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    """A small random Llama quantized to 4-bit GPTQ, act-order, asymmetric, groups of 64."""
    root = tmp_path_factory.mktemp("w4a16")
    path = random_llama(root / "float", **SHAPE)
    return quantize_checkpoint(path, root / "gptq", "gptq", group_size=64, act_order=True, symmetric=False)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in (3, 17, 64, 100, 250)]


def generate(model_dir, prompts, dtype: str, params: SamplingParams):
    llm = LLM(str(model_dir), device="cuda", dtype=dtype, gpu_memory_utilization=0.3, max_model_len=1024)
    model = llm.llm_engine.executor.worker.runner.model
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    on_kernels = [wna16.kernel_weight(m) is not None for m in linears]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm, model, linears
    gc.collect()
    torch.cuda.empty_cache()
    return on_kernels, [o.outputs[0] for o in outputs]


@CUDA_ONLY
def test_a_gptq_models_greedy_tokens_equal_the_dequantize_path(gptq_dir, prompts, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    on_kernels, kernel_out = generate(gptq_dir, prompts, "float32", params)
    assert on_kernels and all(on_kernels)
    monkeypatch.setattr(wna16, "w4a16_kernels_usable", lambda device: False)
    off, plain_out = generate(gptq_dir, prompts, "float32", params)
    assert off and not any(off)
    assert [list(o.token_ids) for o in kernel_out] == [list(o.token_ids) for o in plain_out]


@CUDA_ONLY
def test_a_gptq_models_fp16_logprobs_match_the_dequantize_path(gptq_dir, prompts, monkeypatch):
    """fp16: the GEMV multiplies by the exact fp32 weight, the dequantize path by its fp16 rounding."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    _, kernel_out = generate(gptq_dir, prompts, "float16", params)
    monkeypatch.setattr(wna16, "w4a16_kernels_usable", lambda device: False)
    _, plain_out = generate(gptq_dir, prompts, "float16", params)
    for ours, theirs in zip(kernel_out, plain_out):
        first, reference = ours.logprobs[0], theirs.logprobs[0]
        for token, logprob in first.items():
            if token in reference:
                assert abs(logprob - reference[token]) <= 0.05 * max(1.0, abs(reference[token])), token
        if ours.token_ids[0] != theirs.token_ids[0]:  # only at a near tie
            assert abs(first[ours.token_ids[0]] - first.get(theirs.token_ids[0], float("-inf"))) < 0.05

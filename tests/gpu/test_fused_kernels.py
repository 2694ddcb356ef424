"""kernels/fused_ops.cu against its torch references (raypaged.model.layers, the model's CPU path;
see tests/fused_reference.py) on random inputs, outputs poisoned with NaN first.

Where the kernels round exactly where torch rounds, the comparison is exact: the residual sum
and rotary (every dtype) and the cache write. Norms reduce in another order than torch, so
they are compared within a few units in the last place (fp32 too); SiLU within two units
(expf). In fp16/bf16 nearly every element must also be bit-equal, so a kernel that rounds in
the wrong place fails even within tolerance."""

import pytest
import torch
from transformers import LlamaConfig, Phi3Config

from raypaged import kernels
from raypaged.attention.backend import cuda_backend
from raypaged.model.layers import RotaryEmbedding
from tests import fused_reference as ref
from tests.gpu import CUDA_ONLY, DEVICE, NEEDS_KERNELS

pytestmark = NEEDS_KERNELS


@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    """The kernels are off by default until these tests have passed on a device."""
    monkeypatch.setenv("RAYPAGED_FUSED_KERNELS", "1")


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
NORM_RTOL = {torch.float32: 1e-5, torch.float16: 2 * ULP[torch.float16], torch.bfloat16: 2 * ULP[torch.bfloat16]}
ATOL = 1e-6  # fp16 subnormals
MAX_MISMATCH = 0.01  # fp16/bf16: share of elements (or 2, if more) that may differ by a rounding at all


def poison_allocator(num_bytes: int) -> None:
    """Free a block of 0xFF bytes (NaN in every float dtype) of the next output's size."""
    torch.full((num_bytes,), 255, dtype=torch.uint8, device=DEVICE)


def assert_near(out: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    assert not out.isnan().any(), "an output element was not written"
    torch.testing.assert_close(out, expected, rtol=rtol, atol=ATOL)
    if out.dtype != torch.float32:
        mismatches = int((out != expected).sum())
        assert mismatches <= max(2, MAX_MISMATCH * out.numel()), f"{mismatches} of {out.numel()} elements differ"


def random_rows(rows: int, hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = (torch.randn(rows, hidden, device=DEVICE) * 3).to(dtype)
    weight = torch.empty(hidden, device=DEVICE).uniform_(0.5, 1.5).to(dtype)
    return x, weight


# unvectorized: hidden 67 and 1, and 4100 in fp16/bf16 (8,200-byte rows)
SIZES = [(1, 64), (7, 576), (33, 4096), (300, 128), (2, 8192), (5, 67), (4, 1), (3, 4100)]


@pytest.mark.parametrize(("rows", "hidden"), SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_layers(dtype, rows, hidden):
    x, weight = random_rows(rows, hidden, dtype, rows + hidden)
    before = x.clone()
    poison_allocator(x.numel() * x.element_size())
    out = kernels.rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and torch.equal(x, before)
    assert_near(out, ref.rms_norm(x, weight, 1e-6), NORM_RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_of_an_unaligned_view_runs_unvectorized(dtype):
    x, weight = random_rows(9, 513, dtype, 3)
    view = x[:, 1:]  # rows of 512 that start one element past 16 bytes
    assert_near(kernels.rms_norm(view, weight[1:], 1e-5), ref.rms_norm(view, weight[1:], 1e-5), NORM_RTOL[dtype])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_per_head_over_views_of_qkv(dtype, head_dim):
    """Qwen3's q/k norms: [tokens, heads, head_dim] views of the fused qkv output."""
    tokens, heads, kv_heads = 13, 8, 2
    qkv, _ = random_rows(tokens, (heads + 2 * kv_heads) * head_dim, dtype, head_dim)
    weight = torch.empty(head_dim, device=DEVICE).uniform_(0.5, 1.5).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    for view in (q, k):
        out = kernels.rms_norm(view, weight, 1e-6)
        assert out.is_contiguous()
        assert_near(out, ref.rms_norm(view, weight, 1e-6), NORM_RTOL[dtype])


@pytest.mark.parametrize(("rows", "hidden"), SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_matches_layers(dtype, rows, hidden):
    x, weight = random_rows(rows, hidden, dtype, rows * hidden)
    residual = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    expected_x, expected_residual = x.clone(), residual.clone()
    ref.fused_add_rms_norm(expected_x, expected_residual, weight, 1e-5)
    kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)  # the residual stream, rounded to the dtype as torch does
    assert_near(x, expected_x, NORM_RTOL[dtype])


@pytest.mark.parametrize(("rows", "d"), [(1, 1), (3, 7), (16, 64), (33, 1536), (300, 2816), (2, 5504), (5, 4100)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_layers(dtype, rows, d):
    torch.manual_seed(rows + d)
    x = (torch.randn(rows, 2 * d, device=DEVICE) * 4).to(dtype)
    before = x.clone()
    poison_allocator(rows * d * x.element_size())
    out = kernels.silu_and_mul(x)
    assert out.shape == (rows, d) and torch.equal(x, before)
    assert_near(out, ref.silu_and_mul(x), 2 * ULP[dtype])


def rotary_table(
    head_dim: int, dtype: torch.dtype, max_positions: int = 4096, partial_rotary_factor: float = 1.0
) -> torch.Tensor:
    """Llama's table, or Phi-3's rotating the first ``partial_rotary_factor`` of each head."""
    shape = dict(hidden_size=head_dim * 4, num_attention_heads=4, rope_theta=10000.0)
    if partial_rotary_factor == 1.0:
        config = LlamaConfig(**shape)
    else:
        config = Phi3Config(**shape, partial_rotary_factor=partial_rotary_factor)
    return RotaryEmbedding(config, head_dim, max_positions).to(device=DEVICE, dtype=dtype).cos_sin


def rotary_case(
    dtype, head_dim, block_size, num_heads, num_kv_heads, fused_qkv, seed, num_tokens=37, partial_rotary_factor=1.0
):
    torch.manual_seed(seed)
    cos_sin = rotary_table(head_dim, dtype, partial_rotary_factor=partial_rotary_factor)
    num_blocks = 2 * -(-num_tokens // block_size) + 3
    positions = torch.randint(0, cos_sin.shape[0], (num_tokens,), device=DEVICE)
    positions[:3] = torch.tensor([0, cos_sin.shape[0] - 1, 0])  # the ends, and a repeat
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[::5] = -1  # padding: rotated, not cached
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, device=DEVICE).to(dtype)
    value_cache = torch.randn(shape, device=DEVICE).to(dtype)
    if fused_qkv:  # q, k, v strided views of one buffer, as Llama's attention hands them over
        tensors = (torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE).to(dtype),)
    else:  # separate contiguous q and k, as after Qwen3's q/k norms
        tensors = tuple(
            torch.randn(num_tokens, h, head_dim, device=DEVICE).to(dtype)
            for h in (num_heads, num_kv_heads, num_kv_heads)
        )

    def views(*buffers):
        if not fused_qkv:
            return buffers
        qkv = buffers[0]
        return qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]

    expected = tuple(t.clone() for t in tensors)
    expected_caches = (key_cache.clone(), value_cache.clone())
    ref.rotary_and_cache(positions, *views(*expected), cos_sin, *expected_caches, slots)
    kernels.rotary_and_cache(positions, *views(*tensors), cos_sin, key_cache, value_cache, slots)
    for got, want in zip(tensors, expected):
        assert torch.equal(got, want)
    assert torch.equal(key_cache, expected_caches[0])
    assert torch.equal(value_cache, expected_caches[1])


@pytest.mark.parametrize("fused_qkv", [True, False], ids=["qkv-views", "separate"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_and_cache_equals_rotate_then_reshape_and_cache(dtype, head_dim, block_size, fused_qkv):
    rotary_case(dtype, head_dim, block_size, 8, 2, fused_qkv, seed=head_dim + block_size)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(4, 4), (12, 2), (32, 1), (64, 8)], ids=["mha", "gqa6", "mqa", "wide"]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_and_cache_head_layouts(dtype, num_heads, num_kv_heads):
    rotary_case(dtype, 128, 16, num_heads, num_kv_heads, True, seed=num_heads, num_tokens=300)


@pytest.mark.parametrize(("head_dim", "partial_rotary_factor"), [(128, 0.75), (64, 0.5)], ids=["phi4-mini", "half"])
@pytest.mark.parametrize("fused_qkv", [True, False], ids=["qkv-views", "separate"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_and_cache_partial_rotation(dtype, fused_qkv, head_dim, partial_rotary_factor):
    """Phi-3's partial rotation: the first features of each head rotated, the rest (q's in place, k's in the cache)
    as they were."""
    rotary_case(dtype, head_dim, 16, 8, 2, fused_qkv, seed=head_dim, partial_rotary_factor=partial_rotary_factor)


@CUDA_ONLY
def test_the_kernels_record_into_a_cuda_graph():
    """Each wrapper launches on torch's current stream with no host sync: a captured graph replays
    them on new inputs copied into the same buffers."""
    dtype, tokens, hidden, d, heads, kv_heads, head_dim, block_size = torch.float16, 24, 256, 384, 4, 2, 64, 16
    cos_sin = rotary_table(head_dim, dtype, 512)
    static = dict(
        x=torch.zeros(tokens, hidden, dtype=dtype, device="cuda"),
        residual=torch.zeros(tokens, hidden, dtype=dtype, device="cuda"),
        gate_up=torch.zeros(tokens, 2 * d, dtype=dtype, device="cuda"),
        qkv=torch.zeros(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype, device="cuda"),
        positions=torch.zeros(tokens, dtype=torch.long, device="cuda"),
        slots=torch.full((tokens,), -1, dtype=torch.long, device="cuda"),
    )
    weight = torch.empty(hidden, device="cuda").uniform_(0.5, 1.5).to(dtype)
    cache_shape = (8, kv_heads, block_size, head_dim)
    caches = (
        torch.zeros(cache_shape, dtype=dtype, device="cuda"),
        torch.zeros(cache_shape, dtype=dtype, device="cuda"),
    )

    def split(qkv):
        return qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]

    def step(ops, x, residual, gate_up, qkv, positions, slots, key_cache, value_cache):
        normed = ops.rms_norm(x, weight, 1e-6)
        ops.fused_add_rms_norm(x, residual, weight, 1e-6)
        act = ops.silu_and_mul(gate_up)
        ops.rotary_and_cache(positions, *split(qkv), cos_sin, key_cache, value_cache, slots)
        return normed, act

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and load outside the capture
        step(kernels, **static, key_cache=caches[0], value_cache=caches[1])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(kernels, **static, key_cache=caches[0], value_cache=caches[1])
    for seed in range(2):
        torch.manual_seed(seed)
        fresh = dict(
            x=torch.randn(tokens, hidden, device="cuda").to(dtype),
            residual=torch.randn(tokens, hidden, device="cuda").to(dtype),
            gate_up=torch.randn(tokens, 2 * d, device="cuda").to(dtype),
            qkv=torch.randn(tokens, heads + 2 * kv_heads, head_dim, device="cuda").to(dtype),
            positions=torch.randint(0, 512, (tokens,), device="cuda"),
            slots=torch.randperm(8 * block_size, device="cuda")[:tokens],
        )
        for name, value in fresh.items():
            static[name].copy_(value)
        for cache in caches:
            cache.zero_()
        expected_caches = tuple(torch.zeros_like(c) for c in caches)
        expected_outputs = step(ref, **fresh, key_cache=expected_caches[0], value_cache=expected_caches[1])
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outputs, expected_outputs):
            assert_near(got, want, NORM_RTOL[dtype])
        assert_near(static["x"], fresh["x"], NORM_RTOL[dtype])
        assert torch.equal(static["residual"], fresh["residual"])
        assert torch.equal(static["qkv"], fresh["qkv"])
        for got, want in zip(caches, expected_caches):
            assert torch.equal(got, want)


MODEL_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_the_models_fused_path_matches_its_plain_path(architecture, dtype):
    """Prefills, a chunk over its cached context and decodes (tests/fused_reference.py) through the
    CUDA attention kernels, with the fused kernels and without: the same hidden states and caches
    within the norms' rounding."""
    model = ref.random_model(ref.tiny_config(architecture), dtype, DEVICE)
    backend = cuda_backend()
    plain_hidden, plain_caches = ref.run_steps(model, backend, DEVICE, plain=True)
    fused_hidden, fused_caches = ref.run_steps(model, backend, DEVICE)
    assert model.model.fused_ops is backend.fused_ops is not None

    def relative_error(out, expected):
        return ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()

    for plain, fused in zip(plain_hidden, fused_hidden):
        assert relative_error(fused, plain) <= MODEL_TOLERANCE[dtype]
    for plain_pair, fused_pair in zip(plain_caches, fused_caches):
        for plain, fused in zip(plain_pair, fused_pair):
            assert relative_error(fused, plain) <= MODEL_TOLERANCE[dtype]

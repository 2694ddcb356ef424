"""The CPU fused step ops (raypaged/attention/cpu_fused.c) against their torch references
(tests/fused_reference.py): rotary and the cache write bit for bit, the norms and SiLU within fp32
rounding; in one thread and shared among threads; exact argument errors."""

import pytest
import torch

from raypaged.attention import cpu_fused, cpu_ops
from raypaged.attention.backend import CPU, CPU_FUSED, TORCH
from tests import fused_reference as ref

pytestmark = pytest.mark.skipif(cpu_ops.unavailable_reason() is not None, reason="no C compiler here")

# rows: a decode step's few (one thread) and a prefill's many (the threads share them)
ROWS = [1, 7, 300]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_equals_the_reference(rows, threads):
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, 576) * 3, torch.rand(576) + 0.5
    _close(cpu_fused.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))


def test_rms_norm_of_per_head_rows_in_a_strided_view():
    """Qwen3's q/k norms: [tokens, heads, head_dim] views of the fused qkv rows."""
    torch.manual_seed(0)
    qkv = torch.randn(5, 8 * 64 + 2 * 2 * 64)
    q = qkv[:, :512].view(5, 8, 64)
    weight = torch.rand(64) + 0.5
    got = cpu_fused.rms_norm(q, weight, 1e-6)
    assert got.is_contiguous() and got.shape == (5, 8, 64)
    _close(got, ref.rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("rows", ROWS)
def test_fused_add_rms_norm_writes_the_sum_and_the_norm(rows, threads):
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, 576), torch.randn(rows, 576), torch.rand(576) + 0.5
    expected_x, expected_residual = x.clone(), residual.clone()
    ref.fused_add_rms_norm(expected_x, expected_residual, weight, 1e-5)
    cpu_fused.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)  # one fp32 add, the same everywhere
    _close(x, expected_x)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_equals_the_reference(rows, threads):
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * 1536) * 4
    x[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30])  # zeros, saturated exp, tiny
    got = cpu_fused.silu_and_mul(x)
    assert got.shape == (rows, 1536)
    _close(got, ref.silu_and_mul(x))


@pytest.mark.parametrize("rotary_dim", [64, 40], ids=["whole-heads", "partial"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_and_cache_equals_rotate_then_cache_bit_for_bit(rows, threads, cache_dtype, rotary_dim):
    """float32 caches, and fp8 e4m3 and bf16 ones narrowed as torch's .to() narrows (ties to even, fp8's saturation
    at 448, bf16's overflow to infinity, subnormals, NaN); whole heads rotated, or their first 40 features (a partial
    rotation, as Phi-3's)."""
    torch.manual_seed(rows)
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 40
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim) * 3
    v0 = (heads + kv_heads) * head_dim
    qkv[0, v0 : v0 + 12] = torch.tensor(
        [1000.0, -500.0, 464.0, 449.0, 0.0029296875, -1e-3, 1e-9, float("nan"), float("inf"), -0.0, 3.4e38, 1 + 2**-8]
    )  # V is cached as it is: each case exactly
    cos_sin = torch.randn(512, 2, rotary_dim // 2)
    positions = torch.randint(0, 512, (rows,))
    slots = torch.randperm(num_blocks * block_size)[:rows]
    slots[1::3] = -1  # padding: rotated, not cached

    def split(t):
        q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim), v.view(rows, kv_heads, head_dim)

    caches = [torch.full((num_blocks, kv_heads, block_size, head_dim), 7.0).to(cache_dtype) for _ in range(4)]
    expected = qkv.clone()
    ref.rotary_and_cache(positions, *split(expected), cos_sin, caches[0], caches[1], slots)
    cpu_fused.rotary_and_cache(positions, *split(qkv), cos_sin, caches[2], caches[3], slots)
    assert torch.equal(qkv.view(torch.int32), expected.view(torch.int32))
    # a NaN as a NaN: torch's own bf16 rounding gives 0x7fc0 one by one and 0xffff in its vector loops
    bits = [torch.where(cache.isnan(), 0, cache).view(torch.uint8) for cache in caches]
    assert torch.equal(bits[2], bits[0]) and torch.equal(bits[3], bits[1])
    assert torch.equal(caches[3].isnan(), caches[1].isnan()) and int(caches[3].isnan().sum()) == 1
    assert int((caches[2].float() != 7.0).any(-1).sum()) == kv_heads * int((slots >= 0).sum())


def _rotary_args(positions=None, slots=None, **changes):
    heads, kv_heads, head_dim = 4, 2, 8
    args = dict(
        positions=torch.tensor([0, 1]) if positions is None else positions,
        query=torch.zeros(2, heads, head_dim),
        key=torch.zeros(2, kv_heads, head_dim),
        value=torch.zeros(2, kv_heads, head_dim),
        cos_sin=torch.zeros(16, 2, head_dim // 2),
        key_cache=torch.zeros(3, kv_heads, 4, head_dim),
        value_cache=torch.zeros(3, kv_heads, 4, head_dim),
        slot_mapping=torch.tensor([0, 5]) if slots is None else slots,
    )
    return args | changes


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        (dict(positions=torch.tensor([0, 16])), ValueError, "^a position is outside the rotary table's 16 positions$"),
        (dict(slots=torch.tensor([0, 12])), ValueError, "^a slot is outside the cache's 3 blocks of 4$"),
        (dict(query=torch.zeros(2, 4, 8, dtype=torch.float64)), TypeError, "^query must have dtype torch.float32"),
        (
            dict(key=torch.zeros(2, 8, 2).transpose(1, 2)),
            ValueError,
            r"^key must have contiguous \[heads, head_dim\] rows; got strides \(16, 1, 2\)$",
        ),
        (dict(value_cache=torch.zeros(3, 2, 8, 8)), ValueError, r"^value_cache must have shape \(3, 2, 4, 8\)"),
        (dict(slots=torch.tensor([0, 1], dtype=torch.int32)), TypeError, "^slot_mapping must have dtype torch.int64"),
        (
            dict(cos_sin=torch.zeros(16, 2, 5)),
            ValueError,
            r"^cos_sin must have shape \(\*, 2, 4\), or a narrower last dimension for a partial rotation; got",
        ),
    ],
)
def test_rotary_and_cache_refuses_bad_arguments_before_writing(changes, error, message):
    args = _rotary_args(changes.pop("positions", None), changes.pop("slots", None), **changes)
    args["query"] = args["query"] + 1.0
    before = args["query"].clone()
    with pytest.raises(error, match=message):
        cpu_fused.rotary_and_cache(**args)
    assert torch.equal(args["query"], before) and not args["key_cache"].any()


def test_other_ops_refuse_bad_arguments():
    with pytest.raises(ValueError, match=r"^x and residual must be different buffers \(both are written\)$"):
        x = torch.ones(2, 8)
        cpu_fused.fused_add_rms_norm(x, x, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"^x must have an even last dimension \(gate \| up halves\), got shape"):
        cpu_fused.silu_and_mul(torch.ones(2, 7))
    with pytest.raises(TypeError, match="^x must have dtype torch.float32; got torch.bfloat16$"):
        cpu_fused.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"^weight must have shape \(8,\)"):
        cpu_fused.rms_norm(torch.ones(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="^eps must be >= 0, got -1.0$"):
        cpu_fused.rms_norm(torch.ones(2, 8), torch.ones(8), -1.0)
    with pytest.raises(TypeError, match="^eps must be a float, got str$"):
        cpu_fused.fused_add_rms_norm(torch.ones(2, 8), torch.zeros(2, 8), torch.ones(8), "1e-5")


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_the_cpu_backends_fused_path_gives_the_plain_paths_states(architecture):
    """The model's steps (prefills, a chunk over its cached context, decodes) through the CPU backend,
    which brings these ops, against the plain torch path: caches and hidden states within rounding."""
    model = ref.random_model(ref.tiny_config(architecture), torch.float32, "cpu")
    plain_hidden, plain_caches = ref.run_steps(model, TORCH, "cpu")
    fused_hidden, fused_caches = ref.run_steps(model, CPU, "cpu")
    assert model.model.fused_ops is CPU_FUSED
    for plain, fused in zip(plain_hidden, fused_hidden):
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    for (plain_k, plain_v), (fused_k, fused_v) in zip(plain_caches, fused_caches):
        torch.testing.assert_close(fused_k, plain_k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fused_v, plain_v, rtol=1e-4, atol=1e-4)

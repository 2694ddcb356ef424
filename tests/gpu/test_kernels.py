"""The CUDA kernels against the torch reference (raypaged.attention.torch_ops) on random
inputs: random block tables, ragged context lengths, and outputs poisoned with NaN first
so that any element a kernel fails to write shows up."""

import random

import pytest
import torch

from raypaged import kernels
from raypaged.attention import torch_ops
from tests.gpu import CUDA_ONLY, DEVICE, NEEDS_KERNELS

pytestmark = NEEDS_KERNELS

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
NUM_BLOCKS = 96


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def poison_allocator(num_bytes: int) -> None:
    """Free a block of 0xFF bytes (NaN in fp32, fp16 and bf16) of exactly the next output's
    size: torch's caching allocator hands that block to the wrapper's output allocation."""
    torch.full((num_bytes,), 255, dtype=torch.uint8, device=DEVICE)


def random_layout(rng: random.Random, num_seqs: int, block_size: int, max_context: int, min_context: int = 1):
    """Ragged context lengths and block tables of distinct random blocks, padded with garbage ids."""
    context_lens = [rng.randint(min_context, max_context) for _ in range(num_seqs)]
    max_blocks = -(-max(context_lens) // block_size)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables = []
    for length in context_lens:
        used = [free.pop() for _ in range(-(-length // block_size))]
        tables.append(used + [rng.randrange(NUM_BLOCKS) for _ in range(max_blocks - len(used))])
    return torch.tensor(tables, device=DEVICE), torch.tensor(context_lens, device=DEVICE)


def random_cache(dtype, block_size, num_kv_heads, head_size):
    shape = (NUM_BLOCKS, num_kv_heads, block_size, head_size)
    return torch.randn(shape, dtype=dtype, device=DEVICE), torch.randn(shape, dtype=dtype, device=DEVICE)


def decode_case(
    dtype,
    head_size,
    block_size,
    num_heads,
    num_kv_heads,
    partition_size,
    seed,
    num_seqs=9,
    max_context=None,
    min_context=1,
    caches=random_cache,
):
    """``caches(dtype, block_size, num_kv_heads, head_size)``: the K and V caches (of the query's dtype here; fp8
    in tests/gpu/test_fp8_kv_kernels.py)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    key_cache, value_cache = caches(dtype, block_size, num_kv_heads, head_size)
    block_tables, context_lens = random_layout(
        rng, num_seqs, block_size, max_context or NUM_BLOCKS * block_size // 12, min_context
    )
    query = torch.randn(num_seqs, num_heads, head_size, dtype=dtype, device=DEVICE)
    scale = head_size**-0.5
    ref = torch_ops.paged_attention_decode(
        query.float(), key_cache.float(), value_cache.float(), block_tables, context_lens, scale
    )
    poison_allocator(query.numel() * query.element_size())
    out = kernels.paged_attention_decode(
        query, key_cache, value_cache, block_tables, context_lens, scale, partition_size=partition_size
    )
    assert out.dtype == dtype
    assert not out.isnan().any(), "an output element was not written"
    assert relative_error(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("partition_size", [None, 32], ids=["v1", "v2"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_gqa_matches_torch(dtype, head_size, block_size, partition_size):
    decode_case(dtype, head_size, block_size, num_heads=8, num_kv_heads=2, partition_size=partition_size, seed=7)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (12, 2), (32, 1)], ids=["mha", "gqa6", "mqa"])
@pytest.mark.parametrize("partition_size", [None, 48], ids=["v1", "v2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_head_layouts_match_torch(dtype, num_heads, num_kv_heads, partition_size):
    decode_case(dtype, 128, 16, num_heads, num_kv_heads, partition_size, seed=num_heads)


def test_decode_default_picks_v2_for_one_long_sequence():
    decode_case(torch.float16, 128, 16, 32, 8, None, seed=3, num_seqs=1, max_context=1400, min_context=1100)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_writes_its_slots_only(dtype):
    torch.manual_seed(0)
    num_tokens, num_kv_heads, head_size = 37, 2, 80
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_size, dtype=dtype, device=DEVICE)
    key, value = qkv[:, :num_kv_heads], qkv[:, num_kv_heads : 2 * num_kv_heads]  # strided rows, as from a fused qkv
    slots = torch.randperm(NUM_BLOCKS * 16, device=DEVICE)[:num_tokens]
    slots[::5] = -1  # padding
    key_cache = torch.full((NUM_BLOCKS, num_kv_heads, 16, head_size), float("nan"), dtype=dtype, device=DEVICE)
    value_cache = key_cache.clone()
    ref_key, ref_value = key_cache.clone(), value_cache.clone()
    torch_ops.reshape_and_cache(key, value, ref_key, ref_value, slots)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.nan_to_num(), ref_key.nan_to_num())
    assert torch.equal(value_cache.isnan(), ref_value.isnan())  # untouched slots stay poisoned
    assert torch.equal(value_cache.nan_to_num(), ref_value.nan_to_num())


def kv_pool(num_blocks, dtype, device, fill=None):
    shape = (3, 2, num_blocks, 2, 8, 64)  # [layers, K/V, blocks, kv heads, block size, head dim]
    if fill is None:
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.full(shape, fill, dtype=dtype, device=device, pin_memory=device == "cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_copy_on_write(dtype):
    torch.manual_seed(1)
    pool = kv_pool(NUM_BLOCKS, dtype, DEVICE)
    mapping = [(3, 40), (7, 41), (3, 90)]
    ref = pool.clone()
    for src, dst in mapping:
        ref[:, :, dst] = ref[:, :, src]
    kernels.copy_blocks(pool, pool, torch.tensor(mapping, device=DEVICE))
    assert torch.equal(pool, ref)


@CUDA_ONLY
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_swap_round_trip(dtype):
    torch.manual_seed(1)
    pool = kv_pool(NUM_BLOCKS, dtype, "cuda")
    cpu_pool = kv_pool(16, dtype, "cpu", fill=float("nan"))
    kernels.copy_blocks(pool, cpu_pool, torch.tensor([(40, 0), (5, 9)], device="cuda"))  # swap out
    torch.cuda.current_stream().synchronize()
    assert torch.equal(cpu_pool[:, :, 0], pool[:, :, 40].cpu()) and torch.equal(cpu_pool[:, :, 9], pool[:, :, 5].cpu())
    assert cpu_pool[:, :, 1:9].isnan().all()
    fresh = kv_pool(NUM_BLOCKS, dtype, "cuda", fill=float("nan"))
    kernels.copy_blocks(cpu_pool, fresh, torch.tensor([(0, 60), (9, 2)], device="cuda"))  # swap in
    assert torch.equal(fresh[:, :, 60], pool[:, :, 40]) and torch.equal(fresh[:, :, 2], pool[:, :, 5])
    assert fresh[:, :, 3:60].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_blocks_matches_torch(dtype):
    key_cache, _ = random_cache(dtype, 16, 4, 96)
    block_tables, _ = random_layout(random.Random(2), 5, 16, 200)
    poison_allocator(block_tables.numel() * key_cache[0].numel() * key_cache.element_size())
    assert torch.equal(kernels.gather_blocks(key_cache, block_tables), torch_ops.gather_blocks(key_cache, block_tables))


@pytest.mark.parametrize("query_len", [1, 19, 150], ids=["one", "chunk", "whole-prompt"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_torch(dtype, query_len):
    torch.manual_seed(3)
    key_cache, value_cache = random_cache(dtype, 16, 2, 128)
    context_len = 150
    block_ids = torch.randperm(NUM_BLOCKS, device=DEVICE)[:10]
    query = torch.randn(query_len, 8, 128, dtype=dtype, device=DEVICE)
    ref = torch_ops.paged_attention_prefill(
        query.float(), key_cache.float(), value_cache.float(), block_ids, context_len, 128**-0.5
    )
    out = kernels.paged_attention_prefill(query, key_cache, value_cache, block_ids, context_len, 128**-0.5)
    assert relative_error(out, ref) <= TOLERANCE[dtype]

"""An fp8 KV cache: one byte per element, attention within tolerance of the full-precision cache,
twice the fp16 cache's blocks in the same memory."""

import pytest
import torch

from raypaged.attention.torch_ops import paged_attention_decode, paged_attention_prefill, reshape_and_cache
from raypaged.config import EngineConfig
from raypaged.worker.worker import Worker
from tests.conftest import make_tiny_model

NUM_BLOCKS, HEADS, KV_HEADS, BLOCK, DIM = 8, 4, 2, 4, 16


def filled_caches(dtype: torch.dtype, context_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(context_len, KV_HEADS, DIM, generator=gen) for _ in range(2))
    caches = [torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, DIM, dtype=dtype) for _ in range(2)]
    block_ids = torch.tensor([5, 2, 7])
    slots = block_ids.repeat_interleave(BLOCK)[:context_len] * BLOCK + torch.arange(context_len) % BLOCK
    reshape_and_cache(key, value, *caches, slots)
    return *caches, block_ids


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_attention_is_within_tolerance_of_the_fp32_cache(cache_dtype):
    context_len = 11
    query = torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    results = {}
    for dtype in (torch.float32, cache_dtype):
        key_cache, value_cache, block_ids = filled_caches(dtype, context_len)
        assert key_cache.element_size() == (4 if dtype == torch.float32 else 1)
        decode = paged_attention_decode(
            query, key_cache, value_cache, block_ids[None], torch.tensor([context_len]), DIM**-0.5
        )
        prefill = paged_attention_prefill(
            query.expand(3, -1, -1), key_cache, value_cache, block_ids, context_len, DIM**-0.5
        )
        results[dtype] = (decode, prefill)
    tolerance = 0.1 if cache_dtype == torch.float8_e4m3fn else 0.2  # 3 and 2 mantissa bits
    for exact, rounded in zip(results[torch.float32], results[cache_dtype]):
        assert rounded.dtype == torch.float32
        torch.testing.assert_close(rounded, exact, atol=tolerance / 2, rtol=tolerance)
        assert not torch.equal(rounded, exact)


def test_fp8_cache_holds_twice_the_fp16_blocks(tmp_path, smollm2_dir):
    path = make_tiny_model(tmp_path, smollm2_dir)
    counts = {}
    for kv_dtype in ("auto", "fp8"):
        config = EngineConfig(
            model=str(path), dtype="float16", device="cpu", kv_cache_space=0.01, kv_cache_dtype=kv_dtype
        )
        worker = Worker(config, None)
        counts[kv_dtype] = worker.determine_num_blocks()[0]
        assert worker.attn_backend.name == "torch"
    assert counts["fp8"] // 2 == counts["auto"]  # 10485 and 5242 blocks: floor(space / block bytes)


def test_block_copies_and_swaps_keep_fp8_blocks_bit_for_bit():
    from raypaged.core.outputs import BlockOp
    from raypaged.worker.cache import KVCache

    cache = KVCache(2, 4, 2, (KV_HEADS, BLOCK, DIM), torch.float8_e4m3fn, torch.device("cpu"))
    block = torch.randn(2, 2, KV_HEADS, BLOCK, DIM, generator=torch.Generator().manual_seed(2))
    cache.device_blocks[:, :, 1] = block.to(torch.float8_e4m3fn)
    cache.run_block_ops([BlockOp("copy", 1, 3), BlockOp("swap_out", 1, 0), BlockOp("swap_in", 0, 2)])
    rows = cache.device_blocks.view(torch.uint8)  # compare the stored bytes
    assert torch.equal(rows[:, :, 3], rows[:, :, 1]) and torch.equal(rows[:, :, 2], rows[:, :, 1])
    assert cache.cpu_blocks.element_size() == 1


@pytest.mark.parametrize(("kv_dtype", "backend"), [("fp8", "cpu"), ("fp8_e4m3", "cpu"), ("fp8_e5m2", "torch")])
def test_an_fp32_model_on_cpu_reads_an_e4m3_cache_in_c(tmp_path, smollm2_dir, kv_dtype, backend):
    """The CPU kernels widen and narrow an fp8 e4m3 cache themselves (tests/attention/test_cpu_ops.py); e5m2 stays
    in torch."""
    config = EngineConfig(
        model=str(make_tiny_model(tmp_path, smollm2_dir)),
        dtype="float32",
        device="cpu",
        kv_cache_space=0.01,
        kv_cache_dtype=kv_dtype,
    )
    assert Worker(config, None).attn_backend.name == backend

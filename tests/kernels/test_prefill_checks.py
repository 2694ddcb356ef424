"""paged_prefill_attention rejects bad arguments by name, on CPU, before cupy or a device is touched;
its launch geometry packs a KV head's query heads into one thread block when they fit."""

import pytest
import torch

from raypaged.kernels import paged_prefill_attention
from raypaged.kernels.prefill_ops import MMA_BLOCK_M, SIMT_BLOCK_M, heads_per_block, launch_geometry
from tests.kernels.wrapper_args import HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS, cache, prefill_args


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (dict(query=torch.zeros(7, NUM_HEADS, HEAD_SIZE, dtype=torch.float64)), TypeError, "query must have dtype"),
        (dict(query=torch.zeros(7, NUM_HEADS, HEAD_SIZE)), TypeError, "query, key_cache must share one dtype"),
        (dict(value_cache=cache(torch.bfloat16)), TypeError, "key_cache, value_cache must share one dtype"),
        (dict(query=torch.zeros(7, NUM_HEADS, 48, dtype=torch.float16)), ValueError, "head size 48 is not supported"),
        (dict(key_cache=cache(block_size=4), value_cache=cache(block_size=4)), ValueError, "block size 4"),
        (
            dict(key_cache=cache(head_size=128), value_cache=cache(head_size=128)),
            ValueError,
            r"key_cache must have shape \(\*, \*, \*, 64\)",
        ),
        (dict(query=torch.zeros(7, 3, HEAD_SIZE, dtype=torch.float16)), ValueError, "not a multiple of key_cache's 2"),
        (
            dict(query=torch.zeros(NUM_HEADS, 7, HEAD_SIZE, dtype=torch.float16).transpose(0, 1)),
            ValueError,
            "query must have contiguous",
        ),
        (
            dict(
                query=torch.zeros(7 * NUM_HEADS * HEAD_SIZE + 1, dtype=torch.float16)[1:].view(7, NUM_HEADS, HEAD_SIZE)
            ),
            ValueError,
            "query must start on a 16-byte",
        ),
        (
            dict(key_cache=cache().transpose(1, 2).contiguous().transpose(1, 2)),
            ValueError,
            "key_cache must be contiguous",
        ),
        (dict(cu_seqlens_q=torch.tensor([0, 4, 7])), TypeError, "cu_seqlens_q must have dtype torch.int32"),
        (dict(cu_seqlens_q=torch.zeros(0, dtype=torch.int32)), ValueError, "cu_seqlens_q must have num_spans"),
        (dict(context_lens=torch.tensor([20, 3])), TypeError, "context_lens must have dtype torch.int32"),
        (dict(context_lens=torch.tensor([20], dtype=torch.int32)), ValueError, r"context_lens must have shape \(2,\)"),
        (dict(block_tables=torch.zeros(2, 2, dtype=torch.int16)), TypeError, "block_tables must have dtype"),
        (
            dict(block_tables=torch.zeros(3, 2, dtype=torch.int32)),
            ValueError,
            r"block_tables must have shape \(2, \*\)",
        ),
        (
            dict(block_tables=torch.zeros(2, 4, dtype=torch.int32)[:, ::2]),
            ValueError,
            "block_tables must be contiguous",
        ),
        (dict(scale="0.1"), TypeError, "scale must be a float, got str"),
        (dict(max_query_len=4.0), TypeError, "max_query_len must be an int, got float"),
        (dict(max_query_len=8), ValueError, r"max_query_len must be in \[0, 7\]"),
        (dict(out=torch.zeros(7, NUM_HEADS, HEAD_SIZE)), TypeError, "out, query must share one dtype"),
        (dict(out=torch.zeros(6, NUM_HEADS, HEAD_SIZE, dtype=torch.float16)), ValueError, "out must have shape"),
        (
            dict(
                query=torch.zeros(7, NUM_HEADS, HEAD_SIZE),
                key_cache=cache(torch.float32),
                value_cache=cache(torch.float32),
                tensor_cores=True,
            ),
            ValueError,
            "tensor_cores=True needs float16",
        ),
        (dict(), ValueError, "query must be on a CUDA device, got cpu"),
    ],
)
def test_rejects(overrides, error, message):
    with pytest.raises(error, match=message):
        paged_prefill_attention(**prefill_args(**overrides))


def test_accepts_query_rows_strided_out_of_a_fused_qkv_and_int64_tables():
    qkv = torch.zeros(7, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_SIZE, dtype=torch.float16)
    args = prefill_args(query=qkv[:, :NUM_HEADS], block_tables=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="query must be on a CUDA device"):  # layout passed, device is last
        paged_prefill_attention(**args)


def test_launch_geometry_packs_a_kv_heads_group_into_each_block():
    # Llama-2-7B (no GQA): one head per block, 64 tokens per tile, one block per head
    assert launch_geometry(512, 1, 32, 1, MMA_BLOCK_M) == ((8, 1, 32), 1)
    # GQA 8: the 8 heads of a KV head share a block, 8 tokens per tile; 4 KV heads of 32 heads
    assert launch_geometry(512, 3, 32, 8, MMA_BLOCK_M) == ((64, 3, 4), 8)
    # a group that does not divide the tile's rows: 64 // 6 = 10 tokens per tile
    assert launch_geometry(21, 2, 12, 6, MMA_BLOCK_M) == ((3, 2, 2), 6)
    # MQA with more heads than rows: one head per block
    assert heads_per_block(128, MMA_BLOCK_M) == 1 and heads_per_block(32, SIMT_BLOCK_M) == 1
    assert launch_geometry(5, 1, 32, 32, SIMT_BLOCK_M) == ((1, 1, 32), 1)  # 16 tokens per tile
    assert launch_geometry(5, 1, 32, 16, SIMT_BLOCK_M) == ((5, 1, 2), 16)  # 1 token x 16 heads

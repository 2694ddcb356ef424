"""The kernel wrappers reject bad arguments by name, on CPU, before cupy or a device is touched."""

import pytest
import torch

from raypaged.kernels import (
    copy_blocks,
    gather_blocks,
    paged_attention_decode,
    paged_attention_prefill,
    reshape_and_cache,
)
from raypaged.kernels.ops import decode_partition_size, shared_bytes_limit_tokens
from tests.kernels.wrapper_args import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_BLOCKS,
    NUM_HEADS,
    NUM_KV_HEADS,
    cache,
    decode_args,
    reshape_args,
)


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (dict(query=torch.zeros(3, NUM_HEADS, HEAD_SIZE, dtype=torch.float64)), TypeError, "query must have dtype"),
        (dict(query=[[0.0]]), TypeError, "query must be a torch.Tensor, got list"),
        (dict(value_cache=cache(torch.bfloat16)), TypeError, "key_cache, value_cache must share one dtype"),
        (dict(query=torch.zeros(3, NUM_HEADS, HEAD_SIZE)), TypeError, "query, key_cache must share one dtype"),
        (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)), TypeError, "block_tables must have dtype"),
        (dict(query=torch.zeros(3, NUM_HEADS, 48, dtype=torch.float16)), ValueError, "head size 48 is not supported"),
        (dict(key_cache=cache(block_size=4), value_cache=cache(block_size=4)), ValueError, "block size 4"),
        (dict(value_cache=cache(kv_heads=4)), ValueError, r"value_cache must have shape \(8, 2, 16, 64\)"),
        (dict(query=torch.zeros(3, 3, HEAD_SIZE, dtype=torch.float16)), ValueError, "not a multiple of key_cache's 2"),
        (dict(block_tables=torch.zeros(2, 4, dtype=torch.long)), ValueError, r"block_tables must have shape \(3, \*\)"),
        (dict(context_lens=torch.ones(3, 1, dtype=torch.long)), ValueError, "context_lens must have 1 dimensions"),
        (
            dict(query=torch.zeros(NUM_HEADS, 3, HEAD_SIZE, dtype=torch.float16).transpose(0, 1)),
            ValueError,
            "query must be contiguous",
        ),
        (
            dict(key_cache=cache().transpose(1, 2).contiguous().transpose(1, 2)),
            ValueError,
            "key_cache must be contiguous",
        ),
        (
            dict(
                key_cache=torch.zeros(NUM_BLOCKS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE + 1, dtype=torch.float16)[
                    1:
                ].view(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
            ),
            ValueError,
            "key_cache must start on a 16-byte",
        ),
        (dict(scale="0.1"), TypeError, "scale must be a float, got str"),
        (dict(), ValueError, "query must be on a CUDA device, got cpu"),
    ],
)
def test_decode_rejects(overrides, error, message):
    with pytest.raises(error, match=message):
        paged_attention_decode(**decode_args(**overrides))


def test_decode_rejects_a_partition_larger_than_shared_memory():
    with pytest.raises(ValueError, match=r"partition_size must be in \[1, 2942\]"):
        paged_attention_decode(**decode_args(), partition_size=4096)


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (dict(key=torch.zeros(5, NUM_KV_HEADS, HEAD_SIZE)), TypeError, "key, value, key_cache must share one dtype"),
        (
            dict(value=torch.zeros(5, NUM_KV_HEADS, 32, dtype=torch.float16)),
            ValueError,
            r"value must have shape \(\*, 2, 64\)",
        ),
        (
            dict(key=torch.zeros(5, HEAD_SIZE, NUM_KV_HEADS, dtype=torch.float16).transpose(1, 2)),
            ValueError,
            "key must have contiguous",
        ),
        (dict(slot_mapping=torch.arange(4)), ValueError, r"slot_mapping must have shape \(5,\)"),
        (dict(slot_mapping=torch.arange(5, dtype=torch.int32)), TypeError, "slot_mapping must have dtype"),
        (dict(), ValueError, "key must be on a CUDA device, got cpu"),
    ],
)
def test_reshape_and_cache_rejects(overrides, error, message):
    with pytest.raises(error, match=message):
        reshape_and_cache(**reshape_args(**overrides))


def test_reshape_and_cache_accepts_rows_strided_out_of_a_fused_qkv():
    qkv = torch.zeros(5, 3 * NUM_KV_HEADS, HEAD_SIZE, dtype=torch.float16)
    key, value = qkv[:, :NUM_KV_HEADS], qkv[:, NUM_KV_HEADS : 2 * NUM_KV_HEADS]
    with pytest.raises(ValueError, match="key must be on a CUDA device"):  # layout passed, device is last
        reshape_and_cache(**reshape_args(key=key, value=value))


def pools(num_blocks=NUM_BLOCKS, dtype=torch.float16):
    return torch.zeros(2, 2, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, dtype=dtype)


@pytest.mark.parametrize(
    "src, dst, mapping, error, message",
    [
        (pools(), pools(dtype=torch.float32), torch.zeros(1, 2, dtype=torch.long), TypeError, "src, dst must share"),
        (pools(), pools()[:1], torch.zeros(1, 2, dtype=torch.long), ValueError, "must match except in num_blocks"),
        (
            pools(),
            pools(4),
            torch.zeros(1, 3, dtype=torch.long),
            ValueError,
            r"block_mapping must have shape \(\*, 2\)",
        ),
        (pools(), pools(4), torch.zeros(1, 2, dtype=torch.long), ValueError, "src is a CPU tensor but not in pinned"),
        (pools()[0], pools()[0], torch.zeros(1, 2, dtype=torch.long), ValueError, "src must have 6 dimensions"),
        (
            torch.zeros(2, 2, 4, 1, 1, 3),
            torch.zeros(2, 2, 4, 1, 1, 3),
            torch.zeros(1, 2, dtype=torch.long),
            ValueError,
            "src blocks of 12 bytes are not a multiple of 16",
        ),
    ],
)
def test_copy_blocks_rejects(src, dst, mapping, error, message):
    with pytest.raises(error, match=message):
        copy_blocks(src, dst, mapping)


def test_gather_and_prefill_reject_cpu_and_bad_lengths():
    with pytest.raises(ValueError, match="cache must be on a CUDA device"):
        gather_blocks(cache(), torch.zeros(2, 3, dtype=torch.long))
    query = torch.zeros(4, NUM_HEADS, HEAD_SIZE, dtype=torch.float16)
    with pytest.raises(ValueError, match="context_len 70 must cover the 4 query tokens and fit in 4 blocks of 16"):
        paged_attention_prefill(query, cache(), cache(), torch.arange(4), 70, 0.125)
    with pytest.raises(ValueError, match="query must be on a CUDA device"):
        paged_attention_prefill(query, cache(), cache(), torch.arange(4), 50, 0.125)


def test_partition_choice_is_one_pass_for_full_batches_and_split_for_long_or_small():
    # batch 256 x 32 KV heads at 2048 tokens fills 132 SMs: v1, the whole context per block
    assert decode_partition_size(256, 32, 1, 128, 2048, 132) == 2048
    # one sequence leaves SMs idle: split into 512-token partitions
    assert decode_partition_size(1, 32, 1, 128, 2048, 132) == 512
    # a context beyond shared memory always splits
    assert decode_partition_size(256, 32, 1, 128, 32768, 132) == 512
    # MQA with 32 query heads per KV head: partitions shrink to what shared memory holds
    assert decode_partition_size(1, 1, 32, 128, 4096, 132) == shared_bytes_limit_tokens(32, 128) == 126
    with pytest.raises(ValueError, match="96 query heads per KV head at head size 128 do not fit"):
        shared_bytes_limit_tokens(96, 128)

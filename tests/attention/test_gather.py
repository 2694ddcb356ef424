"""The paged K/V gathers against a gather written block by block."""

import pytest
import torch

from raypaged.attention.torch_ops import gather_blocks, gather_heads_first


def gathered_by_loop(cache, block_tables):
    """[S, max_blocks] -> [S, Hkv, max_blocks * block_size, D], one block at a time."""
    return torch.stack([torch.cat([cache[block] for block in table.tolist()], dim=1) for table in block_tables])


@pytest.mark.parametrize(
    ("num_kv_heads", "block_size", "table"),
    [
        (3, 16, [[7, 2, 9], [0, 0, 0], [4, 4, 1]]),  # padding with block 0, a block repeated in a row
        (1, 8, [[5]]),  # one head, one block
        (2, 1, [[1, 2, 3, 4, 5, 6]]),  # one token per block
    ],
)
def test_gather_heads_first_matches_block_by_block(num_kv_heads, block_size, table):
    torch.manual_seed(num_kv_heads)
    cache = torch.randn(10, num_kv_heads, block_size, 4)
    block_tables = torch.tensor(table)
    out = gather_heads_first(cache, block_tables)
    assert out.shape == (len(table), num_kv_heads, len(table[0]) * block_size, 4)
    assert torch.equal(out, gathered_by_loop(cache, block_tables))


def test_gather_blocks_is_tokens_then_heads():
    torch.manual_seed(0)
    cache = torch.randn(6, 2, 4, 8)
    block_tables = torch.tensor([[3, 1], [5, 0]])
    assert torch.equal(gather_blocks(cache, block_tables), gathered_by_loop(cache, block_tables).transpose(1, 2))


def test_gather_of_a_layer_view_of_the_whole_cache():
    """Each layer's cache is a view into [layers, 2, blocks, ...]: the gather reads only its own layer's K."""
    torch.manual_seed(1)
    blocks = torch.randn(3, 2, 5, 2, 4, 8)  # layers, K/V, blocks, heads, block size, head dim
    key_cache = blocks[1, 0]
    block_tables = torch.tensor([[4, 2, 0]])
    assert torch.equal(gather_heads_first(key_cache, block_tables), gathered_by_loop(key_cache, block_tables))

import pytest

from raypaged.core.block_manager import BlockPool, KVCacheManager


def test_pool_allocates_from_the_front_and_reuses_freed_blocks_last():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.ref_counts == [1, 1, 0, 0]
    pool.free([1, 0])
    assert pool.ref_counts == [0, 0, 0, 0]
    assert pool.allocate(4) == [2, 3, 1, 0]
    assert pool.free_block_ids == []


def test_pool_rejects_overallocation_and_double_free():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="cannot allocate 3 blocks, 2 free"):
        pool.allocate(3)
    pool.allocate(1)
    pool.free([0])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([0])
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_allocate_slots_grows_on_demand_one_block_per_block_size_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    # a 5-token prompt needs 2 blocks
    assert kv.allocate_slots("a", 0, 5).new_block_ids == [0, 1]
    # decode tokens 6..8 fit the second block: nothing new
    assert kv.allocate_slots("a", 5, 1).new_block_ids == []
    assert kv.allocate_slots("a", 6, 1).new_block_ids == []
    assert kv.allocate_slots("a", 7, 1).new_block_ids == []
    # token 9 opens block 3
    assert kv.allocate_slots("a", 8, 1).new_block_ids == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    kv.check_invariants()


def test_allocate_slots_returns_none_and_changes_nothing_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots("a", 0, 8).new_block_ids == [0, 1]
    assert kv.allocate_slots("b", 0, 8) is None
    assert "b" not in kv.block_tables
    assert kv.allocate_slots("a", 8, 5) is None  # would need 2 more blocks, 1 is free
    assert kv.get_block_ids("a") == [0, 1]
    assert kv.num_free_blocks == 1
    kv.check_invariants()


def test_free_releases_everything_last_block_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    kv.allocate_slots("a", 0, 5)  # blocks 0, 1, 2
    kv.allocate_slots("b", 0, 2)  # block 3
    kv.free("a")
    assert kv.pool.ref_counts == [0, 0, 0, 1, 0, 0]
    assert kv.num_free_blocks == 5
    # free queue: 4, 5, then a's blocks in reverse
    assert kv.allocate_slots("c", 0, 10).new_block_ids == [4, 5, 2, 1, 0]
    kv.free("b")
    kv.free("c")
    kv.free("never-allocated")
    assert kv.num_free_blocks == 6
    assert kv.usage == 0.0
    kv.check_invariants()


def test_check_invariants_catches_a_corrupted_ref_count():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    kv.allocate_slots("a", 0, 1)
    kv.pool.ref_counts[0] = 2
    with pytest.raises(AssertionError, match="ref counts disagree with block tables"):
        kv.check_invariants()


def test_blocks_to_swap_in_count_shared_blocks_once_and_every_copy_but_the_last():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=8)
    kv.allocate_slots("a", 0, 6)  # blocks 0, 1; block 1 partly filled
    kv.fork("a", "b")
    kv.fork("a", "c")
    assert kv.swap_out(["a", "b", "c"]) is not None
    # decode: a and b copy the shared, partly filled block; c, its last writer, keeps it
    assert kv.num_blocks_to_swap_in([("a", 6, 1), ("b", 6, 1), ("c", 6, 1)]) == 2 + 2
    # c not scheduled this step: a and b both copy (c still holds the block)
    assert kv.num_blocks_to_swap_in([("a", 6, 1), ("b", 6, 1), ("c", 6, 0)]) == 2 + 2
    assert kv.num_blocks_to_swap_in([("a", 6, 1), ("b", 6, 0), ("c", 6, 0)]) == 2 + 1
    # a chunk past the block end grows the table too
    assert kv.num_blocks_to_swap_in([("a", 6, 7), ("b", 6, 0), ("c", 6, 0)]) == 2 + 1 + 2
    [copies] = [kv.swap_in(["a", "b", "c"])]
    assert len(copies) == 2
    assert [kv.allocate_slots(s, 6, 1).copies != [] for s in "abc"] == [True, True, False]
    assert kv.num_free_blocks == 8 - 4


def test_blocks_to_hold_a_recomputed_sequence_reuse_only_cached_blocks_still_held():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(1, 11))
    kv.allocate_slots("a", 0, 10)  # 3 blocks, 2 of them full
    kv.cache_blocks("a", tokens, [], 10)
    # b recomputes the same 10 tokens: its 2 leading full blocks are a's, the third is new
    assert kv.num_blocks_to_hold(["a"], [tokens]) == 3 + 1
    assert kv.num_blocks_to_hold([], [tokens]) == 3  # a's blocks would not be held: counted
    assert kv.num_blocks_to_hold(["a"], [tokens, [9] + tokens]) == 3 + 1 + 3
    nocache = KVCacheManager(num_blocks=16, block_size=4)
    nocache.allocate_slots("a", 0, 10)
    assert nocache.num_blocks_to_hold(["a"], [tokens]) == 3 + 3
    assert kv.cached_prefix_blocks(tokens) == [0, 1] and nocache.cached_prefix_blocks(tokens) == []

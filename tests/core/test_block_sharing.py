"""Fork, copy-on-write, prefix caching and swapping in the block manager, on exact block ids."""

from raypaged.core.block_manager import KVCacheManager


def test_fork_shares_every_block_and_copy_on_write_splits_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("p", 0, 6)  # blocks 0 (full) and 1 (2 of 4 slots used)
    kv.fork("p", "c")
    assert kv.get_block_ids("c") == [0, 1]
    assert kv.pool.ref_counts[:2] == [2, 2]
    kv.check_invariants()

    # the child writes position 6 into shared block 1: it gets a copy first
    allocation = kv.allocate_slots("c", 6, 1)
    assert allocation.copies == [(1, 2)]
    assert allocation.new_block_ids == []
    assert kv.get_block_ids("c") == [0, 2]
    assert kv.pool.ref_counts[:3] == [2, 1, 1]
    # now the parent is block 1's only owner: it writes in place
    allocation = kv.allocate_slots("p", 6, 1)
    assert allocation.copies == []
    assert kv.get_block_ids("p") == [0, 1]
    kv.check_invariants()

    kv.free("p")
    assert kv.pool.ref_counts[:3] == [1, 0, 1]
    kv.free("c")
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_a_write_that_starts_a_new_block_needs_no_copy():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("p", 0, 4)
    kv.fork("p", "c")
    allocation = kv.allocate_slots("c", 4, 1)
    assert (allocation.copies, allocation.new_block_ids) == ([], [1])
    assert kv.get_block_ids("c") == [0, 1]
    assert kv.pool.ref_counts[:2] == [2, 1]


def test_copy_on_write_counts_its_block_against_the_free_pool():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.allocate_slots("p", 0, 6)
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 6, 1) is None  # the copy needs a block and none is free
    assert kv.get_block_ids("c") == [0, 1]
    kv.check_invariants()


def test_prefix_cache_hits_full_blocks_confirmed_by_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    assert kv.computed_prefix("a", prompt) == 0
    kv.allocate_slots("a", 0, 11)
    kv.cache_blocks("a", prompt, [], 11)
    assert kv.get_block_ids("a") == [0, 1, 2]

    # same first 8 tokens: two blocks hit and are shared
    assert kv.computed_prefix("b", prompt[:8] + [7, 7, 7]) == 8
    assert kv.get_block_ids("b") == [0, 1]
    assert kv.pool.ref_counts[:3] == [2, 2, 1]
    # a different second block: only the first hits
    assert kv.computed_prefix("c", prompt[:4] + [9] * 7) == 4
    # the same tokens after a different first block never hit (chained keys)
    assert kv.computed_prefix("d", [1, 2, 3, 4] + prompt[4:]) == 0
    # a whole prompt in cache still leaves its last token to compute
    assert kv.computed_prefix("e", prompt[:8]) == 4
    kv.check_invariants()


def test_freed_cached_blocks_are_reused_in_lru_order_and_evicted_when_reallocated():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    first, second = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    kv.allocate_slots("a", 0, 5)  # blocks 0, 1, 2
    kv.cache_blocks("a", first, [], 5)
    kv.free("a")  # free list: 3, then 2, 1, 0 (last block first)
    assert kv.pool.free_block_ids == [3, 2, 1, 0]
    # a hit revives freed blocks 0 and 1 out of the free list
    assert kv.computed_prefix("b", first) == 4
    assert kv.pool.free_block_ids == [3, 2]
    kv.free("b")
    assert kv.pool.free_block_ids == [3, 2, 1, 0]
    # new allocations take the least recently freed first: 3 and 2, then block 1 is evicted
    kv.allocate_slots("c", 0, 5)
    kv.cache_blocks("c", second, [], 5)
    assert kv.get_block_ids("c") == [3, 2, 1]
    assert kv.computed_prefix("d", first) == 2  # block 0 still cached, block 1 was evicted
    kv.check_invariants()


def test_swap_out_and_in_keep_shared_blocks_shared():
    kv = KVCacheManager(num_blocks=6, block_size=4, num_cpu_blocks=4)
    kv.allocate_slots("p", 0, 6)  # 0, 1
    kv.fork("p", "c")
    kv.allocate_slots("c", 6, 3)  # copy of block 1 -> 2, then block 3 for position 8
    assert kv.get_block_ids("c") == [0, 2, 3]

    copies = kv.swap_out(["p", "c"])
    assert copies == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert kv.swapped["p"].block_ids == [0, 1] and kv.swapped["c"].block_ids == [0, 2, 3]
    assert kv.cpu_pool.ref_counts == [2, 1, 1, 1]
    assert kv.num_free_blocks == 6 and kv.num_free_cpu_blocks == 0
    kv.check_invariants()

    # device free list is now 4, 5, then p's blocks (1; 0 still c's), then c's (3, 2, 0)
    assert kv.pool.free_block_ids == [4, 5, 1, 3, 2, 0]
    kv.allocate_slots("x", 0, 4)  # takes device block 4
    copies = kv.swap_in(["p", "c"])
    assert copies == [(0, 5), (1, 1), (2, 3), (3, 2)]
    assert kv.get_block_ids("p") == [5, 1] and kv.get_block_ids("c") == [5, 3, 2]
    assert kv.pool.ref_counts == [0, 1, 1, 1, 1, 2]
    assert kv.num_free_cpu_blocks == 4
    kv.check_invariants()


def test_swap_out_refuses_when_the_cpu_pool_is_short():
    kv = KVCacheManager(num_blocks=6, block_size=4, num_cpu_blocks=1)
    kv.allocate_slots("p", 0, 8)
    assert kv.swap_out(["p"]) is None
    assert kv.get_block_ids("p") == [0, 1]
    assert KVCacheManager(num_blocks=2, block_size=4).swap_out([]) is None  # no CPU pool at all


def test_reset_prefix_cache_forgets_cached_blocks_only_when_none_is_in_use():
    from raypaged.core.block_manager import KVCacheManager

    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = list(range(9))  # two full blocks and one token
    kv.computed_prefix("a", tokens)
    kv.allocate_slots("a", 0, 9)
    kv.cache_blocks("a", tokens, [], 9)
    assert kv.reset_prefix_cache() is False  # "a" holds its blocks
    kv.free("a")
    assert kv.cached_prefix_blocks(tokens) != []
    assert kv.reset_prefix_cache() is True
    assert kv.cached_prefix_blocks(tokens) == [] and kv.num_free_blocks == 8
    assert kv.computed_prefix("b", tokens) == 0

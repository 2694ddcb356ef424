"""Prefix-cache keys: sha256 chains rooted at each sequence's cache salt, on exact block ids."""

import struct
from hashlib import sha256

from raypaged.core.block_manager import KVCacheManager
from raypaged.core.outputs import ModelRunnerOutput, SampledToken
from raypaged.core.request import Request
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from raypaged.sampling_params import SamplingParams

PROMPT = list(range(100, 111))  # 11 tokens: 2 full blocks of 4 + 3


def cached(kv: KVCacheManager, seq_id: str, token_ids: list[int], cache_salt: str | None) -> None:
    """Compute ``token_ids`` as a new sequence under ``cache_salt`` and offer its full blocks to the cache."""
    kv.computed_prefix(seq_id, token_ids, cache_salt)
    kv.allocate_slots(seq_id, 0, len(token_ids))
    kv.cache_blocks(seq_id, token_ids, [], len(token_ids))


def test_keys_are_sha256_chained_from_the_salts_root():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    cached(kv, "a", PROMPT, None)
    cached(kv, "b", PROMPT, "tenant-1")
    first = sha256(sha256(b"").digest() + struct.pack("<4q", 100, 101, 102, 103)).digest()
    second = sha256(first + struct.pack("<4q", 104, 105, 106, 107)).digest()
    assert kv.tables["a"].keys == [first, second]
    salted = sha256(sha256(b"salt:tenant-1").digest() + struct.pack("<4q", 100, 101, 102, 103)).digest()
    assert kv.tables["b"].keys[0] == salted
    assert (kv.pool.lookup(first), kv.pool.lookup(second), kv.pool.lookup(salted)) == (0, 1, 3)


def test_the_same_salt_shares_blocks_as_without_salts():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    cached(kv, "a", PROMPT, "tenant-1")
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.computed_prefix("b", PROMPT[:8] + [7, 7, 7], "tenant-1") == 8
    assert kv.get_block_ids("b") == [0, 1]
    assert kv.pool.ref_counts[:3] == [2, 2, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (22, 8)
    kv.check_invariants()


def test_different_salts_never_share_a_block_nor_count_a_hit():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    cached(kv, "a", PROMPT, "tenant-1")
    assert kv.computed_prefix("b", PROMPT, "tenant-2") == 0
    assert kv.cached_prefix_blocks(PROMPT, "tenant-2") == []
    assert kv.cached_prefix_blocks(PROMPT, "tenant-1") == [0, 1]
    kv.allocate_slots("b", 0, 11)
    kv.cache_blocks("b", PROMPT, [], 11)
    assert kv.get_block_ids("b") == [3, 4, 5]
    assert kv.pool.ref_counts[:6] == [1, 1, 1, 1, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (22, 0)
    # each salt now finds its own copy
    assert kv.cached_prefix_blocks(PROMPT, "tenant-2") == [3, 4]
    kv.check_invariants()


def test_no_salt_and_a_salt_never_share_the_empty_salt_included():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    cached(kv, "a", PROMPT, None)
    assert kv.cached_prefix_blocks(PROMPT, "") == []
    assert kv.cached_prefix_blocks(PROMPT, "tenant-1") == []
    assert kv.cached_prefix_blocks(PROMPT) == [0, 1]
    cached(kv, "b", PROMPT, "")
    assert kv.get_block_ids("b") == [3, 4, 5]
    assert kv.computed_prefix("c", PROMPT) == 8
    assert kv.get_block_ids("c") == [0, 1]


def test_a_forked_child_extends_its_parents_salted_chain():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6]
    assert kv.computed_prefix("p", prompt, "tenant-1") == 0
    kv.allocate_slots("p", 0, 6)  # blocks 0 (full) and 1 (half)
    kv.cache_blocks("p", prompt, [], 6)
    kv.fork("p", "c")
    assert kv.tables["c"].cache_salt == "tenant-1"
    # the child fills its copy of block 1: its second full block joins tenant-1's chain
    assert kv.allocate_slots("c", 6, 2).copies == [(1, 2)]
    kv.cache_blocks("c", prompt, [7, 8], 8)
    child_tokens = prompt + [7, 8, 9]
    assert kv.cached_prefix_blocks(child_tokens, "tenant-2") == []
    assert kv.cached_prefix_blocks(child_tokens) == []
    assert kv.computed_prefix("x", child_tokens, "tenant-1") == 8
    assert kv.get_block_ids("x") == [0, 2]
    assert kv.pool.ref_counts[:3] == [3, 1, 2]
    kv.check_invariants()


def test_swapping_keeps_the_salt_so_later_blocks_extend_the_chain():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, num_cpu_blocks=4)
    prompt = [1, 2, 3, 4, 5, 6]
    kv.computed_prefix("a", prompt, "tenant-1")
    kv.allocate_slots("a", 0, 6)
    kv.cache_blocks("a", prompt, [], 6)
    assert kv.swap_out(["a"]) == [(0, 0), (1, 1)]
    assert kv.swap_in(["a"]) == [(0, 2), (1, 3)]
    assert kv.tables["a"].cache_salt == "tenant-1"
    kv.allocate_slots("a", 6, 2)
    kv.cache_blocks("a", prompt, [7, 8], 8)
    assert kv.cached_prefix_blocks(prompt + [7, 8, 9], "tenant-1") == [0, 3]  # block 0 stayed cached while free
    assert kv.cached_prefix_blocks(prompt + [7, 8, 9]) == []
    kv.check_invariants()


def test_blocks_to_hold_count_hits_under_the_recomputed_sequences_salt():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(1, 11))
    cached(kv, "a", tokens, "tenant-1")
    assert kv.num_blocks_to_hold(["a"], [tokens], "tenant-1") == 3 + 1
    assert kv.num_blocks_to_hold(["a"], [tokens]) == 3 + 3


def test_the_scheduler_looks_up_each_request_under_its_salt():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=128), KVCacheManager(32, 4, enable_prefix_caching=True))
    prompt = list(range(1, 21))
    params = SamplingParams(temperature=0)
    for request_id, salt in [("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")]:
        s.add_request(Request(request_id, list(prompt), params, 2, 0, cache_salt=salt))
        out = s.schedule()
        sampled = {rid: SampledToken(7, -0.5, None) for rid in out.num_scheduled_tokens}
        s.update_from_output(out, ModelRunnerOutput(sampled=sampled))
        [new] = out.new_requests
        assert new.num_computed_tokens == {"a": 0, "b": 0, "c": 16}[request_id]
    assert s.stats()["prefix_cache_hits"] == 16

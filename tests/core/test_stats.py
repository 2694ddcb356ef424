"""SchedulerStats: typed attributes and a read-only mapping by the same names."""

import dataclasses

import pytest

from raypaged.core.stats import SchedulerStats

COUNTS = dict(
    num_gpu_blocks_total=10,
    num_gpu_blocks_free=7,
    num_cpu_blocks_total=4,
    num_cpu_blocks_free=4,
    kv_cache_usage=0.3,
    num_requests_running=2,
    num_requests_waiting=1,
    num_requests_swapped=0,
    num_preemptions=5,
    num_swap_outs=1,
    prefix_cache_queries=9,
    prefix_cache_hits=3,
)


def test_attributes_and_mapping_agree():
    spec = {"spec_decode_num_drafts": 2, "spec_decode_num_accepted_tokens_per_pos_0": 1}
    stats = SchedulerStats(**COUNTS, spec_decode=spec)
    assert stats.num_gpu_blocks_free == stats["num_gpu_blocks_free"] == 7
    assert list(stats) == [*COUNTS, *spec]
    assert stats == {**COUNTS, **spec} and dict(stats) == {**COUNTS, **spec} and len(stats) == 14
    assert stats["spec_decode_num_drafts"] == 2
    with pytest.raises(KeyError):
        stats["no_such_counter"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_gpu_blocks_free = 0

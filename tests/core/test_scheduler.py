"""The scheduler on plain Python: exact batches, block ids, preemption order."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypaged.core.block_manager import KVCacheManager
from raypaged.core.outputs import ModelRunnerOutput, SampledToken, SchedulerOutput
from raypaged.core.request import Request, RequestStatus
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from raypaged.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, budget=64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=1024),
        KVCacheManager(num_blocks, block_size),
    )


def make_request(request_id: str, num_prompt: int, max_tokens: int = 8) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(request_id, list(range(1, num_prompt + 1)), params, max_tokens, EOS)


def run_step(scheduler: Scheduler, token_id: int = 7) -> SchedulerOutput:
    """Schedule, then sample ``token_id`` for every request that reached its last token."""
    out = scheduler.schedule()
    sampled = {}
    for request_id, n in out.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        if request.num_computed_tokens + n == request.num_tokens:
            sampled[request_id] = SampledToken(token_id, -0.5, None)
    scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    return out


def test_prefill_then_decode_with_deltas_only():
    s = make_scheduler()
    s.add_request(make_request("a", 7))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 7}
    [new] = out.new_requests
    assert (new.request_id, new.block_ids, new.num_computed_tokens) == ("a", [0, 1], 0)
    assert new.prompt_token_ids == [1, 2, 3, 4, 5, 6, 7]
    s.update_from_output(out, ModelRunnerOutput(sampled={"a": SampledToken(9, -1.0, None)}))

    out = s.schedule()
    assert out.new_requests == []
    [cached] = out.cached_requests
    assert (cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens) == ([9], [], 7)
    assert out.num_scheduled_tokens == {"a": 1}
    s.update_from_output(out, ModelRunnerOutput(sampled={"a": SampledToken(10, -1.0, None)}))
    out = s.schedule()
    assert out.cached_requests[0].new_token_ids == [10]
    assert out.cached_requests[0].new_block_ids == [2]  # position 8 opens the third block


def test_requests_join_and_leave_the_batch_every_step():
    s = make_scheduler()
    s.add_request(make_request("a", 3, max_tokens=2))
    assert run_step(s).num_scheduled_tokens == {"a": 3}
    s.add_request(make_request("b", 2, max_tokens=3))
    assert run_step(s).num_scheduled_tokens == {"a": 1, "b": 2}
    # a has its 2 tokens and is gone; b keeps decoding
    assert s.requests.keys() == {"b"}
    out = run_step(s)
    assert out.num_scheduled_tokens == {"b": 1}
    assert out.finished_request_ids == {"a"}
    run_step(s)
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_token_budget_chunks_a_long_prompt_while_decodes_continue():
    s = make_scheduler(num_blocks=32, budget=8)
    s.add_request(make_request("short", 2, max_tokens=20))
    run_step(s)
    s.add_request(make_request("long", 20))
    out = run_step(s)
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}
    out = run_step(s)
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}
    assert out.cached_requests[1].new_token_ids == []  # still inside the prompt
    out = run_step(s)
    assert out.num_scheduled_tokens == {"short": 1, "long": 6}
    assert len(s.requests["long"].output_token_ids) == 1  # sampled after the last chunk only


def test_max_num_seqs_caps_the_batch_in_fcfs_order():
    s = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid, 2))
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_admission_waits_for_free_blocks():
    s = make_scheduler(num_blocks=3, block_size=4)
    s.add_request(make_request("a", 8))
    s.add_request(make_request("b", 8))
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["a"]
    assert [r.request_id for r in s.waiting] == ["b"]


def test_preemption_frees_the_newest_and_requeues_it_at_the_front():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=8)
    s.add_request(make_request("a", 4, max_tokens=8))
    s.add_request(make_request("b", 4, max_tokens=8))
    s.add_request(make_request("c", 8, max_tokens=8))
    run_step(s)  # a: block 0, b: block 1; c needs 2 but only 2 free -> admitted too
    assert s.kv.get_block_ids("c") == [2, 3]
    out = run_step(s)
    # a needs a new block for its 5th token: the pool is dry, c (newest) is preempted
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.finished_request_ids == {"c"}  # the workers drop their copy of c
    assert s.num_preemptions == 1
    c = s.waiting[0]
    assert (c.request_id, c.status, c.num_computed_tokens, c.output_token_ids) == ("c", RequestStatus.PREEMPTED, 0, [7])
    assert s.kv.get_block_ids("a") == [0, 3]
    assert s.kv.get_block_ids("b") == [1, 2]


def test_a_preempted_request_resumes_with_all_its_tokens():
    s = make_scheduler(num_blocks=4, block_size=4)
    s.add_request(make_request("a", 4, max_tokens=4))
    s.add_request(make_request("b", 4, max_tokens=4))
    s.add_request(make_request("c", 8, max_tokens=8))
    run_step(s)
    run_step(s)  # c preempted here
    while "c" not in (out := s.schedule()).num_scheduled_tokens:
        sampled = {rid: SampledToken(7, 0.0, None) for rid in out.num_scheduled_tokens}
        s.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    [new] = out.new_requests
    assert (new.request_id, new.output_token_ids, new.num_computed_tokens) == ("c", [7], 0)
    assert out.num_scheduled_tokens["c"] == 9


def test_stop_conditions_finish_and_free():
    s = make_scheduler()
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[5], min_tokens=2)
    s.add_request(Request("a", [1, 2], params, 10, EOS))
    run_step(s, token_id=5)  # below min_tokens: not a stop
    assert "a" in s.requests
    run_step(s, token_id=5)
    assert "a" not in s.requests
    assert s.kv.num_free_blocks == s.kv.num_blocks

    s.add_request(Request("b", [1], SamplingParams(temperature=0), 16, EOS))
    run_step(s, token_id=EOS)
    assert "b" not in s.requests


def test_a_prompt_larger_than_the_cache_is_refused():
    s = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="prompt of 8 tokens needs 3 KV blocks but the cache only has 2"):
        s.add_request(make_request("a", 8))
    s.add_request(make_request("b", 3))
    with pytest.raises(ValueError, match="request_id 'b' is already in use"):
        s.add_request(make_request("b", 3))


def test_a_request_outgrowing_the_whole_cache_finishes_with_length():
    s = make_scheduler(num_blocks=2, block_size=2)
    s.add_request(make_request("a", 3, max_tokens=100))
    for _ in range(3):
        run_step(s)
    assert "a" not in s.requests
    assert s.kv.num_free_blocks == 2


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "step", "abort"]),
            st.integers(1, 40),
            st.integers(1, 12),
        ),
        max_size=60,
    ),
    st.integers(4, 24),
    st.sampled_from([1, 2, 4, 16]),
    st.integers(1, 40),
)
def test_random_workloads_never_leak_or_double_free(ops, num_blocks, block_size, budget):
    s = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=6, budget=budget)
    next_id = 0
    for op, size, max_tokens in ops:
        if op == "add":
            try:
                s.add_request(make_request(str(next_id), size, max_tokens))
            except ValueError:
                assert s.kv.num_blocks_for(size + 1) > num_blocks
            next_id += 1
        elif op == "abort" and s.requests:
            victim = sorted(s.requests)[size % len(s.requests)]
            s.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        else:
            run_step(s, token_id=size)
        s.kv.check_invariants()
        used = sum(len(t) for t in s.kv.block_tables.values())
        assert used + s.kv.num_free_blocks == num_blocks
        assert set(s.kv.block_tables) <= {r.request_id for r in s.running}
    for _ in range(10_000):
        if not s.has_unfinished_requests():
            break
        run_step(s)
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == num_blocks
    s.kv.check_invariants()

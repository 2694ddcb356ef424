"""Sequences the scheduler ends on its own are reported, once, with a reason and a message."""

from raypaged.core.request import RequestStatus
from tests.core.test_scheduler import make_request, make_scheduler, run_step


def test_a_sequence_outgrowing_the_pool_is_reported_once():
    s = make_scheduler(num_blocks=2, block_size=2)
    a = make_request("a", 3, max_tokens=100)
    s.add_request(a)
    run_step(s)  # prefill: 3 tokens computed, one sampled
    assert s.take_ended() == []
    run_step(s)  # 4 computed, 5 tokens: the next step needs a third block
    assert s.take_ended() == []
    out = s.schedule()
    assert out.num_scheduled_tokens == {}
    assert out.finished_request_ids == {"a"}
    [ended] = s.take_ended()
    assert ended.request is a
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert ended.message == (
        "request a outgrew the whole KV cache (2 blocks of 2 tokens) at 5 tokens; finished with what it has"
    )
    assert s.take_ended() == []
    assert s.kv.num_free_blocks == 2 and not s.has_unfinished_requests()


def test_a_waiting_sequence_that_can_never_fit_is_ended_by_the_stall_breaker():
    s = make_scheduler(num_blocks=2, block_size=2)
    a = make_request("a", 3, max_tokens=100)
    a.output_token_ids = [7, 7]  # as if preempted after growing past the pool
    a.status = RequestStatus.PREEMPTED
    s.requests["a"] = a
    s.waiting.push(a)
    out = s.schedule()
    assert out.num_scheduled_tokens == {}
    [ended] = s.take_ended()
    assert ended.request is a and a.status == RequestStatus.FINISHED_LENGTH
    assert ended.message == "request a cannot fit in the KV cache (2 blocks of 2 tokens); finished with what it has"
    assert list(s.waiting) == [] and not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 2

"""Scheduler.reset_after_worker_loss: every live sequence is recomputed from its tokens."""

from raypaged.core.request import RequestStatus
from tests.core.test_scheduler import make_request, make_scheduler, run_step


def test_reset_requeues_in_flight_in_order_and_frees_every_block():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2)
    for request_id, num_prompt in (("a", 7), ("b", 5), ("c", 3)):
        s.add_request(make_request(request_id, num_prompt))
    run_step(s)
    run_step(s)
    assert [r.request_id for r in s.running] == ["a", "b"]
    assert s.kv.num_free_blocks == 16 - 2 - 2  # a: 8 computed tokens, b: 6

    s.reset_after_worker_loss()

    assert s.running == [] and s.swapped == []
    assert [r.request_id for r in s.waiting] == ["a", "b", "c"]
    assert [r.num_computed_tokens for r in s.waiting] == [0, 0, 0]
    assert [r.status for r in list(s.waiting)[:2]] == [RequestStatus.PREEMPTED] * 2
    assert s.kv.num_free_blocks == 16 and s.kv.block_tables == {}

    out = s.schedule()
    assert out.finished_request_ids == set()
    assert out.num_scheduled_tokens == {"a": 9, "b": 7}  # prompt + the 2 tokens sampled before the loss
    assert [(d.request_id, d.output_token_ids, d.block_ids, d.num_computed_tokens) for d in out.new_requests] == [
        ("a", [7, 7], [0, 1, 2], 0),
        ("b", [7, 7], [3, 4], 0),
    ]

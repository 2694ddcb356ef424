"""Pipeline parallelism's micro-batches in the scheduler: a sequence in a micro-batch in flight sits out every other
schedule until its results come, no one is preempted beside one, and results reach only the sequences they were
computed for."""

from raypaged.core.block_manager import KVCacheManager
from raypaged.core.outputs import ModelRunnerOutput, SampledToken
from raypaged.core.request import RequestStatus
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from tests.core.test_scheduler import make_group, make_request, make_scheduler


def sampled(*request_ids: str, token_id: int = 7) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled={r: SampledToken(token_id, -0.5, None) for r in request_ids})


def test_a_second_micro_batch_takes_only_the_sequences_the_first_does_not_compute():
    s = make_scheduler(num_blocks=32, budget=64)
    for request_id, n in (("a", 5), ("b", 6)):
        s.add_request(make_request(request_id, n))
    first = s.schedule()
    s.mark_in_flight(first)
    assert first.num_scheduled_tokens == {"a": 5, "b": 6}
    s.add_request(make_request("c", 3))
    second = s.schedule(overlap=True)  # a and b are in flight: only the newcomer
    s.mark_in_flight(second)
    assert second.num_scheduled_tokens == {"c": 3}
    assert [d.request_id for d in second.new_requests] == ["c"]
    assert s.schedule(overlap=True).num_scheduled_tokens == {}  # everyone is in flight

    assert [r.request_id for r in s.update_from_output(first, sampled("a", "b"))] == ["a", "b"]
    third = s.schedule(overlap=True)  # a and b decode beside c's micro-batch
    assert third.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [(d.request_id, d.new_token_ids, d.num_computed_tokens) for d in third.cached_requests] == [
        ("a", [7], 5),
        ("b", [7], 6),
    ]
    s.mark_in_flight(third)
    assert [r.request_id for r in s.update_from_output(second, sampled("c", token_id=8))] == ["c"]
    assert s.requests["c"].output_token_ids == [8] and s.requests["c"].num_computed_tokens == 3
    s.update_from_output(third, sampled("a", "b", token_id=9))
    assert [s.requests[r].output_token_ids for r in "ab"] == [[7, 9], [7, 9]]
    assert not any(r.in_flight for r in s.requests.values()) and s._in_flight_batches == {}


def test_beside_a_micro_batch_in_flight_no_one_is_preempted():
    """4 blocks of 4 tokens. a (9 tokens) decodes into its third block in a micro-batch; b's prompt takes the last
    block beside it. With a still in flight, b's 5th token finds no block: b waits (a is not preempted). Once
    nothing is in flight, the full schedule preempts (b, the newest)."""
    s = make_scheduler(num_blocks=4, budget=64)
    s.add_request(make_request("a", 8))
    first = s.schedule()
    s.update_from_output(first, sampled("a"))
    decode = s.schedule()
    s.mark_in_flight(decode)
    assert decode.num_scheduled_tokens == {"a": 1} and s.kv.get_block_ids("a") == [0, 1, 2]
    s.add_request(make_request("b", 4))
    prefill = s.schedule(overlap=True)
    s.mark_in_flight(prefill)
    assert prefill.num_scheduled_tokens == {"b": 4} and s.kv.get_block_ids("b") == [3]
    s.update_from_output(prefill, sampled("b"))
    blocked = s.schedule(overlap=True)
    assert blocked.num_scheduled_tokens == {} and blocked.block_ops == []
    assert s.requests["a"].status == RequestStatus.RUNNING and s.num_preemptions == 0
    s.update_from_output(decode, sampled("a"))
    full = s.schedule()
    assert full.num_scheduled_tokens == {"a": 1}
    assert s.num_preemptions == 1 and s.requests["b"].status == RequestStatus.PREEMPTED


def test_results_of_a_sequence_aborted_in_flight_never_reach_a_new_one_with_its_id():
    s = make_scheduler(num_blocks=32)
    s.add_request(make_request("a", 5))
    first = s.schedule()
    s.mark_in_flight(first)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    s.add_request(make_request("a", 9))  # the id again, a new request
    second = s.schedule(overlap=True)
    s.mark_in_flight(second)
    assert second.num_scheduled_tokens == {"a": 9} and second.finished_request_ids == {"a"}
    assert s.update_from_output(first, sampled("a")) == []  # computed for the aborted one
    assert s.requests["a"].output_token_ids == [] and s.requests["a"].in_flight
    [updated] = s.update_from_output(second, sampled("a", token_id=5))
    assert updated.output_token_ids == [5] and updated.num_computed_tokens == 9


def test_a_lost_shard_group_forgets_the_micro_batches_in_flight():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024), KVCacheManager(8, 4))
    s.add_request(make_request("a", 5))
    s.mark_in_flight(s.schedule())
    s.reset_after_worker_loss()
    assert s._in_flight_batches == {} and not s.requests["a"].in_flight
    assert s.schedule().num_scheduled_tokens == {"a": 5}


def test_a_long_prompts_chunks_go_in_consecutive_micro_batches():
    """A 40-token prompt in 16-token steps: a chunk that samples nothing counts as computed when its micro-batch is
    sent, so the next chunk goes in the next micro-batch (the stages compute them in order); the last chunk
    samples, and its sequence then waits for that result."""
    s = make_scheduler(num_blocks=32, budget=16)
    s.add_request(make_request("a", 40))
    chunks = []
    for _ in range(3):
        so = s.schedule(overlap=bool(chunks))
        s.mark_in_flight(so)
        chunks.append(so)
    assert [dict(so.num_scheduled_tokens) for so in chunks] == [{"a": 16}, {"a": 16}, {"a": 8}]
    assert [d.num_computed_tokens for d in chunks[1].cached_requests + chunks[2].cached_requests] == [16, 32]
    assert s.kv.get_block_ids("a") == list(range(10))
    assert s.schedule(overlap=True).num_scheduled_tokens == {}  # its last chunk samples: it waits
    request = s.requests["a"]
    assert request.num_computed_tokens == 32 and request.in_flight
    assert s.update_from_output(chunks[0], ModelRunnerOutput()) == []
    assert s.update_from_output(chunks[1], ModelRunnerOutput()) == []
    assert request.num_computed_tokens == 32 and request.in_flight  # the last chunk is still out
    assert s.update_from_output(chunks[2], sampled("a")) == [request]
    assert request.num_computed_tokens == 40 and request.output_token_ids == [7] and not request.in_flight
    assert s.schedule().num_scheduled_tokens == {"a": 1}


def test_samples_fork_from_a_prompt_chunk_counted_ahead():
    """n=3 over a 10-token prompt in 6-token steps: the first sequence computes 6, then up to the fork point (9);
    the samples fork as that chunk is sent, and each computes the last prompt token in the next micro-batch (the
    shared block copied first)."""
    s = make_scheduler(num_blocks=32, block_size=4, budget=6)
    first, *_ = group = make_group("g", 10, 3)
    s.add_request(first)
    one = s.schedule()
    s.mark_in_flight(one)
    two = s.schedule(overlap=True)
    s.mark_in_flight(two)
    assert [dict(one.num_scheduled_tokens), dict(two.num_scheduled_tokens)] == [{"g": 6}, {"g": 3}]
    assert [r.request_id for r in s.running] == [r.request_id for r in group]
    three = s.schedule(overlap=True)
    assert three.num_scheduled_tokens == {r.request_id: 1 for r in group}
    # position 9 sits in shared block 2: the first two writers copy it (after the chunk in flight wrote it)
    assert [(op.kind, op.src, op.dst) for op in three.block_ops] == [("copy", 2, 3), ("copy", 2, 4)]

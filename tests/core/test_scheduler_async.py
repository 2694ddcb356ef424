"""Async scheduling in the scheduler: a step scheduled beside the one in flight, on placeholders.

``commit_in_flight`` counts the running step's tokens as computed and gives every sequence it
samples for a placeholder; ``schedule(overlap=True)`` then schedules the next step from what is
free (no preemption, no stall breaking), and ``update_from_output`` of the committed step puts
each token in its placeholder's place. The workers are sent each output token once, in order.
"""

from raypaged.core.block_manager import KVCacheManager
from raypaged.core.outputs import ModelRunnerOutput, SampledToken
from raypaged.core.request import Request, RequestStatus
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from raypaged.sampling_params import SamplingParams


def make_scheduler(num_blocks: int = 16, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=1024)
    return Scheduler(config, KVCacheManager(num_blocks, 4))


def make_request(request_id: str, num_prompt: int, max_tokens: int = 8) -> Request:
    return Request(
        request_id, list(range(1, num_prompt + 1)), SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens, 0
    )


def sampled(*pairs: tuple[str, int]) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled={rid: SampledToken(token, -0.5, None) for rid, token in pairs})


def test_the_next_step_runs_on_placeholders_and_tokens_reach_the_workers_once():
    s = make_scheduler()
    s.add_request(make_request("a", 6))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 6}
    s.commit_in_flight(first)
    a = s.requests["a"]
    assert (a.num_computed_tokens, a.num_placeholders, a.num_tokens) == (6, 1, 7)
    second = s.schedule(overlap=True)  # the 7th token is not known yet: it is computed from the worker's sample
    assert second.num_scheduled_tokens == {"a": 1}
    assert [
        (c.request_id, c.new_token_ids, c.new_block_ids, c.num_computed_tokens) for c in second.cached_requests
    ] == [("a", [], [], 6)]  # position 6 still fits block 1 (slots 4..7)
    s.update_from_output(first, sampled(("a", 11)))
    assert (a.output_token_ids, a.num_computed_tokens, a.num_placeholders) == ([11], 6, 0)
    s.commit_in_flight(second)
    assert (a.num_computed_tokens, a.num_placeholders) == (7, 1)
    third = s.schedule(overlap=True)
    # the first sampled token is sent now: the workers had it as their own sample
    assert [(c.new_token_ids, c.new_block_ids, c.num_computed_tokens) for c in third.cached_requests] == [([11], [], 7)]
    s.update_from_output(second, sampled(("a", 12)))
    s.commit_in_flight(third)
    fourth = s.schedule(overlap=True)  # position 8: block 2
    assert [(c.new_token_ids, c.new_block_ids, c.num_computed_tokens) for c in fourth.cached_requests] == [
        ([12], [2], 8)
    ]
    assert s.kv.get_block_ids("a") == [0, 1, 2]


def test_a_sequence_whose_coming_token_is_its_last_is_left_out():
    s = make_scheduler()
    s.add_request(make_request("short", 4, max_tokens=1))
    s.add_request(make_request("long", 4, max_tokens=5))
    first = s.schedule()
    s.commit_in_flight(first)
    second = s.schedule(overlap=True)
    assert second.num_scheduled_tokens == {"long": 1}
    s.update_from_output(first, sampled(("short", 9), ("long", 9)))
    assert "short" not in s.requests and s.requests["long"].output_token_ids == [9]


def test_a_sequence_that_ends_while_the_next_step_runs_gets_nothing_from_it():
    s = make_scheduler()
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 4))
    first = s.schedule()
    s.commit_in_flight(first)
    second = s.schedule(overlap=True)
    assert second.num_scheduled_tokens == {"a": 1, "b": 1}
    s.update_from_output(first, sampled(("a", 0), ("b", 5)))  # a samples the EOS (0)
    assert s.requests.keys() == {"b"}
    s.commit_in_flight(second)
    s.update_from_output(second, sampled(("a", 6), ("b", 6)))  # a's extra token is dropped
    assert s.requests["b"].output_token_ids == [5, 6]
    assert s.schedule(overlap=True).finished_request_ids == {"a"}


def test_a_reused_id_is_not_given_the_tokens_of_the_sequence_that_had_it():
    s = make_scheduler()
    s.add_request(make_request("a", 4))
    first = s.schedule()
    s.commit_in_flight(first)
    second = s.schedule(overlap=True)
    s.update_from_output(first, sampled(("a", 7)))
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    s.add_request(make_request("a", 3))  # a new sequence by the same id, admitted beside the old one's step
    s.commit_in_flight(second)
    third = s.schedule(overlap=True)
    assert [n.request_id for n in third.new_requests] == ["a"]
    s.update_from_output(second, sampled(("a", 8)))  # the old sequence's token
    new = s.requests["a"]
    assert (new.output_token_ids, new.num_computed_tokens, new.num_placeholders) == ([], 0, 0)


def test_beside_a_step_in_flight_no_one_is_preempted():
    s = make_scheduler(num_blocks=4, budget=64)
    s.add_request(make_request("a", 8))  # blocks 0, 1: full
    s.add_request(make_request("b", 8))  # blocks 2, 3: full
    first = s.schedule()
    s.commit_in_flight(first)
    s.add_request(make_request("c", 2))
    second = s.schedule(overlap=True)  # a's 9th token needs a block and none is free
    assert second.is_empty and s.num_preemptions == 0
    assert s.requests["a"].status == s.requests["b"].status == RequestStatus.RUNNING
    assert s.requests["c"].status == RequestStatus.WAITING  # nothing admitted after a shortage
    s.forget_later(second)
    s.update_from_output(first, sampled(("a", 5), ("b", 5)))
    third = s.schedule()  # without overlap: the newest is preempted as always
    assert s.num_preemptions == 1 and s.requests["b"].status == RequestStatus.PREEMPTED
    assert third.num_scheduled_tokens == {"a": 1}


def test_a_recomputed_sequence_is_sent_its_output_tokens_once():
    """A preempted sequence comes back with every output token; its later prefill chunks send
    none again (they were sent twice when the slice followed the computed count)."""
    s = make_scheduler(num_blocks=16, budget=6)
    s.add_request(make_request("a", 4, max_tokens=20))
    s.update_from_output(s.schedule(), sampled(("a", 10)))
    for token in range(11, 19):
        s.update_from_output(s.schedule(), sampled(("a", token)))
    a = s.requests["a"]
    assert a.output_token_ids == list(range(10, 19)) and a.num_computed_tokens == 12
    s._preempt(a)
    back = s.schedule()
    assert [(n.output_token_ids, n.num_computed_tokens) for n in back.new_requests] == [(list(range(10, 19)), 0)]
    assert back.num_scheduled_tokens == {"a": 6}
    s.update_from_output(back, ModelRunnerOutput())
    chunks = []
    while not (out := s.schedule()).new_requests and a.num_computed_tokens < a.num_tokens - 1:
        chunks.append([(c.new_token_ids, c.num_computed_tokens) for c in out.cached_requests])
        s.update_from_output(out, ModelRunnerOutput())
    assert chunks == [[([], 6)]]
    assert a.num_computed_tokens == 12

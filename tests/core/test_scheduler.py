"""The scheduler on plain Python: exact batches, block ids, preemption order."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypaged.core import beam_search
from raypaged.core.beam_search import BeamGroup, BeamSearchParams
from raypaged.core.block_manager import KVCacheManager
from raypaged.core.outputs import BlockOpKind, ModelRunnerOutput, SampledToken, SchedulerOutput
from raypaged.core.request import Request, RequestStatus, SequenceGroup
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from raypaged.multimodal import ImageInputs
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
    """Schedule, then sample ``token_id`` for every request that reached its last token
    (beams also propose ``token_id + 1 .. token_id + 3``)."""
    out = scheduler.schedule()
    sampled = {}
    for request_id, n in out.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        if request.num_computed_tokens + n == request.num_tokens:
            top = (
                {token_id + i: -0.5 - i - len(request.output_token_ids) % 3 for i in range(4)} if request.gang else None
            )
            sampled[request_id] = SampledToken(token_id, -0.5, top)
    scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    advance_beams(scheduler)
    return out


def advance_beams(scheduler: Scheduler) -> None:
    """The engine core's part in a step for beam searches (``EngineCore._step_beams``): settle the
    beams the scheduler ended, step the searches whose beams all sampled."""
    ended: dict[str, list] = {}
    groups = {id(r.gang): r.gang for r in scheduler.requests.values() if r.gang is not None}
    records = scheduler.take_ended()
    scheduler._ended = [r for r in records if r.request.gang is None]  # the tests take the others themselves
    for record in records:
        if (gang := record.request.gang) is not None:
            ended.setdefault(gang.gang_id, []).append(record)
            groups[id(gang)] = gang
    beam_search.after_step(scheduler, list(groups.values()), ended)


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
    c = s.waiting.head()
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
    run_step(s, token_id=4)
    assert "a" in s.requests
    # a stop token ends it even below min_tokens: the sampler bans them there unless they are all its row
    # allows (a complete grammar), so one drawn there ends it
    run_step(s, token_id=5)
    assert "a" not in s.requests and s.kv.num_free_blocks == s.kv.num_blocks

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


# ---- sharing: groups, swap, prefix caching, priorities -----------------------------------


def make_group(request_id: str, num_prompt: int, num_samples: int, max_tokens: int = 8) -> list[Request]:
    """What the engine builds for n/best_of: the first sequence carries the others to fork."""
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=num_samples)
    prompt = list(range(1, num_prompt + 1))
    seqs = [
        Request(request_id if i == 0 else f"{request_id}#{i}", prompt, params, max_tokens, EOS, sample_index=i)
        for i in range(num_samples)
    ]
    group = SequenceGroup(request_id, num_prompt - 1, seqs[1:])
    for seq in seqs:
        seq.group = group
    return seqs


def test_a_group_prefills_once_then_forks_and_copies_the_shared_last_block():
    s = make_scheduler(num_blocks=16, block_size=4)
    seqs = make_group("g", 10, 3)
    s.add_request(seqs[0])
    out = run_step(s)
    assert out.num_scheduled_tokens == {"g": 9}  # all of the prompt but its last token
    assert s.kv.get_block_ids("g") == [0, 1, 2]
    # forked: three sequences share blocks 0-2
    assert [r.request_id for r in s.running] == ["g", "g#1", "g#2"]
    assert s.kv.pool.ref_counts[:3] == [3, 3, 3]
    out = run_step(s)
    assert out.num_scheduled_tokens == {"g": 1, "g#1": 1, "g#2": 1}
    assert [d.request_id for d in out.new_requests] == ["g#1", "g#2"]
    assert [(d.sample_index, d.num_computed_tokens, d.block_ids) for d in out.new_requests] == [
        (1, 9, [0, 1, 4]),
        (2, 9, [0, 1, 2]),
    ]
    # position 9 sits in shared block 2: the first two writers copy it, the last owns it
    assert [(op.kind, op.src, op.dst) for op in out.block_ops] == [("copy", 2, 3), ("copy", 2, 4)]
    assert all(op.kind is BlockOpKind.COPY for op in out.block_ops)
    assert s.kv.get_block_ids("g") == [0, 1, 3]
    assert s.kv.get_block_ids("g#2") == [0, 1, 2]
    assert s.kv.pool.ref_counts[:5] == [3, 3, 1, 1, 1]
    assert all(len(r.output_token_ids) == 1 for r in s.running)
    s.kv.check_invariants()


def assert_finishes_with_every_block_free(s: Scheduler, num_blocks: int) -> None:
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        run_step(s)
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == num_blocks
    s.kv.check_invariants()


def test_a_request_of_many_samples_gives_way_to_requests_running_alone():
    s = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=8, budget=64)
    s.add_request(make_group("g", 4, 3, max_tokens=12)[0])
    s.add_request(make_request("a", 4, max_tokens=12))
    outs = []
    for step in range(8):
        if step == 4:
            s.add_request(make_request("b", 4, max_tokens=4))
        if step == 6:
            s.add_request(make_request("c", 4, max_tokens=2))
        outs.append(run_step(s))
    # the pool runs dry at step 5 and again at 6: the newest sample of g goes each time, not b (the newest
    # sequence, which FCFS took before) nor a
    assert outs[5].num_scheduled_tokens == {"g": 1, "a": 1, "g#1": 1, "b": 1}
    assert outs[5].finished_request_ids == {"g#2"}
    assert outs[6].num_scheduled_tokens == {"g": 1, "a": 1, "b": 1}
    assert outs[6].finished_request_ids == {"g#1"}
    # c came after g's preempted samples, and g still runs one: c is admitted first, into block 6
    assert outs[7].num_scheduled_tokens == {"g": 1, "a": 1, "b": 1, "c": 4}
    assert [r.request_id for r in s.waiting] == ["g#1", "g#2"]
    assert s.kv.get_block_ids("c") == [6]
    assert_finishes_with_every_block_free(s, 10)


def test_a_request_with_nothing_running_takes_a_slot_from_the_request_running_the_most_samples():
    """FCFS at max_num_seqs: a newcomer waited until every sample of the requests before it had ended; now the
    newest sample of the request running the most gives up its slot, one for one (the forks of n took this
    batch one past max_num_seqs, and it keeps that size), and has it back when the newcomer ends."""
    s = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=6, budget=64)
    s.add_request(make_group("g", 4, 4, max_tokens=12)[0])
    s.add_request(make_group("h", 4, 3, max_tokens=12)[0])
    outs = [run_step(s), run_step(s)]
    assert len(outs[1].num_scheduled_tokens) == 7
    s.add_request(make_request("a", 4, max_tokens=3))
    outs.append(run_step(s))
    assert outs[2].num_scheduled_tokens == {"g": 1, "h": 1, "g#1": 1, "g#2": 1, "h#1": 1, "h#2": 1, "a": 4}
    assert outs[2].finished_request_ids == {"g#3"}  # g ran the most samples
    assert s.kv.get_block_ids("a") == [14]
    s.add_request(make_request("b", 4, max_tokens=2))
    outs.append(run_step(s))
    assert outs[3].num_scheduled_tokens == {"g": 1, "h": 1, "g#1": 1, "g#2": 1, "h#1": 1, "a": 1, "b": 4}
    assert outs[3].finished_request_ids == {"h#2"}  # g and h ran 3 each: the newer request gives
    assert [r.request_id for r in s.waiting] == ["h#2", "g#3"]
    assert s.kv.get_block_ids("b") == [16]
    outs.append(run_step(s))  # the preempted samples take no slot from each other
    assert outs[4].num_scheduled_tokens == {"g": 1, "h": 1, "g#1": 1, "g#2": 1, "h#1": 1, "a": 1, "b": 1}
    outs.append(run_step(s))  # a and b ended: their slots go back to h#2 and g#3 (7 again), both recomputed
    assert outs[5].num_scheduled_tokens == {"g": 1, "h": 1, "g#1": 1, "g#2": 1, "h#1": 1, "h#2": 6, "g#3": 5}
    assert not s.waiting
    assert_finishes_with_every_block_free(s, 32)


def test_the_prompts_of_one_client_request_share_the_batch_as_its_samples_do():
    """A multi-prompt completion's prompts share an owner (the gateway's parent_request_id): a later request
    takes the newest prompt's slot, and the prompts left waiting go after it."""
    s = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=3, budget=64)
    for i in range(4):
        prompt = make_request(f"p-{i}", 4, max_tokens=6)
        prompt.owner = "p"
        s.add_request(prompt)
    outs = [run_step(s)]
    assert outs[0].num_scheduled_tokens == {"p-0": 4, "p-1": 4, "p-2": 4}
    s.add_request(make_request("a", 4, max_tokens=2))
    outs.append(run_step(s))
    assert outs[1].num_scheduled_tokens == {"p-0": 1, "p-1": 1, "a": 4}
    assert outs[1].finished_request_ids == {"p-2"}
    assert [r.request_id for r in s.waiting] == ["p-2", "p-3"]
    assert s.kv.get_block_ids("a") == [6]
    outs += [run_step(s), run_step(s)]
    assert outs[3].num_scheduled_tokens == {"p-0": 1, "p-1": 1, "p-2": 5}  # a ended: p-2 has its slot back
    assert outs[3].finished_request_ids == {"a"}
    assert_finishes_with_every_block_free(s, 32)


def test_swap_mode_moves_a_whole_group_to_cpu_and_back():
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption_mode=None),
        KVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=8),
    )
    seqs = make_group("g", 4, 2, max_tokens=12)
    s.add_request(seqs[0])
    s.add_request(make_request("late", 8, max_tokens=12))
    run_step(s)  # g prefills 3 tokens (block 0), late prefills 8 (blocks 1, 2)
    run_step(s)  # g and g#1 compute position 3 (copy of block 0 for one of them)
    for _ in range(6):
        run_step(s)
        if s.num_swap_outs:
            break
    assert s.num_swap_outs == 1
    assert s.stats()["num_requests_swapped"] == 2
    assert {r.request_id for r in s.swapped[0]} == {"g", "g#1"}
    assert all(r.status == RequestStatus.SWAPPED for r in s.swapped[0])
    s.kv.check_invariants()
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        run_step(s)
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 8 and s.kv.num_free_cpu_blocks == 8


def test_recompute_mode_never_swaps():
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption_mode="recompute"),
        KVCacheManager(num_blocks=6, block_size=4, num_cpu_blocks=8),
    )
    s.add_request(make_group("g", 4, 3, max_tokens=12)[0])
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        run_step(s)
    assert s.num_preemptions > 0 and s.num_swap_outs == 0
    assert s.kv.num_free_blocks == 6


def test_prefix_cache_hit_skips_the_shared_prefill():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=128), KVCacheManager(32, 4, enable_prefix_caching=True))
    s.add_request(make_request("a", 20, max_tokens=2))
    run_step(s)
    b = Request("b", list(range(1, 17)) + [99, 98, 97], SamplingParams(temperature=0), 2, EOS)
    s.add_request(b)
    out = run_step(s)
    assert out.num_scheduled_tokens["b"] == 3  # 16 cached tokens (4 blocks) skipped
    [new] = [d for d in out.new_requests if d.request_id == "b"]
    assert new.num_computed_tokens == 16
    assert new.block_ids[:4] == [0, 1, 2, 3]  # a's blocks (a has just finished; they stay cached)
    stats = s.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (39, 16)


def test_priority_policy_admits_and_preempts_by_priority():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, policy="priority"), KVCacheManager(4, 4))
    low = make_request("low", 8, max_tokens=20)
    low.priority = 5
    s.add_request(low)
    run_step(s)
    high = make_request("high", 8, max_tokens=2)
    high.priority = 0
    mid = make_request("mid", 4, max_tokens=2)
    mid.priority = 1
    s.add_request(mid)
    s.add_request(high)
    assert [r.request_id for r in s.waiting] == ["high", "mid"]
    out = run_step(s)
    # high cannot fit beside low: low (lower priority) is preempted for it
    assert "high" in out.num_scheduled_tokens and "low" not in out.num_scheduled_tokens
    assert low.status == RequestStatus.PREEMPTED and s.num_preemptions == 1
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        SchedulerConfig(policy="lifo")


def run_workload(ops, num_blocks, block_size, budget, mode, policy, caching) -> tuple[Scheduler, dict[str, Request]]:
    """Random adds (single, n=3 groups or beam searches), steps and aborts; every step keeps the
    pools consistent, and then every request finishes. Returns the scheduler and every sequence
    it ran, by id."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, policy=policy, preemption_mode=mode),
        KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, num_cpu_blocks=num_blocks // 2),
    )
    seen: dict[str, Request] = {}
    next_id = 0
    for op, size, max_tokens in ops:
        if op in ("add", "group", "beam"):
            if op == "group" and size > 1:
                seqs = make_group(str(next_id), size, 3, max_tokens)
            else:
                seqs = [make_request(str(next_id), size, max_tokens)]
            if op == "beam":
                seqs[0].gang = BeamGroup(
                    str(next_id), params=BeamSearchParams(beam_width=2, max_tokens=max_tokens), eos_token_id=EOS
                )
                seqs[0].gang.members.append(seqs[0])
            for seq in seqs:
                seq.priority = size % 3
            try:
                s.add_request(seqs[0])
            except ValueError:
                assert s.kv.num_blocks_for(size + 1) > num_blocks
            next_id += 1
        elif op == "abort" and s.requests:
            victim = sorted(s.requests)[size % len(s.requests)]
            [aborted] = s.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            if aborted.gang is not None:  # its search goes on without it, as the engine core's would
                beam_search.drop_members(s, aborted.gang, [victim])
        else:
            run_step(s, token_id=size % 7 + 1)
        seen.update(s.requests)
        s.kv.check_invariants()
        used = {b for table in s.kv.block_tables.values() for b in table}
        assert len(used) + s.kv.num_free_blocks == num_blocks
        live = set(s.requests)
        assert set(s.kv.tables) <= live and set(s.kv.swapped) <= live
        assert all(r.status == RequestStatus.RUNNING for r in s.running)
    for _ in range(10_000):
        if not s.has_unfinished_requests():
            break
        run_step(s)
        seen.update(s.requests)
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == num_blocks
    assert s.kv.num_free_cpu_blocks == num_blocks // 2
    s.kv.check_invariants()
    return s, seen


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "group", "beam", "step", "step", "step", "abort"]),
            st.integers(1, 30),
            st.integers(1, 10),
        ),
        max_size=60,
    ),
    st.integers(4, 24),
    st.sampled_from([1, 2, 4, 16]),
    st.integers(1, 40),
    st.sampled_from([None, "swap", "recompute"]),
    st.sampled_from(["fcfs", "priority"]),
    st.booleans(),
)
def test_random_workloads_never_leak_or_double_free(ops, num_blocks, block_size, budget, mode, policy, caching):
    """Random workloads: the pools stay consistent at every step and every request finishes."""
    run_workload(ops, num_blocks, block_size, budget, mode, policy, caching)


def test_a_swapped_group_and_an_idle_beam_do_not_livelock():
    """Found by the random workloads: a swapped sequence older than a beam search whose
    running beam waits, holding blocks, for its preempted sibling. The swapped sequence
    used to come back without room for its next chunk and be swapped out again, every
    step, for ever (and the sibling could not be admitted while a group was swapped)."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=29, preemption_mode="swap"),
        KVCacheManager(11, 4, num_cpu_blocks=5),
    )
    group = make_group("0", 29, 3, max_tokens=5)
    s.add_request(group[0])
    beam = make_request("1", 16, max_tokens=5)
    beam.gang = BeamGroup("1", params=BeamSearchParams(beam_width=2, max_tokens=5), eos_token_id=EOS)
    beam.gang.members.append(beam)
    s.add_request(beam)
    steps = []
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        steps.append(run_step(s))
        s.kv.check_invariants()
    assert [out.num_scheduled_tokens for out in steps] == (
        [{"0": 28, "1": 1}]
        + [{"0": 1}] * 5
        + [{"1": 16, "0#1": 13}, {"1": 1}, {"0#1": 16}]
        + [{"0#1": 1}] * 4
        + [{"1": 17, "1#1": 12}, {"1#1": 5}]
        + [{"1": 1, "1#1": 1}] * 3
        + [{"0#2": 29}]
        + [{"0#2": 1}] * 4
    )
    # step 7: 1#1 (a beam) is recomputed and 0#1 swapped out; at step 8 nothing could run
    # (0#1 does not fit beside beam 1, whose sibling waits behind the swapped 0#1): the
    # idle beam is recomputed and 0#1, the older, comes back with its 16 tokens
    assert [(op.kind, op.src, op.dst) for op in steps[7].block_ops] == [
        ("swap_out", 6, 0),
        ("swap_out", 5, 1),
        ("swap_out", 4, 2),
        ("swap_out", 3, 3),
    ]
    assert steps[7].finished_request_ids == {"0#1", "1#1"}
    assert [(op.kind, op.src, op.dst) for op in steps[8].block_ops] == [
        ("swap_in", 0, 1),
        ("swap_in", 1, 0),
        ("swap_in", 2, 3),
        ("swap_in", 3, 4),
    ]
    assert steps[8].finished_request_ids == {"1"}
    assert [d.request_id for d in steps[8].new_requests] == ["0#1"]
    assert sum(len(out.block_ops) for out in steps) == 8  # swapped out once, in once
    assert (s.num_preemptions, s.num_swap_outs) == (6, 1)
    assert [(r.status, r.output_token_ids, r.num_preemptions) for r in group] == [
        (RequestStatus.FINISHED_LENGTH, [7] * 5, 0),
        (RequestStatus.FINISHED_LENGTH, [7] * 5, 1),
        (RequestStatus.FINISHED_LENGTH, [7] * 5, 1),
    ]
    assert beam.gang.done
    assert [(h.token_ids, h.finish_reason) for h in beam.gang.hypotheses] == [
        ([7, 7, 7, 7, 7], "length"),
        ([8, 7, 7, 7, 7], "length"),
    ]
    assert s.kv.num_free_blocks == 11 and s.kv.num_free_cpu_blocks == 5


def test_priority_never_preempts_for_a_request_that_would_not_fit_anyway():
    """Found by the random workloads: a swapped group came back and was swapped out again in
    the same step, for ever, to make room for a waiting beam that did not fit even then."""
    ops = [
        ("add", 11, 10),
        ("beam", 23, 10),
        ("group", 10, 7),
        ("add", 12, 1),
        ("add", 1, 1),
        ("add", 11, 10),
        ("add", 1, 1),
        ("step", 1, 1),
        ("add", 1, 1),
        ("step", 1, 1),
        ("step", 1, 1),
        ("abort", 1, 1),
        ("add", 1, 1),
        ("add", 1, 1),
        ("add", 1, 1),
        ("add", 3, 5),
        ("add", 1, 1),
        ("add", 27, 10),
        ("add", 6, 9),
        ("beam", 25, 6),
        ("add", 1, 1),
        ("add", 1, 1),
    ]
    s, seen = run_workload(ops, 23, 2, 37, "swap", "priority", False)
    assert (s.num_preemptions, s.num_swap_outs) == (18, 7)
    # every request but the aborted one got all its tokens, except beam search 15: its two
    # beams need 28 blocks of the 23 once one is recomputed, so it ends with what it has
    cut = {rid: (r.status, r.num_output_tokens) for rid, r in seen.items() if r.num_output_tokens < r.max_tokens}
    assert cut == {
        "1": (RequestStatus.FINISHED_ABORTED, 0),
        "15": (RequestStatus.FINISHED_LENGTH, 2),
        "15#1": (RequestStatus.FINISHED_LENGTH, 2),
    }


def test_a_beam_search_that_no_longer_fits_is_finished_not_retried_for_ever():
    """A preempted beam, recomputed without sharing its sibling's blocks, needs 40 of the 24
    blocks: when nothing else can run the search is finished with what it has, once, rather
    than readmitted to compute a chunk and be preempted again, step after step."""
    ops = [
        ("abort", 10, 7),
        ("step", 1, 1),
        ("add", 1, 1),
        ("beam", 17, 6),
        ("add", 1, 4),
        ("add", 11, 1),
        ("add", 1, 1),
        ("add", 1, 1),
        ("step", 1, 1),
        ("add", 8, 1),
        ("abort", 11, 1),
        ("add", 1, 1),
        ("add", 1, 1),
    ]
    s, seen = run_workload(ops, 24, 1, 38, None, "priority", True)
    assert (s.num_preemptions, s.num_swap_outs) == (1, 0)
    cut = {rid: (r.status, r.num_output_tokens) for rid, r in seen.items() if r.num_output_tokens < r.max_tokens}
    assert cut == {
        "1": (RequestStatus.FINISHED_LENGTH, 3),
        "1#1": (RequestStatus.FINISHED_ABORTED, 1),
        "1#2": (RequestStatus.FINISHED_LENGTH, 3),
    }


def test_whole_prompts_are_never_cut():
    """An encoder's scheduler (``whole_prompts``) admits a prompt only where all of it fits the step's budget: the
    second prompt waits for the next step instead of computing 4 of its 6 tokens, and the third, which fits the
    step after it beside nothing else, never shares a step it would overflow."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=10, whole_prompts=True),
        KVCacheManager(16, 4),
    )
    for request_id, num_prompt in (("a", 6), ("b", 6), ("c", 5)):
        s.add_request(make_request(request_id, num_prompt, max_tokens=1))
    steps = [run_step(s).num_scheduled_tokens for _ in range(2)]
    assert steps == [{"a": 6}, {"b": 6}]
    assert run_step(s).num_scheduled_tokens == {"c": 5}
    plain = make_scheduler(budget=10)
    for request_id, num_prompt in (("a", 6), ("b", 6)):
        plain.add_request(make_request(request_id, num_prompt, max_tokens=1))
    assert plain.schedule().num_scheduled_tokens == {"a": 6, "b": 4}  # the decoder's scheduler cuts it


def test_long_prefill_token_threshold_cuts_every_long_prompt_and_admits_the_ones_behind():
    """vLLM's long_prefill_token_threshold: no sequence computes more than 6 tokens a step, so three prompts share
    each step's budget of 16 (the third gets what is left), a decode keeps its token, and blocks follow the chunks."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=1024, long_prefill_token_threshold=6),
        KVCacheManager(32, 4),
    )
    for request_id, n in (("a", 14), ("b", 9), ("c", 3)):
        s.add_request(make_request(request_id, n))
    steps = [dict(run_step(s).num_scheduled_tokens) for _ in range(4)]
    assert steps == [
        {"a": 6, "b": 6, "c": 3},
        {"a": 6, "b": 3, "c": 1},
        {"a": 2, "b": 1, "c": 1},
        {"a": 1, "b": 1, "c": 1},
    ]
    # blocks as each chunk needed them: a's 6, b's 6 (2, 3), c's 3 (4); a's 12 (5), b's 9 (6); a's 14 (7), c's 5th (8)
    blocks = [s.kv.get_block_ids(r) for r in "abc"]
    assert blocks == [[0, 1, 5, 7], [2, 3, 6], [4, 8]]


def test_a_prompt_longer_than_the_budget_computes_long_prompt_chunk_a_step_and_shorter_ones_are_not_cut():
    """long_prompt_chunk 4 of a budget of 16: the 40-token prompt computes 4 tokens a step while more than 16 are
    left, so a 10-token prompt arriving during its prefill (not cut: it is shorter than the budget) is prefilled in
    the next step and decodes beside it; with 16 left the long prompt takes the whole step, as it always did."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=1024, long_prompt_chunk=4),
        KVCacheManager(32, 4),
    )
    s.add_request(make_request("long", 40))
    steps = [dict(run_step(s).num_scheduled_tokens)]
    s.add_request(make_request("new", 10))
    steps += [dict(run_step(s).num_scheduled_tokens) for _ in range(7)]
    assert steps == [
        {"long": 4},
        {"long": 4, "new": 10},
        {"long": 4, "new": 1},
        {"long": 4, "new": 1},
        {"long": 4, "new": 1},
        {"long": 4, "new": 1},  # 24 computed: 16 left, no more than the budget
        {"long": 16},
        {"long": 1, "new": 1},
    ]
    # long's as its chunks needed them (an 11th for its 41st token); new's 3 for its prompt, a 4th for its 13th token
    assert [s.kv.get_block_ids(r) for r in ("long", "new")] == [[0, 1, 5, 6, 7, 9, 10, 11, 12, 13, 14], [2, 3, 4, 8]]


def test_long_prefill_token_threshold_off_gives_the_budget_to_the_first_prompt():
    s = make_scheduler(num_blocks=32, budget=16)
    for request_id, n in (("a", 14), ("b", 9)):
        s.add_request(make_request(request_id, n))
    assert run_step(s).num_scheduled_tokens == {"a": 14, "b": 2}


def test_long_prefill_token_threshold_keeps_a_bidirectional_image_whole():
    """Gemma 3's images are computed whole: a threshold of 3 cuts the text before the 6-token image at 3, then the
    image comes whole in one step (within the budget), and the text after it in chunks of 3 again."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=1024, long_prefill_token_threshold=3),
        KVCacheManager(32, 4),
    )
    request = make_request("a", 14)
    request.images = ImageInputs(None, ((4, 6),), ("",), bidirectional=True)
    s.add_request(request)
    assert [run_step(s).num_scheduled_tokens["a"] for _ in range(5)] == [3, 1, 6, 3, 1]

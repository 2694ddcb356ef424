"""Speculative decoding without a model: proposals, the config, and the scheduler's slots for drafts
with their exact rollback (block ids, ref counts, the free list, prefix-cache registration)."""

import numpy as np
import pytest

from raypaged.core.block_manager import KVCacheManager
from raypaged.core.outputs import ModelRunnerOutput, SampledToken
from raypaged.core.request import Request, RequestStatus
from raypaged.core.scheduler import Scheduler, SchedulerConfig
from raypaged.sampling_params import SamplingParams
from raypaged.spec_decode.config import SpeculativeConfig
from raypaged.spec_decode.ngram import NgramProposer, propose_ngram
from raypaged.spec_decode.verify import accepted_run

EOS = 0


# ---- proposals ------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 9, 6, 7])
    # [6, 7] occurs at 1 and 6 ([9, 6, 7] and [1, 6, 7] never did): the latest was followed by 2, 3, 9, 6
    assert propose_ngram(tokens, 4, 2, 4) == [2, 3, 9, 6]
    assert propose_ngram(tokens, 2, 2, 4) == [2, 3]
    # the latest match is followed by fewer than k tokens: the earliest, followed by more
    assert propose_ngram(np.array([1, 2, 3, 1, 2, 4, 1, 2]), 4, 2, 2) == [3, 1, 2, 4]
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3])
    # n=3: [1, 2, 3] occurs at 0, followed by 4, 9; n=2 alone would pick the later [2, 3] (followed by 5)
    assert propose_ngram(tokens, 2, 2, 3) == [4, 9]
    assert propose_ngram(tokens, 2, 2, 2) == [5, 1]


def test_ngram_proposes_nothing_without_a_match_and_stops_at_the_end():
    assert propose_ngram(np.array([1, 2, 3, 4]), 4, 1, 3) == []
    assert propose_ngram(np.array([4]), 4, 1, 3) == []
    # the match's continuation runs into the suffix itself: only what exists is proposed
    assert propose_ngram(np.array([7, 7, 7]), 4, 1, 2) == [7]


def test_ngram_proposer_buffers_grow_with_the_sequence_and_start_over_when_it_shrinks():
    proposer = NgramProposer(3, 1, 2)
    prompt = [1, 2, 3, 1]
    assert proposer.propose("a", prompt, [], 3) == [2, 3, 1]
    output = [2] * 100  # grows the buffer past its first size
    assert proposer.propose("a", prompt, output, 3) == [2, 2, 2]
    assert proposer.propose("a", prompt, output + [3], 2) == [1, 2]  # [2, 3] occurred once, followed by 1, 2
    assert proposer.propose("a", prompt, output + [3], 1) == [1]  # k below the configured 3
    assert proposer.propose("a", [9, 8, 9], [], 3) == [8, 9]  # shorter than it was: a new buffer
    proposer.forget("a")
    assert "a" not in proposer._buffers


def test_a_run_keeps_drafts_up_to_the_first_disagreement():
    tokens = [SampledToken(t, -0.1 * t, None) for t in (4, 5, 9, 2)]
    assert [t.token_id for t in accepted_run(tokens, [4, 5, 6])] == [4, 5, 9]
    assert [t.token_id for t in accepted_run(tokens, [1, 5, 9])] == [4]
    assert [t.token_id for t in accepted_run(tokens, [4, 5, 9])] == [4, 5, 9, 2]  # all accepted: the bonus token


# ---- the config -----------------------------------------------------------------------
def test_speculative_config_parses_vllms_forms():
    spec = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    )
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram",
        4,
        2,
        4,
    )
    assert (
        SpeculativeConfig.parse(
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
        ).prompt_lookup_min
        == 5
    )  # either bound alone sets both, as vLLM
    draft = SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1})
    assert (draft.method, draft.model) == ("draft_model", "/m")
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, draft_model, got 'eagle'"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer, got 0"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "needs 1 <= prompt_lookup_min <= prompt_lookup_max, got 3 and 2",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "typical_acceptance_sampler"},
            "unknown or unsupported key 'acceptance_method'",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "method draft_model needs a model"),
        (
            {"model": "/m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size 2 is not supported",
        ),
        ({"num_speculative_tokens": 2}, "needs a method (ngram or draft_model) or a draft model"),
        ("[1]", "must be a JSON object, got [1]"),
        ("{", "is not valid JSON: Expecting"),
    ],
)
def test_speculative_config_refuses_what_it_cannot_honour_by_name(value, message):
    with pytest.raises(ValueError, match="--speculative-config") as info:
        SpeculativeConfig.parse(value)
    assert message in str(info.value)


# ---- scheduling drafts and rolling them back -----------------------------------------
def make_scheduler(num_blocks=16, block_size=4, budget=64, k=3, lookahead=0, prefix_caching=False, max_model_len=64):
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            num_spec_tokens=k,
            num_lookahead_slots=lookahead,
        ),
        KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching),
    )


def make_request(request_id, prompt, max_tokens=20, k=3):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(request_id, list(prompt), params, max_tokens, EOS, num_spec_tokens=k)


def tokens(*ids):
    return [SampledToken(t, -0.5, None) for t in ids]


def prefill(s, request):
    """Admit ``request`` and compute its prompt; its first token is 50."""
    s.add_request(request)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled={request.request_id: tokens(50)[0]}))
    return out


def test_drafts_are_scheduled_with_the_last_token_and_accepted_ones_are_sent_as_output_tokens():
    s = make_scheduler()
    request = make_request("a", range(1, 7))  # 6 prompt tokens: blocks 0, 1
    prefill(s, request)
    request.spec_token_ids = [51, 52, 53]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}  # the token sampled last step (position 6) and 3 drafts
    assert out.scheduled_spec_tokens == {"a": [51, 52, 53]}
    [cached] = out.cached_requests
    assert (cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens, cached.num_block_ids) == (
        [50],
        [2],
        6,
        3,
    )  # positions 6..9 reach block 2
    assert s.kv.get_block_ids("a") == [0, 1, 2]
    # 51 and 52 accepted, 60 instead of 53
    s.update_from_output(out, ModelRunnerOutput(sampled_runs={"a": tokens(51, 52, 60)}))
    assert request.output_token_ids == [50, 51, 52, 60]
    assert (request.num_computed_tokens, request.num_new_tokens, request.cumulative_logprob) == (9, 3, -2.0)
    assert s.kv.get_block_ids("a") == [0, 1, 2]  # 10 tokens: all three blocks hold some
    out = s.schedule()  # no drafts this time
    [cached] = out.cached_requests
    # the workers saw 51, 52 only as drafts: every output token they lack comes now
    assert (cached.new_token_ids, cached.num_computed_tokens) == ([51, 52, 60], 9)
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_spec_tokens == {}
    assert s.spec.as_dict() == {
        "spec_decode_num_drafts": 1,
        "spec_decode_num_draft_tokens": 3,
        "spec_decode_num_accepted_tokens": 2,
        "spec_decode_num_accepted_tokens_per_pos_0": 1,
        "spec_decode_num_accepted_tokens_per_pos_1": 1,
        "spec_decode_num_accepted_tokens_per_pos_2": 0,
    }


def test_rejected_drafts_give_their_blocks_back_to_the_front_of_the_free_list():
    s = make_scheduler(num_blocks=8)
    request = make_request("a", range(1, 8))  # 7 prompt tokens: blocks 0, 1
    prefill(s, request)
    request.spec_token_ids = [51, 52, 53]
    out = s.schedule()  # positions 7..10: block 2 too
    assert out.cached_requests[0].new_block_ids == [2]
    assert s.kv.get_block_ids("a") == [0, 1, 2] and s.kv.pool.free_block_ids == [3, 4, 5, 6, 7]
    s.update_from_output(out, ModelRunnerOutput(sampled_runs={"a": tokens(60)}))  # all rejected
    assert request.output_token_ids == [50, 60] and request.num_computed_tokens == 8
    # 9 tokens: block 2 holds the newest one still
    assert s.kv.get_block_ids("a") == [0, 1, 2]
    request.spec_token_ids = [61, 62, 63]
    out = s.schedule()  # positions 8..11: still blocks 0-2
    s.update_from_output(out, ModelRunnerOutput(sampled_runs={"a": tokens(70)}))
    request.spec_token_ids = [71, 72, 73]  # a run that reaches block 3 and is rejected
    out = s.schedule()  # positions 9..12: block 3 for position 12
    assert out.cached_requests[0].new_block_ids == [3]
    s.update_from_output(out, ModelRunnerOutput(sampled_runs={"a": tokens(80)}))
    assert request.num_tokens == 11 and s.kv.get_block_ids("a") == [0, 1, 2]
    assert s.kv.pool.ref_counts[:5] == [1, 1, 1, 0, 0]
    assert s.kv.pool.free_block_ids == [3, 4, 5, 6, 7]  # block 3 went back first in line
    s.kv.check_invariants()
    out = s.schedule()
    assert out.cached_requests[0].num_block_ids == 3  # the workers drop block 3 from their table
    assert out.cached_requests[0].new_token_ids == [80]


def test_drafts_stop_at_max_tokens_max_model_len_and_the_budget():
    s = make_scheduler(max_model_len=12)
    request = make_request("a", range(1, 7), max_tokens=4)
    prefill(s, request)  # 1 output token; 3 more allowed: the run adds at most drafts + 1
    request.spec_token_ids = [51, 52, 53]
    out = s.schedule()
    assert out.scheduled_spec_tokens == {"a": [51, 52]}
    s.update_from_output(out, ModelRunnerOutput(sampled_runs={"a": tokens(51, 52, 53)}))
    assert request.status is RequestStatus.FINISHED_LENGTH and request.output_token_ids == [50, 51, 52, 53]

    s = make_scheduler(max_model_len=9)
    request = make_request("b", range(1, 7))
    prefill(s, request)  # 7 tokens: positions up to 8 exist, so 2 drafts (positions 7, 8)
    request.spec_token_ids = [51, 52, 53]
    assert s.schedule().scheduled_spec_tokens == {"b": [51, 52]}

    s = make_scheduler(budget=8)
    prefill(s, make_request("c", range(1, 7)))
    s.add_request(make_request("d", range(1, 6)))
    s.requests["c"].spec_token_ids = [51, 52, 53]
    out = s.schedule()  # c: 1 + 3, d: the other 4 of the budget (a chunk of its prompt)
    assert out.num_scheduled_tokens == {"c": 4, "d": 4}


def test_eos_inside_an_accepted_run_ends_it_there():
    s = make_scheduler()
    request = make_request("a", range(1, 7))
    prefill(s, request)
    request.spec_token_ids = [51, EOS, 53]
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_runs={"a": tokens(51, EOS, 53, 54)}))
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [50, 51, EOS] and request.num_new_tokens == 2
    assert request.run_logprobs == [-0.5, -0.5]
    assert s.kv.num_free_blocks == 16 and "a" not in s.requests


def test_drafts_never_preempt_another_sequence():
    s = make_scheduler(num_blocks=4)
    a, b = make_request("a", range(1, 8)), make_request("b", range(1, 8))  # 2 blocks each: the pool is full
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled={"a": tokens(50)[0], "b": tokens(50)[0]}))
    a.spec_token_ids = [51, 52, 53]  # position 8 needs a fifth block
    out = s.schedule()
    assert out.scheduled_spec_tokens == {}  # a runs without its drafts... and then b's token needs no block
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and s.num_preemptions == 0


def test_prefix_cache_registers_only_verified_tokens():
    s = make_scheduler(prefix_caching=True)
    request = make_request("a", range(1, 4))  # 3 prompt tokens
    prefill(s, request)
    request.spec_token_ids = [51, 52, 53]  # positions 3..6: block 0 full if 51 were right
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_runs={"a": tokens(60)}))  # 51 rejected: 60 at position 4
    assert request.num_computed_tokens == 4 and request.all_token_ids == [1, 2, 3, 50, 60]
    # block 0 (positions 0-3: 1, 2, 3, 50) is verified and cached; nothing past it is
    assert len(s.kv.tables["a"].keys) == 1
    other = make_request("b", [1, 2, 3, 50, 60])
    assert s.kv.cached_prefix_blocks(other.all_token_ids) == [0]
    assert s.kv.cached_prefix_blocks([1, 2, 3, 50, 51, 52, 53, 9, 9]) == [0]


def test_lookahead_slots_follow_a_sampling_sequence_and_are_kept_after_a_rollback():
    s = make_scheduler(lookahead=3)
    request = make_request("a", range(1, 7))
    s.add_request(request)
    out = s.schedule()  # 6 prompt tokens + 3 lookahead slots for the draft model: 3 blocks
    assert out.propose_drafts and s.kv.get_block_ids("a") == [0, 1, 2]
    s.update_from_output(out, ModelRunnerOutput(sampled={"a": tokens(50)[0]}, draft_token_ids={"a": [51, 52, 53]}))
    assert request.spec_token_ids == [51, 52, 53]
    out = s.schedule()  # positions 6..9 plus 3 lookahead (10..12): 4 blocks
    assert out.scheduled_spec_tokens == {"a": [51, 52, 53]} and s.kv.get_block_ids("a") == [0, 1, 2, 3]
    s.update_from_output(out, ModelRunnerOutput(sampled_runs={"a": tokens(60)}, draft_token_ids={"a": [61]}))
    # 8 tokens + 3 lookahead slots: 3 blocks stay
    assert s.kv.get_block_ids("a") == [0, 1, 2] and request.spec_token_ids == [61]


def test_no_drafts_while_more_sequences_run_than_disable_by_batch_size():
    s = Scheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, num_spec_tokens=2, spec_disable_batch_size=1
        ),
        KVCacheManager(16, 4),
    )
    a, b = make_request("a", range(1, 4), k=2), make_request("b", range(1, 4), k=2)
    prefill(s, a)
    s.add_request(b)
    a.spec_token_ids = [51, 52]
    out = s.schedule()  # one sequence runs as the step starts: a verifies its drafts, b is admitted
    assert out.propose_drafts and out.scheduled_spec_tokens == {"a": [51, 52]}
    s.update_from_output(out, ModelRunnerOutput(sampled_runs={"a": tokens(51, 52, 53)}, sampled={"b": tokens(50)[0]}))
    a.spec_token_ids = [61, 62]
    out = s.schedule()  # two run now: no drafts, and no proposals for the next step
    assert not out.propose_drafts and out.scheduled_spec_tokens == {}
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}

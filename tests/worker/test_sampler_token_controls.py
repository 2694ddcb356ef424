"""logit_bias, allowed_token_ids and bad_words in the sampler, on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from raypaged.sampling_params import SamplingParams
from raypaged.worker.sampler import NoTokenLeft, SamplingInput, greedy_fast_path, sample


def _pick(params: SamplingParams, output_token_ids: list[int] | None = None, vocab: int = 8) -> int:
    logits = torch.arange(vocab, dtype=torch.float32)[None, :]  # the last token is the likeliest
    row = SamplingInput(params, [0], output_token_ids or [], eos_token_id=None)
    assert greedy_fast_path(logits, [row]) is None  # the controls need the general path
    return sample(logits, [row], torch.Generator().manual_seed(0))[0].token_id


def test_logit_bias_moves_the_choice():
    assert _pick(SamplingParams(temperature=0, logit_bias={2: 100.0})) == 2
    assert _pick(SamplingParams(temperature=0, logit_bias={7: -100.0})) == 6


def test_allowed_token_ids_are_the_only_choices():
    assert _pick(SamplingParams(temperature=0, allowed_token_ids=[1, 3])) == 3
    assert {_pick(SamplingParams(temperature=1.0, seed=s, allowed_token_ids=[1, 3])) for s in range(20)} == {1, 3}


def test_bad_words_ban_their_last_token_after_their_prefix():
    one_token = SamplingParams(temperature=0, bad_words_token_ids=[[7]])
    assert _pick(one_token) == 6
    two_tokens = SamplingParams(temperature=0, bad_words_token_ids=[[5, 7]])
    assert _pick(two_tokens, [1]) == 7  # the prefix was not just generated
    assert _pick(two_tokens, [1, 5]) == 6


def test_logprobs_stay_the_models():
    logits = torch.arange(8, dtype=torch.float32)[None, :]
    row = SamplingInput(SamplingParams(temperature=0, logit_bias={2: 100.0}, logprobs=0), [0], [], eos_token_id=None)
    token = sample(logits, [row], torch.Generator())[0]
    assert token.token_id == 2 and token.logprob == torch.log_softmax(logits[0], -1)[2].item()


def test_a_row_its_masks_leave_no_token_is_named_and_never_drawn():
    logits = torch.arange(8, dtype=torch.float32).repeat(3, 1)
    rows = [
        SamplingInput(SamplingParams(temperature=0), [0], [], eos_token_id=None),
        SamplingInput(SamplingParams(temperature=0, allowed_token_ids=[3], bad_words_token_ids=[[3]]), [0], [], None),
        SamplingInput(
            SamplingParams(temperature=1.0, allowed_token_ids=[3, 4], bad_words_token_ids=[[3], [4]]), [0], [], None
        ),
    ]
    with pytest.raises(NoTokenLeft) as raised:
        sample(logits, rows, torch.Generator().manual_seed(0))
    assert raised.value.rows == [1, 2]


def test_a_grammar_mask_that_empties_a_greedy_row_leaves_it_to_the_general_path():
    logits = torch.arange(8, dtype=torch.float32).repeat(2, 1)
    logits[1] = float("-inf")  # what a grammar's bitmask and allowed_token_ids left of it
    rows = [SamplingInput(SamplingParams(temperature=0), [0], [], eos_token_id=None)] * 2
    assert greedy_fast_path(logits, rows) is None
    with pytest.raises(NoTokenLeft) as raised:
        sample(logits, rows, torch.Generator(), grammar_masked=True)
    assert raised.value.rows == [1]


def test_min_tokens_bans_stop_tokens_unless_they_are_all_a_row_allows():
    eos = 7
    below_min = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5])
    row = SamplingInput(below_min, [0], [1], eos_token_id=eos)
    logits = torch.arange(8, dtype=torch.float32)[None, :]
    assert sample(logits, [row], torch.Generator())[0].token_id == 6  # EOS (7) banned below min_tokens
    only_stops = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], allowed_token_ids=[5, eos])
    row = SamplingInput(only_stops, [0], [1], eos_token_id=eos)
    assert sample(logits, [row], torch.Generator())[0].token_id == eos  # the ban lifted: the row may only end
    with_another = SamplingParams(temperature=0, min_tokens=3, allowed_token_ids=[2, eos])
    row = SamplingInput(with_another, [0], [1], eos_token_id=eos)
    assert sample(logits, [row], torch.Generator())[0].token_id == 2  # another token: the ban holds

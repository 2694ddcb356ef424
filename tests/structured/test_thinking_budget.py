"""vLLM's ``thinking_token_budget``: the budget's own rules on made-up token ids, then SmolLM2 reasoning
under a budget (offline), each token checked."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from raypaged import LLM, SamplingParams
from raypaged.structured.reasoning import ReasoningConfig
from raypaged.structured.thinking_budget import ThinkingBudget

START, END = [1, 2], [3, 4, 5]  # made-up ids: a two-token start and a three-token end


def accept_all(budget: ThinkingBudget, tokens: list[int]) -> None:
    for token in tokens:
        assert budget.accept_token(token), token


def test_a_prompt_ending_inside_a_section_counts_its_tokens_then_the_end_is_forced_token_by_token():
    budget = ThinkingBudget(3, START, END, [9, 1, 2, 7, 7])  # two tokens of the section in the prompt
    assert budget.forced_token is None
    accept_all(budget, [8])  # the third
    assert budget.forced_token == 3
    assert not budget.accept_token(8)  # nothing but the end's next token
    forced = []
    while (token := budget.forced_token) is not None:
        forced.append(token)
        accept_all(budget, [token])
    assert forced == END
    accept_all(budget, [8] * 10)  # outside a section: free
    assert budget.forced_token is None


def test_budget_zero_forces_the_end_at_once_and_a_prompt_outside_a_section_forces_nothing():
    assert ThinkingBudget(0, START, END, [9, 1, 2]).forced_token == 3
    outside = ThinkingBudget(0, START, END, [1, 2, 6, 3, 4, 5, 9])  # the prompt's section is closed
    accept_all(outside, [6, 7, 8])
    assert outside.forced_token is None


def test_a_section_the_output_opens_gets_the_budget_and_a_natural_end_closes_it():
    budget = ThinkingBudget(2, START, END, [9])
    accept_all(budget, [1, 2, 6])  # opened by the output; one token in
    assert budget.forced_token is None
    accept_all(budget, [3, 4, 5])  # the model ends it itself (its first end token was the section's second)
    accept_all(budget, [6, 6, 6, 1, 2])  # free, then a new section with a new budget
    accept_all(budget, [6, 6])
    assert budget.forced_token == 3


def test_an_end_the_model_already_began_is_continued_not_restarted():
    budget = ThinkingBudget(2, START, END, [1, 2])
    accept_all(budget, [6, 3])  # the budget is spent on a token that begins the end
    assert budget.forced_token == 4
    accept_all(budget, [4, 5])
    assert budget.forced_token is None


def test_a_long_output_keeps_a_bounded_history_and_still_rolls_back_a_few_tokens():
    budget = ThinkingBudget(5000, START, END, [1, 2])
    accept_all(budget, [6] * 3000)
    assert len(budget._states) <= 512
    budget.rollback(10)
    accept_all(budget, [6] * 2010)  # 5000 in all: the budget is spent
    assert budget.forced_token == 3


def test_rollback_and_fork_keep_each_state_apart():
    budget = ThinkingBudget(1, START, END, [1, 2])
    accept_all(budget, [6, 3])
    twin = budget.fork()
    budget.rollback(2)
    assert budget.forced_token is None  # back before the section's first token
    assert twin.forced_token == 4
    with pytest.raises(ValueError, match="cannot roll back 3 tokens, 0 accepted"):
        budget.rollback(3)


@pytest.mark.parametrize("token", [40, 31, 63])
def test_the_mask_allows_only_the_forced_token(token):
    vocab = 100
    budget = ThinkingBudget(0, [90], [token], [90])
    mask = xgr.allocate_token_bitmask(2, vocab)
    budget.fill_next_token_bitmask(mask, 1)
    allowed = [t for t in range(vocab) if (int(mask[1, t // 32]) >> (t % 32)) & 1]
    assert allowed == [token]
    assert bool((mask[0] == -1).all())  # another row untouched


def test_reasoning_config_defaults_come_from_the_parser_and_bad_fields_are_named():
    assert ReasoningConfig().delimiters("") is None
    assert ReasoningConfig().delimiters("qwen3") == ("<think>", "</think>")
    custom = ReasoningConfig.parse('{"reasoning_end_str": "\\nEnough.</think>", "reasoning_parser": "deepseek_r1"}')
    assert custom.delimiters("") == ("<think>", "\nEnough.</think>")
    with pytest.raises(
        ValueError, match="--reasoning-config: unknown field 'think_end_str'; allowed: reasoning_parser"
    ):
        ReasoningConfig.parse({"think_end_str": "</think>"})
    with pytest.raises(ValueError, match="--reasoning-parser 'r2' is not supported"):
        ReasoningConfig.parse({"reasoning_parser": "r2"})


ONE_SHOT = [
    {"role": "system", "content": "Think inside <think></think> first, then answer."},
    {"role": "user", "content": "Where is the Eiffel Tower?"},
    {"role": "assistant", "content": "<think>The Eiffel Tower is in Paris, in France.</think>\nIn Paris."},
    {"role": "user", "content": "Where is the Colosseum?"},
]


@pytest.fixture(scope="module")
def budget_llm(smollm2_dir):
    llm = LLM(
        model=str(smollm2_dir),
        dtype="float32",
        num_gpu_blocks_override=256,
        max_model_len=1024,
        reasoning_config={"reasoning_parser": "qwen3"},
    )
    yield llm
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("n", [0, 3])
def test_smollm2_reasons_for_the_budget_then_ends_its_section_and_answers(budget_llm, n):
    tokenizer = budget_llm.get_tokenizer()
    start, end = (tokenizer.encode(s, add_special_tokens=False) for s in ("<think>", "</think>"))
    greedy = SamplingParams(temperature=0, max_tokens=40)
    [free] = budget_llm.chat(ONE_SHOT, greedy, use_tqdm=False)
    free_ids = list(free.outputs[0].token_ids)
    assert free_ids[: len(start)] == start and free.outputs[0].text.startswith("<think>The Colosseum")
    budgeted = SamplingParams(temperature=0, max_tokens=40, thinking_token_budget=n)
    [out] = budget_llm.chat(ONE_SHOT, budgeted, use_tqdm=False)
    ids = list(out.outputs[0].token_ids)
    cut = len(start) + n
    assert ids[:cut] == free_ids[:cut]  # the section's first n tokens as without a budget
    assert ids[cut : cut + len(end)] == end  # then its end, forced
    # then free again: exactly the greedy continuation of everything so far
    prompt = list(out.prompt_token_ids) + ids[: cut + len(end)]
    [rest] = budget_llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=40 - cut - len(end)), use_tqdm=False
    )
    assert ids[cut + len(end) :] == list(rest.outputs[0].token_ids)


@pytest.mark.slow
def test_a_budget_without_reasoning_delimiters_is_refused_by_name(smollm2_llm):
    with pytest.raises(ValueError, match="thinking_token_budget needs to know where a reasoning section starts"):
        smollm2_llm.generate(["Hi"], SamplingParams(max_tokens=2, thinking_token_budget=4), use_tqdm=False)

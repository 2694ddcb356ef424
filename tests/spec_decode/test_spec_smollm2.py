"""Speculative decoding on the real SmolLM2-135M-Instruct weights: with n-gram proposals or a draft
model, greedy and seeded outputs equal the outputs without speculation token for token, and sampled
outputs keep the target's distribution."""

from collections import Counter

import pytest

from raypaged import LLM, SamplingParams
from tests.conftest import make_tiny_model

PROMPTS = [
    "Repeat after me, word for word: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "List the numbers from 1 to 30, separated by commas: 1, 2, 3,",
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "red green blue red green blue red green",
    "Translate to French: I love programming.",
    "Q: What is 12 times 7?\nA:",
]
NUM_NEW = 64
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
ENGINE = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=512)


def make_llm(smollm2_dir, speculative_config=None, **overrides):
    return LLM(model=str(smollm2_dir), speculative_config=speculative_config, **{**ENGINE, **overrides})


@pytest.fixture(scope="module")
def baseline(smollm2_dir):
    llm = make_llm(smollm2_dir)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def greedy_reference(baseline):
    return [o.outputs[0].token_ids for o in baseline.generate(PROMPTS, GREEDY, use_tqdm=False)]


def spec_stats(llm):
    stats = llm.stats()
    return {key.removeprefix("spec_decode_"): value for key, value in stats.items() if key.startswith("spec_decode")}


def check_pool(llm):
    """Every block is back in the pool, ref counts agree with the (empty) tables."""
    kv = llm.llm_engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def test_ngram_greedy_equals_no_speculation_and_reports_acceptance(smollm2_dir, greedy_reference):
    llm = make_llm(smollm2_dir, NGRAM)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == greedy_reference
        stats = spec_stats(llm)
        assert stats["num_drafts"] > 20 and stats["num_accepted_tokens"] > 50
        per_pos = [stats[f"num_accepted_tokens_per_pos_{i}"] for i in range(4)]
        assert sum(per_pos) == stats["num_accepted_tokens"]
        assert per_pos == sorted(per_pos, reverse=True)  # a draft is accepted only after the ones before it
        assert stats["num_accepted_tokens"] <= stats["num_draft_tokens"] <= 4 * stats["num_drafts"]
        check_pool(llm)
    finally:
        llm.shutdown()


def test_a_tiny_random_draft_model_changes_no_token(smollm2_dir, greedy_reference, tmp_path):
    draft = make_tiny_model(tmp_path, smollm2_dir, max_position_embeddings=512)
    llm = make_llm(smollm2_dir, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == greedy_reference
        stats = spec_stats(llm)
        # it always proposes 3, fewer only in the last steps before max_tokens (at most 3 drafts fewer each)
        assert 3 * stats["num_drafts"] - 3 * len(PROMPTS) <= stats["num_draft_tokens"] <= 3 * stats["num_drafts"]
        assert stats["num_drafts"] > 8 * 50
        check_pool(llm)
    finally:
        llm.shutdown()


def test_smollm2_drafting_for_itself_is_accepted_whole(smollm2_dir, greedy_reference):
    llm = make_llm(smollm2_dir, {"method": "draft_model", "model": str(smollm2_dir), "num_speculative_tokens": 3})
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == greedy_reference
        stats = spec_stats(llm)
        # every draft accepted: each verification makes its drafts plus one tokens
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
        assert stats["num_accepted_tokens_per_pos_0"] == stats["num_drafts"]
        assert stats["num_drafts"] <= len(PROMPTS) * -(-(NUM_NEW - 1) // 4) + len(PROMPTS)
        check_pool(llm)
    finally:
        llm.shutdown()


SELF_DRAFT = "self-draft"


@pytest.mark.parametrize(
    "method, overrides",
    [
        ("ngram", {}),
        (SELF_DRAFT, {}),
        ("ngram", {"preemption_mode": "swap", "swap_space": 0.05}),
        (SELF_DRAFT, {"preemption_mode": "swap", "swap_space": 0.05, "max_num_batched_tokens": 24}),  # chunked too
    ],
    ids=["ngram-recompute", "draft-recompute", "ngram-swap", "draft-swap-chunked"],
)
def test_speculation_under_a_pool_small_enough_to_preempt(smollm2_dir, greedy_reference, method, overrides):
    spec = (
        NGRAM
        if method == "ngram"
        else {"method": "draft_model", "model": str(smollm2_dir), "num_speculative_tokens": 3}
    )
    # 8 sequences of about 20 + 64 tokens want about 48 blocks of 16: 24 force preemptions
    llm = make_llm(smollm2_dir, spec, num_gpu_blocks_override=24, max_model_len=256, **overrides)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == greedy_reference
        stats = llm.stats()
        assert stats["num_preemptions"] > 0
        assert stats["num_swap_outs"] > 0 if "swap_space" in overrides else stats["num_swap_outs"] == 0
        assert stats["spec_decode_num_accepted_tokens"] > 0
        check_pool(llm)
    finally:
        llm.shutdown()


def test_seeded_samples_and_logprobs_equal_those_without_speculation(smollm2_dir, baseline):
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=32, logprobs=2, n=2) for i in range(len(PROMPTS))
    ]
    reference = baseline.generate(PROMPTS, params, use_tqdm=False)
    llm = make_llm(smollm2_dir, NGRAM)
    try:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert spec_stats(llm)["num_accepted_tokens"] > 0
        for output, ref in zip(outputs, reference):
            for got, want in zip(output.outputs, ref.outputs):
                assert got.token_ids == want.token_ids
                assert got.text == want.text
                assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
                for got_pos, want_pos in zip(got.logprobs, want.logprobs):
                    assert list(got_pos) == list(want_pos)
                    assert [v.logprob for v in got_pos.values()] == pytest.approx(
                        [v.logprob for v in want_pos.values()], abs=1e-3
                    )
        check_pool(llm)
    finally:
        llm.shutdown()


def test_a_stop_string_inside_an_accepted_run_cuts_it_there(smollm2_dir, baseline):
    # the self-draft accepts whole runs, so stop strings land inside them
    params = SamplingParams(temperature=0, max_tokens=64, stop=["lazy", ", 9,", "return a /"])
    reference = baseline.generate(PROMPTS[:3], params, use_tqdm=False)
    llm = make_llm(smollm2_dir, {"method": "draft_model", "model": str(smollm2_dir), "num_speculative_tokens": 4})
    try:
        outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        for output, ref in zip(outputs, reference):
            got, want = output.outputs[0], ref.outputs[0]
            assert want.finish_reason == "stop"  # each prompt does reach its stop string
            assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
                want.text,
                want.token_ids,
                want.finish_reason,
                want.stop_reason,
            )
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
        check_pool(llm)
    finally:
        llm.shutdown()


def test_sampling_with_speculation_keeps_the_models_distribution(smollm2_dir, baseline):
    """600 unseeded samples of 3 tokens at temperature 0.8: the second token is verified against an
    n-gram draft (the prompt repeats, so most samples have a draft to accept or reject). Binned into
    the 5 likeliest second tokens and the rest, its counts with and without speculation pass a
    chi-square test of homogeneity at p = 0.001 (5 degrees of freedom: critical value 20.52). A
    verifier that accepted every draft, or none, fails it (see the last asserts). The prompt's 17 tokens
    fill a KV block, which the prefix cache shares among the samples (a 14-token prompt doubled the time)."""
    prompt = "one two three four one two three four one two three four one two three four one"
    params = SamplingParams(temperature=0.8, max_tokens=3)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    llm = make_llm(smollm2_dir, spec, seed=1)
    try:
        with_spec = [o.outputs[0].token_ids for o in llm.generate([prompt] * 600, params, use_tqdm=False)]
        stats = spec_stats(llm)
        assert stats["num_drafts"] >= 400  # most samples verified a draft at their second token
    finally:
        llm.shutdown()
    without = [o.outputs[0].token_ids for o in baseline.generate([prompt] * 600, params, use_tqdm=False)]
    bins = [token for token, _ in Counter(ids[1] for ids in without).most_common(5)]

    def binned(samples):
        counts = Counter(ids[1] if ids[1] in bins else -1 for ids in samples)
        return [counts[token] for token in [*bins, -1]]

    chi2 = chi_square(binned(with_spec), binned(without))
    assert chi2 < 20.52, (chi2, binned(with_spec), binned(without))
    # the same test rejects the outputs of a verifier that always accepts (every draft kept: each
    # second token is what the prompt had after the first) or never does (a second token is never
    # the draft)
    follow = {prompt.split()[i]: prompt.split()[i + 1] for i in range(len(prompt.split()) - 1)}
    tokenizer = baseline.get_tokenizer()
    draft_of = {tokenizer.encode(" " + word)[0]: tokenizer.encode(" " + nxt)[0] for word, nxt in follow.items()}
    accept_all = [[ids[0], draft_of.get(ids[0], ids[1])] for ids in without]
    assert chi_square(binned(accept_all), binned(without)) > 20.52
    never = [ids for ids in without if ids[1] != draft_of.get(ids[0])]
    assert chi_square(binned(never), binned(without)) > 20.52


def chi_square(a: list[int], b: list[int]) -> float:
    """Pearson's statistic of two samples' counts over the same bins (empty bins skipped)."""
    total_a, total_b = sum(a), sum(b)
    statistic = 0.0
    for x, y in zip(a, b):
        if x + y:
            expected_a = (x + y) * total_a / (total_a + total_b)
            expected_b = (x + y) * total_b / (total_a + total_b)
            statistic += (x - expected_a) ** 2 / expected_a + (y - expected_b) ** 2 / expected_b
    return statistic


@pytest.mark.parametrize("method", ["ngram", SELF_DRAFT])
def test_constrained_outputs_with_speculation_equal_those_without(smollm2_dir, baseline, method):
    """Drafts are cut where the grammar refuses them, each verified position is masked by the grammar
    as it stands after the drafts before it, and the matcher advances over the accepted run: greedy
    outputs under JSON schemas (xgrammar and llguidance), a regex, a choice and a grammar equal the
    outputs without speculation, token for token."""
    from raypaged.sampling_params import StructuredOutputsParams
    from tests.structured.schemas import SCHEMAS
    from tests.structured.test_structured_llm import ARITHMETIC

    schemas = list(SCHEMAS.items())[:4]
    all_of = {
        "allOf": [
            {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
            {"properties": {"n": {"maximum": 9}}},
        ]
    }
    constraints = [StructuredOutputsParams(json=schema) for _, schema in schemas] + [
        StructuredOutputsParams(json=all_of),  # llguidance (auto: xgrammar keeps one subschema of allOf)
        StructuredOutputsParams(regex=r"(\d{2}, ){6}\d{2}"),
        StructuredOutputsParams(choice=["the quick brown fox", "the lazy dog"]),
        StructuredOutputsParams(grammar=ARITHMETIC),
    ]
    questions = [f"Answer in JSON: an example of {name.replace('_', ' ')}." for name, _ in schemas] + [
        "Give a JSON object with an integer n.",
        "Count by twos from 10:",
        "Which animal is lazy?",
        "Write an arithmetic expression with three numbers.",
    ]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    params = [SamplingParams(temperature=0, max_tokens=96, structured_outputs=c) for c in constraints]
    reference = baseline.chat(conversations, params, use_tqdm=False)
    spec = (
        NGRAM
        if method == "ngram"
        else {"method": "draft_model", "model": str(smollm2_dir), "num_speculative_tokens": 3}
    )
    llm = make_llm(smollm2_dir, spec)
    try:
        outputs = llm.chat(conversations, params, use_tqdm=False)
        for output, want in zip(outputs, reference):
            assert output.error is None and want.error is None
            assert (output.outputs[0].token_ids, output.outputs[0].finish_reason) == (
                want.outputs[0].token_ids,
                want.outputs[0].finish_reason,
            )
        stats = spec_stats(llm)
        assert stats["num_accepted_tokens"] > 0
        if method != "ngram":  # the unconstrained draft proposes tokens the grammar refuses: they are cut
            assert stats["num_draft_tokens"] < 3 * stats["num_drafts"]
        check_pool(llm)
    finally:
        llm.shutdown()

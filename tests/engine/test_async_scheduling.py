"""Async scheduling (``--async-scheduling``) gives the tokens the synchronous engine gives.

The CPU runs it for real: each step runs on the step thread while the engine schedules the
next one on placeholders, so the tests check that steps did overlap, and that every
sampling mode, preemption, stop tokens and strings, aborts, beam search and grammars come out
identical with it off and on.
"""

from __future__ import annotations

import pytest

from raypaged import LLM
from raypaged.config import EngineConfig
from raypaged.core.beam_search import BeamSearchParams
from raypaged.sampling_params import SamplingParams, StructuredOutputsParams
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)

PROMPTS = [f"story {i} about " + "word " * (3 * (i % 4)) for i in range(12)]


def mixed_params() -> list[SamplingParams]:
    """Greedy, seeded sampling with logprobs, penalties with min_tokens, n/best_of, stop tokens and strings."""
    kinds = [
        lambda i: SamplingParams(temperature=0, max_tokens=30 + i, stop_token_ids=[26077]),
        lambda i: SamplingParams(temperature=0.8, seed=i, max_tokens=36, logprobs=2, prompt_logprobs=1),
        lambda i: SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=40,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.2,
            min_tokens=4,
            stop=["ing"],
        ),
        lambda i: SamplingParams(temperature=0.7, seed=i, n=2, best_of=3, max_tokens=30),
    ]
    return [kinds[i % 4](i) for i in range(len(PROMPTS))]


def run(model_dir, async_scheduling: bool, **options) -> tuple[list, LLM]:
    llm = LLM(
        str(model_dir),
        async_scheduling=async_scheduling,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=160,
        **options,
    )
    outs = llm.generate(PROMPTS, mixed_params(), use_tqdm=False)
    got = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]
    logprobs = [[c.cumulative_logprob for c in o.outputs] for o in outs]
    return (got, logprobs), llm


@pytest.fixture(scope="module")
def sync_results(tiny_model_dir):
    results, llm = run(tiny_model_dir, False, num_gpu_blocks_override=24)
    assert llm.llm_engine.core.num_overlapped_steps == 0
    assert llm.llm_engine.stats().num_preemptions > 0  # the pool is tight: sequences are recomputed
    ends = {(str(reason), stop) for row in results[0] for _, _, reason, stop in row}
    assert ends == {("length", None), ("stop", 26077), ("stop", "ing")}  # every way to end occurs
    llm.shutdown()
    return results


@pytest.mark.parametrize("num_blocks", [24, 64], ids=["tight-pool", "roomy-pool"])
def test_async_scheduling_gives_the_synchronous_tokens(tiny_model_dir, sync_results, num_blocks):
    (got, logprobs), llm = run(tiny_model_dir, True, num_gpu_blocks_override=num_blocks)
    try:
        core = llm.llm_engine.core
        assert core.num_overlapped_steps > 50  # most steps ran beside the one before
        assert got == sync_results[0]
        assert logprobs == [pytest.approx(row, abs=1e-4) for row in sync_results[1]]
        stats = llm.llm_engine.stats()
        assert stats.num_gpu_blocks_free == stats.num_gpu_blocks_total
        assert core.scheduler.requests == {}
    finally:
        llm.shutdown()


def test_an_abort_beside_a_step_in_flight_leaves_the_others_exact(tiny_model_dir):
    results = {}
    for mode in (False, True):
        llm = LLM(str(tiny_model_dir), async_scheduling=mode, num_gpu_blocks_override=64, max_model_len=256)
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS[:4]):
            engine.add_request(prompt, params, request_id=str(i))
        tokens: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
            if steps == 5:
                engine.abort_request(["1"])
        results[mode] = tokens
        assert len(tokens["1"]) == 5  # a token from each step before the abort, none from the one in flight
        assert engine.stats().num_gpu_blocks_free == engine.stats().num_gpu_blocks_total
        llm.shutdown()
    assert results[True] == results[False]


def test_beam_search_and_grammars_run_synchronously_beside_it(tiny_model_dir):
    constraint = StructuredOutputsParams(choice=["yes please", "no thanks", "maybe"])
    results = {}
    for mode in (False, True):
        llm = LLM(str(tiny_model_dir), async_scheduling=mode, num_gpu_blocks_override=64, max_model_len=256)
        beams = llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=8), use_tqdm=False)
        constrained = llm.generate(
            PROMPTS[:3],
            [
                SamplingParams(temperature=0, max_tokens=10),
                SamplingParams(temperature=0, max_tokens=10, structured_outputs=constraint),
                SamplingParams(temperature=0.9, seed=3, max_tokens=10),
            ],
            use_tqdm=False,
        )
        results[mode] = (
            [[s.tokens for s in b.sequences] for b in beams],
            [o.outputs[0].token_ids for o in constrained],
        )
        assert constrained[1].outputs[0].text in ("yes please", "no thanks", "maybe")
        llm.shutdown()
    assert results[True] == results[False]


def test_async_scheduling_is_off_on_cpu_unless_asked_and_refused_where_it_cannot_run(tiny_model_dir):
    assert EngineConfig(model=str(tiny_model_dir)).resolved_async_scheduling is False
    assert EngineConfig(model=str(tiny_model_dir), async_scheduling=True).resolved_async_scheduling is True
    with pytest.raises(ValueError) as tp:
        EngineConfig(model=str(tiny_model_dir), async_scheduling=True, tensor_parallel_size=2)
    assert str(tp.value) == (
        "--async-scheduling runs on one shard: the next step needs the tokens only rank 0 "
        "samples (tensor_parallel_size is 2; use --no-async-scheduling)"
    )
    with pytest.raises(ValueError) as spec:
        EngineConfig(
            model=str(tiny_model_dir),
            async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    assert str(spec.value) == (
        "--async-scheduling cannot run with --speculative-config: the next step's drafts "
        "depend on the tokens the step before accepts (use --no-async-scheduling)"
    )

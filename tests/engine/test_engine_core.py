"""EngineCore: token ids in, per-sequence deltas out, with no tokenizer anywhere.

Greedy deltas equal transformers' tokens one per step; samples get their own sequence
ids; an abort frees every block and ends the deltas; a sequence the core ends on its
own comes with its reason and message; prompt logprobs and the first-token facts come
once, with the first tokens.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

from raypaged.config import EngineConfig
from raypaged.core.request import RequestStatus
from raypaged.engine.core import EngineCore, EngineCoreRequest
from raypaged.outputs import FinishReason
from raypaged.sampling_params import SamplingParams
from tests.conftest import hf_greedy
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)

PROMPTS = [[1, 3251, 314, 253, 1345], [1, 29, 6211, 28, 1111, 17, 34, 99]]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def async_scheduling(request) -> bool:
    """Every test runs with async scheduling off and on: the same deltas either way."""
    return request.param


@pytest.fixture(scope="module")
def core(tiny_model_dir, async_scheduling):
    core = EngineCore(
        EngineConfig(
            model=str(tiny_model_dir), num_gpu_blocks_override=64, max_model_len=256, async_scheduling=async_scheduling
        ),
        2,
    )
    yield core
    core.shutdown()


def run(core: EngineCore) -> list:
    steps = []
    while core.has_unfinished_requests():
        steps.append(core.step())
    return steps


def greedy(max_tokens: int, **more) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **more)


def assert_all_blocks_free(core: EngineCore) -> None:
    stats = core.stats()
    assert stats.num_gpu_blocks_free == stats.num_gpu_blocks_total
    assert core.scheduler.requests == {}


def test_greedy_deltas_are_transformers_tokens_one_per_step(core, tiny_model_dir):
    core.add(EngineCoreRequest("a", PROMPTS[0], greedy(6), 6))
    core.add(EngineCoreRequest("b", PROMPTS[1], greedy(9), 9))
    got: dict[str, list[int]] = {"a": [], "b": []}
    reasons: dict[str, list] = {"a": [], "b": []}
    for out in run(core):
        assert out.failed == {} and out.beams == []
        for delta in out.seqs:
            assert len(delta.new_token_ids) == 1 and delta.new_logprobs is None and delta.message is None
            got[delta.seq_id] += delta.new_token_ids
            reasons[delta.seq_id].append(delta.finish_reason)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert got == {"a": hf_greedy(hf, PROMPTS[0], 6), "b": hf_greedy(hf, PROMPTS[1], 9)}
    assert reasons == {"a": [None] * 5 + [FinishReason.LENGTH], "b": [None] * 8 + [FinishReason.LENGTH]}
    assert_all_blocks_free(core)


def test_the_first_delta_carries_prompt_logprobs_and_first_token_facts(core):
    core.add(EngineCoreRequest("p", PROMPTS[0], greedy(3, logprobs=2, prompt_logprobs=1), 3))
    deltas = [d for out in run(core) for d in out.seqs]
    first, *rest = deltas
    assert first.first_scheduled_time is not None and first.num_cached_tokens == 0
    assert len(first.prompt_logprobs) == len(PROMPTS[0]) - 1  # every prompt token but the first
    assert all(d.first_scheduled_time is None and d.prompt_logprobs is None for d in rest)
    assert [len(d.new_logprobs) for d in deltas] == [1, 1, 1]
    for d in deltas:  # the sampled token leads its top logprobs
        assert d.new_token_ids[0] in d.new_logprobs[0]
    assert deltas[-1].cumulative_logprob == pytest.approx(sum(d.new_logprobs[0][d.new_token_ids[0]] for d in deltas))


def test_samples_are_sequences_of_their_own(core):
    ids = core.add(
        EngineCoreRequest(
            "s", PROMPTS[1], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True), 4
        )
    )
    assert ids == ["s", "s#1", "s#2"]
    tokens: dict[str, list[int]] = {}
    for out in run(core):
        for delta in out.seqs:
            tokens.setdefault(delta.seq_id, []).extend(delta.new_token_ids)
    assert sorted(tokens) == ids and all(len(t) == 4 for t in tokens.values())
    assert_all_blocks_free(core)


def test_an_abort_ends_the_deltas_and_frees_the_blocks(core):
    core.add(EngineCoreRequest("x", PROMPTS[0], greedy(50), 50))
    core.add(EngineCoreRequest("y", PROMPTS[1], greedy(3), 3))
    core.step()
    core.step()
    core.abort(["x"])
    assert core.scheduler.requests.keys() == {"y"}
    later = [d.seq_id for out in run(core) for d in out.seqs]
    assert later == ["y"]  # its third token; nothing more for x
    assert_all_blocks_free(core)


def test_a_stop_the_caller_found_finishes_the_sequence(core):
    core.add(EngineCoreRequest("t", PROMPTS[0], greedy(50), 50))
    core.step()
    core.finish(["t"], RequestStatus.FINISHED_STOPPED)
    assert not core.has_unfinished_requests()
    assert_all_blocks_free(core)


def test_a_sequence_the_core_ends_itself_comes_with_its_message(tiny_model_dir, async_scheduling):
    small = EngineCore(
        EngineConfig(
            model=str(tiny_model_dir), num_gpu_blocks_override=16, max_model_len=256, async_scheduling=async_scheduling
        ),
        2,
    )
    try:
        small.add(EngineCoreRequest("big", PROMPTS[0], greedy(400), 400))  # 16 blocks of 16 tokens: 256 at most
        deltas = [d for out in run(small) for d in out.seqs]
        tokens = [t for d in deltas for t in d.new_token_ids]
        last = deltas[-1]
        assert last.new_token_ids == [] and last.finish_reason == FinishReason.LENGTH
        assert len(PROMPTS[0]) + len(tokens) == 257  # the pool's 256 slots computed, the newest token not
        assert last.message == (
            "request big outgrew the whole KV cache (16 blocks of 16 tokens) at 257 tokens; finished with what it has"
        )
        assert_all_blocks_free(small)
    finally:
        small.shutdown()


def test_the_core_imports_neither_a_tokenizer_nor_torch():
    code = (
        "import sys, raypaged.engine.core; "
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

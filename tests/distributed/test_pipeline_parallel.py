"""Pipeline parallelism over Ray actors on CPU (gloo): each stage holds its contiguous layers and their KV cache,
the residual stream goes from stage to stage, and the tokens and logprobs are one shard's."""

from __future__ import annotations

import re

import pytest
import ray
import torch

from raypaged import LLM, SamplingParams
from raypaged.config import EngineConfig
from raypaged.executor.ray_executor import RayExecutor, ranks_by_node
from raypaged.lora.request import LoRARequest
from raypaged.model.stages import stage_layers
from tests.conftest import make_peft_adapter, make_tiny_model
from tests.distributed.conftest import TINY_PARAMS, TINY_PROMPTS, greedy_tokens
from tests.distributed.test_recovery import kill_rank_1
from tests.serving.conftest import Stack

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)
PROMPTS = [{"prompt_token_ids": list(range(100 + i, 100 + i + n))} for i, n in enumerate((41, 7, 23))]


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory, smollm2_dir):
    """3 layers (stages of 2 and 1, or 1 each), its LM head the embeddings (as SmolLM2's): the last stage reads it."""
    return make_tiny_model(tmp_path_factory.mktemp("pp"), smollm2_dir, num_hidden_layers=3, tie_word_embeddings=True)


def tokens_and_logprobs(llm: LLM) -> tuple[list[list[int]], list[float]]:
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    logprobs = [e[t].logprob for o in outputs for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
    logprobs += [e[t].logprob for o in outputs for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
    return [list(o.outputs[0].token_ids) for o in outputs], logprobs


def start(model, **options) -> LLM:
    return LLM(model=str(model), num_gpu_blocks_override=64, max_model_len=128, max_num_batched_tokens=16, **options)


@pytest.fixture(scope="module")
def one_shard(tied_model):
    return tokens_and_logprobs(start(tied_model))


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (3, 1), (2, 2)])
def test_stages_give_one_shards_tokens_and_logprobs(ray_session, tied_model, one_shard, pp, tp):
    """In 16-token chunks (the prompts' prefills cross steps), as micro-batches of different sequences in flight
    together (one per stage at most); tp 2 within stages sums in another order, so its logprobs are close, the
    others' equal."""
    llm = start(tied_model, pipeline_parallel_size=pp, tensor_parallel_size=tp)
    try:
        executor = llm.llm_engine.executor
        assert isinstance(executor, RayExecutor) and len(executor.workers) == pp * tp
        tokens, logprobs = tokens_and_logprobs(llm)
        assert llm.llm_engine.core.num_pipelined_steps > 0
    finally:
        llm.shutdown()
    assert tokens == one_shard[0]
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(one_shard[1]), atol=1e-5 if tp > 1 else 0, rtol=0)


def test_prompt_embeddings_enter_at_the_first_stage(ray_session, tied_model):
    """Rows given as the prompt replace the first stage's token embeddings: 2 stages answer as one shard."""
    generator = torch.Generator().manual_seed(3)
    rows = [0.2 * torch.randn(n, 64, generator=generator) for n in (5, 21)]
    prompts = [{"prompt_embeds": r} for r in rows]
    tokens = []
    for pp in (1, 2):
        llm = start(tied_model, pipeline_parallel_size=pp, enable_prompt_embeds=True)
        try:
            outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
            tokens.append([o.outputs[0].token_ids for o in outputs])
        finally:
            llm.shutdown()
    assert tokens[1] == tokens[0]


def test_ngram_drafts_are_verified_by_the_last_stage(ray_session, tied_model):
    """N-gram speculation (proposed by the engine, verified by the last stage's sampler): 2 stages give one shard's
    tokens, and drafts were accepted."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    prompts = [{"prompt_token_ids": [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]}, {"prompt_token_ids": list(range(300, 340))}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens, accepted = [], []
    for pp in (1, 2):
        llm = start(tied_model, pipeline_parallel_size=pp, speculative_config=spec)
        try:
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            accepted.append(llm.stats()["spec_decode_num_accepted_tokens"])
        finally:
            llm.shutdown()
    assert tokens[1] == tokens[0]
    assert accepted[1] == accepted[0] > 0


def test_each_stage_caches_its_own_layers(ray_session, tiny_llama, tiny_reference):
    """The same --kv-cache-space holds twice the blocks at 2 stages of the tiny Llama's 2 layers: each stage caches
    one layer; and the tokens are one shard's."""
    counts = []
    for pp in (1, 2):
        llm = LLM(model=str(tiny_llama), device="cpu", pipeline_parallel_size=pp, kv_cache_space=0.01)
        try:
            counts.append(llm.stats()["num_gpu_blocks_total"])
            if pp == 2:
                assert greedy_tokens(llm, TINY_PROMPTS, TINY_PARAMS) == tiny_reference
                # each stage holds what it reads: the embeddings the first, the LM head the last
                held = [ray.get(w.__ray_call__.remote(_held_modules)) for w in llm.llm_engine.executor.workers]
                assert held == [(1, True, False), (1, False, True)]
        finally:
            llm.shutdown()
    assert counts[1] == 2 * counts[0]


def test_a_lost_stage_is_replaced_and_requests_finish_unchanged(ray_session, tiny_llama, tiny_reference):
    """The last stage's actor (the one that samples) killed mid-batch: the whole group is replaced and every
    request recomputed to the same tokens."""
    llm = LLM(model=str(tiny_llama), device="cpu", pipeline_parallel_size=2, num_gpu_blocks_override=128)
    try:
        engine = llm.llm_engine
        request_ids = [
            engine.add_request(None, TINY_PARAMS, prompt_token_ids=p["prompt_token_ids"]) for p in TINY_PROMPTS
        ]
        finished, step = {}, 0
        while engine.has_unfinished_requests():
            if step == 4:
                lost = kill_rank_1(llm)
            finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            step += 1
        assert [finished[r] for r in request_ids] == tiny_reference
        assert lost not in [w._actor_id.hex() for w in engine.executor.workers]
    finally:
        llm.shutdown()


def test_micro_batches_share_the_sequences_and_results_reach_only_their_own(ray_session, tiny_llama, tiny_reference):
    """2 stages, 16 sequences: each micro-batch takes at most 8, and while one is in flight the next takes the
    others. A request aborted in flight and a new one under its id: the old one's results never reach the new
    one, which gives its prompt's tokens; every other request gives one shard's."""
    llm = LLM(model=str(tiny_llama), device="cpu", pipeline_parallel_size=2, num_gpu_blocks_override=128)
    try:
        engine = llm.llm_engine
        core = engine.core
        ids = [engine.add_request(None, TINY_PARAMS, prompt_token_ids=p["prompt_token_ids"]) for p in TINY_PROMPTS]
        assert engine.step() == []  # the first micro-batch is sent and nothing is collected yet
        [first] = core._batches
        assert request_ids(first.scheduler_output) == ids[:8]
        engine.step()  # the second, beside it; then the first's tokens come
        second = core._batches[0].scheduler_output
        assert request_ids(second) == ids[8:]
        in_flight = ids[8]
        engine.abort_request([in_flight])
        again = engine.add_request(
            None, TINY_PARAMS, request_id=in_flight, prompt_token_ids=TINY_PROMPTS[3]["prompt_token_ids"]
        )
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        assert finished[again] == tiny_reference[3]
        assert [finished[r] for r in ids if r != in_flight] == [t for i, t in enumerate(tiny_reference) if i != 8]
        assert core.num_pipelined_steps > 0 and not core._batches
        assert llm.stats()["num_gpu_blocks_free"] == 128
    finally:
        llm.shutdown()


def request_ids(scheduler_output) -> list[str]:
    """The requests of a step's sequences (a sequence id is its request's id, ``:``, a counter)."""
    return [seq_id.split(":")[0] for seq_id in scheduler_output.num_scheduled_tokens]


def test_beam_search_over_stages_equals_one_shard(ray_session, tiny_llama):
    """Beams wait for each other, so a live beam search runs one micro-batch at a time, uncapped: its beams and
    scores are one shard's."""
    from raypaged.core.beam_search import BeamSearchParams

    prompts = TINY_PROMPTS[:3]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    answers = []
    for pp in (1, 2):
        llm = LLM(model=str(tiny_llama), device="cpu", pipeline_parallel_size=pp, num_gpu_blocks_override=128)
        try:
            beams = llm.beam_search(prompts, params, use_tqdm=False)
            answers.append([[(s.tokens, round(s.cum_logprob, 4)) for s in out.sequences] for out in beams])
        finally:
            llm.shutdown()
    assert answers[1] == answers[0]


def test_micro_batches_through_the_compiled_graph_channel(ray_session, tiny_llama, tiny_reference, monkeypatch):
    """The step channel between nodes (a Ray Compiled Graph) takes a micro-batch per stage in flight too."""
    monkeypatch.setenv("RAYPAGED_STEP_CHANNEL", "graph")
    llm = LLM(model=str(tiny_llama), device="cpu", pipeline_parallel_size=2, num_gpu_blocks_override=128)
    try:
        assert llm.llm_engine.executor.step_channel == "graph"
        assert greedy_tokens(llm, TINY_PROMPTS, TINY_PARAMS) == tiny_reference
        assert llm.llm_engine.core.num_pipelined_steps > 0
    finally:
        llm.shutdown()


def test_layers_split_as_vllm_splits_them():
    assert [len(r) for r in stage_layers(30, 4)] == [7, 8, 8, 7]
    assert [len(r) for r in stage_layers(32, 4)] == [8, 8, 8, 8]
    assert [len(r) for r in stage_layers(5, 3)] == [2, 2, 1]
    assert stage_layers(3, 2) == [range(0, 2), range(2, 3)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pipeline_parallel_size": 4}, "--pipeline-parallel-size 4 is not supported: the model has 3 layers, fewer"),
        (
            {
                "pipeline_parallel_size": 2,
                "speculative_config": {"method": "draft_model", "model": "x", "num_speculative_tokens": 2},
            },
            "--pipeline-parallel-size 2 is not supported: a draft model runs beside the whole model on one shard",
        ),
        (
            {"pipeline_parallel_size": 2, "async_scheduling": True},
            "--async-scheduling runs on one shard: the next step needs the tokens only rank 0 samples "
            "(tensor_parallel_size is 1, pipeline_parallel_size 2; use --no-async-scheduling)",
        ),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be at least 1, got 0"),
    ],
)
def test_what_stages_cannot_run_is_refused_at_start(tied_model, options, message):
    if "speculative_config" in options:  # the model drafts for itself
        options = {**options, "speculative_config": {**options["speculative_config"], "model": str(tied_model)}}
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(model=str(tied_model), **options)


def _held_modules(actor) -> tuple[int, bool, bool]:
    model = actor.worker.model
    return len(model.model.layers), model.model.embed_tokens is not None, model.lm_head is not None


def test_ranks_run_in_bundles_grouped_by_node():
    """Two nodes holding alternate bundles: ranks 0-1 (stage 0 at tp 2) on the first node, 2-3 on the second."""
    assert ranks_by_node(["a", "b", "a", "b"]) == [0, 2, 1, 3]
    assert ranks_by_node(["b", "a", "a", "b"]) == [0, 3, 1, 2]
    assert ranks_by_node(["a", "a", "a"]) == [0, 1, 2]


def test_adapters_apply_on_every_stage(ray_session, tiny_llama, tmp_path):
    """Two adapters on every linear and the base model in one batch: each stage adds its layers' adapter terms,
    and 2 stages give one shard's tokens."""
    adapters = [
        LoRARequest(
            "a", 1, str(make_peft_adapter(tiny_llama, tmp_path / "a", 1, 0.3, r=4, target_modules="all-linear"))
        ),
        LoRARequest(
            "b", 2, str(make_peft_adapter(tiny_llama, tmp_path / "b", 2, 0.3, r=8, target_modules="all-linear"))
        ),
        None,
    ]
    prompts = TINY_PROMPTS[:1] * 3  # one prompt: the adapters' tokens differ from the base model's
    tokens = []
    for pp in (1, 2):
        llm = LLM(
            model=str(tiny_llama),
            device="cpu",
            pipeline_parallel_size=pp,
            enable_lora=True,
            max_lora_rank=8,
            num_gpu_blocks_override=64,
        )
        try:
            outputs = llm.generate(prompts, TINY_PARAMS, use_tqdm=False, lora_request=adapters)
            tokens.append([o.outputs[0].token_ids for o in outputs])
        finally:
            llm.shutdown()
    assert tokens[1] == tokens[0]
    assert tokens[0][0] != tokens[0][2] and tokens[0][1] != tokens[0][2]


def test_a_served_model_in_stages_answers_as_one_shard(ray_session, tied_model):
    """`raypaged serve -pp 2`'s stack (engine server and gateway): the completion and its usage are one shard's."""
    configs = [
        EngineConfig(model=str(tied_model), served_model_name=name, num_gpu_blocks_override=64, max_model_len=128, **o)
        for name, o in (("one", {}), ("stages", {"pipeline_parallel_size": 2}))
    ]
    stack = Stack(configs)
    try:
        with stack.client() as http:
            body = {"prompt": "The cat sat on", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            answers = [http.post("/v1/completions", json={**body, "model": m}).json() for m in ("one", "stages")]
    finally:
        stack.close()
    assert answers[1]["choices"][0]["text"] == answers[0]["choices"][0]["text"]
    assert answers[1]["usage"] == answers[0]["usage"]

"""Tensor parallelism over Ray actors on CPU (gloo): the same greedy tokens as one shard."""

from __future__ import annotations

import os
import re
import sys

import pytest
import ray
from transformers import LlamaConfig

from raypaged import LLM, SamplingParams
from raypaged.config import EngineConfig
from raypaged.executor.ray_executor import RayExecutor
from raypaged.executor.uniproc import UniProcExecutor
from raypaged.executor.worker_actor import node_cores
from raypaged.model.llama import check_tensor_parallel
from raypaged.sampling_params import StructuredOutputsParams
from tests.distributed.conftest import TINY_PARAMS, TINY_PROMPTS, greedy_tokens


@pytest.mark.parametrize("tp", [2, 4])
def test_tiny_llama_tp_matches_tp1(ray_session, tiny_llama, tiny_reference, tp):
    llm = LLM(model=str(tiny_llama), device="cpu", tensor_parallel_size=tp, num_gpu_blocks_override=128)
    try:
        executor = llm.llm_engine.executor
        assert isinstance(executor, RayExecutor) and len(executor.workers) == tp
        assert executor.step_channel == "shm"  # every shard on the driver's node
        assert shard_threads(executor) == [expected_threads(max(1, CORES // tp))] * tp
        assert greedy_tokens(llm, TINY_PROMPTS, TINY_PARAMS) == tiny_reference
        # grammar masks travel to the shards filled (the engine fills them during the step)
        constrained = SamplingParams(
            temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex="[a-z]{3}-[0-9]{2}")
        )
        outputs = llm.generate(TINY_PROMPTS, constrained, use_tqdm=False)
        assert all(re.fullmatch("[a-z]{3}-[0-9]{2}", o.outputs[0].text) for o in outputs), [
            o.outputs[0].text for o in outputs
        ]
        stats = llm.stats()
        assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"] == 128
    finally:
        llm.shutdown()


def test_compiled_graph_channel_matches_tp1(ray_session, tiny_llama, tiny_reference, monkeypatch):
    monkeypatch.setenv("RAYPAGED_STEP_CHANNEL", "graph")
    llm = LLM(model=str(tiny_llama), device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=128)
    try:
        assert llm.llm_engine.executor.step_channel == "graph"
        assert greedy_tokens(llm, TINY_PROMPTS, TINY_PARAMS) == tiny_reference
    finally:
        llm.shutdown()


def test_sleep_mode_lets_the_shards_go_and_new_ones_answer_alike(ray_session, tiny_llama, tiny_reference):
    llm = LLM(
        model=str(tiny_llama), device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=128, enable_sleep_mode=True
    )
    try:
        executor = llm.llm_engine.executor
        old = [worker._actor_id for worker in executor.workers]
        llm.sleep(level=1)
        assert executor.workers == [] and executor.placement_group is None
        llm.wake_up(["weights"])
        assert len(executor.workers) == 2 and not {w._actor_id for w in executor.workers} & set(old)
        llm.wake_up(["kv_cache"])
        assert greedy_tokens(llm, TINY_PROMPTS, TINY_PARAMS) == tiny_reference
    finally:
        llm.shutdown()


def test_bad_step_channel(ray_session, tiny_llama, monkeypatch):
    monkeypatch.setenv("RAYPAGED_STEP_CHANNEL", "zmq")
    with pytest.raises(ValueError, match=r"^\$RAYPAGED_STEP_CHANNEL must be one of auto, shm, graph, got 'zmq'$"):
        LLM(model=str(tiny_llama), device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=128)


CORES = node_cores()  # one node: every shard of the session's Ray shares this machine's cores


def expected_threads(n: int) -> dict[str, int | str]:
    return {"torch_threads": n, "OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}


def shard_threads(executor: RayExecutor) -> list[dict]:
    return ray.get([worker.thread_settings.remote() for worker in executor.workers])


@pytest.mark.parametrize(("tp", "override", "threads"), [(1, None, CORES), (2, "3", 3)])
def test_cpu_shards_split_the_cores(ray_session, tiny_llama, monkeypatch, tp, override, threads):
    """Default: the node's cores over its shards (Ray alone would give each num_cpus=1 actor one thread);
    $RAYPAGED_CPU_THREADS_PER_SHARD overrides."""
    if override is not None:
        monkeypatch.setenv("RAYPAGED_CPU_THREADS_PER_SHARD", override)
    executor = RayExecutor(EngineConfig(model=str(tiny_llama), device="cpu", tensor_parallel_size=tp), eos_token_id=2)
    try:
        assert shard_threads(executor) == [expected_threads(threads)] * tp
    finally:
        executor.shutdown()


def test_the_drivers_switches_reach_the_shards(ray_session, tiny_llama, monkeypatch):
    """A $RAYPAGED_* switch set after Ray started (or where the shards' node never saw it) is the shards' too."""
    monkeypatch.setenv("RAYPAGED_VARLEN_PREFILL", "1")
    executor = RayExecutor(EngineConfig(model=str(tiny_llama), device="cpu", tensor_parallel_size=2), eos_token_id=2)
    try:
        seen = ray.get(
            [w.__ray_call__.remote(lambda _: os.environ.get("RAYPAGED_VARLEN_PREFILL")) for w in executor.workers]
        )
        assert seen == ["1", "1"]
    finally:
        executor.shutdown()


def test_shards_read_the_models_config_on_transformers_base_class(ray_session, tiny_llama):
    """The shards get the LlamaConfig's values on a base PretrainedConfig: unpickling it never imports the class's
    module (and with it torch.distributed.tensor), and the tokens stay tp 1's (test_tiny_llama_tp_matches_tp1)."""
    executor = RayExecutor(EngineConfig(model=str(tiny_llama), device="cpu", tensor_parallel_size=2), eos_token_id=2)
    try:
        seen = ray.get(
            [
                w.__ray_call__.remote(
                    lambda actor: (
                        type(actor.worker.config.hf_config).__name__,
                        actor.worker.config.hf_config.to_dict(),
                        "transformers.models.llama.configuration_llama" in sys.modules,
                        "torch.distributed.tensor" in sys.modules,
                    )
                )
                for w in executor.workers
            ]
        )
    finally:
        executor.shutdown()
    expected = executor.config.hf_config.to_dict()
    assert seen == [("ShardModelConfig", expected, False, False)] * 2


def test_bf16_shards_run_bf16_linears_and_match_tp1(ray_session, tiny_llama):
    """A bf16 model on CPU shards: each shard computes in fp32 from its share of the bf16 weights over a bf16 KV
    cache (layers.bf16_linears_on_cpu), and the tokens are one bf16 shard's."""
    options = {"model": str(tiny_llama), "device": "cpu", "dtype": "bfloat16", "num_gpu_blocks_override": 128}
    one = LLM(**options)
    expected = greedy_tokens(one, TINY_PROMPTS, TINY_PARAMS)
    one.shutdown()
    llm = LLM(**options, tensor_parallel_size=2)
    try:
        seen = ray.get(
            [
                w.__ray_call__.remote(
                    lambda actor: (
                        actor.worker.bf16_linears,
                        str(actor.worker.cache_dtype),
                        sorted({str(p.dtype) for p in actor.worker.model.parameters() if getattr(p, "bf16", False)}),
                    )
                )
                for w in llm.llm_engine.executor.workers
            ]
        )
        assert seen == [(True, "torch.bfloat16", ["torch.bfloat16"])] * 2
        assert greedy_tokens(llm, TINY_PROMPTS, TINY_PARAMS) == expected
    finally:
        llm.shutdown()


def test_bad_thread_override(ray_session, tiny_llama, monkeypatch):
    monkeypatch.setenv("RAYPAGED_CPU_THREADS_PER_SHARD", "0")
    with pytest.raises(ValueError, match=r"^\$RAYPAGED_CPU_THREADS_PER_SHARD must be a positive int, got '0'$"):
        RayExecutor(EngineConfig(model=str(tiny_llama), device="cpu", tensor_parallel_size=2), eos_token_id=2)


def test_tp1_stays_in_process(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", num_gpu_blocks_override=8, max_model_len=128)
    assert isinstance(llm.llm_engine.executor, UniProcExecutor)


def test_kv_cache_is_sized_by_the_smallest_shard(ray_session, tiny_llama):
    """Each tp=2 shard holds 1 of the 2 KV heads: 1 GiB of cache per shard is twice the blocks of tp=1."""
    config = EngineConfig(model=str(tiny_llama), device="cpu", tensor_parallel_size=2, kv_cache_space=0.001)
    executor = RayExecutor(config, eos_token_id=2)
    try:
        # 2 layers x K,V x 16 tokens x 1 KV head x 8 dims x 4 bytes = 2048 bytes per block and shard
        assert executor.determine_num_blocks() == ((1 << 30) // 1000 // 2048, 0)
    finally:
        executor.shutdown()


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(ray_session, smollm2_dir):
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "The three primary colors are",
        "Water boils at",
        "My favourite programming language is",
        "In 1969, astronauts",
        "The quick brown fox",
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    reference = greedy_tokens(
        LLM(model=str(smollm2_dir), dtype="float32", device="cpu", num_gpu_blocks_override=64, max_model_len=1024),
        prompts,
        params,
    )
    llm = LLM(
        model=str(smollm2_dir),
        dtype="float32",
        device="cpu",
        tensor_parallel_size=3,
        num_gpu_blocks_override=64,
        max_model_len=1024,
    )
    try:
        assert greedy_tokens(llm, prompts, params) == reference
    finally:
        llm.shutdown()


def test_heads_not_divisible_fail_at_start(smollm2_dir):
    with pytest.raises(
        ValueError, match=r"^the model's num_attention_heads 9 is not divisible by tensor_parallel_size 2$"
    ):
        LLM(model=str(smollm2_dir), device="cpu", tensor_parallel_size=2)


def test_kv_heads_must_divide_or_be_divided():
    config = LlamaConfig(hidden_size=768, num_attention_heads=12, num_key_value_heads=3, intermediate_size=144)
    check_tensor_parallel(config, 4 * 3)  # 12 heads, 3 KV heads replicated 4 times
    with pytest.raises(ValueError, match=r"num_key_value_heads 3 and tensor_parallel_size 2 must divide one another"):
        check_tensor_parallel(config, 2)


def test_bad_placement_strategy(tiny_llama):
    with pytest.raises(ValueError, match="placement_strategy must be one of STRICT_PACK, PACK, SPREAD, got 'TIGHT'"):
        EngineConfig(model=str(tiny_llama), device="cpu", placement_strategy="TIGHT")


def test_lora_adapters_under_tp_match_tp1(ray_session, tiny_llama, tmp_path):
    """Each shard writes the driver's slot loads into its share of A and B: tp 2 equals tp 1."""
    from raypaged import LoRARequest
    from tests.lora.conftest import make_peft_adapter

    adapters = [
        LoRARequest(
            "qv",
            1,
            str(
                make_peft_adapter(
                    tiny_llama, tmp_path / "qv", 1, std=0.3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
                )
            ),
        ),
        LoRARequest(
            "all",
            2,
            str(
                make_peft_adapter(
                    tiny_llama, tmp_path / "all", 2, std=0.3, r=8, lora_alpha=8, target_modules="all-linear"
                )
            ),
        ),
    ]
    per_prompt = [None if i % 3 == 0 else adapters[i % 2] for i in range(len(TINY_PROMPTS))]

    def run(tp: int) -> list[list[int]]:
        llm = LLM(
            model=str(tiny_llama),
            device="cpu",
            tensor_parallel_size=tp,
            num_gpu_blocks_override=128,
            enable_lora=True,
            max_loras=1,
        )
        try:
            outputs = llm.generate(TINY_PROMPTS, TINY_PARAMS, use_tqdm=False, lora_request=per_prompt)
            return [o.outputs[0].token_ids for o in outputs]
        finally:
            llm.shutdown()

    reference = run(1)
    assert reference != greedy_tokens(
        LLM(model=str(tiny_llama), device="cpu", num_gpu_blocks_override=128), TINY_PROMPTS, TINY_PARAMS
    )  # the adapters change the tokens
    assert run(2) == reference


def test_ngram_speculation_under_tp_matches_tp1(ray_session, tiny_llama, tiny_reference):
    """Every shard verifies the driver's drafts in its forward and drops rejected ones' slots as told."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(
        model=str(tiny_llama),
        device="cpu",
        tensor_parallel_size=2,
        num_gpu_blocks_override=128,
        speculative_config=spec,
    )
    try:
        assert greedy_tokens(llm, TINY_PROMPTS, TINY_PARAMS) == tiny_reference
        stats = llm.stats()
        assert stats["spec_decode_num_accepted_tokens"] > 0
        assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]  # some rejected
        assert stats["num_gpu_blocks_free"] == 128
    finally:
        llm.shutdown()


def test_embeddings_under_tp_equal_transformers(ray_session, tiny_llama):
    """An embedding model over two shards: rank 0 pools the replicated final hidden states of every chunk."""
    import torch
    from transformers import AutoModel

    base = AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompts = [p["prompt_token_ids"] for p in TINY_PROMPTS[:4]] + [list(range(50, 90))]
    with torch.inference_mode():
        expected = [base(torch.tensor([p])).last_hidden_state[0].mean(0) for p in prompts]
    llm = LLM(
        model=str(tiny_llama),
        device="cpu",
        tensor_parallel_size=2,
        num_gpu_blocks_override=128,
        runner="pooling",
        pooler_config={"pooling_type": "MEAN", "normalize": False},
        max_num_batched_tokens=16,
    )
    try:
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    finally:
        llm.shutdown()
    for output, vector in zip(outputs, expected, strict=True):
        assert (torch.tensor(output.outputs.embedding) - vector).abs().max().item() < 2e-6

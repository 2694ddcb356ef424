"""Tensor parallelism on CUDA devices (two or more; skipped with fewer): Ray shards on one GPU each, the
all-reduces through NCCL. fp32 greedy tokens at tp 2 equal tp 1's; with ``$RAYPAGED_TP_CUDA_GRAPHS`` every shard
captures and replays CUDA graphs (its all-reduces through NCCL called directly, ``raypaged.worker.nccl``) with
the eager run's tokens."""

import gc

import pytest
import torch

from raypaged import LLM, SamplingParams
from tests.gpu import NEEDS_CUDA_AND_CUPY, TINY_LLAMA, ragged_prompts, random_llama

pytestmark = [
    *NEEDS_CUDA_AND_CUPY,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_llama(tmp_path_factory.mktemp("tp_cuda") / "tiny", **TINY_LLAMA)


@pytest.fixture(scope="module")
def prompts():
    return [p[:300] for p in ragged_prompts()]


def generate(model_dir, prompts, tp, **kwargs):
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        tensor_parallel_size=tp,
        gpu_memory_utilization=0.3,
        max_model_len=1024,
        **kwargs,
    )
    try:
        tokens = [
            list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        ]
        replays = None
        if tp > 1:
            import ray

            executor = llm.llm_engine.executor
            replays = ray.get(
                [
                    w.__ray_call__.remote(lambda actor: getattr(actor._started().runner.graphs, "replays", None))
                    for w in executor.workers
                ]
            )
        return tokens, replays
    finally:
        llm.shutdown()
        gc.collect()
        torch.cuda.empty_cache()


def test_tp2_over_nccl_gives_tp1s_greedy_tokens(model_dir, prompts):
    expected, _ = generate(model_dir, prompts, 1, enforce_eager=True)
    got, replays = generate(model_dir, prompts, 2, enforce_eager=True)
    assert got == expected and replays == [None, None]


def test_tp2_cuda_graphs_replay_with_the_eager_runs_tokens(monkeypatch, model_dir, prompts):
    eager, _ = generate(model_dir, prompts, 2, enforce_eager=True)
    monkeypatch.setenv("RAYPAGED_TP_CUDA_GRAPHS", "1")
    graphs, replays = generate(model_dir, prompts, 2)
    assert graphs == eager
    assert len(replays) == 2 and replays[0] == replays[1] > 0  # every shard replays the same steps

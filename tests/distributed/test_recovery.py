"""A shard actor killed in the middle of a batch: recomputed transparently, or a clear error."""

from __future__ import annotations

import pytest
import ray

from raypaged import LLM
from raypaged.executor.ray_executor import WorkerDiedError
from tests.distributed.conftest import TINY_PARAMS, TINY_PROMPTS

KILL_AFTER_STEPS = 4


def start_tp2(tiny_llama, enable_recovery: bool) -> LLM:
    return LLM(
        model=str(tiny_llama),
        device="cpu",
        tensor_parallel_size=2,
        num_gpu_blocks_override=128,
        enable_recovery=enable_recovery,
    )


def add_all(llm: LLM) -> list[str]:
    engine = llm.llm_engine
    return [
        engine.add_request(None, TINY_PARAMS, prompt_token_ids=p["prompt_token_ids"]) for p in TINY_PROMPTS
    ]


def kill_rank_1(llm: LLM) -> str:
    worker = llm.llm_engine.executor.workers[1]
    ray.kill(worker, no_restart=True)
    return worker._actor_id.hex()


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"] == 128
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def test_killed_worker_is_replaced_and_requests_finish_unchanged(ray_session, tiny_llama, tiny_reference):
    llm = start_tp2(tiny_llama, enable_recovery=True)
    try:
        engine = llm.llm_engine
        request_ids = add_all(llm)
        streamed: dict[str, list[int]] = {}  # what a streaming caller saw, token by token
        finished = {}
        step = 0
        while engine.has_unfinished_requests():
            if step == KILL_AFTER_STEPS:
                dead_actor = kill_rank_1(llm)
            for output in engine.step():
                tokens = output.outputs[0].token_ids
                assert tokens[: len(streamed.get(output.request_id, []))] == streamed.get(output.request_id, [])
                streamed[output.request_id] = tokens
                if output.finished:
                    finished[output.request_id] = tokens
            step += 1
        assert [finished[rid] for rid in request_ids] == tiny_reference
        assert dead_actor not in {w._actor_id.hex() for w in engine.executor.workers}
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_without_recovery_requests_fail_naming_the_dead_worker(ray_session, tiny_llama):
    llm = start_tp2(tiny_llama, enable_recovery=False)
    try:
        engine = llm.llm_engine
        add_all(llm)
        for _ in range(KILL_AFTER_STEPS):
            engine.step()
        dead_actor = kill_rank_1(llm)
        with pytest.raises(WorkerDiedError, match=rf"^worker rank 1 \(Ray actor {dead_actor}\) died: "):
            engine.step()
        assert not engine.has_unfinished_requests()
        assert_all_blocks_free(llm)
        assert engine.executor.workers == []  # the survivor was released too
        with pytest.raises(WorkerDiedError, match="worker rank 1"):
            engine.step()
    finally:
        llm.shutdown()

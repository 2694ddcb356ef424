"""Sleep mode (``enable_sleep_mode``): ``sleep`` frees the weights and the KV cache, ``wake_up`` brings them back,
and every request, in flight or waiting, ends with the tokens it would have had without the nap."""

from __future__ import annotations

import psutil
import pytest

from raypaged import LLM
from raypaged.config import SLEEP_MODE_OFF
from raypaged.sampling_params import SamplingParams
from tests.engine.test_async_scheduling import PROMPTS, mixed_params
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)

POOL_BLOCKS = 16384  # of 16 tokens: the tiny model's KV pool is 64 MiB


def finished(llm: LLM) -> dict[str, list[list[int]]]:
    """Run the engine's requests to their end: each one's sequences' tokens, by request id."""
    engine, done = llm.llm_engine, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = [list(c.token_ids) for c in output.outputs]
    return done


def outputs(llm: LLM) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(PROMPTS, mixed_params(), use_tqdm=False)]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def llm(request, tiny_model_dir):
    llm = LLM(
        model=str(tiny_model_dir),
        enable_sleep_mode=True,
        async_scheduling=request.param,
        num_gpu_blocks_override=POOL_BLOCKS,
        max_model_len=256,
    )
    yield llm
    llm.shutdown()


def test_requests_in_flight_and_added_asleep_finish_as_without_sleep(llm):
    engine = llm.llm_engine
    expected = outputs(llm)
    ids = [engine.add_request(p, s) for p, s in zip(PROMPTS[:6], mixed_params()[:6])]
    for _ in range(4):
        engine.step()
    pool = engine.core.executor.worker.bytes_per_block() * POOL_BLOCKS
    rss = psutil.Process().memory_info().rss
    llm.sleep(level=1)
    assert engine.is_sleeping() and not hasattr(engine.core.executor, "worker")
    assert pool == 64 << 20 and rss - psutil.Process().memory_info().rss > 0.9 * pool  # the pool went
    ids += [engine.add_request(p, s) for p, s in zip(PROMPTS[6:], mixed_params()[6:])]
    assert engine.step() == [] and engine.stats()["num_gpu_blocks_free"] == POOL_BLOCKS
    with pytest.raises(RuntimeError, match=r"^the engine is asleep: call LLM.wake_up\(\) before giving it requests$"):
        llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(
        ValueError, match=r"^the KV cache wakes with or after the weights: wake_up\(tags=\['weights'\]\) first$"
    ):
        llm.wake_up(["kv_cache"])
    llm.wake_up(["weights"])
    assert engine.is_sleeping() and engine.step() == []
    llm.wake_up(["kv_cache"])
    assert not engine.is_sleeping()
    done = finished(llm)
    assert [done[i] for i in ids] == expected
    llm.sleep(level=2)  # both at once, and a second nap
    llm.wake_up()
    assert outputs(llm) == expected


def test_sleep_needs_sleep_mode_and_a_level_of_one_or_two(llm, tiny_model_dir):
    with pytest.raises(
        ValueError, match=r"^sleep level must be 1 \(offload the weights\) or 2 \(discard them\), got 3$"
    ):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match=r"^wake_up tags are 'weights' and 'kv_cache', got 'cache'$"):
        llm.wake_up(["cache"])
    assert not llm.llm_engine.is_sleeping()
    plain = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=64, max_model_len=256)
    with pytest.raises(ValueError) as info:
        plain.sleep()
    assert str(info.value) == SLEEP_MODE_OFF

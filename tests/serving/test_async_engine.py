"""AsyncLLMEngine: a cancel that arrives while the engine thread adds the request still aborts it;
a failing metrics observer never stops the engine."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from raypaged.engine.async_llm_engine import AsyncLLMEngine
from raypaged.engine.llm_engine import LLMEngine
from raypaged.sampling_params import SamplingParams, StructuredOutputsParams
from tests.serving.conftest import tiny_config

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_engine(tiny_model_dir):
    return LLMEngine(tiny_config(tiny_model_dir, "tiny"))


def test_a_cancel_while_the_engine_adds_the_request_aborts_it(llm_engine, monkeypatch):
    inside_add = threading.Event()
    release_add = threading.Event()
    real_add = llm_engine.add_processed

    def slow_add(*args, **kwargs):
        result = real_add(*args, **kwargs)
        inside_add.set()
        release_add.wait(10)  # the request is in the scheduler; the caller is cancelled now
        return result

    monkeypatch.setattr(llm_engine, "add_processed", slow_add)

    async def scenario() -> dict:
        engine = AsyncLLMEngine(llm_engine)
        try:
            task = asyncio.ensure_future(engine.add_request("cancel me", LONG, request_id="r1"))
            await asyncio.get_running_loop().run_in_executor(None, inside_add.wait, 10)
            task.cancel()
            await asyncio.sleep(0)
            release_add.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await engine.abort(["unrelated"]) == 0  # commands run in order: the add and its abort ran
            assert not llm_engine.has_unfinished_requests()
            return engine.stats()
        finally:
            engine.shutdown()

    stats = asyncio.run(scenario())
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]


class _FailingObserver:
    def on_outputs(self, outputs, arrival_times, now) -> None:
        raise ValueError("Counters can only be incremented by non-negative amounts.")

    def on_abort(self, request_ids) -> None:
        raise KeyError("observer fault")


def test_a_failing_observer_never_stops_the_engine(tiny_model_dir):
    reference = LLMEngine(tiny_config(tiny_model_dir, "tiny"))

    async def scenario() -> list[list[int]]:
        engine = AsyncLLMEngine(reference, observer=_FailingObserver())
        try:
            texts = []
            for prompt in ("one", "two"):
                async for output in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=5)):
                    last = output
                texts.append(last.outputs[0].token_ids)
            await engine.add_request("aborted", LONG, request_id="gone")
            assert await engine.abort(["gone"]) == 1
            assert engine.is_running
            return texts
        finally:
            engine.shutdown()

    tokens = asyncio.run(scenario())
    assert [len(t) for t in tokens] == [5, 5]


def test_a_reused_id_never_gets_the_old_requests_outputs(tiny_model_dir):
    reference = LLMEngine(tiny_config(tiny_model_dir, "tiny"))
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def scenario() -> tuple[list[int], list[int]]:
        engine = AsyncLLMEngine(reference)
        try:
            await engine.add_request("first request", LONG, request_id="same")
            first = engine.stream("same")
            await first.__anext__()  # it runs
            await first.aclose()  # leaving early aborts it; its late outputs may still be on their way
            outputs = [o async for o in engine.generate("second request", short, request_id="same")]
            alone = [o async for o in engine.generate("second request", short, request_id="other")]
            return outputs[-1].outputs[0].token_ids, alone[-1].outputs[0].token_ids
        finally:
            engine.shutdown()

    reused, alone = asyncio.run(scenario())
    assert reused == alone and len(reused) == 4


def test_an_embedding_aborted_before_it_finishes_raises_aborted(tmp_path, smollm2_dir):
    """``encode`` of a request an ``abort`` ends first raises ``RequestAbortedError`` (the gRPC Embed's CANCELLED),
    never a failure; the engine thread is held between the add and the abort so that no step runs in between."""
    from raypaged.engine.async_llm_engine import RequestAbortedError
    from raypaged.pooling_params import PoolingParams
    from tests.conftest import make_tiny_embedding_model

    engine_core = LLMEngine(tiny_config(make_tiny_embedding_model(tmp_path, smollm2_dir), "embed", device="cpu"))
    release = threading.Event()

    async def scenario() -> None:
        engine = AsyncLLMEngine(engine_core)
        try:
            held = asyncio.ensure_future(engine.call(lambda: release.wait(10)))
            encode = asyncio.ensure_future(engine.encode(None, PoolingParams(), "e1", [5, 6, 7]))
            await asyncio.sleep(0.05)  # the add is queued behind the held call
            aborted = asyncio.ensure_future(engine.abort(["e1"]))
            await asyncio.sleep(0.05)
            release.set()
            await held
            assert await aborted == 1
            with pytest.raises(RequestAbortedError, match="^request e1 was aborted before it finished$"):
                await encode
            done = await engine.encode(None, PoolingParams(), "e2", [5, 6, 7])
            assert done.pooled is not None and done.pooled.shape == (64,)
        finally:
            engine.shutdown()

    asyncio.run(scenario())


def test_grammars_waiting_to_compile_hold_no_thread_other_requests_need(tiny_model_dir, monkeypatch):
    """More requests with new grammars than the loop's executor has threads, the first compile held: text prompts
    and a request whose grammar is compiled already go on meanwhile, and every held request then completes."""
    engine_core = LLMEngine(tiny_config(tiny_model_dir, "tiny", max_num_seqs=64))
    grammars = engine_core.input_processor.grammars
    compiling, release = threading.Event(), threading.Event()
    real_grammar = grammars.build

    def held(params, *args):
        if params.spec.startswith("[0-9]"):
            compiling.set()
            release.wait(30)
        return real_grammar(params, *args)

    monkeypatch.setattr(grammars, "build", held)
    constrained = [
        SamplingParams(
            temperature=0, max_tokens=n + 1, structured_outputs=StructuredOutputsParams(regex=f"[0-9]{{{n}}}")
        )
        for n in range(1, min(32, (os.cpu_count() or 1) + 4) + 3)  # past the default executor's threads
    ]
    compiled = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))

    async def text(engine: AsyncLLMEngine, prompt: str, params: SamplingParams) -> str:
        outputs = [o async for o in engine.generate(prompt, params)]
        return outputs[-1].outputs[0].text

    async def scenario() -> tuple[list[str], list[str]]:
        engine = AsyncLLMEngine(engine_core)
        try:
            await text(engine, "warm", compiled)
            waiting = [asyncio.ensure_future(text(engine, f"digits {n}", p)) for n, p in enumerate(constrained)]
            await asyncio.get_running_loop().run_in_executor(None, compiling.wait, 10)
            await asyncio.sleep(0.2)  # every constrained request is in its executor's queue
            others = await asyncio.wait_for(
                asyncio.gather(
                    *(text(engine, f"a text prompt {i}", SamplingParams(max_tokens=3)) for i in range(8)),
                    text(engine, "again", compiled),
                ),
                timeout=30,
            )
            assert not any(task.done() for task in waiting)
            release.set()
            return others, await asyncio.wait_for(asyncio.gather(*waiting), timeout=60)
        finally:
            release.set()
            engine.shutdown()

    others, digits = asyncio.run(scenario())
    assert len(others) == 9 and others[-1].isalpha()
    assert [len(d) for d in digits] == list(range(1, len(constrained) + 1)) and all(d.isdigit() for d in digits)

"""The engine process's link (``raypaged serve``'s default) answers exactly as the in-process link.

One engine server in this process and one in a child process (``EngineProcess``), both with API keys,
each behind a gateway: every request of ``test_inprocess.CASES``, good or bad, streamed or not, gets the
same status and body from both (ids and timestamps aside). Then what only a second process can do:
a child that stops answering, one that dies, one that cannot start.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import grpc
import httpx
import pytest

from raypaged.serving import messages
from raypaged.serving.engine_process import EngineProcess, EngineProcessLost, ProcessStub
from raypaged.serving.gateway.tenants import Tenants
from raypaged.serving.inprocess import InProcessStub
from raypaged.serving.launch import Gateway, GatewayOptions
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc
from tests.serving.conftest import Stack, tiny_config
from tests.serving.test_inprocess import CASES, KEY, METADATA, _request, _stream, as_values, comparable, not_plain

LOST = "the engine process has exited (exit code -9)"


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack([tiny_config(tiny_model_dir, "tiny")], api_key=KEY)
    yield stack
    stack.close()


async def start_engine(tiny_model_dir, *configs) -> EngineProcess:
    engine = EngineProcess()
    configs = configs or (tiny_config(tiny_model_dir, "tiny"),)
    await engine.start((list(configs), Tenants.from_args(KEY, None)), "127.0.0.1", 0)
    return engine


@pytest.fixture(scope="module")
def engine(stack, tiny_model_dir):
    engine = stack.background.run(start_engine(tiny_model_dir))
    child = engine._process
    yield engine
    stack.background.run(engine.stop())
    assert child is not None and child.returncode == 0  # closing the link stops the child, cleanly


@pytest.fixture(scope="module")
def process_url(stack, engine):
    address = f"127.0.0.1:{engine.grpc_port}"
    options = GatewayOptions(port=0, log_level="warning", api_key=KEY)
    gateway = Gateway({"tiny": address}, options, {address: ProcessStub(engine)})
    serving = asyncio.run_coroutine_threadsafe(gateway.serve(), stack.background.loop)
    while not gateway.server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{gateway.port}"
    stack.background.loop.call_soon_threadsafe(gateway.stop)
    serving.result(timeout=30)


@pytest.mark.parametrize("path, body, headers", CASES, ids=[f"{i}{c[0]}" for i, c in enumerate(CASES)])
def test_the_process_link_answers_as_the_in_process_link(stack, process_url, path, body, headers):
    with stack.client() as local, httpx.Client(base_url=process_url, timeout=120) as linked:
        a = local.post(path, json=body, headers=headers)
        b = linked.post(path, json=body, headers=headers)
    assert a.status_code == b.status_code, (a.text, b.text)
    assert comparable(a.text) == comparable(b.text)


def test_the_stream_crosses_as_plain_objects_equal_to_the_grpc_streams_messages(stack, engine):
    """The child's handler builds both streams (its gRPC server's and the link's) from one engine."""
    request = _request(request_id="same", logprobs=2, prompt_logprobs=1, echo=True)

    async def both() -> tuple[list, list]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{engine.grpc_port}") as channel:
            remote = pb_grpc.TextGenerationServiceStub(channel)
            return await _stream(ProcessStub(engine), request), await _stream(remote, request)

    linked, protos = stack.background.run(both())
    assert [type(r) for r in linked] == [messages.GenerateResponse] * len(linked)
    assert [bad for r in linked for bad in not_plain(r)] == []
    assert [as_values(r) for r in linked] == [as_values(r) for r in protos]
    assert linked[-1].finished and [len(d.token_ids) for d in linked[-1].outputs] == [1, 1]


def test_an_abort_and_a_cancel_cross_the_link(stack, engine):
    stub = ProcessStub(engine)

    async def running() -> float:
        text = (await stub.Metrics(pb.MetricsRequest(), metadata=METADATA)).prometheus_text
        return float(re.search(r"^raypaged:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))

    async def abort_then_cancel() -> tuple[list, float]:
        call = stub.Generate(_request(request_id="to-abort", stopping={"max_tokens": 200}), metadata=METADATA)
        responses = [await call.read(), await call.read()]
        aborted = await stub.Abort(pb.AbortRequest(request_ids=["to-abort"]), metadata=METADATA)
        assert aborted.num_aborted == 1
        while (response := await call.read()) is not grpc.aio.EOF:
            responses.append(response)
        cancelled = stub.Generate(_request(stopping={"max_tokens": 200}), metadata=METADATA)
        await cancelled.read()
        await cancelled.read()
        assert await running() == 2  # its two sequences (n=2)
        assert cancelled.cancel() and not cancelled.cancel()  # the first cancel goes to the child, once
        for _ in range(100):
            if (left := await running()) == 0:
                break
            await asyncio.sleep(0.02)
        return responses, left

    responses, left = stack.background.run(abort_then_cancel())
    last = responses[-1]
    assert last.finished and [d.finish_reason for d in last.outputs] == [pb.FINISH_REASON_ABORT] * 2
    assert left == 0  # the cancelled call's request left the engine's batch


def test_a_handlers_refusal_crosses_with_its_code_details_and_trailing_metadata(stack, engine):
    wrong = (("authorization", "Bearer wrong"),)
    request = pb.TokenizeRequest(model="tiny", text="hi")

    async def refusals() -> list[tuple]:
        found = []
        for stub in (InProcessStub(stack.engine_server.servicer), ProcessStub(engine)):
            try:
                await stub.Tokenize(request, metadata=wrong)
            except grpc.aio.AioRpcError as exc:
                found.append((exc.code(), exc.details(), tuple(exc.trailing_metadata())))
            call = stub.Generate(_request(), metadata=wrong)
            try:
                await call.read()
            except grpc.aio.AioRpcError as exc:
                found.append((exc.code(), exc.details(), tuple(exc.trailing_metadata())))
        return found

    local_unary, local_stream, linked_unary, linked_stream = stack.background.run(refusals())
    assert local_unary == linked_unary and local_stream == linked_stream
    assert linked_unary[0] == linked_stream[0] == grpc.StatusCode.UNAUTHENTICATED


def test_a_child_that_stops_answering_fails_calls_at_their_deadline_and_health_says_so(stack, engine, process_url):
    stub = ProcessStub(engine)
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as stalled:
            stack.background.run(stub.Health(pb.HealthRequest(), timeout=0.2))
        health = httpx.get(f"{process_url}/health", timeout=30)
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    assert (stalled.value.code(), stalled.value.details()) == (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert health.status_code == 503
    assert health.json()["error"]["message"] == f"engine 127.0.0.1:{engine.grpc_port} unreachable: DEADLINE_EXCEEDED"
    answered = stack.background.run(stub.Health(pb.HealthRequest(), timeout=30))
    assert answered.status == pb.SERVING_STATUS_SERVING  # and the late answer to the stalled call was dropped


def test_a_killed_child_fails_every_open_call_and_each_later_one_unavailable(stack, tiny_model_dir):
    engine = stack.background.run(start_engine(tiny_model_dir))
    lost: list[str] = []
    engine.on_lost = lost.append
    stub = ProcessStub(engine)

    async def killed() -> list[tuple]:
        call = stub.Generate(_request(stopping={"max_tokens": 200}), metadata=METADATA)
        await call.read()
        os.kill(engine.pid, signal.SIGKILL)
        failures = []
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as exc:
            failures.append((exc.code(), exc.details()))
        for later in (stub.Health(pb.HealthRequest(), timeout=5), _stream(stub, _request())):
            try:
                await later
            except grpc.aio.AioRpcError as exc:
                failures.append((exc.code(), exc.details()))
        return failures

    try:
        failures = stack.background.run(killed())
    finally:
        stack.background.run(engine.stop())
    assert failures == [(grpc.StatusCode.UNAVAILABLE, LOST)] * 3
    assert lost == [LOST] and engine.lost == LOST


def test_a_child_that_cannot_start_raises_its_error_in_the_parent(stack, tiny_model_dir):
    twice = (tiny_config(tiny_model_dir, "same"), tiny_config(tiny_model_dir, "same"))
    with pytest.raises(ValueError, match=r"^served model names must be distinct, got \['same', 'same'\]$"):
        stack.background.run(start_engine(tiny_model_dir, *twice))


def test_a_child_that_dies_while_starting_is_reported_with_its_exit_code(stack):
    engine = EngineProcess()
    engine.launch()
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(EngineProcessLost, match=r"^the engine process exited while starting \(exit code -9\)$"):
        stack.background.run(engine.start(([],), "127.0.0.1", 0))


def test_embed_crosses_the_link_as_in_process(stack, tmp_path, smollm2_dir):
    """``raypaged serve``'s default link carries ``Embed`` too: the child's vector equals the in-process
    engine's, and its refusal crosses with its code and field."""
    from raypaged.engine.llm_engine import LLMEngine
    from raypaged.pooling_params import PoolingParams
    from tests.conftest import make_tiny_embedding_model

    path = make_tiny_embedding_model(tmp_path, smollm2_dir)
    prompt = list(range(100, 137))
    expected = LLMEngine(tiny_config(path, "embed", device="cpu"))
    expected.add_pooling_request(None, PoolingParams(), "local", prompt)
    while not (done := [o for o in expected.step() if o.finished]):
        pass
    vector = done[0].pooled.tolist()

    async def linked() -> tuple[pb.EmbedResponse, tuple]:
        engine = await start_engine(None, tiny_config(path, "embed", device="cpu"))
        try:
            stub = ProcessStub(engine)
            answer = await stub.Embed(
                pb.EmbedRequest(model="embed", request_id="p-1", token_ids=pb.TokenIds(ids=prompt)), metadata=METADATA
            )
            try:
                await stub.Embed(pb.EmbedRequest(model="embed", text="hi", dimensions=8), metadata=METADATA)
            except grpc.aio.AioRpcError as exc:
                return answer, (exc.code(), exc.details(), tuple(exc.trailing_metadata()))
            raise AssertionError("dimensions on a model that is not matryoshka was taken")
        finally:
            await engine.stop()

    answer, refusal = stack.background.run(linked())
    assert (answer.request_id, answer.prompt_tokens) == ("p-1", 37)
    assert max(abs(a - b) for a, b in zip(answer.embedding, vector, strict=True)) < 1e-6
    assert refusal[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert refusal[1].startswith("Model does not support matryoshka representation")
    assert ("raypaged-param", "dimensions") in refusal[2]

"""The gRPC engine server holds direct clients to what HTTP holds them to: keys, tenant limits, input bounds."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from raypaged.engine.async_llm_engine import RequestFailedError
from raypaged.entrypoints.cli import build_parser, main
from raypaged.serving.engine_server import EngineServer
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.tenants import Tenant, TenantGate, Tenants, load_tenants
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc
from tests.serving.conftest import BackgroundLoop, tiny_config

A, B, Q = "sk-a", "sk-b", "sk-q"
MISSING = "Missing API key; send it as 'Authorization: Bearer KEY'"
INCORRECT = "Incorrect API key provided; send it as 'Authorization: Bearer KEY'"
GREEDY = dict(
    sampling=pb.SamplingParameters(temperature=0), stopping=pb.StoppingCriteria(max_tokens=8, ignore_eos=True)
)
LONG = dict(
    sampling=pb.SamplingParameters(temperature=0), stopping=pb.StoppingCriteria(max_tokens=200, ignore_eos=True)
)


def key(api_key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {api_key}"),)


class Server:
    """An engine server with tenants ``a``, ``b`` and ``q`` (one request at a time, no queue)."""

    def __init__(self, configs) -> None:
        self.background = BackgroundLoop()
        tenants = Tenants(
            [
                Tenant("a", api_keys=(A,)),
                Tenant("b", api_keys=(B,), priority=5),
                Tenant("q", api_keys=(Q,), max_concurrent_requests=1, max_queued_requests=0),
            ]
        )
        self.engine_server = EngineServer(configs, tenants=tenants)
        port = self.background.run(self.engine_server.start("127.0.0.1", 0))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.TextGenerationServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.background.run(self.engine_server.stop())
        self.background.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir):  # priority scheduling: a request's own priority counts
    server = Server([tiny_config(tiny_model_dir, "tiny", scheduling_policy="priority")])
    yield server
    server.close()


def tokens(responses) -> tuple[list[int], int]:
    """A finished stream's token ids and the finish reason of its one completion."""
    ids, reason = [], None
    for response in responses:
        for delta in response.outputs:
            ids.extend(delta.token_ids)
            reason = delta.finish_reason or reason
    return ids, reason


def assert_refused(call, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
    """``call()`` fails with this status, message and trailing ``raypaged-param``."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert (error.code(), error.details()) == (code, message)
    assert dict(error.trailing_metadata() or ()).get("raypaged-param") == param


def test_missing_or_wrong_key_is_unauthenticated_on_every_call_but_health_info_metrics(server):
    stub = server.stub
    calls = {
        "Generate": lambda md: list(stub.Generate(pb.GenerateRequest(text="hi", **GREEDY), metadata=md)),
        "Abort": lambda md: stub.Abort(pb.AbortRequest(request_ids=["x"]), metadata=md),
        "Tokenize": lambda md: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=md),
        "Detokenize": lambda md: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1]), metadata=md),
    }
    for _name, call in calls.items():
        assert_refused(lambda call=call: call(()), grpc.StatusCode.UNAUTHENTICATED, MISSING)
        assert_refused(lambda call=call: call(key("sk-wrong")), grpc.StatusCode.UNAUTHENTICATED, INCORRECT)
        assert_refused(lambda call=call: call((("authorization", A),)), grpc.StatusCode.UNAUTHENTICATED, INCORRECT)
    assert stub.Health(pb.HealthRequest()).status == pb.SERVING_STATUS_SERVING
    assert [m.name for m in stub.Info(pb.InfoRequest()).models] == ["tiny"]
    assert "raypaged:" in stub.Metrics(pb.MetricsRequest()).prometheus_text


def test_a_right_key_generates_and_the_users_id_comes_back(server):
    responses = list(
        server.stub.Generate(pb.GenerateRequest(request_id="mine", text="Hello", **GREEDY), metadata=key(A))
    )
    assert {r.request_id for r in responses} == {"mine"}
    ids, reason = tokens(responses)
    assert (len(ids), reason) == (8, pb.FINISH_REASON_LENGTH)
    unnamed = list(server.stub.Generate(pb.GenerateRequest(text="Hello", **GREEDY), metadata=key(A)))
    assert len(unnamed[0].request_id) == 32 and {r.request_id for r in unnamed} == {unnamed[0].request_id}


def test_the_same_id_in_two_tenants_runs_twice_and_each_aborts_only_its_own(server):
    stub = server.stub
    of_a = stub.Generate(pb.GenerateRequest(request_id="shared", text="Hello", **LONG), metadata=key(A))
    of_b = stub.Generate(pb.GenerateRequest(request_id="shared", text="Hello", **LONG), metadata=key(B))
    assert next(of_a).request_id == next(of_b).request_id == "shared"  # both accepted
    assert stub.Abort(pb.AbortRequest(request_ids=["shared"]), metadata=key(Q)).num_aborted == 0
    assert stub.Abort(pb.AbortRequest(request_ids=["shared"]), metadata=key(A)).num_aborted == 1
    assert tokens(of_a)[1] == pb.FINISH_REASON_ABORT
    ids, reason = tokens(of_b)
    assert (len(ids), reason) == (200, pb.FINISH_REASON_LENGTH)


def test_an_in_flight_duplicate_id_of_one_tenant_is_invalid(server):
    first = server.stub.Generate(pb.GenerateRequest(request_id="dup", text="Hello", **LONG), metadata=key(A))
    assert next(first).request_id == "dup"
    again = pb.GenerateRequest(request_id="dup", text="Hello", **GREEDY)
    assert_refused(
        lambda: list(server.stub.Generate(again, metadata=key(A))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "request_id 'dup' is already in use",
        "request_id",
    )
    assert server.stub.Abort(pb.AbortRequest(request_ids=["dup"]), metadata=key(A)).num_aborted == 1
    assert tokens(first)[1] == pb.FINISH_REASON_ABORT
    ids, reason = tokens(server.stub.Generate(again, metadata=key(A)))  # free once its call has ended
    assert (len(ids), reason) == (8, pb.FINISH_REASON_LENGTH)


@pytest.mark.parametrize("priority", [-1, 1_000_001])
def test_priority_outside_the_tenants_range_is_invalid_and_names_the_field(server, priority):
    request = pb.GenerateRequest(text="Hello", priority=priority, **GREEDY)
    assert_refused(
        lambda: list(server.stub.Generate(request, metadata=key(B))),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"priority {priority} is outside [0, 1000000], the range of tenant b: a request may only lower its "
        "priority (min_request_priority and max_request_priority of a tenant in --tenants set the range)",
        "priority",
    )


def test_the_engine_gets_the_tenants_priority_plus_the_requests_and_its_name_as_cache_salt(server, monkeypatch):
    engine = server.engine_server.models["tiny"].engine
    seen = []

    async def add_request(prompt, params, request_id, token_ids, priority, cache_salt, **more):
        seen.append((request_id, priority, cache_salt, more))
        return await original(prompt, params, request_id, token_ids, priority, cache_salt, **more)

    original = engine.add_request
    monkeypatch.setattr(engine, "add_request", add_request)
    list(server.stub.Generate(pb.GenerateRequest(request_id="p", text="Hello", priority=3, **GREEDY), metadata=key(B)))
    more = {"lora_request": None, "beam": None, "multi_modal": None, "prompt_embeds": None, "owner": None}
    assert seen == [("b/p", 8, "b", more)]
    part = pb.GenerateRequest(request_id="q", parent_request_id="batch", text="Hello", **GREEDY)
    list(server.stub.Generate(part, metadata=key(B)))
    assert seen[1] == ("b/q", 5, "b", more | {"owner": "b/batch"})  # the client request's id, in its tenant


def test_a_request_the_engine_failed_alone_ends_internal_with_its_message(server, monkeypatch):
    engine = server.engine_server.models["tiny"].engine
    original = engine.stream

    async def failing(request_id):
        outputs = original(request_id)
        yield await anext(outputs)
        await outputs.aclose()  # the engine aborts the rest, as when it ends a request itself
        raise RequestFailedError("sampling request a/f failed: probabilities are NaN")

    monkeypatch.setattr(engine, "stream", failing)
    call = server.stub.Generate(pb.GenerateRequest(request_id="f", text="Hello", **GREEDY), metadata=key(A))
    assert_refused(lambda: list(call), grpc.StatusCode.INTERNAL, "sampling request a/f failed: probabilities are NaN")
    monkeypatch.undo()
    ids, _ = tokens(server.stub.Generate(pb.GenerateRequest(request_id="f", text="Hello", **GREEDY), metadata=key(A)))
    assert len(ids) == 8  # its id and slot are free again


def test_a_huge_text_prompt_is_refused_at_once_and_the_server_goes_on(server):
    request = pb.GenerateRequest(text="Hello", **GREEDY)
    before, _ = tokens(server.stub.Generate(request, metadata=key(A)))
    huge = pb.GenerateRequest(text="x" * 4_000_000, **GREEDY)
    start = time.monotonic()
    assert_refused(
        lambda: list(server.stub.Generate(huge, metadata=key(A))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt has 4000000 characters, more than the limit of 8192 (--max-prompt-chars) before tokenization",
        "prompt",
    )
    assert time.monotonic() - start < 1.0
    after, _ = tokens(server.stub.Generate(request, metadata=key(A)))
    assert after == before and len(after) == 8


def test_prompt_ids_and_conversations_are_bounded_before_they_are_copied_or_rendered(server):
    def generate(request, metadata):
        return list(server.stub.Generate(request, metadata=metadata))

    ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 256), **GREEDY)
    assert_refused(
        lambda: generate(ids, metadata=key(A)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt has 256 tokens, which leaves no room to generate within max_model_len 256 (--max-model-len)",
        "prompt",
    )
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")] * 1025)
    assert_refused(
        lambda: generate(pb.GenerateRequest(messages=chat, **GREEDY), metadata=key(A)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages has 1025 messages, more than the limit of 1024 (--max-chat-messages)",
        "messages",
    )
    long_turn = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x" * 8189)])
    assert_refused(
        lambda: generate(pb.GenerateRequest(messages=long_turn, **GREEDY), metadata=key(A)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages has 8193 characters, more than the limit of 8192 (--max-prompt-chars) before tokenization",
        "messages",
    )


def test_tokenize_and_detokenize_are_bounded(server):
    stub = server.stub
    assert list(stub.Tokenize(pb.TokenizeRequest(text="Hello world"), metadata=key(A)).token_ids) == [19556, 905]
    assert_refused(
        lambda: stub.Tokenize(pb.TokenizeRequest(text="x" * 8193), metadata=key(A)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt has 8193 characters, more than the limit of 8192 (--max-prompt-chars) before tokenization",
        "prompt",
    )
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")] * 1025)
    assert_refused(
        lambda: stub.Tokenize(pb.TokenizeRequest(messages=chat), metadata=key(A)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages has 1025 messages, more than the limit of 1024 (--max-chat-messages)",
        "messages",
    )
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=[19556, 905]), metadata=key(A)).text == "Hello world"
    assert_refused(
        lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1] * 257), metadata=key(A)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tokens has 257 ids, more than the limit of 256 (--max-model-len)",
        "tokens",
    )
    assert_refused(
        lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 49152]), metadata=key(A)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tokens must be token ids in [0, 49152), got 49152",
        "tokens",
    )


def test_a_tenant_over_its_queue_limit_is_resource_exhausted(server):
    running = server.stub.Generate(pb.GenerateRequest(text="Hello", **LONG), metadata=key(Q))
    assert next(running).request_id
    second = pb.GenerateRequest(text="Hello", **GREEDY)
    assert_refused(
        lambda: list(server.stub.Generate(second, metadata=key(Q))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "tenant q has 1 requests running and 0 queued, its limits; retry later",
    )
    ids, _ = tokens(server.stub.Generate(pb.GenerateRequest(text="Hello", **GREEDY), metadata=key(A)))  # others run
    assert len(ids) == 8
    ids, reason = tokens(running)
    assert (len(ids), reason) == (200, pb.FINISH_REASON_LENGTH)
    ids, _ = tokens(server.stub.Generate(pb.GenerateRequest(text="Hello", **GREEDY), metadata=key(Q)))  # slot freed
    assert len(ids) == 8


# ---- the gate itself -----------------------------------------------------------------------------------------


def test_a_request_of_k_prompts_holds_k_slots_and_more_than_the_limit_is_refused_at_once():
    async def scenario() -> list[str]:
        gate = TenantGate(Tenant("t", max_concurrent_requests=3, max_queued_requests=1))
        with pytest.raises(APIError) as info:
            await gate.admit(4)
        assert (info.value.status, info.value.message) == (
            429,
            "the request has 4 prompts, more than tenant t's max_concurrent_requests 3; send at most 3 at once",
        )
        events = []
        await gate.admit(2)
        waiting = asyncio.ensure_future(gate.admit(2))
        await asyncio.sleep(0)
        assert gate.num_queued == 1 and not waiting.done()
        with pytest.raises(APIError):  # the queue (one request) is full, though one slot is free
            await gate.admit(1)
        gate.release(1)
        await waiting
        events.append("two admitted")
        gate.release(1)
        gate.release(2)
        await gate.admit(3)
        events.append("three admitted")
        return events

    assert asyncio.run(scenario()) == ["two admitted", "three admitted"]


def test_a_cancelled_waiter_leaves_the_queue_and_wakes_the_next():
    async def scenario() -> None:
        gate = TenantGate(Tenant("t", max_concurrent_requests=2, max_queued_requests=2))
        await gate.admit(1)
        big = asyncio.ensure_future(gate.admit(2))
        small = asyncio.ensure_future(gate.admit(1))
        await asyncio.sleep(0)
        assert gate.num_queued == 2 and not small.done()  # no overtaking the request ahead
        big.cancel()
        await asyncio.sleep(0)
        await small
        assert gate.num_queued == 0

    asyncio.run(scenario())


def test_tenants_file_priority_range(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(
        "tenants:\n  - name: t\n    api_keys: [k]\n    min_request_priority: -5\n    max_request_priority: 7\n"
    )
    (tenant,) = load_tenants(path)
    assert (tenant.min_request_priority, tenant.max_request_priority, tenant.engine_priority(-5)) == (-5, 7, -5)
    path.write_text("tenants:\n  - name: t\n    max_request_priority: -1\n")
    with pytest.raises(ValueError, match="tenant t: min_request_priority must not exceed max_request_priority"):
        load_tenants(path)
    with pytest.raises(ValueError, match="tenant name 'a/b' must be non-empty and without '/'"):
        Tenant("a/b")
    # without a tenants file (open, or one --api-key), any int32 priority, as vLLM's
    assert Tenants([]).tenant_for(None).tenant.engine_priority(-(2**31)) == -(2**31)
    assert Tenants.from_args("k", None).tenant_for("Bearer k").tenant.engine_priority(-5) == -5
    with pytest.raises(ValueError, match=r"^priority 2147483648 is outside \[-2147483648, 2147483647\], the range"):
        Tenants([]).tenant_for(None).tenant.engine_priority(2**31)


def test_engine_flags_for_keys_tenants_and_prefix_cache_sharing(tmp_path, capsys):
    parser = build_parser()
    args = parser.parse_args(["engine", "--api-key", A, "--tenants", "t.yaml", "--share-prefix-cache"])
    assert (args.api_key, args.tenants, args.share_prefix_cache) == ([A], "t.yaml", True)
    assert parser.parse_args(["serve"]).share_prefix_cache is False
    bad = tmp_path / "tenants.yaml"
    bad.write_text("tenants:\n  - name: t\n    max_request_priority: -1\n")
    assert main(["engine", "--tenants", str(bad)]) == 2  # before any model loads
    assert capsys.readouterr().err.strip() == (
        "error: tenant t: min_request_priority must not exceed max_request_priority"
    )

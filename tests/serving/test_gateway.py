"""The gateway and engine server on two tiny random models: routing, errors, tenants, aborts, metrics."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raypaged import LLM, SamplingParams
from raypaged.serving.launch import Gateway, GatewayOptions, listen
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc
from tests.serving.conftest import Stack, tiny_config

FLOOD, CALM = "sk-flood", "sk-calm"
TENANTS = """
tenants:
  - name: flood
    api_keys: [sk-flood]
    max_concurrent_requests: 1
    max_queued_requests: 1
  - name: calm
    api_keys: [sk-calm]
    priority: -1
"""
LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}
CALM_KEY = (("authorization", f"Bearer {CALM}"),)  # gRPC metadata: the engine server checks the same keys


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tiny_qwen_dir, tmp_path_factory):
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tenants.write_text(TENANTS)
    configs = [tiny_config(tiny_model_dir, "tiny"), tiny_config(tiny_qwen_dir, "tiny-qwen", num_gpu_blocks_override=20)]
    stack = Stack(configs, tenants_file=str(tenants), max_body_bytes=4096)
    yield stack
    stack.close()


@pytest.fixture
def client(stack):
    with stack.client(headers={"Authorization": f"Bearer {CALM}"}) as client:
        yield client


def engine_stats(stack: Stack, model: str) -> dict[str, float]:
    response = stack.grpc_stub().Metrics(pb.MetricsRequest())
    return dict(next(m for m in response.models if m.name == model).stats)


def wait_all_blocks_free(stack: Stack, model: str, within_s: float) -> dict[str, float]:
    deadline = time.monotonic() + within_s
    while True:
        stats = engine_stats(stack, model)
        if stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"] and stats["num_requests_running"] == 0:
            return stats
        assert time.monotonic() < deadline, f"blocks still held after {within_s}s: {stats}"
        time.sleep(0.02)


def assert_error(response, status: int, error_type: str, code: str | None, message_part: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == error_type and body["error"]["code"] == code
    assert message_part in body["error"]["message"], body["error"]["message"]


def test_two_models_answer_under_their_own_names_and_match_llm_generate(stack, client, tiny_model_dir):
    listed = client.get("/v1/models").json()
    assert [(m["id"], m["max_model_len"]) for m in listed["data"]] == [("tiny", 256), ("tiny-qwen", 256)]
    texts = {}
    for name in ("tiny", "tiny-qwen"):
        body = client.post(
            "/v1/completions",
            json={"model": name, "prompt": "Hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        ).json()
        assert body["model"] == name and body["object"] == "text_completion"
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
        texts[name] = body["choices"][0]["text"]
    assert texts["tiny"] != texts["tiny-qwen"]
    offline = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=64, max_model_len=256)
    expected = offline.generate("Hello there", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert texts["tiny"] == expected[0].outputs[0].text


def test_every_error_has_its_status_and_openai_shape(stack, client):
    completions = "/v1/completions"
    assert_error(
        client.post(completions, json={"model": "tiny", "prompt": "x", "temperature": -1}),
        400,
        "invalid_request_error",
        None,
        "temperature must be non-negative, got -1.0",
    )
    assert_error(
        client.post(completions, json={"model": "tiny", "prompt": [5] * 300}),
        400,
        "invalid_request_error",
        None,
        "prompt has 300 tokens",
    )
    assert "max_model_len 256" in client.post(completions, json={"model": "tiny", "prompt": [5] * 300}).text
    assert_error(
        client.post(completions, content=b"{not json", headers={"Content-Type": "application/json"}),
        400,
        "invalid_request_error",
        None,
        "not valid JSON",
    )
    assert_error(client.post(completions, json={"model": "tiny"}), 400, "invalid_request_error", None, "prompt")
    assert_error(
        client.post(completions, json={"model": "tiny", "prompt": "x", "n": 0}),
        400,
        "invalid_request_error",
        None,
        "n:",
    )
    assert_error(
        client.post(completions, json={"prompt": "x"}), 400, "invalid_request_error", None, "model is required"
    )
    assert_error(
        client.post(completions, json={"model": "gpt-9", "prompt": "x"}),
        404,
        "invalid_request_error",
        "model_not_found",
        "The model `gpt-9` does not exist.",
    )
    assert_error(
        client.post(completions, json={"model": "tiny", "prompt": "x" * 5000}),
        413,
        "invalid_request_error",
        "request_too_large",
        "exceeds the limit of 4096 bytes",
    )
    with stack.client() as anonymous:
        assert_error(
            anonymous.post(completions, json={"model": "tiny", "prompt": "x"}),
            401,
            "invalid_request_error",
            "invalid_api_key",
            "Missing API key",
        )
        wrong = anonymous.post(
            completions, json={"model": "tiny", "prompt": "x"}, headers={"Authorization": "Bearer no"}
        )
        assert_error(wrong, 401, "invalid_request_error", "invalid_api_key", "Incorrect API key")
        assert anonymous.get("/health").status_code == 200


def test_unreachable_engine_is_503(stack):
    ghost = listen("127.0.0.1", 0)
    port = ghost.getsockname()[1]
    ghost.close()  # nothing listens there now
    gateway = Gateway({"ghost": f"127.0.0.1:{port}"}, GatewayOptions(port=0, log_level="warning"))
    future = asyncio.run_coroutine_threadsafe(gateway.serve(), stack.background.loop)
    try:
        while not gateway.server.started:
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=30) as client:
            assert_error(client.get("/health"), 503, "server_error", "engine_unavailable", "unreachable")
            assert_error(
                client.post("/v1/completions", json={"prompt": "x"}),
                503,
                "server_error",
                "engine_unavailable",
                "the engine is unavailable",
            )
    finally:
        stack.background.loop.call_soon_threadsafe(gateway.stop)
        future.result(timeout=30)


def test_flooding_tenant_queues_behind_its_limit_and_cannot_starve_another(stack):
    body = {"model": "tiny", "prompt": "flood", "stream": True, **LONG, "max_tokens": 250}
    flood_gate = stack.gateway.tenants.tenant_for(f"Bearer {FLOOD}")
    with (
        stack.client(headers={"Authorization": f"Bearer {FLOOD}"}) as flood,
        stack.client(headers={"Authorization": f"Bearer {CALM}"}) as calm,
    ):
        with flood.stream("POST", "/v1/completions", json=body) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # running: the tenant's one slot is taken
            queued_done = threading.Event()
            queued = threading.Thread(
                target=lambda: (flood.post("/v1/completions", json={**body, "stream": False}), queued_done.set())
            )
            queued.start()
            deadline = time.monotonic() + 5
            while flood_gate.num_queued == 0:  # the second waits in the tenant's queue at the gateway
                assert time.monotonic() < deadline, "the second request was not queued"
                time.sleep(0.002)
            assert_error(
                flood.post("/v1/completions", json=body),
                429,
                "requests",
                "rate_limit_exceeded",
                "tenant flood has 1 requests running and 1 queued",
            )
            answer = calm.post("/v1/completions", json={"model": "tiny", "prompt": "calm", "max_tokens": 3})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
            assert not queued_done.is_set()
        queued.join(timeout=60)  # the first stream closed: the queued one ran
        assert queued_done.is_set()
    wait_all_blocks_free(stack, "tiny", within_s=5)


def test_grpc_client_streams_and_cancelling_frees_blocks(stack):
    stub = stack.grpc_stub()
    request = pb.GenerateRequest(
        model="tiny",
        text="stream me",
        sampling=pb.SamplingParameters(n=1, temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=200, ignore_eos=True),
    )
    call = stub.Generate(request, metadata=CALM_KEY)
    accepted = next(call)
    assert accepted.request_id and not accepted.outputs
    tokens = []
    for response in call:
        tokens.extend(response.outputs[0].token_ids)
        if len(tokens) >= 5:
            break
    assert engine_stats(stack, "tiny")["num_requests_running"] == 1
    call.cancel()
    stats = wait_all_blocks_free(stack, "tiny", within_s=1.0)
    assert stats["num_requests_waiting"] == 0


def test_abort_rpc_ends_the_stream_with_finish_reason_abort(stack):
    stub = stack.grpc_stub()
    call = stub.Generate(
        pb.GenerateRequest(
            model="tiny", request_id="to-abort", text="x", stopping=pb.StoppingCriteria(max_tokens=200, ignore_eos=True)
        ),
        metadata=CALM_KEY,
    )
    assert next(call).request_id == "to-abort"
    next(call)
    assert stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown"]), metadata=CALM_KEY).num_aborted == 1
    last = list(call)[-1]
    assert last.finished and [d.finish_reason for d in last.outputs] == [pb.FINISH_REASON_ABORT]
    wait_all_blocks_free(stack, "tiny", within_s=1.0)


def test_grpc_errors_use_status_codes(stack):
    stub = stack.grpc_stub()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(model="tiny", text="x")))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(model="nope", text="x"), metadata=CALM_KEY))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        list(
            stub.Generate(
                pb.GenerateRequest(model="tiny", text="x", sampling=pb.SamplingParameters(top_p=2)), metadata=CALM_KEY
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p must be in (0, 1]" in err.value.details()
    info = stub.Info(pb.InfoRequest())
    assert [(m.name, m.block_size, m.max_model_len, m.tensor_parallel_size, m.num_gpu_blocks) for m in info.models] == [
        ("tiny", 16, 256, 1, 64),
        ("tiny-qwen", 16, 256, 1, 20),
    ]
    assert stub.Health(pb.HealthRequest()).status == pb.SERVING_STATUS_SERVING


def test_http_client_disconnect_aborts_the_request(stack, client):
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "talk"}],
            "stream": True,
            **LONG,
        },
    ) as response:
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
        assert engine_stats(stack, "tiny")["num_requests_running"] == 1
    wait_all_blocks_free(stack, "tiny", within_s=1.0)


def test_request_heads_over_16_kib_are_refused_by_default(stack, client):
    # without --h11-max-incomplete-event-size a head may hold 16 KiB (h11's default), as before httptools
    assert client.get("/v1/models", headers={"X-Pad": "a" * 15_000}).status_code == 200
    with stack.client() as fresh:  # refused: a 400, sent while the client still writes, may arrive as a reset
        try:
            response = fresh.get("/v1/models", headers={"X-Pad": "a" * 17_000})
            status, text = response.status_code, response.text
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
            status, text = 400, "Invalid HTTP request received."
        assert (status, text) == (400, "Invalid HTTP request received.")
    assert client.get("/v1/models").status_code == 200  # the server serves on


def test_a_request_with_more_than_256_headers_is_refused_by_default(stack, client):
    few = {f"X-H{i}": "1" for i in range(240)}  # with httpx's own and the Authorization: under 256
    assert client.get("/v1/models", headers=few).status_code == 200
    many = {f"X-H{i}": "1" for i in range(257)}
    with stack.client() as fresh:
        try:
            response = fresh.get("/v1/models", headers=many)
            status, text = response.status_code, response.text
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
            status, text = 400, "Invalid HTTP request received."
    assert (status, text) == (400, "Invalid HTTP request received.")


def test_streams_end_with_done_and_usage_when_asked(client):
    response = client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 4,
            "ignore_eos": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        },
    )
    events = [line[len("data: ") :] for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    whole = client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "ignore_eos": True,
            "temperature": 0,
        },
    ).json()
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert whole["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"]


def test_tokenize_and_detokenize(client):
    tokens = client.post("/tokenize", json={"model": "tiny", "prompt": "Hello world"}).json()
    assert tokens == {"count": 2, "max_model_len": 256, "tokens": [19556, 905], "token_strs": None}
    strs = client.post("/tokenize", json={"model": "tiny", "prompt": "Hello world", "return_token_strs": True})
    assert strs.json()["token_strs"] == ["Hello", "Ġworld"]
    assert client.post("/detokenize", json={"model": "tiny", "tokens": [19556, 905]}).json() == {
        "prompt": "Hello world"
    }
    chat = client.post("/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 5
    refused = client.post("/detokenize", json={"model": "tiny", "tokens": [10**6]})
    assert_error(refused, 400, "invalid_request_error", None, "tokens must be token ids in [0, 49152), got 1000000")
    assert refused.json()["error"]["param"] == "tokens"


def test_tokenize_takes_vllms_chat_fields_and_refuses_them_with_a_prompt(client, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        ({}, {"add_generation_prompt": True}),
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
        ({"tools": [tool]}, {"add_generation_prompt": True, "tools": [tool]}),
    ]
    for fields, template_args in cases:
        got = client.post("/tokenize", json={"model": "tiny", "messages": messages, **fields}).json()
        expected = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **template_args)
        assert got["tokens"] == list(expected), fields
    bos = client.post("/tokenize", json={"model": "tiny", "messages": messages, "add_special_tokens": True})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert bos.json()["tokens"] == tokenizer(rendered, add_special_tokens=True)["input_ids"]  # (SmolLM2 adds none)
    own = client.post("/tokenize", json={"model": "tiny", "messages": messages, "chat_template": "{{ 1 }}"})
    assert own.status_code == 400 and "--trust-request-chat-template" in own.json()["error"]["message"]
    refused = client.post("/tokenize", json={"model": "tiny", "prompt": "Hi", "add_generation_prompt": False})
    assert_error(
        refused, 400, "invalid_request_error", None, "add_generation_prompt applies to messages, not to a prompt"
    )


def scrape(client) -> dict[tuple[str, tuple], float]:
    text = client.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_parse_and_move_under_load(stack, client):
    label = (("engine", "0"), ("model_name", "tiny-qwen"))
    before = scrape(client)
    body = {"model": "tiny-qwen", "prompt": [7] * 60, "max_tokens": 120, "ignore_eos": True, "stream": True}
    threads = [threading.Thread(target=lambda: client.post("/v1/completions", json=body)) for _ in range(3)]
    for thread in threads:
        thread.start()
    during = []
    while any(t.is_alive() for t in threads):
        during.append(scrape(client))
        time.sleep(0.05)
    after = scrape(client)

    def moved(name: str) -> float:
        return after[(name, label)] - before.get((name, label), 0.0)

    assert moved("raypaged:prompt_tokens_total") >= 180  # recomputed prompts count again
    assert moved("raypaged:generation_tokens_total") == 360
    assert moved("raypaged:num_preemptions_total") > 0  # 3 x 12 blocks do not fit in 20
    assert moved("raypaged:time_to_first_token_seconds_count") == 3
    assert moved("raypaged:e2e_request_latency_seconds_count") == 3
    assert moved("raypaged:inter_token_latency_seconds_count") >= 3 * 119
    assert ("raypaged:prefix_cache_hits_total", label) in after
    assert max(s[("raypaged:num_requests_running", label)] for s in during) >= 1
    assert max(s[("raypaged:num_requests_waiting", label)] for s in during) >= 1
    assert max(s[("raypaged:kv_cache_usage_perc", label)] for s in during) > 0.5
    assert after[("raypaged:kv_cache_usage_perc", label)] == 0
    assert after[("raypaged:num_requests_running", label)] == 0
    assert after[("raypaged:num_requests_swapped", label)] == 0
    assert after[("raypaged:gpu_memory_usage_bytes", label)] > 100e6
    assert max(s[("raypaged:gpu_utilization", label)] for s in during) > 0
    assert ("raypaged:num_requests_running", (("engine", "0"), ("model_name", "tiny"))) in after


def test_a_request_holds_one_tenant_slot_per_prompt(stack):
    with stack.client(headers={"Authorization": f"Bearer {FLOOD}"}) as flood:
        assert_error(
            flood.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2}),
            429,
            "requests",
            "rate_limit_exceeded",
            "the request has 2 prompts, more than tenant flood's max_concurrent_requests 1",
        )
        answer = flood.post("/v1/completions", json={"model": "tiny", "prompt": ["a"], "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


def test_one_failed_prompt_fails_the_whole_request_and_frees_the_others(stack, client):
    body = {"model": "tiny", "prompt": [[5] * 10, [5] * 300], **LONG}
    for stream in (False, True):
        response = client.post("/v1/completions", json={**body, "stream": stream})
        assert_error(response, 400, "invalid_request_error", None, "prompt has 300 tokens")
        assert response.json()["error"]["param"] == "prompt"
    wait_all_blocks_free(stack, "tiny", within_s=1.0)


def sse_chunks(response) -> list[dict]:
    events = [line[len("data: ") :] for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]", events
    return [json.loads(e) for e in events[:-1]]


def test_best_of_returns_the_best_of_its_samples_streamed_or_not(client):
    sampling = {
        "model": "tiny",
        "prompt": "Pick one",
        "max_tokens": 6,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 7,
    }
    samples = client.post("/v1/completions", json={**sampling, "n": 3, "logprobs": 0}).json()["choices"]
    assert len({c["text"] for c in samples}) == 3  # three different samples to choose from
    best = max(samples, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    whole = client.post("/v1/completions", json={**sampling, "best_of": 3}).json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [(0, best["text"], "length")]
    assert whole["usage"]["completion_tokens"] == 3 * 6  # every sampled token counts once
    chunks = sse_chunks(client.post("/v1/completions", json={**sampling, "best_of": 3, "stream": True}))
    assert {c["index"] for chunk in chunks for c in chunk["choices"]} == {0}
    assert "".join(c["choices"][0]["text"] for c in chunks) == best["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Pick"}],
        "max_tokens": 4,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 7,
    }
    chat_whole = client.post("/v1/chat/completions", json={**chat, "n": 2, "best_of": 4}).json()
    assert [c["index"] for c in chat_whole["choices"]] == [0, 1]
    chat_chunks = sse_chunks(client.post("/v1/chat/completions", json={**chat, "n": 2, "best_of": 4, "stream": True}))
    for index in (0, 1):
        text = "".join(
            c["choices"][0]["delta"].get("content", "") for c in chat_chunks if c["choices"][0]["index"] == index
        )
        assert text == chat_whole["choices"][index]["message"]["content"]


class FakeEngine(pb_grpc.TextGenerationServiceServicer):
    """An engine server that answers by prompt text and records what each call carried.

    ``ok``: two deltas, then finished. ``hang``: accepted, then waits until cancelled.
    ``refuse:CODE:message``: refused with that status before accepting (``INVALID_ARGUMENT``
    names the field ``stop``). ``fail:CODE:message``: one delta, then that status.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str], int]] = []  # (method, metadata, priority)
        self.num_cancelled = 0

    def _record(self, method: str, context, priority: int = 0) -> None:
        self.calls.append((method, dict(context.invocation_metadata()), priority))

    async def Generate(self, request, context):
        self._record("Generate", context, request.priority)
        verb, _, rest = request.text.partition(":")
        code, _, message = rest.partition(":")
        if verb == "refuse":
            if code == "INVALID_ARGUMENT":
                context.set_trailing_metadata((("raypaged-param", "stop"),))
            await context.abort(grpc.StatusCode[code], message)
        yield pb.GenerateResponse(request_id="fake")
        if verb == "hang":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.num_cancelled += 1
                raise
        yield pb.GenerateResponse(
            request_id="fake",
            outputs=[pb.CompletionDelta(index=0, token_ids=[1], text="a")],
            usage=pb.Usage(prompt_tokens=1, completion_tokens=1),
        )
        if verb == "fail":
            await context.abort(grpc.StatusCode[code], message)
        yield pb.GenerateResponse(
            request_id="fake",
            finished=True,
            usage=pb.Usage(prompt_tokens=1, completion_tokens=2),
            outputs=[pb.CompletionDelta(index=0, token_ids=[2], text="b", finish_reason=pb.FINISH_REASON_LENGTH)],
        )

    async def Tokenize(self, request, context):
        self._record("Tokenize", context)
        return pb.TokenizeResponse(token_ids=[1, 2], max_model_len=8)

    async def Detokenize(self, request, context):
        self._record("Detokenize", context)
        return pb.DetokenizeResponse(text="ab")


@pytest.fixture(scope="module")
def fake(stack):
    """A gateway (no keys) in front of a ``FakeEngine``, on the stack's loop: (engine, HTTP client)."""
    engine = FakeEngine()

    async def start():
        server = grpc.aio.server()
        pb_grpc.add_TextGenerationServiceServicer_to_server(engine, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = stack.background.run(start())
    gateway = Gateway({"fake": f"127.0.0.1:{port}"}, GatewayOptions(port=0, log_level="warning"))
    serving = asyncio.run_coroutine_threadsafe(gateway.serve(), stack.background.loop)
    while not gateway.server.started:
        time.sleep(0.02)
    with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=30) as client:
        yield engine, client
    stack.background.loop.call_soon_threadsafe(gateway.stop)
    serving.result(timeout=30)
    stack.background.run(server.stop(None))


def openai_error(message: str, error_type: str, code: str | None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@pytest.mark.parametrize(
    ("prompt", "status", "body"),
    [
        (
            "refuse:INVALID_ARGUMENT:stop has 70 stop strings",
            400,
            openai_error("stop has 70 stop strings", "invalid_request_error", None, "stop"),
        ),
        (
            "refuse:UNAUTHENTICATED:Missing API key",
            401,
            openai_error("Missing API key", "invalid_request_error", "invalid_api_key"),
        ),
        (
            "refuse:RESOURCE_EXHAUSTED:tenant t has 1 requests running",
            429,
            openai_error("tenant t has 1 requests running", "requests", "rate_limit_exceeded"),
        ),
        (
            "refuse:RESOURCE_EXHAUSTED:Received message larger than max (9 vs. 8)",
            413,
            openai_error(
                "the request is too large for the engine: Received message larger than max (9 vs. 8)",
                "invalid_request_error",
                "request_too_large",
            ),
        ),
        (
            "refuse:INTERNAL:the engine failed on request r1: step raised",
            500,
            openai_error("the engine failed on request r1: step raised", "server_error", "internal_error"),
        ),
        (
            "refuse:UNKNOWN:secret detail",
            500,
            openai_error("the engine failed on this request", "server_error", "internal_error"),
        ),
    ],
)
def test_engine_statuses_become_http_errors(fake, prompt, status, body):
    _, client = fake
    response = client.post("/v1/completions", json={"prompt": prompt})
    assert (response.status_code, response.json()) == (status, body)


def test_an_engine_error_mid_stream_is_one_error_event_then_done(fake):
    _, client = fake
    response = client.post("/v1/completions", json={"prompt": "fail:INTERNAL:boom", "stream": True})
    events = [line for line in response.text.splitlines() if line]
    assert response.status_code == 200 and len(events) == 3 and events[-1] == "data: [DONE]"
    assert json.loads(events[0][len("data: ") :])["choices"][0]["text"] == "a"
    assert json.loads(events[1][len("data: ") :]) == openai_error("boom", "server_error", "internal_error")


def test_a_failed_prompt_ends_the_request_and_cancels_its_other_prompts(fake):
    engine, client = fake
    before = engine.num_cancelled
    response = client.post("/v1/completions", json={"prompt": ["hang", "fail:INTERNAL:boom"]})
    assert (response.status_code, response.json()) == (500, openai_error("boom", "server_error", "internal_error"))
    deadline = time.monotonic() + 5
    while engine.num_cancelled == before:
        assert time.monotonic() < deadline, "the other prompt's call was not cancelled"
        time.sleep(0.02)
    ok = client.post("/v1/completions", json={"prompt": ["ok", "ok"]}).json()
    assert [(c["index"], c["text"]) for c in ok["choices"]] == [(0, "ab"), (1, "ab")]


def test_engine_calls_carry_the_clients_authorization_and_own_priority(fake):
    engine, client = fake
    engine.calls.clear()
    headers = {"Authorization": "Bearer sk-client"}
    assert client.post("/v1/completions", json={"prompt": "ok", "priority": 5}, headers=headers).status_code == 200
    assert client.post("/tokenize", json={"prompt": "ok"}, headers=headers).status_code == 200
    assert client.post("/detokenize", json={"tokens": [1]}, headers=headers).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "ok", "priority": -3}).status_code == 200
    assert [(method, metadata.get("authorization"), priority) for method, metadata, priority in engine.calls] == [
        ("Generate", "Bearer sk-client", 5),
        ("Tokenize", "Bearer sk-client", 0),
        ("Detokenize", "Bearer sk-client", 0),
        ("Generate", None, -3),
    ]
    response = client.post("/v1/completions", json={"prompt": "ok"}, headers={"Authorization": b"Bearer \xe9"})
    assert (response.status_code, response.json()) == (
        401,
        openai_error(
            "Incorrect API key provided: the Authorization header must be printable ASCII",
            "invalid_request_error",
            "invalid_api_key",
        ),
    )
    assert len(engine.calls) == 4


def test_vllm_probe_and_model_endpoints(stack, client):
    from raypaged import __version__

    assert client.get("/ping").status_code == 200
    assert client.get("/version").json() == {"version": __version__}
    # vLLM's /load: the generation requests in flight, here a request waiting for its tenant's one slot
    assert client.get("/load").json() == {"server_load": 0}
    flood_gate = stack.gateway.tenants.tenant_for(f"Bearer {FLOOD}")
    stack.background.run(flood_gate.admit(num_slots=1))  # the flood tenant's one slot, held here
    with stack.client(headers={"Authorization": f"Bearer {FLOOD}"}) as flood:
        waiting = threading.Thread(
            target=flood.post,
            args=("/v1/completions",),
            kwargs={"json": {"model": "tiny", "prompt": "x", "max_tokens": 2}},
        )
        waiting.start()
        deadline = time.monotonic() + 5
        while flood_gate.num_queued == 0:
            assert time.monotonic() < deadline, "the request was not queued"
            time.sleep(0.002)
        assert client.get("/load").json() == {"server_load": 1}

        async def release() -> None:  # on the gateway's loop, as its requests release slots
            flood_gate.release(num_slots=1)

        stack.background.run(release())
        waiting.join(timeout=30)
    assert client.get("/load").json() == {"server_load": 0}
    listed = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert client.get("/v1/models/tiny-qwen").json() == listed["tiny-qwen"]
    missing = client.get("/v1/models/nope")
    assert (missing.status_code, missing.json()["error"]["message"]) == (404, "The model `nope` does not exist.")


def test_retry_after_on_429_and_503():
    from raypaged.serving.gateway.errors import APIError

    assert APIError(429, "busy").response().headers["retry-after"] == "1"
    assert APIError(503, "down").response().headers["retry-after"] == "1"
    assert "retry-after" not in APIError(400, "bad").response().headers

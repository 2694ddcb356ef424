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
        body = client.post("/v1/completions", json={"model": name, "prompt": "Hello there", "max_tokens": 8,
                                                    "temperature": 0, "ignore_eos": True}).json()
        assert body["model"] == name and body["object"] == "text_completion"
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
        texts[name] = body["choices"][0]["text"]
    assert texts["tiny"] != texts["tiny-qwen"]
    offline = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=64, max_model_len=256)
    expected = offline.generate("Hello there", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert texts["tiny"] == expected[0].outputs[0].text


def test_every_error_has_its_status_and_openai_shape(stack, client):
    completions = "/v1/completions"
    assert_error(client.post(completions, json={"model": "tiny", "prompt": "x", "temperature": -1}),
                 400, "invalid_request_error", None, "temperature must be non-negative, got -1.0")
    assert_error(client.post(completions, json={"model": "tiny", "prompt": [5] * 300}),
                 400, "invalid_request_error", None, "prompt has 300 tokens")
    assert "max_model_len 256" in client.post(completions, json={"model": "tiny", "prompt": [5] * 300}).text
    assert_error(client.post(completions, content=b"{not json", headers={"Content-Type": "application/json"}),
                 400, "invalid_request_error", None, "not valid JSON")
    assert_error(client.post(completions, json={"model": "tiny"}), 400, "invalid_request_error", None, "prompt")
    assert_error(client.post(completions, json={"model": "tiny", "prompt": "x", "n": 0}),
                 400, "invalid_request_error", None, "n:")
    assert_error(client.post(completions, json={"prompt": "x"}), 400, "invalid_request_error", None, "model is required")
    assert_error(client.post(completions, json={"model": "gpt-9", "prompt": "x"}),
                 404, "invalid_request_error", "model_not_found", "The model `gpt-9` does not exist.")
    assert_error(client.post(completions, json={"model": "tiny", "prompt": "x" * 5000}),
                 413, "invalid_request_error", "request_too_large", "exceeds the limit of 4096 bytes")
    with stack.client() as anonymous:
        assert_error(anonymous.post(completions, json={"model": "tiny", "prompt": "x"}),
                     401, "invalid_request_error", "invalid_api_key", "Missing API key")
        wrong = anonymous.post(completions, json={"model": "tiny", "prompt": "x"}, headers={"Authorization": "Bearer no"})
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
            assert_error(client.post("/v1/completions", json={"prompt": "x"}), 503, "server_error",
                         "engine_unavailable", "the engine is unavailable")
    finally:
        stack.background.loop.call_soon_threadsafe(gateway.stop)
        future.result(timeout=30)


def test_flooding_tenant_queues_behind_its_limit_and_cannot_starve_another(stack):
    body = {"model": "tiny", "prompt": "flood", "stream": True, **LONG}
    with stack.client(headers={"Authorization": f"Bearer {FLOOD}"}) as flood, stack.client(
        headers={"Authorization": f"Bearer {CALM}"}
    ) as calm:
        with flood.stream("POST", "/v1/completions", json=body) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # running: the tenant's one slot is taken
            queued_done = threading.Event()
            queued = threading.Thread(
                target=lambda: (flood.post("/v1/completions", json={**body, "stream": False}), queued_done.set())
            )
            queued.start()
            time.sleep(0.3)  # the second waits in the tenant's queue at the gateway
            assert_error(flood.post("/v1/completions", json=body), 429, "requests", "rate_limit_exceeded",
                         "tenant flood has 1 requests running and 1 queued")
            answer = calm.post("/v1/completions", json={"model": "tiny", "prompt": "calm", "max_tokens": 3})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
            assert not queued_done.is_set()
        queued.join(timeout=60)  # the first stream closed: the queued one ran
        assert queued_done.is_set()
    wait_all_blocks_free(stack, "tiny", within_s=5)


def test_grpc_client_streams_and_cancelling_frees_blocks(stack):
    stub = stack.grpc_stub()
    request = pb.GenerateRequest(
        model="tiny", text="stream me", sampling=pb.SamplingParameters(n=1, temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=200, ignore_eos=True),
    )
    call = stub.Generate(request)
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
    call = stub.Generate(pb.GenerateRequest(model="tiny", request_id="to-abort", text="x",
                                            stopping=pb.StoppingCriteria(max_tokens=200, ignore_eos=True)))
    assert next(call).request_id == "to-abort"
    next(call)
    assert stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown"])).num_aborted == 1
    last = list(call)[-1]
    assert last.finished and [d.finish_reason for d in last.outputs] == [pb.FINISH_REASON_ABORT]
    wait_all_blocks_free(stack, "tiny", within_s=1.0)


def test_grpc_errors_use_status_codes(stack):
    stub = stack.grpc_stub()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(model="nope", text="x")))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(model="tiny", text="x", sampling=pb.SamplingParameters(top_p=2))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p must be in (0, 1]" in err.value.details()
    info = stub.Info(pb.InfoRequest())
    assert [(m.name, m.block_size, m.max_model_len, m.tensor_parallel_size, m.num_gpu_blocks) for m in info.models] == [
        ("tiny", 16, 256, 1, 64), ("tiny-qwen", 16, 256, 1, 20)]
    assert stub.Health(pb.HealthRequest()).status == pb.SERVING_STATUS_SERVING


def test_http_client_disconnect_aborts_the_request(stack, client):
    with client.stream("POST", "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "talk"}], "stream": True, **LONG,
    }) as response:
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
        assert engine_stats(stack, "tiny")["num_requests_running"] == 1
    wait_all_blocks_free(stack, "tiny", within_s=1.0)


def test_streams_end_with_done_and_usage_when_asked(client):
    response = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4,
        "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True},
    })
    events = [line[len("data: "):] for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    whole = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True,
        "temperature": 0,
    }).json()
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert whole["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"]


def test_tokenize_and_detokenize(client):
    tokens = client.post("/tokenize", json={"model": "tiny", "prompt": "Hello world"}).json()
    assert tokens == {"count": 2, "max_model_len": 256, "tokens": [19556, 905]}
    assert client.post("/detokenize", json={"model": "tiny", "tokens": [19556, 905]}).json() == {"prompt": "Hello world"}
    chat = client.post("/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 5
    assert_error(client.post("/detokenize", json={"model": "tiny", "tokens": [10**6]}), 400,
                 "invalid_request_error", None, "token ids must be in [0, 49152)")


def scrape(client) -> dict[tuple[str, tuple], float]:
    text = client.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_parse_and_move_under_load(stack, client):
    label = (("model_name", "tiny-qwen"),)
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
    assert ("raypaged:num_requests_running", (("model_name", "tiny"),)) in after

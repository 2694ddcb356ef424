"""Faults under a running server: a shard actor killed, the engine process lost and restarted."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import ray

from raypaged import LLM, SamplingParams
from raypaged.config import EngineConfig
from raypaged.serving.launch import Gateway, GatewayOptions
from tests.reliability.conftest import ServerProcess, free_port, sse_events, stream_text_and_tail
from tests.serving.conftest import BackgroundLoop, Stack

NUM_STREAMS = 12
MAX_TOKENS = 24


def prompt_ids(i: int) -> list[int]:
    return [1, 17 + 5 * i, 400 + 31 * i, 2000 + 7 * i]


def stream_all(url: str, num_streams: int, max_tokens: int, progressed: threading.Barrier | None) -> list[list[str]]:
    """Streams ``num_streams`` greedy completions at once; each waits at ``progressed`` after its third chunk."""
    events: list[list[str]] = [[] for _ in range(num_streams)]

    def run(i: int) -> None:
        body = {
            "model": "tiny",
            "prompt": prompt_ids(i),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for event in sse_events(response.iter_lines()):
                events[i].append(event)
                if progressed is not None and len(events[i]) == 3:
                    progressed.wait(timeout=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    return events


def test_killed_shard_actor_mid_load_is_replaced_and_streams_finish_unchanged(ray_session, tiny_model_dir):
    reference = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=128, max_model_len=256)
    expected = [
        o.outputs[0].text
        for o in reference.generate(
            [{"prompt_token_ids": prompt_ids(i)} for i in range(NUM_STREAMS)],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    ]
    reference.shutdown()
    config = EngineConfig(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        device="cpu",
        tensor_parallel_size=2,
        num_gpu_blocks_override=128,
        max_model_len=256,
    )
    stack = Stack([config])
    try:
        executor = stack.engine().engine.executor
        killed = []
        # every stream has 3 chunks before the kill; none can finish meanwhile (24 tokens each)
        progressed = threading.Barrier(NUM_STREAMS + 1)
        killer = threading.Thread(
            target=lambda: (
                progressed.wait(timeout=120),
                killed.append(executor.workers[1]._actor_id.hex()),
                ray.kill(executor.workers[1], no_restart=True),
                progressed.reset(),
            )
        )
        killer.start()
        events = stream_all(stack.url, NUM_STREAMS, MAX_TOKENS, progressed)
        killer.join(timeout=10)
        assert len(killed) == 1
        texts = []
        for stream in events:
            text, chunks = stream_text_and_tail(stream)
            assert "error" not in chunks[-1], chunks[-1]
            assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
            texts.append(text)
        assert texts == expected
        assert killed[0] not in {w._actor_id.hex() for w in executor.workers}
        stats = stack.engine().stats()
        assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"] == 128
    finally:
        stack.close()


def test_lost_engine_gives_503s_without_hanging_and_a_restarted_engine_serves_again(tmp_path, tiny_model_dir):
    grpc_port = free_port()
    engine_args = [
        "--model",
        str(tiny_model_dir),
        "--served-model-name",
        "tiny",
        "--grpc-port",
        str(grpc_port),
        "--num-gpu-blocks-override",
        "64",
        "--max-model-len",
        "256",
    ]
    engine = ServerProcess("engine", engine_args, tmp_path / "engine1.log")
    background = BackgroundLoop()
    gateway = Gateway({"tiny": f"127.0.0.1:{grpc_port}"}, GatewayOptions(port=0, log_level="warning"))
    serving = asyncio.run_coroutine_threadsafe(gateway.serve(), background.loop)
    url = f"http://127.0.0.1:{gateway.port}"
    greedy = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    client = httpx.Client(base_url=url, timeout=30)
    try:
        engine.wait_http_ready(url)
        before = client.post("/v1/completions", json=greedy).json()["choices"][0]["text"]

        with client.stream("POST", "/v1/completions", json={**greedy, "max_tokens": 240, "stream": True}) as response:
            events = sse_events(response.iter_lines())
            next(events)
            engine.signal(signal.SIGKILL)
            engine.wait(within_s=10)
            rest = list(events)
        assert rest[-1] == "[DONE]"
        error = httpx.Response(503, content=rest[-2]).json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
        assert error["message"].startswith("the engine is unavailable: ")

        started = time.monotonic()
        health = client.get("/health")
        refused = client.post("/v1/completions", json=greedy)
        assert time.monotonic() - started < 10  # no hang
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
        assert health.json()["error"]["message"] == f"engine 127.0.0.1:{grpc_port} unreachable: UNAVAILABLE"
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
        assert refused.json()["error"]["message"].startswith("the engine is unavailable: ")

        engine.close()
        engine = ServerProcess("engine", engine_args, tmp_path / "engine2.log")
        engine.wait_http_ready(url)  # the gateway reconnects to the engine on the same port
        assert client.post("/v1/completions", json=greedy).json()["choices"][0]["text"] == before

        # `raypaged engine` drains too: SIGTERM lets the running stream finish, then it exits 0
        with client.stream("POST", "/v1/completions", json={**greedy, "max_tokens": 200, "stream": True}) as response:
            events = sse_events(response.iter_lines())
            next(events)
            engine.signal(signal.SIGTERM)
            text, chunks = stream_text_and_tail([e for e in events])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert engine.wait(within_s=60) == 0
        assert "shutdown requested: finishing running calls within 30 s" in engine.log()
    finally:
        client.close()
        engine.close()
        background.loop.call_soon_threadsafe(gateway.stop)
        serving.result(timeout=30)
        background.close()

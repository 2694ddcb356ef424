"""``raypaged serve`` as a process: SIGTERM drains in-flight streams and exits 0; keys and prompts stay out of
its log."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil

from tests.reliability.conftest import ServerProcess, free_port, sse_events, stream_text_and_tail

API_KEY = "sk-never-in-logs-5b1f"
SECRET_PROMPT = "zebra quartz mangrove"  # a prompt no log line may contain
NUM_STREAMS = 8
MAX_TOKENS = 400
DRAINING = {
    "error": {
        "message": "the server is draining: it is shutting down and accepts no new requests",
        "type": "server_error",
        "param": None,
        "code": "server_draining",
    }
}


def test_sigterm_drains_streams_refuses_new_requests_and_exits_0(tmp_path, tiny_model_dir):
    port, grpc_port = free_port(), free_port()
    server = ServerProcess(
        "serve",
        [
            "--model",
            str(tiny_model_dir),
            "--served-model-name",
            "tiny",
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--num-gpu-blocks-override",
            "256",
            "--max-model-len",
            "512",
            "--api-key",
            API_KEY,
            "--disable-log-requests",
            "--log-level",
            "debug",
        ],
        tmp_path / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    try:
        server.wait_http_ready(url)  # /health needs no key by default
        gateway = psutil.Process(server.pid)
        [engine] = gateway.children()  # the engines and their gRPC server, in a process of their own

        def listening(process: psutil.Process) -> set[tuple[str, int]]:
            return {
                (c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)  # gRPC listens on a v4-mapped socket
                for c in process.net_connections("tcp")
                if c.status == "LISTEN"
            }

        # loopback only by default
        assert (listening(gateway), listening(engine)) == ({("127.0.0.1", port)}, {("127.0.0.1", grpc_port)})

        def loads_torch(process: psutil.Process) -> bool:
            return any("libtorch" in Path(m.path).name for m in process.memory_maps())

        # the engines' configs are built in the engine process: the gateway's never imports torch
        assert (loads_torch(gateway), loads_torch(engine)) == (False, True)

        events: list[list[str]] = [[] for _ in range(NUM_STREAMS)]
        started = [threading.Event() for _ in range(NUM_STREAMS)]

        def stream(i: int) -> None:
            body = {
                "model": "tiny",
                "prompt": f"{SECRET_PROMPT} {i}",
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth, timeout=60) as response:
                assert response.status_code == 200
                for event in sse_events(response.iter_lines()):
                    events[i].append(event)
                    started[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(60)
        server.signal(signal.SIGTERM)
        engine.send_signal(signal.SIGTERM)  # as systemd signals every process of a service: the parent drains
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{url}/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "late"}, headers=auth, timeout=5)
        models = httpx.get(f"{url}/v1/models", headers=auth, timeout=5)
        still_streaming = sum(t.is_alive() for t in threads)
        assert (health.status_code, health.json()) == (503, DRAINING)
        assert (refused.status_code, refused.json()) == (503, DRAINING)
        assert (models.status_code, models.json()) == (503, DRAINING)
        assert still_streaming > 0  # the refusals above happened while streams were running

        for thread in threads:
            thread.join(timeout=60)
        for i in range(NUM_STREAMS):
            text, chunks = stream_text_and_tail(events[i])
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        assert server.wait(within_s=60) == 0
        assert not engine.is_running()  # the gateway waited for its engine process
        log = server.log()
        assert f"draining: {NUM_STREAMS} requests in flight, waiting up to 30 s for them" in log
        assert "drained" in log and "aborting" not in log
    finally:
        server.close()
    assert API_KEY not in log
    assert SECRET_PROMPT not in log and "zebra" not in log
    assert "request cmpl-" not in log  # --disable-log-requests: no line per request


def test_requests_left_at_the_drain_timeout_end_with_an_error_and_free_their_blocks(tiny_model_dir):
    from tests.serving.conftest import Stack, tiny_config

    stack = Stack([tiny_config(tiny_model_dir, "tiny")], drain_timeout_s=0.2)
    try:
        body = {"model": "tiny", "prompt": "long", "max_tokens": 240, "ignore_eos": True, "stream": True}
        streams = []
        with stack.client() as client:
            for _ in range(4):
                response = client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
                events = sse_events(response.iter_lines())
                next(events)
                streams.append((response, events))
            stack.background.run(stack.gateway.shutdown())
            for response, events in streams:
                rest = list(events)
                response.close()
                assert rest[-1] == "[DONE]"
                assert json.loads(rest[-2]) == {
                    "error": {
                        "message": "the server shut down before this request finished (drain timeout 0.2 s)",
                        "type": "server_error",
                        "param": None,
                        "code": "server_draining",
                    }
                }
        deadline = time.monotonic() + 10
        while (stats := stack.engine().stats())["num_gpu_blocks_free"] != stats["num_gpu_blocks_total"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.02)
        assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    finally:
        stack.close()


def test_a_killed_engine_process_ends_its_streams_with_an_error_and_the_server_with_exit_code_1(
    tmp_path, tiny_model_dir
):
    """As vLLM's API server when its engine core dies: the open streams end with an error, and the server
    exits (non-zero, for its supervisor to restart it) instead of serving 503s."""
    port = free_port()
    server = ServerProcess(
        "serve",
        [
            *("--model", str(tiny_model_dir), "--served-model-name", "tiny", "--port", str(port), "--grpc-port", "0"),
            *("--num-gpu-blocks-override", "64", "--max-model-len", "512"),
        ],
        tmp_path / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_http_ready(url)
        [engine] = psutil.Process(server.pid).children()
        body = {"model": "tiny", "prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            events = sse_events(response.iter_lines())
            first = next(events)
            engine.kill()
            rest = list(events)
        assert server.wait(within_s=30) == 1
    finally:
        server.close()
    assert json.loads(first)["choices"][0]["text"]
    lost = "the engine process has exited (exit code -9)"  # SIGKILL
    assert json.loads(rest[-2])["error"]["message"] == f"the engine is unavailable: {lost}"
    assert rest[-1] == "[DONE]"
    assert f"ERROR raypaged: {lost}" in server.log() and f"error: {lost}" in server.log()

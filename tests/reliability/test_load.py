"""Many concurrent streams against ``raypaged serve`` with a KV pool small enough to force preemption."""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from raypaged import LLM, SamplingParams
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc
from tests.reliability.conftest import ServerProcess, free_port, sse_events, stream_text_and_tail

NUM_BLOCKS = 48  # 200 requests of up to 3 blocks each: most wait, many are preempted
MAX_MODEL_LEN = 512


def sizes(soak: bool) -> tuple[int, int]:
    """(concurrent clients, tokens each)."""
    return (1000, 64) if soak else (200, 16)


def prompt_ids(i: int) -> list[int]:
    return [1] + [(17 + 13 * i + 7 * j) % 49000 + 3 for j in range(6 + i % 25)]


class Server:
    def __init__(self, process: ServerProcess, port: int, grpc_port: int) -> None:
        self.process = process
        self.url = f"http://127.0.0.1:{port}"
        self.stub = pb_grpc.TextGenerationServiceStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))

    def stats(self) -> dict[str, float]:
        return dict(self.stub.Metrics(pb.MetricsRequest()).models[0].stats)

    def wait_idle(self, within_s: float) -> dict[str, float]:
        """Engine stats once every block is free and no request is left."""
        deadline = time.monotonic() + within_s
        while True:
            stats = self.stats()
            if (
                stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]
                and stats["num_requests_running"] == stats["num_requests_waiting"] == 0
            ):
                return stats
            assert time.monotonic() < deadline, f"KV blocks still held after {within_s} s: {stats}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    port, grpc_port = free_port(), free_port()
    process = ServerProcess(
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
            str(NUM_BLOCKS),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--disable-log-requests",
        ],
        tmp_path_factory.mktemp("load") / "serve.log",
    )
    try:
        process.wait_http_ready(f"http://127.0.0.1:{port}")
        yield Server(process, port, grpc_port)
    finally:
        process.close()


async def one_stream(client: httpx.AsyncClient, i: int, max_tokens: int) -> dict:
    body = {
        "model": "tiny",
        "prompt": prompt_ids(i),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    first_token_at = None
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {await response.aread()!r}"}
        async for line in response.aiter_lines():
            for event in sse_events([line]):
                if first_token_at is None and event != "[DONE]":
                    first_token_at = time.monotonic()
                events.append(event)
    if not events or events[-1] != "[DONE]":
        return {"error": f"stream ended without [DONE]: {events[-2:]}"}
    text, chunks = stream_text_and_tail(events)
    if "error" in chunks[-1]:
        return {"error": chunks[-1]["error"]["message"]}
    return {
        "text": text,
        "tokens": chunks[-1]["usage"]["completion_tokens"],
        "latency_s": time.monotonic() - start,
        "ttft_s": first_token_at - start,
    }


async def load(url: str, num_clients: int, max_tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=num_clients + 10, max_keepalive_connections=num_clients + 10)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600), limits=limits) as client:
        return await asyncio.gather(*(one_stream(client, i, max_tokens) for i in range(num_clients)))


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def test_concurrent_streams_all_finish_identical_to_unloaded_with_preemption(server, tiny_model_dir, soak, tmp_path):
    num_clients, max_tokens = sizes(soak)
    before = server.stats()
    started = time.monotonic()
    results = asyncio.run(load(server.url, num_clients, max_tokens))
    wall_s = time.monotonic() - started
    after = server.wait_idle(within_s=10)

    failures = [(i, r["error"]) for i, r in enumerate(results) if "error" in r]
    assert failures == []
    # unloaded: the same prompts with room for all of them, so nothing waits or is preempted
    reference_started = time.monotonic()
    longest = max(len(prompt_ids(i)) for i in range(num_clients)) + max_tokens
    unloaded = LLM(
        model=str(tiny_model_dir),
        num_gpu_blocks_override=num_clients * -(-longest // 16),  # blocks of 16 for every sequence at its longest
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=num_clients,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    expected = unloaded.generate(
        [{"prompt_token_ids": prompt_ids(i)} for i in range(num_clients)], params, use_tqdm=False
    )
    assert unloaded.stats()["num_preemptions"] == 0
    unloaded.shutdown()
    reference_s = time.monotonic() - reference_started
    mismatched = [i for i, (r, e) in enumerate(zip(results, expected)) if r["text"] != e.outputs[0].text]
    assert mismatched == []
    assert all(r["tokens"] == max_tokens for r in results)
    preemptions = after["num_preemptions"] - before["num_preemptions"]
    assert preemptions > 0
    assert after["num_gpu_blocks_free"] == after["num_gpu_blocks_total"] == NUM_BLOCKS

    latencies = [r["latency_s"] for r in results]
    ttfts = [r["ttft_s"] for r in results]
    figures = {
        "requests": num_clients,
        "failed": 0,
        "tokens_per_request": max_tokens,
        "kv_blocks": NUM_BLOCKS,
        "wall_s": round(wall_s, 2),
        "output_tokens_per_s": round(num_clients * max_tokens / wall_s, 1),
        "latency_p50_s": round(percentile(latencies, 50), 3),
        "latency_p99_s": round(percentile(latencies, 99), 3),
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p99_s": round(percentile(ttfts, 99), 3),
        "preemptions": int(preemptions),
        "unloaded_reference_s": round(reference_s, 2),
    }
    print("load figures:", json.dumps(figures))
    (tmp_path / "load_figures.json").write_text(json.dumps(figures, indent=2))


CLIENT = """
import sys, httpx
body = {"model": "tiny", "prompt": [1, 5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
with httpx.stream("POST", sys.argv[1] + "/v1/completions", json=body, timeout=60) as response:
    for line in response.iter_lines():
        if line.startswith("data: "):
            print("streaming", flush=True)
            break
    import time
    time.sleep(600)
"""


def test_killed_client_aborts_its_request_and_frees_its_blocks(server):
    aborted_before = server.process.log().count("aborted requests")
    client = subprocess.Popen([sys.executable, "-c", CLIENT, server.url], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline() == "streaming\n"
        client.send_signal(signal.SIGKILL)  # at its first token: 500 tokens take far longer
        client.wait(timeout=10)
        server.wait_idle(within_s=10)
        assert server.process.log().count("aborted requests") == aborted_before + 1  # aborted, not finished
    finally:
        client.kill()
        client.wait(timeout=10)

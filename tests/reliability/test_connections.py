"""More connections at once than the server has file descriptors: every request still completes, nothing
already accepted fails for want of a descriptor, and the log does not flood."""

from __future__ import annotations

import asyncio
import re
import resource
import subprocess
import sys
import time

import httpx
import pytest

from raypaged.serving.listener import connection_reserve
from tests.reliability.conftest import ServerProcess, free_port, sse_events, stream_text_and_tail

OPEN_FILES = 128  # soft and hard: 64 kept for the server, so about 50 connections at once on the tiny model
CLIENTS = 150
BODY = {"model": "tiny", "prompt": [1, 400, 401, 402], "max_tokens": 12, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    port = free_port()
    args = ["--model", str(tiny_model_dir), "--served-model-name", "tiny", "--port", str(port)]
    args += ["--grpc-port", str(free_port()), "--disable-log-requests"]
    process = ServerProcess("serve", args, tmp_path_factory.mktemp("conns") / "serve.log", open_files=OPEN_FILES)
    try:
        process.wait_http_ready(f"http://127.0.0.1:{port}")
        yield process, f"http://127.0.0.1:{port}"
    finally:
        process.close()


async def _stream(client: httpx.AsyncClient, url: str) -> tuple[int, str]:
    async with client.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True}) as response:
        lines = [line async for line in response.aiter_lines()]
    if response.status_code != 200:
        return response.status_code, "\n".join(lines)
    return 200, stream_text_and_tail(list(sse_events(iter(lines))))[0]


async def _flood(url: str) -> list[tuple[int, str]]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(_stream(client, url) for _ in range(CLIENTS)))


def test_more_connections_than_descriptors_all_complete_and_the_log_stays_short(server):
    process, url = server
    expected = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    start = time.monotonic()
    answers = asyncio.run(_flood(url))
    elapsed = time.monotonic() - start
    assert answers == [(200, expected)] * CLIENTS
    log = process.log()
    max_fd = OPEN_FILES - connection_reserve(OPEN_FILES)
    pauses = log.count(f"no room for another connection: descriptors {max_fd} and above are kept")
    assert 1 <= pauses <= elapsed + 2  # accepting paused, and asyncio logged it once a second at most
    assert "Internal Server Error" not in log and "Too many open files" not in log
    assert len(re.findall(r"socket\.accept\(\) out of system resource", log)) == pauses
    assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"] == expected


def test_the_soft_open_files_limit_is_raised_to_the_hard_one():
    script = (
        "import resource\n"
        "from raypaged.serving.listener import raise_open_files_limit\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 3000))\n"
        "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))\n"
        "print(raise_open_files_limit(target=1000), resource.getrlimit(resource.RLIMIT_NOFILE))\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 3000))\n"
        "print(raise_open_files_limit(target=1000), resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 3000:
        pytest.skip(f"the hard open-files limit here is {hard}")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["3000 (3000, 3000)", "3000 (3000, 3000)", "1000 (1000, 3000)"]


@pytest.mark.parametrize(("limit", "reserve"), [(128, 64), (256, 64), (1024, 128), (65535, 1024), (100, 50)])
def test_the_reserve_is_an_eighth_of_the_limit_within_64_to_1024(limit, reserve):
    assert connection_reserve(limit) == reserve

"""A vLLM command line, unchanged but for the program's name, starts a server that answers as vLLM's
does: both served names, model cards, request ids, cached-token usage, forced usage chunks,
stop_reason ids, system_fingerprint, and priority refused under fcfs."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.reliability.conftest import ServerProcess, free_port

pytestmark = pytest.mark.slow

LONG = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"


@pytest.fixture(scope="module")
def url(tmp_path_factory, smollm2_dir):
    port, grpc_port = free_port(), free_port()
    process = ServerProcess(
        "serve",
        [
            str(smollm2_dir),
            "-tp",
            "1",
            "--served-model-name",
            "a",
            "b",
            "--max-model-len",
            "2048",
            "--generation-config",
            "auto",
            "--disable-log-stats",
            "--enable-prompt-tokens-details",
            "--enable-request-id-headers",
            "--enable-force-include-usage",
            "--num-gpu-blocks-override",
            "512",
            "--block-size",
            "4",
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
        ],
        tmp_path_factory.mktemp("vllm") / "serve.log",
    )
    try:
        address = f"http://127.0.0.1:{port}"
        process.wait_http_ready(address)
        yield address
    finally:
        process.close()


def test_both_names_answer_and_are_listed_with_vllms_cards(url, smollm2_dir):
    cards = httpx.get(f"{url}/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["a", "b"]
    for card in cards:
        assert (card["root"], card["parent"], card["max_model_len"], card["owned_by"]) == (
            str(smollm2_dir),
            None,
            2048,
            "raypaged",
        )
        assert card["created"] > 0 and card["permission"][0]["object"] == "model_permission"
    fingerprints = set()
    for name in ("a", "b"):
        answer = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["model"] == name
        fingerprints.add(answer.json()["system_fingerprint"])
    [fingerprint] = fingerprints  # one engine under two names: one setup
    assert re.fullmatch(r"raypaged-0\.1\.0-[0-9a-f]{8}", fingerprint)


def test_the_request_id_names_the_response_and_comes_back_in_the_header(url):
    answer = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"X-Request-Id": "trace-42"},
        json={"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert answer.json()["id"] == "chatcmpl-trace-42" and answer.headers["x-request-id"] == "trace-42"
    body_id = httpx.post(
        f"{url}/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 1, "request_id": "mine"}
    )
    assert body_id.json()["id"] == "cmpl-mine" and body_id.headers["x-request-id"] == "mine"
    bad = httpx.post(
        f"{url}/v1/completions",
        headers={"X-Request-Id": "has space"},
        json={"model": "a", "prompt": "hi", "max_tokens": 1},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


def test_usage_counts_the_prompt_tokens_read_from_the_prefix_cache(url):
    body = {"model": "a", "prompt": LONG, "max_tokens": 1, "temperature": 0}
    first = httpx.post(f"{url}/v1/completions", json=body).json()["usage"]
    second = httpx.post(f"{url}/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == (second["prompt_tokens"] - 1) // 4 * 4 and cached > 0  # every full block but the last token's


def test_cache_salt_shares_prefix_blocks_only_among_requests_of_the_same_salt(url):
    def cached(**salt) -> int:
        body = {"model": "a", "prompt": "Salted. " + LONG, "max_tokens": 1, "temperature": 0, **salt}
        return httpx.post(f"{url}/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="s-1") == 0
    full = cached(cache_salt="s-1")
    assert full > 0  # the same salt: its blocks
    assert cached(cache_salt="s-2") == 0  # another salt: none of them
    assert cached() == 0  # no salt: none either
    empty = httpx.post(f"{url}/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 1, "cache_salt": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"


def test_every_stream_ends_with_usage(url):
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 3, "stream": True}
    ) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


def test_stop_reason_is_the_stop_token_id_as_a_number(url):
    greedy = {"model": "a", "prompt": "hi", "max_tokens": 1, "temperature": 0, "logprobs": 0}
    token = httpx.post(f"{url}/v1/completions", json=greedy).json()["choices"][0]["logprobs"]["tokens"][0]
    token_id = httpx.post(f"{url}/tokenize", json={"model": "a", "prompt": token, "add_special_tokens": False}).json()[
        "tokens"
    ][0]
    stopped = httpx.post(f"{url}/v1/completions", json={**greedy, "max_tokens": 4, "stop_token_ids": [token_id]})
    choice = stopped.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", token_id)


def test_priority_needs_the_priority_policy(url):
    answer = httpx.post(f"{url}/v1/completions", json={"model": "a", "prompt": "hi", "priority": 1})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == (
        "priority 1 needs --scheduling-policy priority (this engine schedules fcfs)"
    )

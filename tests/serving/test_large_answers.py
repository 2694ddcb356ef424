"""A large non-streaming answer is built and written off the gateway's event loop, as JSONResponse writes it.

n=32 x 500 tokens x 20 top logprobs (24 MB of JSON) held the loop, and every stream on it, for 1.6 s.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from fastapi.responses import JSONResponse

from raypaged.serving.gateway.responses import LARGE_ANSWER, Accumulator, answer_json
from tests.serving.conftest import Stack, tiny_config


@pytest.mark.parametrize(
    "body",
    [
        {"id": "x", "choices": [{"text": 'é \u2603 "q" \\', "n": [1, 2.5, None]}, {"text": ""}], "usage": {"a": 1}},
        {"id": "x", "choices": [], "nested": {"list": [1, [2, 3]]}, "empty": {}},
        {"content": [{"type": "text", "text": "z"}], "stop_reason": None},
    ],
)
def test_answer_json_writes_what_json_response_writes(body):
    assert answer_json(body) == JSONResponse(body).body
    assert answer_json(body, pause=lambda: None) == JSONResponse(body).body


def test_answer_json_refuses_what_json_response_refuses():
    with pytest.raises(ValueError):
        answer_json({"choices": [{"logprob": math.nan}]})


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack([tiny_config(tiny_model_dir, "tiny", num_gpu_blocks_override=256, max_model_len=512)])
    yield stack
    stack.close()


def test_a_large_answer_is_built_off_the_event_loop_and_a_small_one_on_it(stack, monkeypatch):
    where = []
    body = Accumulator.body

    def recording(self, *args):
        try:
            asyncio.get_running_loop()
            where.append(("event loop", self.size()))
        except RuntimeError:
            where.append(("thread", self.size()))
        return body(self, *args)

    monkeypatch.setattr(Accumulator, "body", recording)
    asked = {"model": "tiny", "prompt": "Once", "ignore_eos": True, "temperature": 0, "logprobs": 20}
    with stack.client() as client:
        small = client.post("/v1/completions", json=asked | {"max_tokens": 8})
        large = client.post("/v1/completions", json=asked | {"max_tokens": 200, "n": 8, "temperature": 1, "seed": 3})
    assert small.status_code == large.status_code == 200
    assert small.headers["content-type"] == large.headers["content-type"] == "application/json"
    assert [w for w, _ in where] == ["event loop", "thread"]
    assert where[0][1] < LARGE_ANSWER <= where[1][1] == 8 * 200 * 21
    choices = json.loads(large.content)["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [200] * 8
    with stack.client() as client:  # the same seeded samples, streamed (no answer built): the same texts and logprobs
        streamed = client.post(
            "/v1/completions", json=asked | {"max_tokens": 200, "n": 8, "temperature": 1, "seed": 3, "stream": True}
        )
    texts, tops = [""] * 8, [[] for _ in range(8)]
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] += choice["text"]
                tops[choice["index"]] += choice["logprobs"]["top_logprobs"] if choice["logprobs"] else []
    assert texts == [c["text"] for c in choices]
    assert tops == [c["logprobs"]["top_logprobs"] for c in choices]

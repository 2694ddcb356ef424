"""vLLM's sleep-mode routes on a real gateway and engine server: ``POST /sleep?level=``, ``POST /wake_up?tags=``,
``GET /is_sleeping``. A stream running when the engine falls asleep ends with the tokens it gets from an engine that
never slept; a request sent while it sleeps is refused with 503 (as vLLM's); a server without sleep mode refuses
by name."""

import json
import threading
import time

import grpc
import pytest

from raypaged.serving.proto import generate_pb2 as pb
from tests.serving.conftest import Stack, tiny_config, tiny_model_dir  # noqa: F401  (session fixture)

BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack([tiny_config(tiny_model_dir, "tiny", enable_sleep_mode=True)])
    yield stack
    stack.close()


def error(response) -> tuple[int, str, str | None]:
    body = response.json()["error"]
    return response.status_code, body["message"], body["param"]


def test_a_stream_waits_out_the_sleep_and_new_requests_are_refused(stack):
    with stack.client() as client:
        expected = client.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        texts: dict[str, str] = {}
        first_chunk = threading.Event()

        def stream() -> None:
            pieces = []
            with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        pieces.append(json.loads(line[6:])["choices"][0]["text"])
                        first_chunk.set()
            texts["streamed"] = "".join(pieces)

        streaming = threading.Thread(target=stream)
        streaming.start()
        assert first_chunk.wait(30)
        assert client.post("/sleep", params={"level": "2"}).status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        assert not hasattr(stack.engine("tiny").engine.core.executor, "worker")  # the weights and cache are gone
        time.sleep(0.3)
        assert streaming.is_alive()
        assert error(client.post("/v1/completions", json=BODY)) == (
            503,
            "the engine is unavailable: tiny is sleeping (sleep mode): send the request again once it is woken up "
            "(POST /wake_up), or to another replica",
            None,
        )
        refused = client.post("/wake_up", params={"tags": "kv_cache"})
        assert error(refused) == (
            400,
            "the KV cache wakes with or after the weights: wake_up(tags=['weights']) first",
            None,
        )
        assert client.post("/wake_up", params={"tags": "weights"}).status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        assert client.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        streaming.join(30)
        assert texts == {"streamed": expected}


def test_bad_levels_and_tags_are_refused_by_name(stack):
    with stack.client() as client:
        assert error(client.post("/sleep", params={"level": "3"})) == (400, "level must be 1 or 2, got '3'", "level")
        assert error(client.post("/wake_up", params={"tags": "cache"})) == (
            400,
            "wake_up tags are 'weights' and 'kv_cache', got 'cache'",
            None,
        )
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}


def test_grpc_sleep_wake_up_and_is_sleeping(stack):
    grpc_stub = stack.grpc_stub()
    assert grpc_stub.Sleep(pb.SleepRequest(model="tiny"), timeout=30).is_sleeping
    assert grpc_stub.IsSleeping(pb.IsSleepingRequest(), timeout=30).is_sleeping
    assert not grpc_stub.WakeUp(pb.WakeUpRequest(model="tiny"), timeout=60).is_sleeping
    with pytest.raises(grpc.RpcError) as info:
        grpc_stub.Sleep(pb.SleepRequest(model="nope"), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_server_without_sleep_mode_refuses_to_sleep(tiny_model_dir):
    plain = Stack([tiny_config(tiny_model_dir, "plain")])
    try:
        with plain.client() as client:
            assert error(client.post("/sleep")) == (
                400,
                "sleep mode is off: start the engine with --enable-sleep-mode (LLM(enable_sleep_mode=True)) "
                "(model plain)",
                None,
            )
            assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    finally:
        plain.close()

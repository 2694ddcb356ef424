"""No single request can hurt another: every case that once killed, stalled or leaked the engine.

Each case goes through HTTP and through gRPC (and the ``LLM`` API where it applies)
and gets its documented answer within a bounded time; after each one a greedy
canary returns exactly its earlier tokens and the engine holds nothing running,
waiting or swapped, with every block free.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from raypaged import LLM, SamplingParams
from raypaged.sampling_params import StructuredOutputsParams
from raypaged.serving.proto import generate_pb2 as pb
from tests.engine.test_isolation import fail_stop_matching
from tests.reliability.conftest import assert_openai_error
from tests.serving.conftest import Stack, tiny_config

MAX_MODEL_LEN = 64
VOCAB = 49152
CANARY = {"model": "tiny", "prompt": "The canary sings", "max_tokens": 12, "ignore_eos": True, "temperature": 0}
ANSWER_WITHIN_S = 10.0  # a bound on hanging, not a speed claim


@dataclass
class Case:
    """One request, as HTTP JSON (``path``, ``body``) and as gRPC fields; ``status`` 200 means it must succeed."""

    name: str
    body: dict[str, Any] | bytes
    status: int
    message: str | None = None
    grpc_fields: dict[str, Any] | None = None  # GenerateRequest fields; None: HTTP only
    grpc_code: grpc.StatusCode | None = grpc.StatusCode.INVALID_ARGUMENT
    path: str = "/v1/completions"
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    params: dict[str, Any] | None = None  # SamplingParams kwargs for the LLM API; None: not an LLM case


def grpc_request(fields: dict[str, Any]) -> pb.GenerateRequest:
    fields = dict(fields)
    sampling = pb.SamplingParameters(**fields.pop("sampling", {}))
    stopping = pb.StoppingCriteria(**fields.pop("stopping", {"max_tokens": 4}))
    if "token_ids" in fields:
        fields["token_ids"] = pb.TokenIds(ids=fields["token_ids"])
    if "messages" in fields:
        fields["messages"] = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in fields["messages"]])
    fields.setdefault("model", "tiny")
    if not any(k in fields for k in ("text", "token_ids", "messages")):
        fields["text"] = "hello"
    return pb.GenerateRequest(sampling=sampling, stopping=stopping, **fields)


DEEP_JSON = "[" * 1000 + "]" * 1000  # within the characters a structured output may have, past the parsers' recursion


def _stop_strings(count: int) -> list[str]:
    return [f"s{i}" for i in range(count)]


CASES = [
    Case(
        "stop token id past the vocabulary",
        {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [VOCAB]},
        400,
        f"stop_token_ids must be token ids in [0, {VOCAB}), got {VOCAB}",
        grpc_fields={"stopping": {"max_tokens": 4, "stop_token_ids": [VOCAB]}},
        params={"stop_token_ids": [VOCAB]},
    ),
    Case(
        "logprobs past the limit",
        {"prompt": "hi", "max_tokens": 4, "logprobs": 100_000},
        400,
        f"logprobs 100000 is more than the limit of 20 (--max-logprobs, at most the vocabulary size {VOCAB})",
        grpc_fields={"logprobs": 100_000},
        params={"logprobs": 100_000},
    ),
    Case(
        "n without bound",
        {"prompt": "hi", "max_tokens": 4, "n": 100_000},
        400,
        "n has 100000 samples, more than the limit of 128 (--max-num-samples)",
        grpc_fields={"sampling": {"n": 100_000}},
        params={"n": 100_000},
    ),
    Case(
        "best_of without bound",
        {"prompt": "hi", "max_tokens": 4, "best_of": 100_000},
        400,
        "best_of has 100000 samples, more than the limit of 128 (--max-num-samples)",
        grpc_fields={"sampling": {"best_of": 100_000}},
        params={"best_of": 100_000},
    ),
    Case(
        "200,000 stop strings",
        {"prompt": "hi", "max_tokens": 4, "stop": _stop_strings(200_000)},
        400,
        "stop has 200000 stop strings, more than the limit of 64 (--max-stop-strings)",
        grpc_fields={"stopping": {"max_tokens": 4, "stop_sequences": _stop_strings(200_000)}},
        params={"stop": _stop_strings(200_000)},
    ),
    Case(
        "a stop string of 100,000 characters",
        {"prompt": "hi", "max_tokens": 4, "stop": ["x" * 100_000]},
        400,
        "stop has a string of 100000 characters, more than the limit of 256 (--max-stop-string-chars)",
        grpc_fields={"stopping": {"max_tokens": 4, "stop_sequences": ["x" * 100_000]}},
        params={"stop": ["x" * 100_000]},
    ),
    Case(
        "1,000,000 stop token ids",
        {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [7] * 1_000_000},
        400,
        "stop_token_ids has 1000000 ids, more than the limit of 1024 (--max-stop-token-ids)",
        grpc_fields={"stopping": {"max_tokens": 4, "stop_token_ids": [7] * 1_000_000}},
        params={"stop_token_ids": [7] * 1_000_000},
    ),
    Case(
        "a 4M-token prompt",
        {"prompt": [5] * 4_000_000, "max_tokens": 4},
        400,
        f"prompt has 4000000 tokens, which leaves no room to generate within max_model_len {MAX_MODEL_LEN} "
        "(--max-model-len)",
        grpc_fields={"token_ids": [5] * 4_000_000},
    ),
    Case(
        "a 6M-character chat message",
        {"messages": [{"role": "user", "content": "y" * 6_000_000}], "max_tokens": 4},
        400,
        "messages has 6000004 characters, more than the limit of 2048 (--max-prompt-chars) before tokenization",
        path="/v1/chat/completions",
        grpc_fields={"messages": [{"role": "user", "content": "y" * 6_000_000}]},
    ),
    Case(
        "100,000 chat messages",
        {"messages": [{"role": "user", "content": "hi"}] * 100_000, "max_tokens": 4},
        400,
        "messages has 100000 messages, more than the limit of 1024 (--max-chat-messages)",
        path="/v1/chat/completions",
        grpc_fields={"messages": [{"role": "user", "content": "hi"}] * 100_000},
    ),
    Case(
        "2,000,000 prompts",
        {"prompt": ["a"] * 2_000_000, "max_tokens": 4},
        400,
        "prompt has 2000000 prompts, more than the limit of 1024 (--max-prompts-per-request)",
    ),
    Case(
        "a bad first prompt of several",
        {"prompt": [[VOCAB], [5, 6, 7], [8, 9]], "max_tokens": 40},
        400,
        f"prompt must be token ids in [0, {VOCAB}), got {VOCAB}",
    ),
    Case(
        "tokenize 4M characters",
        {"prompt": "z" * 4_000_000},
        400,
        "prompt has 4000000 characters, more than the limit of 2048 (--max-prompt-chars) before tokenization",
        path="/tokenize",
    ),
    Case(
        "detokenize 2M ids",
        {"tokens": [5] * 2_000_000},
        400,
        f"tokens has 2000000 ids, more than the limit of {MAX_MODEL_LEN} (--max-model-len)",
        path="/detokenize",
    ),
    Case(
        "a JSON schema text nested 1,000 deep",
        {"prompt": "hi", "max_tokens": 4, "structured_outputs": {"json": DEEP_JSON}},
        400,
        "structured outputs: the json constraint nests too deeply",
        grpc_fields={"structured": pb.StructuredOutput(json_schema=DEEP_JSON)},
        params={"structured_outputs": StructuredOutputsParams(json=DEEP_JSON)},
    ),
    Case("deeply nested JSON", b"[" * 100_000, 400, "request body is not valid JSON: it nests too deeply"),
    Case(
        "a priority above the tenant's",
        {"prompt": "hi", "max_tokens": 4, "priority": -5},
        400,
        None,
        grpc_fields={"priority": -5},
    ),
    Case("a cross-site text/plain POST", b'{"prompt": "hi"}', 415, None, headers={"Content-Type": "text/plain"}),
    Case(
        "a foreign Host header",
        {"prompt": "hi", "max_tokens": 4},
        400,
        None,
        headers={"Content-Type": "application/json", "Host": "attacker.example"},
    ),
    Case(
        "more tokens than the context holds",
        {"prompt": "hi", "max_tokens": 100},
        400,
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested 101 tokens "
        "(1 in the messages, 100 in the completion). Please reduce the length of the messages or completion.",
        grpc_fields={"stopping": {"max_tokens": 100}},
        params={"max_tokens": 100},
    ),
    Case(
        "best_of 3 with n 1",
        {"prompt": "hi", "max_tokens": 5, "best_of": 3, "n": 1, "ignore_eos": True},
        200,
        grpc_fields={"sampling": {"best_of": 3, "n": 1}, "stopping": {"max_tokens": 5, "ignore_eos": True}},
        grpc_code=None,
        params={"best_of": 3, "n": 1, "max_tokens": 5, "ignore_eos": True},
    ),
    Case(
        "best_of 2 with n 1, streamed",
        {"prompt": "hi", "max_tokens": 5, "best_of": 2, "n": 1, "ignore_eos": True, "stream": True},
        200,
    ),
]
IDS = [case.name for case in CASES]


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack([tiny_config(tiny_model_dir, "tiny", num_gpu_blocks_override=128, max_model_len=MAX_MODEL_LEN)])
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def canary_text(stack) -> str:
    with stack.client() as client:
        return client.post("/v1/completions", json=CANARY).json()["choices"][0]["text"]


def assert_unharmed(stack: Stack, canary_text: str) -> None:
    """The canary's exact text, and nothing left in the engine."""
    with stack.client() as client:
        response = client.post("/v1/completions", json=CANARY)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == canary_text
    deadline = time.monotonic() + 5
    while True:
        stats = stack.engine().stats()
        idle = (stats["num_requests_running"], stats["num_requests_waiting"], stats["num_requests_swapped"]) == (
            0,
            0,
            0,
        )
        if idle and stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_http(stack, canary_text, case: Case):
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    started = time.monotonic()
    with stack.client() as client:
        response = client.post(case.path, content=content, headers=case.headers)
    assert time.monotonic() - started < ANSWER_WITHIN_S
    assert response.status_code == case.status, response.text[:500]
    if case.status != 200:
        error = assert_openai_error(response)
        if case.message is not None:
            assert error["message"] == case.message
    elif isinstance(case.body, dict) and case.body.get("stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["index"] for chunk in chunks for c in chunk["choices"]} == {0}
        assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"]][-1] == "length"
    else:
        body = response.json()
        assert [c["index"] for c in body["choices"]] == [0]
        assert body["usage"]["completion_tokens"] == case.body["best_of"] * case.body["max_tokens"]
    assert_unharmed(stack, canary_text)


GRPC_CASES = [case for case in CASES if case.grpc_fields is not None]


@pytest.mark.parametrize("case", GRPC_CASES, ids=[c.name for c in GRPC_CASES])
def test_grpc(stack, canary_text, case: Case):
    stub = stack.grpc_stub()
    started = time.monotonic()
    try:
        responses = list(stub.Generate(grpc_request(case.grpc_fields), timeout=ANSWER_WITHIN_S))
    except grpc.RpcError as exc:
        assert case.grpc_code is not None, exc
        assert exc.code() == case.grpc_code, exc
        if case.message is not None:
            assert exc.details() == case.message
    else:
        assert case.grpc_code is None, responses[:1]
        last = responses[-1]
        assert last.finished
        assert {d.index for r in responses for d in r.outputs} == {0}
        stopping = case.grpc_fields["stopping"]
        assert last.usage.completion_tokens == case.grpc_fields["sampling"]["best_of"] * stopping["max_tokens"]
    assert time.monotonic() - started < ANSWER_WITHIN_S
    assert_unharmed(stack, canary_text)


def test_grpc_ids_cannot_collide_with_sample_ids(stack, canary_text):
    stub = stack.grpc_stub()
    first = stub.Generate(grpc_request({"request_id": "x#1", "stopping": {"max_tokens": 30, "ignore_eos": True}}))
    second = stub.Generate(
        grpc_request({"request_id": "x", "sampling": {"n": 2}, "stopping": {"max_tokens": 30, "ignore_eos": True}})
    )
    results = {}
    for call in (first, second):
        responses = list(call)
        results[responses[0].request_id] = responses
    for request_id, num_samples in (("x#1", 1), ("x", 2)):
        last = results[request_id][-1]
        assert last.finished and last.usage.completion_tokens == 30 * num_samples
        tokens = {}
        for response in results[request_id]:
            for delta in response.outputs:
                tokens.setdefault(delta.index, []).extend(delta.token_ids)
        assert {i: len(t) for i, t in tokens.items()} == {i: 30 for i in range(num_samples)}
    assert_unharmed(stack, canary_text)


def test_a_long_stop_string_holds_back_only_what_could_begin_it(stack, canary_text):
    body = dict(CANARY, stream=True, stop=["\u2603" * 256], max_tokens=12)  # never matched: nothing held back
    with stack.client() as client:
        response = client.post("/v1/completions", json=body)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    texts = [c["text"] for e in events[:-1] for c in json.loads(e)["choices"]]
    assert "".join(texts) == canary_text
    assert len([t for t in texts if t]) > 1  # text streamed as it came, not all at the end


LLM_CASES = [case for case in CASES if case.params is not None]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=64, max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("case", LLM_CASES, ids=[c.name for c in LLM_CASES])
def test_llm(llm, case: Case):
    canary = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(CANARY["prompt"], canary, use_tqdm=False)[0].outputs[0].token_ids
    kwargs = {"max_tokens": 4, **case.params}
    if case.status == 200:
        [output] = llm.generate("hi", SamplingParams(temperature=1.0, seed=1, **kwargs), use_tqdm=False)
        assert [c.index for c in output.outputs] == [0]
        assert output.num_generated_tokens == kwargs["best_of"] * kwargs["max_tokens"]
    else:
        with pytest.raises(ValueError) as info:
            llm.generate("hi", SamplingParams(**kwargs), use_tqdm=False)
        assert str(info.value) == case.message
    assert llm.generate(CANARY["prompt"], canary, use_tqdm=False)[0].outputs[0].token_ids == expected
    stats = llm.stats()
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]
    assert (stats["num_requests_running"], stats["num_requests_waiting"]) == (0, 0)


FAULT = "detokenizing or stop matching failed: RuntimeError: injected fault"


def test_a_request_whose_handling_fails_gets_an_error_on_every_api(stack, canary_text, monkeypatch):
    fail_stop_matching(monkeypatch, RuntimeError("injected fault"))
    victim = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "stop": ["VICTIM"]}
    with stack.client() as client:
        response = client.post("/v1/completions", json=victim)
        assert response.status_code == 500
        error = assert_openai_error(response)
        assert (error["message"], error["type"]) == (FAULT, "server_error")
        streamed = client.post("/v1/completions", json=dict(victim, stream=True))
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == FAULT
    with pytest.raises(grpc.RpcError) as info:
        list(stack.grpc_stub().Generate(grpc_request({"stopping": {"max_tokens": 8, "stop_sequences": ["VICTIM"]}})))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INTERNAL, FAULT)
    assert_unharmed(stack, canary_text)

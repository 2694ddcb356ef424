"""Bad input: schema-driven fuzzing of the HTTP API and hand-written malformed requests.

Every bad request gets an OpenAI-shaped 4xx (Anthropic-shaped on the Messages API's routes), nothing gets a
5xx or hangs, and a good request streaming beside them keeps its exact tokens.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode

from raypaged import LLM, SamplingParams
from tests.reliability.conftest import (
    GoodTraffic,
    assert_anthropic_error,
    assert_openai_error,
    fuzz_beside_good_traffic,
)
from tests.serving.conftest import Stack, tiny_config

MAX_MODEL_LEN = 64
GOOD = {"model": "tiny", "prompt": "A good request", "max_tokens": 40, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack(
        [tiny_config(tiny_model_dir, "tiny", num_gpu_blocks_override=512, max_model_len=MAX_MODEL_LEN)],
        enable_scale_out=True,  # its render, generate, abort and derender routes are fuzzed too
    )
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def good_text(tiny_model_dir) -> str:
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=64, max_model_len=MAX_MODEL_LEN)
    text = (
        llm.generate(GOOD["prompt"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].text
    )
    llm.shutdown()
    return text


def test_schema_fuzzing_gives_no_5xx_and_no_hang(stack, good_text, soak):
    document = httpx.get(f"{stack.url}/openapi.json").json()
    schema = schemathesis.openapi.from_dict(document)
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    ran: list[tuple[str, int]] = []

    def check(case) -> None:
        response = case.call(base_url=stack.url, timeout=60)
        ran.append((f"{case.method} {case.path}", response.status_code))
        assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text)
        if response.status_code >= 400:
            answer = httpx.Response(response.status_code, content=response.content)
            if case.path in ("/v1/messages", "/v1/messages/count_tokens"):  # its render answers as vLLM's: OpenAI's
                assert_anthropic_error(answer)
            else:
                assert_openai_error(answer)

    texts = fuzz_beside_good_traffic(stack.url, GOOD, cases, check, 1000 if soak else 120, soak)
    print(
        f"fuzz cases run: {len(ran)}; by operation: "
        f"{json.dumps({op: sum(1 for o, _ in ran if o == op) for op in sorted({o for o, _ in ran})})}"
    )
    assert texts and all(t == good_text for t in texts)


SURROGATE = "request body is not valid JSON: a string holds an unpaired UTF-16 surrogate"
# (path, body as bytes or JSON, status, message, param)
BAD_REQUESTS = [
    (
        "/v1/completions",
        b"{not json",
        400,
        "request body is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        None,
    ),
    (
        "/v1/completions",
        b'{"prompt": "\xff\xfe"}',
        400,
        "request body is not valid JSON: 'utf-8' codec can't decode byte 0xff in position 12: invalid start byte",
        None,
    ),
    ("/v1/completions", b'{"prompt": "\\ud800"}', 400, SURROGATE, None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, SURROGATE, None),
    ("/tokenize", b'{"prompt": "a\\ud800b"}', 400, SURROGATE, None),
    (
        "/v1/completions",
        b'{"prompt": "x", "temperature": NaN}',
        400,
        "request body is not valid JSON: NaN is not a JSON number",
        None,
    ),
    ("/v1/completions", b'{"prompt": "x", "top_p": 1e400}', 400, "top_p: Input should be a finite number", "top_p"),
    ("/v1/completions", [1, 2], 400, "Input should be a valid dictionary or instance of CompletionRequest", None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt.str: Input should be a valid string", "prompt.str"),
    (
        "/v1/completions",
        {"prompt": "x", "max_tokens": "ten"},
        400,
        "max_tokens: Input should be a valid integer, unable to parse string as an integer",
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "max_tokens": 10**12},
        400,
        "max_tokens: Input should be less than or equal to 4294967295",
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "n": 10**6},
        400,
        "n has 1000000 samples, more than the limit of 128 (--max-num-samples)",
        "n",
    ),
    ("/v1/completions", {"prompt": "x", "n": 2**32}, 400, "n: Input should be less than or equal to 4294967295", "n"),
    (
        "/v1/completions",
        {"prompt": "x", "logprobs": 21},
        400,
        "logprobs 21 is more than the limit of 20 (--max-logprobs, at most the vocabulary size 49152)",
        "logprobs",
    ),
    (
        "/v1/completions",
        {"prompt": ["x"] * 1025},
        400,
        "prompt has 1025 prompts, more than the limit of 1024 (--max-prompts-per-request)",
        "prompt",
    ),
    (
        "/v1/completions",
        {"prompt": [[5]] * 1025},
        400,
        "prompt has 1025 prompts, more than the limit of 1024 (--max-prompts-per-request)",
        "prompt",
    ),
    ("/v1/completions", b"[" * 100_000, 400, "request body is not valid JSON: it nests too deeply", None),
    (
        "/v1/chat/completions",
        b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        400,
        "request body is not valid JSON: it nests too deeply",
        None,
    ),
    (
        "/v1/completions",
        {"prompt": "x", "seed": 2**70},
        400,
        "seed: Input should be less than or equal to 9223372036854775807",
        "seed",
    ),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature must be non-negative, got -1.0", None),
    (
        "/v1/completions",
        {"prompt": "x", "max_tokens": -5},
        400,
        "max_tokens: Input should be greater than or equal to 0",
        "max_tokens",
    ),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0", None),
    (
        "/v1/completions",
        {"prompt": "x", "min_tokens": 100, "max_tokens": 3},
        400,
        "min_tokens must be less than or equal to max_tokens=3, got 100",
        None,
    ),
    ("/v1/completions", {"prompt": ""}, 400, "prompt must not be empty", "prompt"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt must not be empty", "prompt"),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt must be token ids in [0, 49152), got 1000000", "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages must not be empty", "messages"),
    (
        "/v1/completions",
        {"prompt": "x" * 10_000_000},
        400,
        "prompt has 10000000 characters, more than the limit of 2048 (--max-prompt-chars) before tokenization",
        "prompt",
    ),
    ("/detokenize", {"tokens": [2**33]}, 400, "tokens.0: Input should be less than or equal to 4294967295", "tokens.0"),
]


def test_bad_requests_get_exact_4xx_and_leave_a_good_request_unchanged(stack, good_text, caplog):
    traffic = GoodTraffic(stack.url, GOOD)
    try:
        with stack.client() as client:
            for path, body, status, message, param in BAD_REQUESTS:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                response = client.post(path, content=content, headers={"Content-Type": "application/json"})
                assert response.status_code == status, (path, body if len(content) < 200 else "...", response.text)
                error = assert_openai_error(response)
                assert (error["message"], error["param"], error["type"]) == (message, param, "invalid_request_error")
            # odd but valid: unknown fields are ignored; only special tokens, or an empty message, still generate
            greedy = {"max_tokens": 3, "ignore_eos": True, "temperature": 0}
            plain = client.post("/v1/completions", json={"prompt": "x", **greedy}).json()["choices"][0]["text"]
            extra = client.post("/v1/completions", json={"prompt": "x", "frobnicate": {"a": 1}, **greedy})
            assert extra.json()["choices"][0]["text"] == plain
            special = client.post("/v1/completions", json={"prompt": "<|im_start|><|im_end|>", **greedy})
            assert special.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
            empty = client.post("/v1/chat/completions", json={"messages": [{"role": "user"}], **greedy})
            assert empty.status_code == 200 and empty.json()["usage"]["completion_tokens"] == 3
    finally:
        texts = traffic.stop()
    assert texts and all(t == good_text for t in texts)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]  # no traceback, no 500
    stats = stack.engine().stats()
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]

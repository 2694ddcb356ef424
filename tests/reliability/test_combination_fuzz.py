"""Valid fields in random combinations, on every generation API of one server that runs its features together
(chunked prefill, prefix caching, n-gram drafts, preemption, a reasoning and a tool parser).

Each field is checked alone elsewhere; what breaks is a combination (``allowed_token_ids`` with a grammar left a
row no token, and the engine drew token 0 and failed with a 500). Every request gets a 200 or a 4xx of its API's
shape, every stream ends, a stream's error event is the request's own (``invalid_request_error``), a greedy
request beside them keeps its exact text, and every KV block is free afterwards.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import strategies as st

from raypaged import LLM, SamplingParams
from tests.reliability.conftest import assert_anthropic_error, assert_openai_error, fuzz_beside_good_traffic
from tests.serving.conftest import Stack, tiny_config

MAX_MODEL_LEN = 128
GOOD = {"model": "tiny", "prompt": "A good request", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

words = st.sampled_from(["hello", "the", " cat", "Paris", "1", ",", "\n", "é", "日本", "🙂", "<think>", "</think>"])
text = st.lists(words, min_size=1, max_size=10).map(" ".join)
SAMPLING = {
    "temperature": st.sampled_from([0, 0.7, 2.0]),
    "top_p": st.sampled_from([0.1, 1.0]),
    "top_k": st.sampled_from([-1, 1, 5]),
    "min_p": st.sampled_from([0.0, 0.5]),
    "seed": st.integers(0, 2**31),
    "presence_penalty": st.sampled_from([-2, 2]),
    "frequency_penalty": st.sampled_from([-2, 2]),
    "repetition_penalty": st.sampled_from([0.5, 2.0]),
    "min_tokens": st.sampled_from([0, 1, 6]),
    "max_tokens": st.sampled_from([1, 6, 16]),
    "ignore_eos": st.booleans(),
    "stop": st.sampled_from([".", ["\n", "the"], "e"]),
    "stop_token_ids": st.sampled_from([[2], [0, 1, 2]]),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "logit_bias": st.sampled_from([{"2": -100}, {"5": 100}]),
    "allowed_token_ids": st.sampled_from([[5, 6, 7], [2], list(range(100, 140))]),
    "bad_words": st.sampled_from([["the"], ["hello world", "cat"]]),
    "n": st.sampled_from([1, 2]),
    "best_of": st.sampled_from([None, 3]),
    "use_beam_search": st.booleans(),
    "prompt_logprobs": st.sampled_from([0, 2]),
    "truncate_prompt_tokens": st.sampled_from([-1, 3]),
    "structured_outputs": st.sampled_from(
        [{"regex": "[a-z]{1,5}"}, {"choice": ["yes", "no"]}, {"json": SCHEMA}, {"grammar": 'root ::= "a" | "b" root'}]
    ),
    "stream": st.booleans(),
}
COMPLETIONS = {**SAMPLING, "logprobs": st.sampled_from([0, 3]), "echo": st.booleans()}
CHAT = {
    **SAMPLING,
    "logprobs": st.booleans(),
    "top_logprobs": st.sampled_from([0, 2]),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}]),
    "tools": st.just([TOOL]),
    "tool_choice": st.sampled_from(
        ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]
    ),
    "chat_template_kwargs": st.sampled_from([{"enable_thinking": True}, {"enable_thinking": False}]),
    "include_reasoning": st.booleans(),
    "add_special_tokens": st.booleans(),
}
RESPONSES = {
    "max_output_tokens": st.sampled_from([4, 16]),
    "temperature": st.sampled_from([0, 1]),
    "stream": st.booleans(),
    "tools": st.just([{"type": "function", **TOOL["function"]}]),
    "tool_choice": st.sampled_from(["auto", "required", "none"]),
    "text": st.sampled_from(
        [{"format": {"type": "json_object"}}, {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}]
    ),
    "top_logprobs": st.sampled_from([0, 2]),
}
MESSAGES = {
    "system": text,
    "stream": st.booleans(),
    "temperature": st.sampled_from([0, 1]),
    "stop_sequences": st.just(["the"]),
    "tools": st.just([{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}]),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"}]),
    "top_k": st.sampled_from([1, 5]),
}
token_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=12)
requests = st.one_of(
    st.tuples(
        st.just("/v1/completions"),
        st.fixed_dictionaries(
            {"model": st.just("tiny"), "prompt": st.one_of(text, st.lists(text, min_size=2, max_size=2), token_ids)},
            optional=COMPLETIONS,
        ),
    ),
    st.tuples(
        st.just("/v1/chat/completions"),
        st.fixed_dictionaries(
            {"model": st.just("tiny"), "messages": text.map(lambda t: [{"role": "user", "content": t}])}, optional=CHAT
        ),
    ),
    st.tuples(
        st.just("/v1/responses"), st.fixed_dictionaries({"model": st.just("tiny"), "input": text}, optional=RESPONSES)
    ),
    st.tuples(
        st.just("/v1/messages"),
        st.fixed_dictionaries(
            {
                "model": st.just("tiny"),
                "max_tokens": st.sampled_from([4, 16]),
                "messages": text.map(lambda t: [{"role": "user", "content": t}]),
            },
            optional=MESSAGES,
        ),
    ),
)


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    config = tiny_config(
        tiny_model_dir,
        "tiny",
        num_gpu_blocks_override=48,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
        structured_outputs_config={"reasoning_parser": "qwen3"},
    )
    stack = Stack([config], enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def good_text(tiny_model_dir) -> str:
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=64, max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0, max_tokens=GOOD["max_tokens"], ignore_eos=True)
    text = llm.generate(GOOD["prompt"], params)[0].outputs[0].text
    llm.shutdown()
    return text


def check_answer(path: str, body: dict, response: httpx.Response) -> None:
    """A 200 (a stream that ends, with no error event but the request's own) or a 4xx of its API's shape."""
    assert response.status_code < 500, (path, body, response.status_code, response.text)
    if response.status_code >= 400:
        (assert_anthropic_error if path == "/v1/messages" else assert_openai_error)(response)
        return
    if not body.get("stream"):
        return
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    for event in events:
        if event != "[DONE]" and '"error"' in event[:24]:
            assert json.loads(event)["error"]["type"] == "invalid_request_error", (path, body, event)
    if path in ("/v1/completions", "/v1/chat/completions"):
        assert events and events[-1] == "[DONE]", (path, body, events[-3:])
    elif path == "/v1/responses":  # a terminal event last (or the request's own error)
        last = json.loads(events[-1])
        assert last.get("type") in ("response.completed", "response.incomplete", "error"), (body, events[-3:])
    else:
        assert json.loads(events[-1])["type"] in ("message_stop", "error"), (body, events[-3:])


def test_valid_fields_in_any_combination_give_no_5xx_and_leave_the_others_exact(stack, good_text, soak):
    def check(request: tuple[str, dict]) -> None:
        path, body = request
        with httpx.Client(base_url=stack.url, timeout=120) as client:
            check_answer(path, body, client.post(path, json=body))

    texts = fuzz_beside_good_traffic(stack.url, GOOD, requests, check, 1000 if soak else 150, soak)
    assert texts and all(t == good_text for t in texts)
    stats = stack.engine().stats()
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]

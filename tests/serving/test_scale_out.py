"""vLLM's scale-out endpoints (``--enable-scale-out``): a render endpoint's request generates on
``/inference/v1/generate`` exactly what its body generates on the OpenAI route; render refuses what those routes
refuse, in the same words; ``/inference/v1/generate`` refuses, by name, what it cannot honour."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from raypaged.serving.gateway.drain import Drain
from raypaged.serving.gateway.engines import EngineRoutes
from raypaged.serving.gateway.guard import check_exempt_paths
from raypaged.serving.gateway.scale_out_request import GenerateBody, sampling_json
from raypaged.serving.gateway.tenants import Tenants
from raypaged.serving.launch import GatewayOptions, gateway_app
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.protocol import ALL_LOGPROBS
from tests.serving.conftest import Stack, tiny_config
from tests.serving.test_server_flags import options

KEY = "sk-scale"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    # the model's defaults: a temperature that samples, and a chat answer's length when the body sets none
    config = tiny_config(tiny_model_dir, "tiny", override_generation_config={"temperature": 0.5, "max_new_tokens": 9})
    stack = Stack([config], api_key=KEY, enable_scale_out=True)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def http(stack):
    with stack.client(headers=AUTH) as client:
        yield client


def ok(response: httpx.Response) -> dict | list:
    assert response.status_code == 200, response.text
    return response.json()


def tokenized(http: httpx.Client, **body) -> list[int]:
    return ok(http.post("/tokenize", json={"model": "tiny", **body}))["tokens"]


def events(text: str) -> list[dict | str]:
    found = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in found]


def test_a_rendered_completion_is_vllms_generate_request_with_the_prompts_token_ids(http):
    body = {
        **GREEDY,
        "request_id": "r1",
        "n": 2,
        "seed": 7,
        "logprobs": 2,
        "stop": ["zz"],
        "logit_bias": {"5": 1.5},
        "min_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    [rendered] = ok(http.post("/v1/completions/render", json=body))
    assert rendered == {
        "request_id": "cmpl-r1",
        "token_ids": tokenized(http, prompt="Hello there"),
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": {
            "n": 2,
            "temperature": 0.0,
            "seed": 7,
            "stop": ["zz"],
            "ignore_eos": True,
            "max_tokens": 5,
            "min_tokens": 1,
            "logprobs": 2,
            "logit_bias": {"5": 1.5},
        },
        "model": "tiny",
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def test_a_completion_of_several_prompts_renders_one_request_each_and_the_models_defaults_are_written(http):
    body = {"model": "tiny", "prompt": [[5, 6, 7], [8]], "request_id": "two"}
    rendered = ok(http.post("/v1/completions/render", json=body))
    assert [r["request_id"] for r in rendered] == ["cmpl-two-0", "cmpl-two-1"]
    assert [r["token_ids"] for r in rendered] == [[5, 6, 7], [8]]
    # the generation config's temperature, and completions' default max_tokens
    assert [r["sampling_params"] for r in rendered] == [{"temperature": 0.5, "max_tokens": 16}] * 2


def test_a_rendered_chat_completion_is_one_request_with_the_templates_token_ids(http):
    rendered = ok(http.post("/v1/chat/completions/render", json=CHAT))
    assert rendered["request_id"].startswith("chatcmpl-")
    assert rendered["token_ids"] == tokenized(http, messages=CHAT["messages"])
    # no max_tokens in the body: the generation config's max_new_tokens
    assert rendered["sampling_params"] == {"temperature": 0.0, "ignore_eos": True, "max_tokens": 9}


def test_truncate_prompt_tokens_is_applied_by_render(http):
    prompt = "one two three four five six seven"
    [rendered] = ok(http.post("/v1/completions/render", json={**GREEDY, "prompt": prompt, "truncate_prompt_tokens": 3}))
    assert rendered["token_ids"] == tokenized(http, prompt=prompt)[-3:]
    assert "truncate_prompt_tokens" not in rendered["sampling_params"]


@pytest.mark.parametrize(
    "body",
    [
        {**GREEDY, "logprobs": 2},
        {**GREEDY, "prompt": ["Hello there", "Bye"], "n": 2, "temperature": 0.9, "seed": 3},  # seeded sampling
        {**GREEDY, "max_tokens": 4, "n": 2, "seed": 11, "temperature": None},  # the model's temperature, 0.5
        {**GREEDY, "prompt": "one two three four five", "truncate_prompt_tokens": 2, "stop_token_ids": [2]},
        {**GREEDY, "structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 8},
    ],
    ids=["greedy-logprobs", "seeded-two-prompts", "model-default-temperature", "truncated", "structured"],
)
def test_a_rendered_completion_generates_exactly_what_the_completion_does(http, body):
    body = {k: v for k, v in body.items() if v is not None}
    completion = ok(http.post("/v1/completions", json={**body, "return_token_ids": True}))
    rendered = ok(http.post("/v1/completions/render", json=body))
    answers = [ok(http.post("/inference/v1/generate", json=r)) for r in rendered]
    generated = [(c["token_ids"], c["finish_reason"]) for a in answers for c in a["choices"]]
    assert generated == [(c["token_ids"], c["finish_reason"]) for c in completion["choices"]]
    for name in ("prompt_tokens", "completion_tokens"):
        assert sum(a["usage"][name] for a in answers) == completion["usage"][name]
    if "logprobs" in body:  # greedy: the sampled token is the most likely, so it leads its top two
        [logprobs] = [c["logprobs"] for c in completion["choices"]]
        content = answers[0]["choices"][0]["logprobs"]["content"]
        assert [e["logprob"] for e in content] == logprobs["token_logprobs"]
        assert [[t["logprob"] for t in e["top_logprobs"]] for e in content] == [
            sorted(top.values(), reverse=True) for top in logprobs["top_logprobs"]
        ]
        assert [[t["rank"] for t in e["top_logprobs"]] for e in content] == [[1, 2]] * len(content)


def test_a_rendered_chat_completion_generates_exactly_what_the_chat_completion_does(http):
    chat = ok(http.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True}))
    answer = ok(http.post("/inference/v1/generate", json=ok(http.post("/v1/chat/completions/render", json=CHAT))))
    assert answer["choices"][0]["token_ids"] == chat["choices"][0]["token_ids"]
    assert len(answer["choices"][0]["token_ids"]) == 9  # the generation config's max_new_tokens, on both
    assert answer["usage"] == {**chat["usage"], "prompt_tokens_details": None}


def test_a_generate_answer_is_vllms_generate_response(http):
    request = {
        "request_id": "g1",
        "token_ids": [5, 6, 7],
        "sampling_params": {"temperature": 0, "max_tokens": 2, "ignore_eos": True, "logprobs": 1, "prompt_logprobs": 1},
        "return_token_ids": True,
    }
    answer = ok(http.post("/inference/v1/generate", json=request))
    completion = ok(
        http.post(
            "/v1/completions",
            json={**GREEDY, "prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 1, "prompt_logprobs": 1},
        )
    )
    [choice] = answer["choices"]
    sampled = [
        {"token_id": t, "logprob": lp, "rank": 1}
        for t, lp in zip(choice["token_ids"], completion["choices"][0]["logprobs"]["token_logprobs"])
    ]
    assert answer == {
        "request_id": "generate-tokens-g1",
        "model": "tiny",
        "created": answer["created"],
        "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None},
        "prompt_logprobs": completion["choices"][0]["prompt_logprobs"],
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": [5, 6, 7],
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "token_ids": choice["token_ids"],
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": None,
                "logprobs": {"content": [s | {"top_logprobs": [s]} for s in sampled]},
            }
        ],
    }


def test_text_mode_adds_the_text_and_decoded_logprobs(http):
    request = {"token_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_tokens": 3, "logprobs": 0}}
    answer = ok(http.post("/inference/v1/generate", json={**request, "output_mode": "text"}))
    completion = ok(http.post("/v1/completions", json={**GREEDY, "prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 0}))
    [choice] = answer["choices"]
    assert (answer["output_mode"], choice["text"]) == ("text", completion["choices"][0]["text"])
    tokens = completion["choices"][0]["logprobs"]["tokens"]
    assert [(e["token"], e["bytes"], len(e["top_logprobs"])) for e in choice["logprobs"]["content"]] == [
        (t, list(t.encode()), 1) for t in tokens
    ]


def test_a_streamed_generate_sends_a_chunk_per_step_the_usage_then_done(http):
    request = {
        "request_id": "s1",
        "token_ids": [5, 6, 7],
        "sampling_params": {"temperature": 0, "max_tokens": 3, "ignore_eos": True},
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    whole = ok(http.post("/inference/v1/generate", json={**request, "stream": False}))["choices"][0]["token_ids"]
    answer = http.post("/inference/v1/generate", json=request)
    assert answer.status_code == 200
    found = events(answer.text)

    def chunk(i: int) -> dict:
        usage = {"prompt_tokens": 3, "total_tokens": 4 + i, "completion_tokens": 1 + i, "prompt_tokens_details": None}
        choice = {
            "index": 0,
            "finish_reason": "length" if i == 2 else None,
            "token_ids": [whole[i]],
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": None,
            "logprobs": None,
        }
        first = {"prompt_token_ids": [5, 6, 7]} if i == 0 else {}
        return {
            "request_id": "generate-tokens-s1",
            "usage": usage,
            **first,
            "output_mode": "tokens",
            "choices": [choice],
        }

    last = {
        "request_id": "generate-tokens-s1",
        "usage": {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3},
        "output_mode": "tokens",
        "choices": [],
    }
    assert found == [chunk(0), chunk(1), chunk(2), last, "[DONE]"]


def error(status: int, message: str, param: str | None) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


def answered(response: httpx.Response) -> tuple[int, dict]:
    return response.status_code, response.json()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}),  # refused by the gateway
        ("/v1/completions", {**GREEDY, "prompt": "x " * 300}),  # by the engine's input gate
        ("/v1/completions", {**GREEDY, "temperature": -1}),  # by the engine's sampling params
        ("/v1/completions", {**GREEDY, "logprobs": 50}),  # over --max-logprobs
        ("/v1/completions", {**GREEDY, "suffix": "x"}),  # a vLLM field this server cannot honour
        ("/v1/completions", {**GREEDY, "priority": 1}),  # fcfs scheduling
    ],
)
def test_render_refuses_what_the_openai_route_refuses_with_the_same_error(http, path, body):
    expected = answered(http.post(path, json=body))
    assert expected[0] == 400
    assert answered(http.post(path + "/render", json=body)) == expected


@pytest.mark.parametrize(
    "path, body, refused",
    [
        ("/v1/completions/render", {**GREEDY, "echo": True}, "echo"),
        ("/v1/chat/completions/render", {**CHAT, "use_beam_search": True, "n": 2}, "use_beam_search"),
    ],
)
def test_render_refuses_what_a_generate_request_cannot_carry(http, path, body, refused):
    assert answered(http.post(path, json=body)) == error(
        400, f"{refused} is not supported by the render endpoints: a GenerateRequest cannot carry it", refused
    )


@pytest.mark.parametrize(
    "request_fields, message, param",
    [
        (
            {"sampling_params": {"foo": 1}},
            "sampling_params.foo is not supported by this server; send the request without it",
            "sampling_params.foo",
        ),
        (
            {"sampling_params": {"detokenize": False}},
            "sampling_params.detokenize is not supported by this server; send the request without it",
            "sampling_params.detokenize",
        ),
        (
            {"kv_transfer_params": {"remote": 1}},
            "kv_transfer_params is not supported by this server; send the request without it",
            "kv_transfer_params",
        ),
        (
            {"features": {"mm_hashes": {}}},
            "features is not supported by this server; send the request without it",
            "features",
        ),
        ({"token_ids": []}, "token_ids: List should have at least 1 item after validation, not 0", "token_ids"),
        (
            {"stream": True, "sampling_params": {"prompt_logprobs": 1}},
            "prompt_logprobs are not available when stream is true",
            "sampling_params.prompt_logprobs",
        ),
        ({"sampling_params": {"temperature": -1}}, "temperature must be non-negative, got -1.0", None),
    ],
)
def test_generate_refuses_what_it_cannot_honour_by_name(http, request_fields, message, param):
    request = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 1}} | request_fields
    assert answered(http.post("/inference/v1/generate", json=request)) == error(400, message, param)


def test_vllms_engine_internal_sampling_fields_are_taken(http):
    request = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 1, "output_kind": 2, "skip_clone": True}}
    assert len(ok(http.post("/inference/v1/generate", json=request))["choices"][0]["token_ids"]) == 1


def test_generate_needs_the_api_key_and_cannot_be_exempt_from_it(stack):
    with stack.client() as anonymous:
        assert anonymous.post("/inference/v1/generate", json={}).status_code == 401
        assert anonymous.post("/v1/completions/render", json={}).status_code == 401
    with pytest.raises(ValueError, match="cannot include /inference/v1/generate"):
        check_exempt_paths(("/inference/v1/generate",))


def test_the_flag_reaches_the_gateway_and_without_it_the_endpoints_are_404():
    assert (options("--enable-scale-out").enable_scale_out, options().enable_scale_out) == (True, False)
    with pytest.raises(ValueError, match="^--tokens-only is not supported: "):
        options("--tokens-only")
    app = gateway_app(EngineRoutes({"tiny": "127.0.0.1:1"}), Tenants([]), Drain(0), GatewayOptions())
    transport = httpx.ASGITransport(app=app)

    async def statuses() -> list[int]:
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            paths = ("/v1/completions/render", "/v1/chat/completions/render", "/inference/v1/generate")
            return [(await client.post(path, json={})).status_code for path in paths]

    assert asyncio.run(statuses()) == [404, 404, 404]


def test_every_field_of_an_engine_request_crosses_the_generate_request_and_back():
    """What the OpenAI routes can ask of the engine, the JSON carries: each field of the gRPC request set
    (but the prompt, which is token ids, and what the render endpoints refuse or resolve), written by render
    and read by generate, is the same request again."""
    request = pb.GenerateRequest(
        request_id="x",
        model="tiny",
        token_ids=pb.TokenIds(ids=[1, 2]),
        sampling=pb.SamplingParameters(
            n=2,
            best_of=3,
            temperature=0.7,
            top_p=0.9,
            top_k=-1,
            min_p=0.1,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            seed=-9,
            logit_bias={7: -2.0, 3: 1.0},
            allowed_token_ids=[3, 7],
            bad_words=["bad"],
            thinking_token_budget=4,
            logprob_token_ids=[7],
        ),
        stopping=pb.StoppingCriteria(
            max_tokens=16,
            min_tokens=2,
            stop_sequences=["a", "b"],
            stop_token_ids=[9],
            ignore_eos=True,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
            spaces_between_special_tokens=False,
            repetition_detection=pb.RepetitionDetection(max_pattern_size=4, min_pattern_size=2, min_count=3),
        ),
        logprobs=ALL_LOGPROBS,
        priority=-3,
        structured=pb.StructuredOutput(
            json_schema='{"type": "object"}', disable_any_whitespace=True, in_reasoning=True
        ),
        prompt_logprobs=2,
        truncate_prompt_tokens=5,
        return_token_ids=True,
        stream_interval=3,
        cache_salt="salt",
    )
    not_carried = {"text", "messages", "echo", "beam_search", "truncation_side"}  # refused, or resolved by render
    set_fields = {f.name for f, _ in request.ListFields()}
    assert {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields} - set_fields == not_carried
    for message in (request.sampling, request.stopping):
        assert [f.name for f, _ in message.ListFields()] == [f.name for f in message.DESCRIPTOR.fields]
    body = {
        "request_id": "x",
        "token_ids": [1, 2],
        "sampling_params": sampling_json(request),
        "reasoning_ended": True,
        "return_token_ids": True,
        "cache_salt": "salt",
        "priority": -3,
    }
    assert GenerateBody.model_validate(json.loads(json.dumps(body))).engine_request("tiny", "x") == request


def test_the_engine_renders_alike_over_grpc(stack, http):
    [rendered] = ok(http.post("/v1/completions/render", json={**GREEDY, "request_id": "grpc"}))
    request = pb.GenerateRequest(
        request_id="cmpl-grpc",
        model="tiny",
        text="Hello there",
        sampling=pb.SamplingParameters(n=1, temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=5, ignore_eos=True),
    )
    answer = stack.grpc_stub().Render(request, metadata=(("authorization", f"Bearer {KEY}"),))
    assert answer.request.request_id == rendered["request_id"]
    assert list(answer.request.token_ids.ids) == rendered["token_ids"]
    assert sampling_json(answer.request) == rendered["sampling_params"]

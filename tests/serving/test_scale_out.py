"""vLLM's scale-out endpoints (``--enable-scale-out``): a render endpoint's request generates on
``/inference/v1/generate`` exactly what its body generates on the OpenAI route, and derendered answers what that
route answers; render refuses what those routes refuse, in the same words; ``/inference/v1/generate`` and the
derender endpoints refuse, by name, what they cannot honour; without the flag every path is a 403."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from raypaged.serving.gateway.drain import Drain
from raypaged.serving.gateway.engines import EngineRoutes
from raypaged.serving.gateway.guard import check_exempt_paths
from raypaged.serving.gateway.scale_out import SCALE_OUT_PATHS
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
    stack = Stack([config], api_key=KEY, enable_scale_out=True, enable_auto_tool_choice=True, tool_call_parser="hermes")
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
        "parse_context": None,
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
                "stop_reason": None,
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
            "stop_reason": None,
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
        ("/v1/chat/completions/render", {**CHAT, "mm_processor_kwargs": {"max_pixels": 9}}, "mm_processor_kwargs"),
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


def test_the_endpoints_need_the_api_key_and_generate_and_abort_cannot_be_exempt_from_it(stack):
    with stack.client() as anonymous:
        assert [anonymous.post(path, json={}).status_code for path in SCALE_OUT_PATHS] == [401] * 8
    for path in ("/inference/v1/generate", "/inference/v1/abort_requests"):
        with pytest.raises(ValueError, match=f"cannot include {path}"):
            check_exempt_paths((path,))


def test_the_flag_reaches_the_gateway_and_without_it_every_endpoint_is_403():
    assert (options("--enable-scale-out").enable_scale_out, options().enable_scale_out) == (True, False)
    with pytest.raises(ValueError, match="^--tokens-only is not supported: "):
        options("--tokens-only")
    app = gateway_app(EngineRoutes({"tiny": "127.0.0.1:1"}), Tenants([]), Drain(0), GatewayOptions())
    transport = httpx.ASGITransport(app=app)

    async def answers() -> list[tuple[int, dict]]:
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return [answered(await client.post(path, json={})) for path in SCALE_OUT_PATHS]

    message = (
        "Scale-out endpoints are disabled. Restart raypaged serve (or raypaged gateway) with --enable-scale-out to "
        "enable them."
    )
    refused = (403, {"error": {"message": message, "type": "PermissionDeniedError", "param": None, "code": 403}})
    assert asyncio.run(answers()) == [refused] * 8
    assert SCALE_OUT_PATHS == (
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/v1/messages/render",
        "/v1/responses/render",
        "/v1/completions/derender",
        "/v1/chat/completions/derender",
        "/inference/v1/generate",
        "/inference/v1/abort_requests",
    )


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
    # refused, or resolved by render
    not_carried = {
        "text",
        "messages",
        "prompt_embeds",
        "echo",
        "beam_search",
        "truncation_side",
        "mm_processor_kwargs_json",
        "add_special_tokens",
        "parent_request_id",  # the gateway's, for a multi-prompt completion: each rendered request runs alone
    }
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


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_CHAT = {
    **CHAT,
    "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "and in Rome?"},
    ],
    "tools": [TOOL],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "max_tokens": 12,
    "logprobs": True,
    "top_logprobs": 2,
    "return_token_ids": True,
}


def without_ids(answer: dict) -> dict:
    """An answer without what differs between two answers for the same tokens: its id, time, tool call ids."""
    answer = {k: v for k, v in answer.items() if k not in ("id", "created")}
    for choice in answer.get("choices", ()):
        for call in (choice.get("message") or choice.get("delta") or {}).get("tool_calls") or ():
            call.pop("id", None)
    return answer


def test_a_rendered_chat_completion_carries_its_parse_context(http):
    rendered = ok(http.post("/v1/chat/completions/render", json={**TOOL_CHAT, "reasoning_effort": "low"}))
    assert rendered["parse_context"] == {
        "tools": [{**TOOL, "function": {**TOOL["function"], "strict": None}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": True,
        "include_reasoning": True,
        "chat_template_kwargs": {"reasoning_effort": "low", "enable_thinking": True},
        "history_tool_call_cnt": 1,
    }
    plain = ok(http.post("/v1/chat/completions/render", json={**CHAT, "return_tokens_as_token_ids": False}))
    assert plain["parse_context"] == {
        "tools": None,
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "include_reasoning": True,
        "return_tokens_as_token_ids": False,
        "chat_template_kwargs": {},
        "history_tool_call_cnt": 0,
    }


def test_render_generate_derender_answers_what_the_chat_route_answers(http):
    """A named tool call with logprobs: the message, its tool call, logprobs and token ids, the usage."""
    chat = ok(http.post("/v1/chat/completions", json=TOOL_CHAT))
    assert chat["choices"][0]["message"]["tool_calls"]
    rendered = ok(http.post("/v1/chat/completions/render", json=TOOL_CHAT))
    generated = ok(http.post("/inference/v1/generate", json=rendered))
    body = {"generate_response": generated, "chat_request": TOOL_CHAT, "prompt_token_ids": rendered["token_ids"]}
    derendered = ok(http.post("/v1/chat/completions/derender", json=body))
    assert derendered["id"] == generated["request_id"] == f"generate-tokens-{rendered['request_id']}"
    assert without_ids(derendered) == without_ids(chat)
    # without prompt_token_ids the engine renders the chat request's prompt for the detokenizer's context
    del body["prompt_token_ids"]
    assert without_ids(ok(http.post("/v1/chat/completions/derender", json=body))) == without_ids(chat)


def test_render_generate_derender_answers_what_the_completion_route_answers(http):
    """Two prompts, two seeded samples each, logprobs, and a stop string that cuts the text."""
    body = {**GREEDY, "prompt": ["Hello there", "Bye now"], "max_tokens": 10, "logprobs": 2}
    body |= {"n": 2, "temperature": 0.8, "seed": 5}
    text = ok(http.post("/v1/completions", json=body))["choices"][0]["text"]
    stop = text[4:6]  # a stop string the first answer meets
    completion = ok(http.post("/v1/completions", json={**body, "stop": [stop]}))
    body["stop"] = [stop]
    assert completion["choices"][0]["stop_reason"] == stop
    rendered = ok(http.post("/v1/completions/render", json=body))
    generated = [ok(http.post("/inference/v1/generate", json=r)) for r in rendered]
    derender = {"generate_responses": generated, "completion_request": body}
    assert without_ids(ok(http.post("/v1/completions/derender", json=derender))) == without_ids(completion)
    assert generated[0]["choices"][0]["stop_reason"] == stop


def test_a_completion_derenders_without_its_request_as_plain_text(http):
    """No completion_request: the prompt's tokens seed the detokenizer, the text is the completion's."""
    body = {**GREEDY, "prompt": [5, 6, 7], "max_tokens": 4}
    completion = ok(http.post("/v1/completions", json=body))
    generated = ok(http.post("/inference/v1/generate", json=ok(http.post("/v1/completions/render", json=body))[0]))
    derender = {"generate_responses": [generated], "prompt_token_ids": [[5, 6, 7]], "prompt_tokens": [7]}
    derendered = ok(http.post("/v1/completions/derender", json=derender))
    assert [(c["text"], c["finish_reason"]) for c in derendered["choices"]] == [
        (c["text"], c["finish_reason"]) for c in completion["choices"]
    ]
    assert derendered["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}


def test_output_mode_derender_answers_the_chat_routes_message(http):
    chat = ok(http.post("/v1/chat/completions", json=TOOL_CHAT))
    rendered = ok(http.post("/v1/chat/completions/render", json=TOOL_CHAT))
    answer = ok(http.post("/inference/v1/generate", json={**rendered, "output_mode": "derender"}))
    [choice] = answer["choices"]
    [expected] = chat["choices"]
    assert answer["output_mode"] == "derender"
    assert without_ids({"choices": [choice]}) == without_ids(
        {
            "choices": [
                {
                    "index": 0,
                    "finish_reason": expected["finish_reason"],
                    "stop_reason": expected["stop_reason"],
                    "token_ids": expected["token_ids"],
                    "routed_experts": None,
                    "sampling_mask": None,
                    "weight_versions": None,
                    "message": expected["message"],
                    "logprobs": expected["logprobs"],
                }
            ]
        }
    )
    streamed = events(
        http.post("/inference/v1/generate", json={**rendered, "output_mode": "derender", "stream": True}).text
    )
    deltas = [e["choices"][0]["delta"] for e in streamed[:-1]]
    assert deltas[0]["role"] == "assistant"
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d)
    assert arguments == expected["message"]["tool_calls"][0]["function"]["arguments"]
    assert [t for e in streamed[:-1] for t in e["choices"][0]["token_ids"]] == expected["token_ids"]


def derendered_stream(http: httpx.Client, path: str, request_field: str, body: dict, rendered: dict) -> list[dict]:
    """A rendered request's generate stream, derendered chunk by chunk with the state each answer carries."""
    found, state = [], None
    generated = events(http.post("/inference/v1/generate", json=rendered).text)[:-1]
    for chunk in generated:
        derender = {"stream": True, "generate_chunk": chunk, "stream_state": state, request_field: body}
        answer = ok(http.post(path, json=derender | {"prompt_token_ids": rendered["token_ids"]}))
        found.append(answer["chunk"])
        state = answer["stream_state"]
    assert state is not None
    assert state["output_token_ids"] == [t for chunk in generated for c in chunk["choices"] for t in c["token_ids"]]
    return found


def test_a_derendered_chat_stream_is_the_chat_routes_stream(http):
    body = {**TOOL_CHAT, "stream": True, "stream_options": {"include_usage": True}}
    chat = events(http.post("/v1/chat/completions", json=body).text)
    rendered = ok(http.post("/v1/chat/completions/render", json=body))
    found = derendered_stream(http, "/v1/chat/completions/derender", "chat_request", body, rendered)
    assert found[0]["choices"][0]["delta"].pop("role") == chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # the route's role chunk
    expected = [without_ids(c) for c in chat[1:-1]]
    assert [without_ids(c) for c in found] == expected
    assert found[-1]["usage"] == chat[-2]["usage"] and found[-1]["choices"] == []


def test_a_derendered_completion_stream_is_the_completion_routes_stream(http):
    body = {**GREEDY, "logprobs": 1, "max_tokens": 6, "stream": True}
    completion = events(http.post("/v1/completions", json=body).text)
    [rendered] = ok(http.post("/v1/completions/render", json=body))
    found = derendered_stream(http, "/v1/completions/derender", "completion_request", body, rendered)
    assert [without_ids(c) for c in found] == [without_ids(c) | {"usage": None} for c in completion[:-1]]


def test_abort_requests_ends_a_streaming_generate_by_its_id(http):
    request = {
        "request_id": "long",
        "token_ids": [5, 6, 7],
        "sampling_params": {"temperature": 0, "max_tokens": 240, "ignore_eos": True},
        "stream": True,
    }
    with http.stream("POST", "/inference/v1/generate", json=request) as streamed:
        lines = (json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {"))
        next(lines)  # it runs
        aborted = http.post("/inference/v1/abort_requests", json={"request_ids": "long"})  # no engine request's id
        assert (aborted.status_code, aborted.content) == (200, b"")
        assert [next(lines)["choices"][0]["finish_reason"] for _ in range(5)] == [None] * 5
        aborted = http.post("/inference/v1/abort_requests", json={"request_ids": ["other", "generate-tokens-long"]})
        assert (aborted.status_code, aborted.content) == (200, b"")
        rest = list(lines)
    assert rest[-1]["choices"][0]["finish_reason"] == "abort"
    assert len(rest) < 200


def test_abort_requests_refuses_a_body_without_ids(http):
    assert answered(http.post("/inference/v1/abort_requests", json={"ids": ["x"]})) == error(
        400, "request_ids: Field required", "request_ids"
    )


def test_a_rendered_messages_request_generates_what_the_messages_route_answers(http):
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "system": "Be brief.", "messages": CHAT["messages"]}
    message = ok(http.post("/v1/messages", json=body))
    rendered = ok(http.post("/v1/messages/render", json=body))
    assert rendered["token_ids"] == tokenized(
        http, messages=[{"role": "system", "content": "Be brief."}, *CHAT["messages"]]
    )
    answer = ok(http.post("/inference/v1/generate", json={**rendered, "output_mode": "text"}))
    assert answer["choices"][0]["text"] == "".join(b["text"] for b in message["content"] if b["type"] == "text")
    assert answer["usage"]["completion_tokens"] == message["usage"]["output_tokens"]


def test_a_rendered_responses_request_generates_what_the_responses_route_answers(http):
    body = {"model": "tiny", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0}
    response = ok(http.post("/v1/responses", json=body))
    rendered = ok(http.post("/v1/responses/render", json=body))
    assert rendered["request_id"].startswith("resp_")
    assert (rendered["parse_context"], rendered["stream"], rendered["stream_options"]) == (None, False, None)
    answer = ok(http.post("/inference/v1/generate", json={**rendered, "output_mode": "text"}))
    [item] = [i for i in response["output"] if i["type"] == "message"]
    assert answer["choices"][0]["text"] == item["content"][0]["text"]
    assert answered(http.post("/v1/responses/render", json={**body, "previous_response_id": response["id"]})) == error(
        400, "previous_response_id is not supported by the stateless render endpoint.", "previous_response_id"
    )


@pytest.mark.parametrize(
    "path, body, message, param",
    [
        (
            "/v1/chat/completions/derender",
            {"generate_response": {"request_id": "g", "choices": [], "prompt_logprobs": [None]}, "chat_request": CHAT},
            "prompt_logprobs is not supported by this server; send the request without it",
            "prompt_logprobs",
        ),
        (
            "/v1/chat/completions/derender",
            {"generate_response": {"request_id": "g", "choices": [], "output_mode": "text"}, "chat_request": CHAT},
            "generate_response.output_mode: Input should be 'tokens'",
            "generate_response.output_mode",
        ),
        (
            "/v1/chat/completions/derender",
            {"generate_response": {"request_id": "g", "choices": [{"index": 0, "token_ids": [5]}]}},
            "chat_request is required on this server: it parses answers (--tool-call-parser or --reasoning-parser), "
            "whose markup plain detokenization would leave in the content",
            "chat_request",
        ),
        (
            "/v1/chat/completions/derender",
            {
                "stream": True,
                "generate_chunk": {"request_id": "g", "choices": []},
                "chat_request": {**CHAT, "stop": "x"},
            },
            "stop is not supported by streaming derender: text already sent cannot be cut at a stop string; "
            "derender the whole answer (stream false), or generate with output_mode text, which holds stop strings "
            "back",
            "stop",
        ),
        (
            "/v1/completions/derender",
            {"stream": True, "generate_chunk": {"request_id": "g", "choices": []}, "stream_state": {"read_offset": 3}},
            "stream_state.read_offset is not used by this server: send back the stream_state it answered",
            "stream_state.read_offset",
        ),
        # a choice index or n past the limit is refused before anything is sized by it (index 4294967295 once made
        # a 500, an index of 2^31 a list of 2^31 slots: the server's memory gone)
        (
            "/v1/completions/derender",
            {"stream": True, "generate_chunk": {"request_id": "g", "choices": [{"index": 10**8, "token_ids": [5]}]}},
            "n has 100000001 samples, more than the limit of 128 (--max-num-samples)",
            "n",
        ),
        (
            "/v1/completions/derender",
            {"generate_responses": [{"request_id": "g", "choices": [{"index": 2**32 - 1, "token_ids": [5]}]}]},
            "choice 4294967295 is past any request's n (at most 4294967295)",
            "index",
        ),
        (
            "/v1/completions/derender",
            {"generate_responses": [{"request_id": "g", "choices": [{"index": 10**8, "token_ids": [5]}]}]},
            "a generate answer has choices [100000000], not 0..n-1",
            None,
        ),
        (
            "/v1/chat/completions/derender",
            {
                "generate_response": {"request_id": "g", "choices": [{"index": 0, "token_ids": [5]}]},
                "chat_request": {**CHAT, "n": 10**8},
            },
            "n has 100000000 samples, more than the limit of 128 (--max-num-samples)",
            "n",
        ),
        (
            "/v1/chat/completions/derender",
            {
                "stream": True,
                "generate_chunk": {"request_id": "g", "choices": [{"index": 0, "token_ids": [5]}]},
                "chat_request": {**CHAT, "n": 10**8},
            },
            "n has 100000000 samples, more than the limit of 128 (--max-num-samples)",
            "n",
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [5], "sampling_params": {}, "output_mode": "derender"},
            "output_mode derender needs parse_context on this server, which parses answers (--tool-call-parser or "
            "--reasoning-parser); send the one /v1/chat/completions/render wrote",
            "parse_context",
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [5], "sampling_params": {}, "output_mode": "derender", "parse_context": {"shiny": 1}},
            "parse_context.shiny is not supported by this server (the render server is newer); send the request "
            "without it",
            "parse_context.shiny",
        ),
        (
            "/inference/v1/generate",
            {"token_ids": [5], "sampling_params": {"watermarking": True}},
            "sampling_params.watermarking is not supported by this server; send the request without it",
            "sampling_params.watermarking",
        ),
    ],
)
def test_what_the_new_fields_cannot_carry_is_refused_by_name(http, path, body, message, param):
    assert answered(http.post(path, json=body)) == error(400, message, param)


def test_the_engine_derenders_alike_over_grpc(stack):
    """Generate's tokens through Derender, in two streamed steps: the texts Generate streamed, merged per step."""
    stub = stack.grpc_stub()
    auth = (("authorization", f"Bearer {KEY}"),)
    request = pb.GenerateRequest(
        request_id="d",
        model="tiny",
        token_ids=pb.TokenIds(ids=[5, 6, 7]),
        sampling=pb.SamplingParameters(n=1, temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=4, ignore_eos=True),
    )
    deltas = [o for r in stub.Generate(request, metadata=auth) for o in r.outputs]
    token_ids = [t for o in deltas for t in o.token_ids]
    completion = pb.GeneratedCompletion(token_ids=token_ids, finish_reason=pb.FINISH_REASON_LENGTH, step_lens=[3, 1])
    found = stub.Derender(pb.DerenderRequest(request=request, completions=[completion]), metadata=auth)
    assert [(o.text, list(o.token_ids), o.finish_reason) for r in found.responses for o in r.outputs] == [
        ("".join(o.text for o in deltas[:3]), token_ids[:3], pb.FINISH_REASON_UNSPECIFIED),
        (deltas[3].text, token_ids[3:], pb.FINISH_REASON_LENGTH),
    ]


@pytest.fixture(scope="module")
def reasoning_http(tiny_model_dir):
    config = tiny_config(tiny_model_dir, "tiny", structured_outputs_config={"reasoning_parser": "deepseek_r1"})
    stack = Stack([config], enable_scale_out=True, reasoning_parser="deepseek_r1")
    with stack.client() as client:
        yield client
    stack.close()


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_derender_splits_reasoning_off_as_the_chat_route_does(reasoning_http, include_reasoning):
    http = reasoning_http
    body = {**CHAT, "max_tokens": 8, "logprobs": True, "include_reasoning": include_reasoning}
    chat = ok(http.post("/v1/chat/completions", json=body))
    assert ("reasoning_content" in chat["choices"][0]["message"]) == include_reasoning
    rendered = ok(http.post("/v1/chat/completions/render", json=body))
    generated = ok(http.post("/inference/v1/generate", json=rendered))
    derendered = ok(
        http.post("/v1/chat/completions/derender", json={"generate_response": generated, "chat_request": body})
    )
    assert without_ids(derendered) == without_ids(chat)
    answer = ok(http.post("/inference/v1/generate", json={**rendered, "output_mode": "derender"}))
    assert answer["choices"][0]["message"] == chat["choices"][0]["message"]

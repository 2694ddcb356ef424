"""Structured outputs over HTTP (the official ``openai`` client) and gRPC, with SmolLM2."""

from __future__ import annotations

import json
import re
import time

import grpc
import jsonschema
import openai
import pytest

from raypaged.config import EngineConfig
from raypaged.serving.proto import generate_pb2 as pb
from tests.serving.conftest import Stack
from tests.structured.schemas import SCHEMAS

pytestmark = pytest.mark.slow
PERSON = SCHEMAS["person"]
ASK = [{"role": "user", "content": "Give me a person as JSON."}]
MAX_COMPILE_S = 2
# a small schema xgrammar takes about 100 s to compile (the nested repetition of its pattern)
SLOW_TO_COMPILE = {"type": "string", "pattern": "^([a-z]{1,60}){1,60}$"}


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    stack = Stack(
        [
            EngineConfig(
                model=str(smollm2_dir),
                served_model_name="smollm2",
                dtype="float32",
                num_gpu_blocks_override=1024,
                structured_outputs_config={"max_compile_s": MAX_COMPILE_S},
            )
        ]
    )
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none")


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_response_format_json_schema_is_enforced(client, temperature):
    chat = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        max_tokens=64,
        temperature=temperature,
        seed=5,
        response_format=_json_schema_format(PERSON),
    )
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    assert chat.choices[0].finish_reason == "stop"


def test_json_object_on_chat_and_completions(client):
    ask = [{"role": "user", "content": "Give me a JSON object with a name and an age."}]
    chat = client.chat.completions.create(
        model="smollm2", messages=ask, max_tokens=64, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    completion = client.completions.create(
        model="smollm2",
        prompt="A JSON object:",
        max_tokens=64,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(completion.choices[0].text), dict)


def test_vllm_structured_outputs_and_guided_fields(client):
    regex = client.completions.create(
        model="smollm2",
        prompt="Today's date:",
        max_tokens=16,
        temperature=0.8,
        seed=1,
        extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}},
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", regex.choices[0].text)
    choice = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Is fire hot?"}],
        max_tokens=5,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert choice.choices[0].message.content in ("yes", "no")
    text_format = client.chat.completions.create(  # response_format text asks for nothing: the choice still holds
        model="smollm2",
        messages=[{"role": "user", "content": "Is fire hot?"}],
        max_tokens=5,
        temperature=0,
        response_format={"type": "text"},
        extra_body={"guided_choice": ["maybe", "never"]},
    )
    assert text_format.choices[0].message.content in ("maybe", "never")
    guided = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        max_tokens=64,
        temperature=0,
        extra_body={"guided_json": PERSON, "guided_decoding_backend": "xgrammar"},
    )
    jsonschema.validate(json.loads(guided.choices[0].message.content), PERSON)
    grammar = client.completions.create(
        model="smollm2",
        prompt="1+1=",
        max_tokens=4,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= [0-9] "!"'}},
    )
    assert re.fullmatch(r"[0-9]!", grammar.choices[0].text)


def test_a_streamed_constrained_answer_joins_to_valid_json(client):
    stream = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        max_tokens=64,
        temperature=0,
        stream=True,
        response_format=_json_schema_format(SCHEMAS["nested"]),
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])


def test_ruled_out_tokens_report_a_finite_logprob(client):
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Is ice cold?"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=8,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    first = chat.choices[0].logprobs.content[0]
    values = [top.logprob for top in first.top_logprobs]
    assert -9999.0 in values and all(v >= -9999.0 for v in values)
    assert {top.token for top in first.top_logprobs if top.logprob > -9999.0} <= {"y", "ye", "yes", "n", "no"}


@pytest.mark.parametrize(
    ("extra", "message", "param"),
    [
        (
            {"response_format": _json_schema_format({"type": "objec"})},
            'structured outputs: the json constraint does not compile: Unsupported type "objec"',
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"grammar": "root ::= ("}},
            "structured outputs: the grammar constraint does not compile: EBNF parser error at line 1, column 11: "
            "Expect element, but got",
            "structured_outputs",
        ),
        (
            {"guided_regex": "a", "guided_decoding_backend": "outlines"},
            "guided_decoding_backend 'outlines' is not supported; this server decodes structured outputs with xgrammar",
            "guided_decoding_backend",
        ),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "give one structured output constraint, got response_format, guided_regex",
            "guided_regex",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object or structural_tag, "
            "got ['regex', 'choice']",
            "structured_outputs",
        ),
        (
            {"guided_whitespace_pattern": " "},
            "guided_whitespace_pattern is not supported by the xgrammar backend",
            "guided_whitespace_pattern",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format json_schema needs json_schema.schema",
            "response_format",
        ),
    ],
)
def test_bad_constraints_are_a_400_naming_the_problem(client, extra, message, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=8, extra_body=extra)
    error = raised.value.body
    assert error["message"].strip() == message
    assert error["param"] == param


def test_a_constraint_slower_to_compile_than_max_compile_s_is_a_400_and_the_next_one_compiles(client):
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=8, response_format=_json_schema_format(SLOW_TO_COMPILE)
        )
    assert time.monotonic() - started < 30  # not the compile's 100 s
    assert raised.value.body["message"] == (
        "structured outputs: the json constraint did not compile within 2 s (max_compile_s of "
        "--structured-outputs-config)"
    )
    assert raised.value.body["param"] == "structured_outputs"
    answer = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        max_tokens=8,
        temperature=0,
        response_format=_json_schema_format({"type": "string", "pattern": "^[a-z]{1,3}$"}),
    )
    assert re.fullmatch(r'"[a-z]{1,3}"', answer.choices[0].message.content or "")


def test_an_unknown_response_format_type_is_a_400(stack):
    with stack.client() as http:
        answer = http.post(
            "/v1/chat/completions", json={"model": "smollm2", "messages": ASK, "response_format": {"type": "yaml"}}
        )
    assert answer.status_code == 400
    assert "response_format.type" in answer.json()["error"]["message"]


def test_grpc_takes_the_constraint_in_its_own_field(stack):
    request = pb.GenerateRequest(
        model="smollm2",
        text="Is water wet?",
        stopping=pb.StoppingCriteria(max_tokens=5),
        sampling=pb.SamplingParameters(temperature=0),
        structured=pb.StructuredOutput(choice=pb.StructuredChoices(choices=["wet", "dry"])),
    )
    text = "".join(d.text for r in stack.grpc_stub().Generate(request, timeout=60) for d in r.outputs)
    assert text in ("wet", "dry")


LETTER_A = 81  # "a" in SmolLM2's vocabulary
NO_TOKEN = (
    "no token is left to sample after 0 output tokens: allowed_token_ids and the structured output's grammar "
    "together allow no token"
)


def test_a_grammar_that_allowed_token_ids_leave_no_token_is_the_requests_own_400(stack):
    """Found as it samples: a 400 before any byte, an error event in a stream, INVALID_ARGUMENT over gRPC;
    the request beside it is unharmed (vLLM answers 200 with token 0, outside allowed_token_ids)."""
    body = {
        "model": "smollm2",
        "prompt": "Count:",
        "max_tokens": 4,
        "allowed_token_ids": [LETTER_A],
        "structured_outputs": {"regex": "[0-9]+"},
    }
    with stack.client() as http:
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 400
        assert answer.json() == {
            "error": {"message": NO_TOKEN, "type": "invalid_request_error", "param": "allowed_token_ids", "code": None}
        }
        streamed = http.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 200
        events = [line[len("data: ") :] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"] == {
            "message": NO_TOKEN,
            "type": "invalid_request_error",
            "param": "allowed_token_ids",
            "code": None,
        }
        beside = http.post("/v1/completions", json={**body, "allowed_token_ids": None})
        assert beside.status_code == 200 and re.fullmatch("[0-9]+", beside.json()["choices"][0]["text"])
    request = pb.GenerateRequest(
        model="smollm2",
        text="Count:",
        stopping=pb.StoppingCriteria(max_tokens=4),
        sampling=pb.SamplingParameters(temperature=0, allowed_token_ids=[LETTER_A]),
        structured=pb.StructuredOutput(regex="[0-9]+"),
    )
    with pytest.raises(grpc.RpcError) as raised:
        list(stack.grpc_stub().Generate(request, timeout=60))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == NO_TOKEN

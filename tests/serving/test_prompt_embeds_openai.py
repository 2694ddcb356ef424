"""vLLM's prompt_embeds over the OpenAI completions API and gRPC, on a real gateway and engine server: base64 of
``torch.save``'d rows answers transformers' tokens for the same ``inputs_embeds``, before the body's text prompts,
streamed or not; bad embeddings and what they cannot go with are refused by name."""

from __future__ import annotations

import base64
import io

import grpc
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from raypaged.serving.proto import generate_pb2 as pb
from tests.entrypoints.test_prompt_embeds import MAX_TOKENS, hf_tokens
from tests.serving.conftest import Stack, tiny_config, tiny_model_dir  # noqa: F401  (session fixture)


def encoded(rows: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(rows, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def rows(hf) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        embeds = [hf.get_input_embeddings()(torch.arange(500, 500 + n)) for n in (6, 19)]
    return [e + 0.05 * torch.randn(e.shape, generator=generator) for e in embeds]


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack(
        [tiny_config(tiny_model_dir, "embeds", enable_prompt_embeds=True), tiny_config(tiny_model_dir, "plain")]
    )
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused")


def complete(client, **fields):
    options = {"max_tokens": MAX_TOKENS, "temperature": 0}
    extra = {"ignore_eos": True, **fields.pop("extra_body", {})}
    return client.completions.create(model=fields.pop("model", "embeds"), **options, **fields, extra_body=extra)


def test_prompt_embeds_answer_transformers_tokens_before_the_text_prompts(client, hf, rows, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = [hf_tokens(hf, r) for r in rows]
    [one] = complete(
        client, prompt="", extra_body={"prompt_embeds": encoded(rows[0]), "return_token_ids": True}
    ).choices
    assert one.token_ids == expected[0] and one.text == tokenizer.decode(expected[0])
    answer = complete(client, prompt=["Hello there"], extra_body={"prompt_embeds": [encoded(r) for r in rows]})
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in answer.choices[:2]] == [tokenizer.decode(e) for e in expected]
    text_only = complete(client, prompt="Hello there")
    assert answer.choices[2].text == text_only.choices[0].text
    assert answer.usage.prompt_tokens == 6 + 19 + text_only.usage.prompt_tokens


def test_streamed_prompt_embeds_give_the_same_text(client, hf, rows, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    chunks = complete(
        client,
        prompt="",
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"prompt_embeds": encoded(rows[1])},
    )
    chunks = list(chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tokenizer.decode(hf_tokens(hf, rows[1]))
    assert chunks[-1].usage.prompt_tokens == 19 and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_grpc_clients_send_the_saved_bytes(stack, hf, rows):
    buffer = io.BytesIO()
    torch.save(rows[0], buffer)
    request = pb.GenerateRequest(model="embeds", prompt_embeds=buffer.getvalue(), request_id="g1")
    request.sampling.temperature = 0
    request.stopping.max_tokens = MAX_TOKENS
    request.stopping.ignore_eos = True
    tokens = [t for r in stack.grpc_stub().Generate(request) for o in r.outputs for t in o.token_ids]
    assert tokens == hf_tokens(hf, rows[0])


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"extra_body": {"prompt_embeds": "not base64!"}}, "prompt_embeds", "must be base64 of the bytes torch.save"),
        (
            {"extra_body": {"prompt_embeds": base64.b64encode(b"junk").decode()}},
            "prompt_embeds",
            "prompt_embeds is not a tensor saved by torch.save",
        ),
        (
            {"extra_body": {"prompt_embeds": encoded(torch.zeros(3, 7))}},
            "prompt_embeds",
            "prompt_embeds must be [num_tokens, 64] (the model's hidden size), got [3, 7]",
        ),
        (
            {"echo": True, "extra_body": {"prompt_embeds": encoded(torch.zeros(3, 64))}},
            "echo",
            "echo needs the prompt's text: prompt_embeds have none",
        ),
        (
            {"model": "plain", "extra_body": {"prompt_embeds": encoded(torch.zeros(3, 64))}},
            "prompt_embeds",
            "prompt_embeds needs the engine started with --enable-prompt-embeds",
        ),
        ({"prompt": None}, "prompt", "prompt is required (or prompt_embeds)"),
    ],
    ids=["base64", "not-saved", "hidden-size", "echo", "flag-off", "no-prompt"],
)
def test_bad_prompt_embeds_are_a_400_naming_the_field(client, fields, param, message):
    with pytest.raises(openai.BadRequestError) as refused:
        complete(client, **{"prompt": "", **fields})
    assert refused.value.body["param"] == param
    assert message in refused.value.body["message"]


def test_a_chat_body_refuses_prompt_embeds(stack):
    with stack.client() as http:
        response = http.post(
            "/v1/chat/completions",
            json={"model": "embeds", "messages": [{"role": "user", "content": "Hi"}], "prompt_embeds": "AAAA"},
        )
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_embeds"


def test_grpc_render_refuses_prompt_embeds(stack):
    with pytest.raises(grpc.RpcError) as refused:
        stack.grpc_stub().Render(pb.GenerateRequest(model="embeds", prompt_embeds=b"x"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "prompt_embeds cannot be rendered: they are no token ids"

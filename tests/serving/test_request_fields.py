"""vLLM and OpenAI request fields this server does not implement are refused by name, never ignored;
fields of no API are logged once and ignored, as vLLM does."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer

from raypaged.inputs.limits import InputLimits
from raypaged.serving.proto import generate_pb2 as pb
from tests.serving.conftest import BOS_ID, Stack, add_bos, tiny_config

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    """``tiny``, and ``bos``: the same model with a tokenizer that adds a BOS (as Llama's)."""
    bos_dir = add_bos(Path(shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("bos") / "model")))
    stack = Stack([tiny_config(tiny_model_dir, "tiny", trust_request_chat_template=True), tiny_config(bos_dir, "bos")])
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def http(stack):
    with stack.client() as client:
        yield client


@pytest.mark.parametrize(
    ("body", "field", "value"),
    [
        (COMPLETION, "suffix", "end"),
        (CHAT, "functions", [{"name": "f", "parameters": {}}]),
        (CHAT, "prediction", {"type": "content", "content": "x"}),
        (COMPLETION, "watermarking", True),
        (CHAT, "return_prompt_text", True),
        (COMPLETION, "ec_transfer_params", {"x": 1}),
    ],
)
def test_a_known_field_it_cannot_honour_is_a_400_naming_it(http, body, field, value):
    answer = http.post("/v1/chat/completions" if body is CHAT else "/v1/completions", json={**body, field: value})
    assert answer.status_code == 400
    assert answer.json()["error"] == {
        "message": f"{field} is not supported by this server; send the request without it",
        "type": "invalid_request_error",
        "param": field,
        "code": None,
    }


def test_a_thinking_budget_on_a_server_that_knows_no_reasoning_section_is_a_400_naming_it(http):
    answer = http.post("/v1/chat/completions", json={**CHAT, "thinking_token_budget": 64})
    assert answer.status_code == 400
    assert answer.json()["error"] == {
        "message": "thinking_token_budget needs to know where a reasoning section starts and ends: serve with "
        "--reasoning-parser or --reasoning-config",
        "type": "invalid_request_error",
        "param": "thinking_token_budget",
        "code": None,
    }


@pytest.mark.parametrize(
    ("body", "field", "value"),
    [
        (COMPLETION, "echo", False),
        (COMPLETION, "logit_bias", {}),
        (COMPLETION, "length_penalty", 1.0),
        (CHAT, "functions", []),
        (CHAT, "function_call", "none"),
        (CHAT, "modalities", ["text"]),
        (CHAT, "bad_words", None),
        (COMPLETION, "watermarking", False),
        (COMPLETION, "truncation_side", "left"),
        (CHAT, "thinking_token_budget", -1),
        (CHAT, "stream_interval", 1),
        (COMPLETION, "session_id", "conversation-7"),
    ],
)
def test_the_same_fields_asking_for_nothing_are_accepted(http, body, field, value):
    answer = http.post("/v1/chat/completions" if body is CHAT else "/v1/completions", json={**body, field: value})
    assert answer.status_code == 200, answer.text


def test_messages_keep_no_field_silently(http):
    message = {"role": "assistant", "content": "hi", "function_call": {"name": "f", "arguments": "{}"}}
    answer = http.post("/v1/chat/completions", json={**CHAT, "messages": [message]})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == (
        "messages: function_call is not supported by this server; send messages without it"
    )


def test_add_special_tokens_adds_or_leaves_out_the_tokenizers_bos(http, stack):
    """vLLM's defaults (a text prompt gets the BOS, a chat's template writes its own) and both overrides, on
    completions, chat, /tokenize and gRPC; token ids are used as they are (true is refused for them)."""
    text = http.post("/tokenize", json={"model": "bos", "prompt": "hi", "add_special_tokens": False}).json()["tokens"]
    template = http.post("/tokenize", json={"model": "bos", "messages": CHAT["messages"]}).json()["tokens"]
    tokenized = http.post("/tokenize", json={"model": "bos", "messages": CHAT["messages"], "add_special_tokens": True})
    assert tokenized.json()["tokens"] == [BOS_ID, *template]

    def prompt_ids(body: dict, **fields: object) -> list[int]:
        chat = "messages" in body
        answer = http.post(
            "/v1/chat/completions" if chat else "/v1/completions",
            json={**body, "model": "bos", "return_token_ids": True, **fields},
        )
        assert answer.status_code == 200, answer.text
        return answer.json()["prompt_token_ids"] if chat else answer.json()["choices"][0]["prompt_token_ids"]

    assert prompt_ids(COMPLETION) == [BOS_ID, *text]
    assert prompt_ids(COMPLETION, add_special_tokens=False) == text
    assert prompt_ids(CHAT) == template
    assert prompt_ids(CHAT, add_special_tokens=True) == [BOS_ID, *template]
    assert prompt_ids({**COMPLETION, "prompt": text}, add_special_tokens=False) == text
    ids = pb.GenerateRequest(
        model="bos",
        token_ids=pb.TokenIds(ids=text),
        stopping=pb.StoppingCriteria(max_tokens=2),
        add_special_tokens=True,
    )
    with pytest.raises(grpc.RpcError) as raised:
        list(stack.grpc_stub().Generate(ids, timeout=60))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "add_special_tokens applies to a text or messages: token_ids are used as they are"


def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_holds(http):
    """vLLM's -1 crosses the gRPC wire (as 4294967295) to the engine, which keeps max_model_len tokens."""
    assert http.post(
        "/v1/completions",
        json={**COMPLETION, "prompt": [5, 6, 7], "truncate_prompt_tokens": -1, "return_token_ids": True},
    ).json()["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    long = http.post("/v1/completions", json={**COMPLETION, "prompt": [5] * 300, "truncate_prompt_tokens": -1})
    assert long.status_code == 400
    assert long.json()["error"]["message"] == (
        "prompt has 256 tokens, which leaves no room to generate within max_model_len 256 (--max-model-len)"
    )


def test_a_turn_without_content_renders_as_empty_text(http, tiny_model_dir):
    """An assistant's tool calls with content null reach the template with content "", as vLLM renders them
    (transformers would drop the key, and a template reading message['content'] would fail)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    got = http.post("/tokenize", json={"model": "tiny", "messages": turns})
    assert got.status_code == 200, got.text
    plain = [turns[0], {"role": "assistant", "content": ""}, {"role": "tool", "content": "ok"}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # SmolLM2's template reads roles and contents only
    expected = tokenizer.apply_chat_template(plain, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert got.json()["tokens"] == list(expected)
    answer = http.post("/v1/chat/completions", json={**CHAT, "messages": turns})
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(
    ("path", "body", "nulls"),
    [
        (
            "/v1/completions",
            {**COMPLETION, "max_tokens": 6, "temperature": 0},
            ["n", "stream", "echo", "logprobs", "presence_penalty", "frequency_penalty", "min_p"],
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "max_tokens": 6, "temperature": 0},
            ["n", "stream", "logprobs", "presence_penalty", "frequency_penalty", "parallel_tool_calls"],
        ),
        (
            "/v1/responses",
            {"model": "tiny", "input": "hi", "max_output_tokens": 6, "temperature": 0},
            ["stream", "store"],
        ),
    ],
    ids=["completions", "chat", "responses"],
)
def test_openais_nullable_fields_take_their_default_when_null(http, path, body, nulls):
    """Clients that write every field send OpenAI's nullable ones as null: the answer is the one without them."""
    plain = http.post(path, json=body)
    nulled = http.post(path, json={**body, **dict.fromkeys(nulls)})
    assert plain.status_code == nulled.status_code == 200, nulled.text
    if path == "/v1/responses":
        assert nulled.json()["output"][0]["content"][0]["text"] == plain.json()["output"][0]["content"][0]["text"]
    else:
        assert nulled.json()["choices"] == plain.json()["choices"]


def test_a_field_of_no_api_is_logged_once_and_ignored(http, caplog, monkeypatch):
    from raypaged.serving.gateway import schemas

    monkeypatch.setattr(schemas, "_logged_fields", set())  # fuzzing earlier in the run may have filled the cap
    with caplog.at_level(logging.WARNING, logger="raypaged"):
        for _ in range(3):
            assert http.post("/v1/completions", json={**COMPLETION, "made_up_field": 1}).status_code == 200
    logged = [r.getMessage() for r in caplog.records if "made_up_field" in r.getMessage()]
    assert logged == ["request field 'made_up_field' is not part of the API and is ignored"]


def test_a_templates_own_error_is_a_400_with_its_message(http):
    answer = http.post(
        "/v1/chat/completions",
        json={**CHAT, "chat_template": "{{ raise_exception('Conversation roles must alternate user/assistant') }}"},
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == (
        "the chat template failed: TemplateError: Conversation roles must alternate user/assistant"
    )
    assert answer.json()["error"]["param"] == "messages"


def test_a_trusted_request_template_renders_the_prompt(http):  # continued: cut after the last content
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    body = {
        **CHAT,
        "messages": messages,
        "chat_template": "{% for m in messages %}<{{ m.content }}>{% endfor %}",
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 1,
    }
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == len(
        http.post("/tokenize", json={"model": "tiny", "prompt": "<hi><Hel", "add_special_tokens": False}).json()[
            "tokens"
        ]
    )


def _greedy_ids(http, **fields) -> list[int]:
    body = {**COMPLETION, "max_tokens": 4, "temperature": 0, "logprobs": 0, **fields}
    tokens = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    return http.post(
        "/tokenize", json={"model": "tiny", "prompt": "".join(tokens), "add_special_tokens": False}
    ).json()["tokens"]


def test_logit_bias_allowed_token_ids_and_bad_words_steer_the_tokens(http):
    assert _greedy_ids(http, logit_bias={"5": 100}) == [5, 5, 5, 5]
    allowed = _greedy_ids(http, allowed_token_ids=[300, 301])
    assert allowed and set(allowed) <= {300, 301}
    free = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 1, "temperature": 0}).json()
    word = free["choices"][0]["text"]
    banned = http.post(
        "/v1/completions", json={**COMPLETION, "max_tokens": 1, "temperature": 0, "bad_words": [word]}
    ).json()
    assert word.strip() and banned["choices"][0]["text"] != word


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("logit_bias", {"x": 1}, "logit_bias keys must be token ids"),
        ("logit_bias", {"5": 200}, "logit_bias values must be in [-100, 100], got 200.0"),
        ("allowed_token_ids", [999999], "allowed_token_ids must be token ids in [0, 49152), got 999999"),
        ("allowed_token_ids", [], "allowed_token_ids must not be empty"),
        ("bad_words", [""], "bad_words must not contain empty strings"),
    ],
)
def test_bad_token_controls_are_a_400_naming_them(http, field, value, message):
    answer = http.post("/v1/completions", json={**COMPLETION, field: value})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == message


def test_include_stop_str_in_output_and_truncate_prompt_tokens(http):
    greedy = {**COMPLETION, "max_tokens": 6, "temperature": 0}
    text = http.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
    stop = text[2:4]
    cut = http.post("/v1/completions", json={**greedy, "stop": [stop]}).json()["choices"][0]
    kept = http.post("/v1/completions", json={**greedy, "stop": [stop], "include_stop_str_in_output": True}).json()
    assert cut["text"] + stop == kept["choices"][0]["text"] == text[: text.index(stop) + len(stop)]
    long_prompt = list(range(100, 400))  # 300 tokens: over max_model_len 256 unless cut
    assert http.post("/v1/completions", json={**COMPLETION, "prompt": long_prompt}).status_code == 400
    truncated = http.post("/v1/completions", json={**COMPLETION, "prompt": long_prompt, "truncate_prompt_tokens": 8})
    last = http.post(
        "/v1/completions", json={**COMPLETION, "prompt": long_prompt[-8:], "temperature": 0, "max_tokens": 4}
    ).json()
    again = http.post(
        "/v1/completions",
        json={**COMPLETION, "prompt": long_prompt, "truncate_prompt_tokens": 8, "temperature": 0, "max_tokens": 4},
    ).json()
    assert truncated.json()["usage"]["prompt_tokens"] == 8
    assert again["choices"][0]["text"] == last["choices"][0]["text"]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_pooling_endpoints_say_a_generative_model_serves_no_embeddings(http, path):
    answer = http.post(path, json={"model": "tiny", "input": "hi"})
    error = answer.json()["error"]
    assert (answer.status_code, error["param"]) == (400, "model")
    assert error["message"] == (
        "The model `tiny` does not support the Embeddings API: it generates text; embeddings need an embedding model "
        "(--runner pooling)"
    )


def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(http):
    plain = http.post("/v1/completions", json={**COMPLETION, "logprobs": 2, "echo": True, "temperature": 0}).json()
    by_id = http.post(
        "/v1/completions",
        json={**COMPLETION, "logprobs": 2, "echo": True, "temperature": 0, "return_tokens_as_token_ids": True},
    ).json()
    chat = http.post(
        "/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    ).json()
    [choice], [named] = plain["choices"], by_id["choices"]
    assert named["text"] == choice["text"]  # the text is decoded as always
    tokens = named["logprobs"]["tokens"]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens) and len(tokens) == len(choice["logprobs"]["tokens"])
    assert named["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"]
    assert named["logprobs"]["text_offset"] == choice["logprobs"]["text_offset"]
    assert all(re.fullmatch(r"token_id:\d+", t) for top in named["logprobs"]["top_logprobs"] if top for t in top)
    content = chat["choices"][0]["logprobs"]["content"]
    ids = [int(entry["token"].removeprefix("token_id:")) for entry in content]
    assert len(ids) == chat["usage"]["completion_tokens"]
    assert all(entry["bytes"] == list(entry["token"].encode()) for entry in content)
    assert all(top["token"].startswith("token_id:") for entry in content for top in entry["top_logprobs"])


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(http):
    body = {
        **COMPLETION,
        "max_tokens": 6,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = [
        json.loads(line[6:])
        for line in http.post("/v1/completions", json=body).text.split("\n")
        if line.startswith("data: {")
    ]
    with_choices = [c for c in chunks if c["choices"]]
    completion_tokens = [c["usage"]["completion_tokens"] for c in with_choices]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 6
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
        for c in with_choices
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    without = {**body, "stream_options": {"continuous_usage_stats": True}}  # only with include_usage, as vLLM
    plain = [
        json.loads(line[6:])
        for line in http.post("/v1/completions", json=without).text.split("\n")
        if line.startswith("data: {")
    ]
    assert all("usage" not in c for c in plain)


def test_use_beam_search_answers_with_the_engines_beams(http, tiny_model_dir):
    from raypaged import LLM
    from raypaged.sampling_params import BeamSearchParams

    body = {
        "model": "tiny",
        "prompt": "The sky is",
        "max_tokens": 6,
        "n": 3,
        "use_beam_search": True,
        "length_penalty": 0.5,
    }
    answer = http.post("/v1/completions", json=body).json()
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=64, max_model_len=256)
    [expected] = llm.beam_search(
        "The sky is", BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5), use_tqdm=False
    )
    assert [c["text"] for c in answer["choices"]] == [b.text for b in expected.outputs]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert answer["usage"]["completion_tokens"] == sum(len(b.token_ids) for b in expected.outputs)
    chat = http.post("/v1/chat/completions", json={**CHAT, "n": 2, "use_beam_search": True}).json()
    assert len(chat["choices"]) == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"stream": True}, "use_beam_search does not stream: the beams come once they are finished"),
        (
            {"temperature": 0.7},
            "temperature is not supported with use_beam_search (beams are ranked by the model's "
            "log-probabilities at temperature 1)",
        ),
        (
            {"stop": ["x"]},
            "stop is not supported with use_beam_search (beams are ranked by the model's "
            "log-probabilities at temperature 1)",
        ),
        (
            {"logprobs": 1},
            "logprobs is not supported with use_beam_search (beams are ranked by the model's "
            "log-probabilities at temperature 1)",
        ),
        (
            {"thinking_token_budget": 8},
            "thinking_token_budget is not supported with use_beam_search (beams are ranked by the model's "
            "log-probabilities at temperature 1)",
        ),
    ],
)
def test_use_beam_search_refuses_what_beams_cannot_honour(http, extra, message):
    answer = http.post("/v1/completions", json={**COMPLETION, "use_beam_search": True, "n": 2, **extra})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == message


def test_length_penalty_needs_use_beam_search(http):
    answer = http.post("/v1/completions", json={**COMPLETION, "length_penalty": 2.0})
    assert (answer.status_code, answer.json()["error"]["message"]) == (
        400,
        "length_penalty applies to use_beam_search only",
    )


def test_logprobs_minus_one_means_the_whole_vocabulary_within_max_logprobs(http, tiny_model_dir):
    refused = http.post("/v1/completions", json={**COMPLETION, "logprobs": -1})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "logprobs -1 (the whole vocabulary, 49152) is more than the limit of 20 (--max-logprobs, at most the "
        "vocabulary size 49152)"
    )
    stack = Stack([tiny_config(tiny_model_dir, "tiny", limits=InputLimits(max_logprobs=-1))])
    try:
        with stack.client() as client:
            answer = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 1, "logprobs": -1}).json()
            chat = client.post(
                "/v1/chat/completions", json={**CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": -1}
            ).json()
    finally:
        stack.close()
    [top] = answer["choices"][0]["logprobs"]["top_logprobs"]
    assert len(top) > 40000  # every token (the texts of a few decode alike and share a key)
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 49152


def test_chat_echo_opens_the_answer_with_the_last_message_of_its_role(http):
    """As vLLM: with echo, an assistant message being continued comes first in the answer, whole and
    streamed (in a chunk of its own after the role); a last message of another role is not echoed."""
    messages = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "Well, I"}]
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 5,
        "temperature": 0,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed == {"role": "assistant", "content": "Well, I" + plain}
    deltas = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "echo": True, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[6:])["choices"][0]["delta"])
    assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "Well, I"}]
    assert "".join(d.get("content", "") for d in deltas) == "Well, I" + plain
    asked = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5, "temperature": 0, "echo": True}).json()
    alone = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5, "temperature": 0}).json()
    assert asked["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_spaces_between_special_tokens_reaches_the_engines_sampling_params():
    """The field crosses the gateway's wire format (unset: vLLM's default, true); its effect on the text
    is tested on the detokenizer (tests/engine/test_detokenizer.py)."""
    from raypaged.serving.gateway.schemas import CompletionRequest
    from raypaged.serving.protocol import sampling_params_from_proto

    def params(**fields):
        body = CompletionRequest(**{**COMPLETION, **fields})
        return sampling_params_from_proto(
            body.generate_request("tiny", {"text": "hi"}, None, 2, 0, None), InputLimits()
        )

    assert params(spaces_between_special_tokens=False, skip_special_tokens=False).spaces_between_special_tokens is False
    assert params().spaces_between_special_tokens is True


def test_every_vllm_request_field_is_declared_or_refused_unless_it_asks_for_nothing():
    from pathlib import Path

    from raypaged.serving.gateway.schemas import _UNSUPPORTED, ChatCompletionRequest, CompletionRequest

    lines = (Path(__file__).parent / "vllm_request_fields.txt").read_text().splitlines()
    fields = [line.split() for line in lines if not line.startswith("#")]
    models = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
    assert len(fields) == 121
    assert [(e, f) for e, f in fields if f not in models[e].model_fields and f not in _UNSUPPORTED] == []


def test_return_token_ids_gives_the_prompts_and_each_choices_token_ids(http):
    prompt_ids = http.post("/tokenize", json={"model": "tiny", "prompt": "hi"}).json()["tokens"]
    body = {**COMPLETION, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    assert (whole["prompt_token_ids"], len(whole["token_ids"])) == (prompt_ids, 4)
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line)["choices"][0] for line in lines]
    assert chunks[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert (
        "token_ids" not in http.post("/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    )

    chat = {**CHAT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    answer = http.post("/v1/chat/completions", json=chat).json()
    templated = http.post("/tokenize", json={"model": "tiny", "messages": CHAT["messages"]}).json()["tokens"]
    assert (answer["prompt_token_ids"], len(answer["choices"][0]["token_ids"])) == (templated, 3)
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line) for line in lines]
    assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [templated]
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids", [])]
    assert streamed == answer["choices"][0]["token_ids"]


def test_repetition_detection_ends_an_answer_whose_tail_repeats(http):
    from raypaged.sampling_params import RepetitionDetectionParams

    detect = {"max_pattern_size": 4, "min_pattern_size": 2, "min_count": 3}
    body = {**COMPLETION, "max_tokens": 16, "ignore_eos": True, "return_token_ids": True, "allowed_token_ids": [42]}
    free = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    assert free == [42] * 16
    rule = RepetitionDetectionParams(**detect)
    end = next(n for n in range(1, len(free) + 1) if rule.repeated_tail(free, n))
    assert end == 6  # "42 42" three times: patterns of one token are not looked for
    choice = http.post("/v1/completions", json={**body, "repetition_detection": detect}).json()["choices"][0]
    assert (choice["token_ids"], choice["finish_reason"], choice["stop_reason"]) == (
        free[:end],
        "stop",
        "repetition_detected",
    )
    refused = http.post(
        "/v1/completions", json={**body, "repetition_detection": {"max_pattern_size": 2, "min_count": 1}}
    )
    assert (refused.status_code, refused.json()["error"]["message"]) == (
        400,
        "repetition_detection: min_count must be at least 2, got 1",
    )


def test_truncation_side_chooses_which_end_of_the_prompt_truncate_prompt_tokens_keeps(http):
    body = {**COMPLETION, "prompt": [11, 12, 13, 14, 15], "truncate_prompt_tokens": 2, "return_token_ids": True}
    kept = {
        side: http.post("/v1/completions", json={**body, "truncation_side": side}).json()["choices"][0]
        for side in ("left", "right")
    }
    assert (kept["left"]["prompt_token_ids"], kept["right"]["prompt_token_ids"]) == ([14, 15], [11, 12])
    assert http.post("/v1/completions", json=body).json()["choices"][0]["prompt_token_ids"] == [14, 15]
    refused = http.post("/v1/completions", json={**body, "truncation_side": "middle"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncation_side"


def test_a_requests_stream_interval_sends_fewer_larger_chunks(http):
    body = {**COMPLETION, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "logprobs": 0, "stream": True}
    counts = {}
    for interval in (1, 3):
        with http.stream("POST", "/v1/completions", json={**body, "stream_interval": interval}) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
        counts[interval] = [len(json.loads(line)["choices"][0]["logprobs"]["tokens"]) for line in lines]
    assert counts == {1: [1] * 7, 3: [1, 3, 3]}


def test_logprob_token_ids_show_those_tokens_logprobs_at_each_generated_position(http, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    asked = [5, 7, 300]
    body = {
        **CHAT,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "logprob_token_ids": asked,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    answer = http.post("/v1/chat/completions", json=body).json()
    prompt, generated = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    positions = answer["choices"][0]["logprobs"]["content"]
    assert len(positions) == 3
    for k, (position, token_id) in enumerate(zip(positions, generated)):
        shown = {entry["token"]: entry["logprob"] for entry in position["top_logprobs"]}
        assert sorted(shown) == sorted(f"token_id:{t}" for t in {token_id, *asked})  # the chosen and the asked
        for t in {token_id, *asked}:
            assert shown[f"token_id:{t}"] == pytest.approx(expected[k, t].item(), abs=1e-4)
        assert list(shown.values()) == sorted(shown.values(), reverse=True)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "logprob_token_ids needs logprobs (a completion's count, or a chat's logprobs: true)"),
        ({"logprobs": 1, "logprob_token_ids": [49152]}, "logprob_token_ids must be token ids in [0, 49152), got 49152"),
        (
            {"logprobs": 1, "logprob_token_ids": list(range(21))},
            "logprob_token_ids has 21 token ids, more than the limit of 20 (--max-logprobs)",
        ),
        (
            {"logprobs": 1, "echo": True, "max_tokens": 0},
            "logprob_token_ids applies to generated tokens, and an echo with max_tokens 0 generates none",
        ),
        (
            {"logprobs": 1, "use_beam_search": True, "n": 2},
            "logprob_token_ids is not supported with use_beam_search (beams are ranked by the model's "
            "log-probabilities at temperature 1)",
        ),
    ],
)
def test_logprob_token_ids_refusals_name_the_field(http, extra, message):
    answer = http.post("/v1/completions", json={"logprob_token_ids": [5], **COMPLETION, **extra})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == message


def test_reasoning_effort_reaches_the_chat_template_as_vllm_passes_it(http, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = "{{ reasoning_effort }}|{{ enable_thinking }}|{% for m in messages %}{{ m.content }}{% endfor %}"

    def rendered(**fields) -> str:
        body = {**CHAT, "max_tokens": 1, "chat_template": template, "return_token_ids": True, **fields}
        answer = http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        return tokenizer.decode(answer.json()["prompt_token_ids"])

    assert rendered(reasoning_effort="low") == "low|True|hi"
    assert rendered(reasoning_effort="none") == "none|False|hi"
    assert rendered(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}) == "high|False|hi"
    assert rendered() == "||hi"
    refused = http.post("/v1/completions", json={**COMPLETION, "reasoning_effort": "low"})
    assert refused.json()["error"]["message"] == (
        "reasoning_effort is not supported by this server; send the request without it"
    )


def test_invocations_answers_a_chat_or_a_completion_by_its_body(http):
    chat = http.post("/invocations", json={**CHAT, "temperature": 0}).json()
    assert chat["object"] == "chat.completion"
    assert (
        chat["choices"][0]["message"]
        == http.post("/v1/chat/completions", json={**CHAT, "temperature": 0}).json()["choices"][0]["message"]
    )
    completion = http.post("/invocations", json={**COMPLETION, "temperature": 0}).json()
    assert completion["object"] == "text_completion"
    assert (
        completion["choices"][0]["text"]
        == http.post("/v1/completions", json={**COMPLETION, "temperature": 0}).json()["choices"][0]["text"]
    )
    neither = http.post("/invocations", json={"model": "tiny"})
    assert (neither.status_code, neither.json()["error"]["message"]) == (
        400,
        "/invocations takes a chat completion request (with messages) or a completion request (with prompt)",
    )
    broken = http.post("/invocations", content=b"{", headers={"Content-Type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["message"].startswith("request body is not valid JSON")


PARTS = (
    "{% for m in messages %}[{{ m.role }}]{% for p in m['content'] %}({{ p.type }}:{{ p.text }}){% endfor %}"
    "{% endfor %}"
)
WHOLE = "{% for m in messages %}[{{ m.role }}]{{ m['content'] }}{% endfor %}"


def test_content_parts_reach_the_template_in_order_or_joined_by_newlines(http, stack):
    """A message's parts cross the gRPC wire as parts (``ChatMessage.parts``): a template that loops over them gets
    each (vLLM's openai content format), one that reads the content whole gets the texts joined by newlines (its
    string format), over HTTP and gRPC alike."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b c"}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "d"}]

    def rendered(template: str) -> list[int]:
        answer = http.post("/tokenize", json={"model": "tiny", "messages": messages, "chat_template": template})
        assert answer.status_code == 200, answer.text
        return answer.json()["tokens"]

    def text(prompt: str) -> list[int]:
        return http.post("/tokenize", json={"model": "tiny", "prompt": prompt, "add_special_tokens": False}).json()[
            "tokens"
        ]

    assert rendered(PARTS) == text("[user](text:a)(text:b c)[assistant](text:d)")
    assert rendered(WHOLE) == text("[user]a\nb c[assistant]d")
    conversation = pb.ChatMessages(
        messages=[
            pb.ChatMessage(role="user", parts=[pb.ContentPart(text="a"), pb.ContentPart(text="b c")]),
            pb.ChatMessage(role="assistant", content="d"),
        ],
        chat_template=WHOLE,
    )
    stub = stack.grpc_stub()
    tokenized = stub.Tokenize(pb.TokenizeRequest(model="tiny", messages=conversation), timeout=60)
    assert list(tokenized.token_ids) == text("[user]a\nb c[assistant]d")
    conversation.messages[0].content = "a"
    with pytest.raises(grpc.RpcError) as raised:
        stub.Tokenize(pb.TokenizeRequest(model="tiny", messages=conversation), timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "a message's parts are its whole content: send no content or image_urls"

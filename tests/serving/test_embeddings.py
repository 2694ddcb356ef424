"""The embeddings API (``/v1/embeddings``, ``/pooling``, gRPC ``Embed``) of a tiny random ``Qwen3Model``: every
vector is transformers' base model's last final hidden state of the same token ids, L2-normalized; what an
embedding model cannot do, and what a generative model cannot, is refused by name."""

from __future__ import annotations

import base64
import shutil
import struct
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerFast

from raypaged.serving.proto import generate_pb2 as pb
from tests.conftest import make_tiny_embedding_model
from tests.serving.conftest import BOS_ID, Stack, add_bos, tiny_config

LONG = list(range(100, 137))  # 37 tokens
SHORT = [5, 9, 300]
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory, smollm2_dir) -> Path:
    path = make_tiny_embedding_model(tmp_path_factory.mktemp("embed"), smollm2_dir, "qwen3", head_dim=16)
    shutil.copy(smollm2_dir / "chat_template.jinja", path / "chat_template.jinja")
    return add_bos(path)


@pytest.fixture(scope="module")
def tokenizer(embedding_dir) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(embedding_dir)


@pytest.fixture(scope="module")
def hf_base(embedding_dir):
    return AutoModel.from_pretrained(embedding_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def stack(embedding_dir, tiny_model_dir):
    """One server: the embedding model ``embed`` and the generative ``tiny``."""
    configs = [
        tiny_config(embedding_dir, "embed", max_model_len=MAX_MODEL_LEN, trust_request_chat_template=True),
        tiny_config(tiny_model_dir, "tiny"),
    ]
    stack = Stack(configs)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def http(stack):
    with stack.client() as client:
        yield client


def expected(hf_base, token_ids: list[int], normalize: bool = True) -> list[float]:
    """transformers' base model: the last token's final hidden state, L2-normalized."""
    with torch.inference_mode():
        last = hf_base(torch.tensor([token_ids])).last_hidden_state[0, -1]
    return (torch.nn.functional.normalize(last, dim=-1) if normalize else last).tolist()


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == 64
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-5


def embed(http, **body) -> dict:
    answer = http.post("/v1/embeddings", json={"model": "embed", **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_each_input_is_transformers_last_hidden_state_normalized(http, hf_base, tokenizer):
    texts = ["hello world", "an embedding of a longer sentence"]
    by_text = embed(http, input=texts)
    by_ids = embed(http, input=[LONG, SHORT], request_id="ids-1")
    single = embed(http, input=SHORT)
    one_text = embed(http, input=texts[0], user="u-1")
    text_ids = [tokenizer(t)["input_ids"] for t in texts]
    assert text_ids[0][0] == BOS_ID
    assert by_ids["id"] == "embd-ids-1" and by_text["id"].startswith("embd-")
    assert {k: v for k, v in by_ids.items() if k not in ("created", "data")} == {
        "id": "embd-ids-1",
        "object": "list",
        "model": "embed",
        "usage": {"prompt_tokens": 40, "total_tokens": 40, "completion_tokens": 0, "prompt_tokens_details": None},
    }
    assert isinstance(by_ids["created"], int)
    assert [(d["index"], d["object"]) for d in by_ids["data"]] == [(0, "embedding"), (1, "embedding")]
    for answer, inputs in ((by_ids, [LONG, SHORT]), (by_text, text_ids), (single, [SHORT]), (one_text, text_ids[:1])):
        assert answer["usage"]["prompt_tokens"] == sum(len(ids) for ids in inputs)
        assert len(answer["data"]) == len(inputs)
        for item, ids in zip(answer["data"], inputs, strict=True):
            assert_close(item["embedding"], expected(hf_base, ids))


def test_base64_is_the_same_floats_as_little_endian_float32(http):
    floats = embed(http, input=[LONG, SHORT])
    encoded = embed(http, input=[LONG, SHORT], encoding_format="base64")
    for plain, packed in zip(floats["data"], encoded["data"], strict=True):
        assert struct.unpack("<64f", base64.b64decode(packed["embedding"])) == tuple(plain["embedding"])


def test_pooling_fields_and_the_chat_form(http, hf_base, tokenizer, stack):
    long = list(range(200, 300))  # 100 tokens: over max_model_len 64 unless cut
    truncated = embed(http, input=long, truncate_prompt_tokens=8)
    assert truncated["usage"]["prompt_tokens"] == 8
    assert_close(truncated["data"][0]["embedding"], expected(hf_base, long[-8:]))
    whole_context = embed(http, input=long, truncate_prompt_tokens=-1)
    assert_close(whole_context["data"][0]["embedding"], expected(hf_base, long[-MAX_MODEL_LEN:]))
    for switch in ("normalize", "use_activation"):
        raw = embed(http, input=SHORT, **{switch: False})
        assert_close(raw["data"][0]["embedding"], expected(hf_base, SHORT, normalize=False))
    plain = embed(http, input="hello world", add_special_tokens=False)
    assert_close(
        plain["data"][0]["embedding"],
        expected(hf_base, tokenizer("hello world", add_special_tokens=False)["input_ids"]),
    )
    messages = [{"role": "user", "content": "What is an embedding?"}]
    chat = embed(http, messages=messages)
    rendered = http.post("/tokenize", json={"model": "embed", "messages": messages, "add_generation_prompt": False})
    ids = rendered.json()["tokens"]
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert_close(chat["data"][0]["embedding"], expected(hf_base, ids))
    for special in (True, False):  # token ids are used as they are, as vLLM's (true, its default, adds nothing)
        ids_as_given = embed(http, input=SHORT, add_special_tokens=special)
        assert ids_as_given["usage"]["prompt_tokens"] == len(SHORT)
        assert_close(ids_as_given["data"][0]["embedding"], expected(hf_base, SHORT))
    with_bos = embed(http, messages=messages, add_special_tokens=True)  # the template's ids after the tokenizer's BOS
    assert with_bos["usage"]["prompt_tokens"] == len(ids) + 1
    assert_close(with_bos["data"][0]["embedding"], expected(hf_base, [BOS_ID, *ids]))
    pooled = http.post("/pooling", json={"model": "embed", "input": [SHORT], "task": "embed"}).json()
    assert pooled["id"].startswith("pool-") and pooled["object"] == "list"
    [item] = pooled["data"]
    assert (item["index"], item["object"]) == (0, "pooling")
    assert_close(item["data"], expected(hf_base, SHORT))
    assert stack.engine("embed").stats()["num_gpu_blocks_free"] == 64


def error_of(answer) -> tuple[int, dict]:
    return answer.status_code, answer.json()["error"]


def invalid(message: str, param: str | None) -> dict:
    return {"message": message, "type": "invalid_request_error", "param": param, "code": None}


def test_refusals_name_the_field(http, stack):
    dimensions = http.post("/v1/embeddings", json={"model": "embed", "input": SHORT, "dimensions": 8})
    assert error_of(dimensions) == (
        400,
        invalid(
            "Model does not support matryoshka representation, changing output dimensions will lead to poor results "
            "(its config sets neither is_matryoshka nor matryoshka_dimensions; dimensions 8)",
            "dimensions",
        ),
    )
    unknown = http.post("/v1/embeddings", json={"model": "embed", "input": SHORT, "embed_dtype": "float16"})
    assert error_of(unknown) == (
        400,
        invalid("embed_dtype is not supported by this server; send the request without it", "embed_dtype"),
    )
    too_long = http.post("/v1/embeddings", json={"model": "embed", "input": [SHORT, list(range(100, 165))]})
    assert error_of(too_long) == (
        400,
        invalid(
            "This model's maximum context length is 64 tokens. However, you requested 65 tokens in the input for "
            "embedding generation. Please reduce the length of the input.",
            "input",
        ),
    )
    both = http.post("/pooling", json={"model": "embed", "input": SHORT, "normalize": True, "use_activation": False})
    assert error_of(both) == (
        400,
        invalid(
            "normalize (True) and use_activation (False) are the same switch (normalize is its older name): give one",
            None,
        ),
    )
    chat_field = http.post("/v1/embeddings", json={"model": "embed", "input": "hi", "add_generation_prompt": True})
    assert error_of(chat_field) == (
        400,
        invalid("add_generation_prompt applies to messages, not to input", "add_generation_prompt"),
    )
    assert stack.engine("embed").stats()["num_gpu_blocks_free"] == 64  # the other input was aborted, or never ran


def test_each_model_refuses_the_other_kind_of_request(http):
    generate = http.post("/v1/completions", json={"model": "embed", "prompt": "hi", "max_tokens": 2})
    assert error_of(generate) == (
        400,
        invalid(
            "The model `embed` is an embedding model (--runner pooling): it serves /v1/embeddings, /pooling, /score "
            "and /rerank, not generation",
            "model",
        ),
    )
    chat = http.post("/v1/chat/completions", json={"model": "embed", "messages": [{"role": "user", "content": "hi"}]})
    assert error_of(chat) == error_of(generate)
    for path in ("/v1/embeddings", "/pooling"):
        embedding = http.post(path, json={"model": "tiny", "input": "hi"})
        assert error_of(embedding) == (
            400,
            invalid(
                "The model `tiny` does not support the Embeddings API: it generates text; embeddings need an "
                "embedding model (--runner pooling)",
                "model",
            ),
        )


def test_grpc_embed(stack, hf_base):
    stub = stack.grpc_stub()
    info = {m.name: (m.embedding, m.pooling_task, list(m.labels)) for m in stub.Info(pb.InfoRequest()).models}
    assert info == {"embed": (True, "embed", []), "tiny": (False, "", [])}
    answer = stub.Embed(pb.EmbedRequest(model="embed", request_id="g-1", token_ids=pb.TokenIds(ids=LONG)))
    assert (answer.request_id, answer.prompt_tokens) == ("g-1", 37)
    assert_close(list(answer.embedding), expected(hf_base, LONG))
    raw = stub.Embed(
        pb.EmbedRequest(model="embed", token_ids=pb.TokenIds(ids=LONG), truncate_prompt_tokens=3, normalize=False)
    )
    assert raw.prompt_tokens == 3
    assert_close(list(raw.embedding), expected(hf_base, LONG[-3:], normalize=False))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Embed(pb.EmbedRequest(model="tiny", text="hi"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        refused.value.details() == "tiny is a generative model: embeddings need an embedding model (--runner pooling)"
    )
    assert ("raypaged-param", "model") in tuple(refused.value.trailing_metadata())
    with pytest.raises(grpc.RpcError) as empty:
        stub.Embed(pb.EmbedRequest(model="embed"))
    assert (empty.value.code(), empty.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "input is required: text, token_ids, messages or text_pair",
    )

"""vLLM's classification and scoring APIs (``/classify``, ``/score``, ``/rerank``; gRPC ``Embed``'s text pair and
task) of tiny random checkpoints: a 3-label classifier's probabilities and a cross-encoder's pair scores equal
transformers' ``AutoModelForSequenceClassification``, an embedding model scores the cosine similarity of transformers'
vectors; what a model cannot serve is refused by name."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from tokenizers.processors import TemplateProcessing
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerFast

from raypaged.serving.proto import generate_pb2 as pb
from tests.conftest import make_classifier, make_tiny_embedding_model, make_tiny_encoder
from tests.serving.conftest import Stack, tiny_config

BOS_ID, SEP_ID = 1, 2  # the tokenizers add them: "<bos> A" and "<bos> A <sep> B"
QUERY = "what is paged attention"
DOCUMENTS = ["a kv cache in blocks", "a cat on a mat", "attention over pages of keys", "bread"]
LABELS = ["class_0", "class_1", "class_2"]
MAX_PROMPTS = 6


def with_pair_template(path: Path) -> Path:
    """``path``'s tokenizer made to add ``<bos>`` to a text and ``<bos> A <sep> B`` to a text pair."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    bos, sep = tokenizer.convert_ids_to_tokens([BOS_ID, SEP_ID])
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {sep} $B", special_tokens=[(bos, BOS_ID), (sep, SEP_ID)]
    )
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scoring")
    classifier = with_pair_template(make_classifier(root, smollm2_dir, "qwen3", 3))
    shutil.copy(smollm2_dir / "chat_template.jinja", classifier / "chat_template.jinja")
    return {
        "classifier": classifier,
        "cross": with_pair_template(make_classifier(root, smollm2_dir, "llama", 1)),
        "embed": make_tiny_embedding_model(root, smollm2_dir, "qwen3", head_dim=16),
        "bert-cross": make_tiny_encoder(root, "bert", num_labels=1),
    }


@pytest.fixture(scope="module")
def http(stack):
    with stack.client() as client:
        yield client


@pytest.fixture(scope="module")
def stack(dirs, tiny_model_dir):
    """One server: the four pooling models under their ``dirs`` names, and the generative ``tiny``."""
    configs = [tiny_config(path, name, max_model_len=64) for name, path in dirs.items()]
    stack = Stack([*configs, tiny_config(tiny_model_dir, "tiny")], max_prompts_per_request=MAX_PROMPTS)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def tokenizer(dirs) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(dirs["cross"])


@pytest.fixture(scope="module")
def hf(dirs) -> dict[str, torch.nn.Module]:
    models = {
        name: AutoModelForSequenceClassification.from_pretrained(dirs[name], dtype=torch.float32).eval()
        for name in ("classifier", "cross", "bert-cross")
    }
    return {**models, "embed": AutoModel.from_pretrained(dirs["embed"], dtype=torch.float32).eval()}


def logits(hf, name: str, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf[name](torch.tensor([token_ids])).logits[0]


def hf_cosine(hf, tokenizer, text_1: str, text_2: str) -> float:
    with torch.inference_mode():
        a, b = (
            hf["embed"](torch.tensor([tokenizer(t)["input_ids"]])).last_hidden_state[0, -1] for t in (text_1, text_2)
        )
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def post(http, path: str, **body) -> dict:
    answer = http.post(path, json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def head_of(answer: dict) -> dict:
    """A list answer without its items and time."""
    assert isinstance(answer["created"], int)
    return {k: v for k, v in answer.items() if k not in ("created", "data")}


def list_head(answer_id: str, model: str, num_tokens: int) -> dict:
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}
    return {"id": answer_id, "object": "list", "model": model, "usage": {**usage, "prompt_tokens_details": None}}


def test_classify_gives_transformers_probabilities_and_the_likeliest_label(http, hf, tokenizer):
    texts = ["hello world", "a longer sentence to classify"]
    token_ids = [list(range(100, 137)), [5, 9, 300]]
    by_text = post(http, "/classify", model="classifier", input=texts, request_id="c-1")
    by_ids = post(http, "/classify", model="classifier", input=token_ids)
    plain = post(http, "/classify", model="classifier", input=texts[0], add_special_tokens=False)
    raw = post(http, "/classify", model="classifier", input=token_ids[1], use_activation=False)
    messages = [{"role": "user", "content": "Is this positive?"}]
    chat = post(http, "/classify", model="classifier", messages=messages)
    rendered = http.post(
        "/tokenize", json={"model": "classifier", "messages": messages, "add_generation_prompt": False}
    )
    text_ids = [tokenizer(t)["input_ids"] for t in texts]
    assert text_ids[0][0] == BOS_ID
    assert head_of(by_text) == list_head("classify-c-1", "classifier", sum(map(len, text_ids)))
    cases = [
        (by_text, text_ids),
        (by_ids, token_ids),
        (plain, [tokenizer(texts[0], add_special_tokens=False)["input_ids"]]),
        (chat, [rendered.json()["tokens"]]),
    ]
    for answer, inputs in cases:
        assert answer["usage"]["prompt_tokens"] == sum(map(len, inputs))
        for index, (item, ids) in enumerate(zip(answer["data"], inputs, strict=True)):
            probs = logits(hf, "classifier", ids).softmax(-1)
            assert (item["index"], item["num_classes"], item["label"]) == (index, 3, LABELS[int(probs.argmax())])
            assert (torch.tensor(item["probs"]) - probs).abs().max() < 1e-5
    assert (torch.tensor(raw["data"][0]["probs"]) - logits(hf, "classifier", token_ids[1])).abs().max() < 1e-5


def test_a_cross_encoder_scores_each_text_pair_as_transformers(http, hf, tokenizer):
    one_to_many = post(http, "/score", model="cross", text_1=QUERY, text_2=DOCUMENTS, request_id="s-1")
    pairwise = post(http, "/v1/score", model="cross", text_1=[QUERY, "bread"], text_2=["bread", QUERY])
    pairs = [tokenizer(QUERY, d)["input_ids"] for d in DOCUMENTS]
    assert pairs[0][0] == BOS_ID and SEP_ID in pairs[0]
    assert head_of(one_to_many) == list_head("score-s-1", "cross", sum(map(len, pairs)))
    for index, (item, ids) in enumerate(zip(one_to_many["data"], pairs, strict=True)):
        assert (item["index"], item["object"]) == (index, "score")
        assert abs(item["score"] - float(logits(hf, "cross", ids).sigmoid()[0])) < 1e-5
    for item, (a, b) in zip(pairwise["data"], [(QUERY, "bread"), ("bread", QUERY)], strict=True):
        assert abs(item["score"] - float(logits(hf, "cross", tokenizer(a, b)["input_ids"]).sigmoid()[0])) < 1e-5
    raw = post(http, "/score", model="cross", text_1=QUERY, text_2=DOCUMENTS[0], use_activation=False)
    assert abs(raw["data"][0]["score"] - float(logits(hf, "cross", pairs[0])[0])) < 1e-5


def test_a_bert_cross_encoder_scores_pairs_with_their_token_types(http, hf, dirs):
    """BERT's pair ``[CLS] A [SEP] B [SEP]`` over HTTP (gRPC ``Embed``'s text pair): the second text embeds as token
    type 1, so the scores equal transformers' with the tokenizer's token types; reranking orders by them."""
    tokenizer = AutoTokenizer.from_pretrained(dirs["bert-cross"])
    encodings = [tokenizer(QUERY, d, return_tensors="pt") for d in DOCUMENTS]
    assert encodings[0]["token_type_ids"][0, -1] == 1
    with torch.inference_mode():
        scores = [float(hf["bert-cross"](**e).logits[0, 0].sigmoid()) for e in encodings]
    answer = post(http, "/score", model="bert-cross", text_1=QUERY, text_2=DOCUMENTS)
    assert answer["usage"]["prompt_tokens"] == sum(e["input_ids"].shape[1] for e in encodings)
    for item, score in zip(answer["data"], scores, strict=True):
        assert abs(item["score"] - score) < 1e-5
    ranked = post(http, "/rerank", model="bert-cross", query=QUERY, documents=DOCUMENTS)
    assert [r["index"] for r in ranked["results"]] == sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])


def test_an_embedding_model_scores_the_cosine_similarity(http, hf, dirs):
    tokenizer = AutoTokenizer.from_pretrained(dirs["embed"])
    answer = post(http, "/score", model="embed", text_1=QUERY, text_2=DOCUMENTS[:2])
    num_tokens = sum(len(tokenizer(QUERY)["input_ids"]) + len(tokenizer(d)["input_ids"]) for d in DOCUMENTS[:2])
    assert answer["usage"]["prompt_tokens"] == num_tokens  # as vLLM counts: both texts of every pair
    for item, document in zip(answer["data"], DOCUMENTS[:2], strict=True):
        assert abs(item["score"] - hf_cosine(hf, tokenizer, QUERY, document)) < 1e-5
    [pairwise] = post(http, "/score", model="embed", text_1=["bread"], text_2=[QUERY])["data"]
    assert abs(pairwise["score"] - hf_cosine(hf, tokenizer, "bread", QUERY)) < 1e-5


def test_rerank_orders_documents_by_score_and_keeps_the_top_n(http, stack, hf, tokenizer):
    pairs = [tokenizer(QUERY, document)["input_ids"] for document in DOCUMENTS]
    scores = [float(logits(hf, "cross", ids).sigmoid()[0]) for ids in pairs]
    assert min(abs(a - b) for a, b in itertools.combinations(scores, 2)) > 1e-4  # an order rounding cannot change
    ranked = sorted(range(len(DOCUMENTS)), key=lambda index: -scores[index])
    answer = post(http, "/rerank", model="cross", query=QUERY, documents=DOCUMENTS, top_n=2, request_id="r-1")
    num_tokens = sum(map(len, pairs))
    results = answer.pop("results")
    assert answer == {
        "id": "rerank-r-1",
        "model": "cross",
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
    assert [(r["index"], r["document"]) for r in results] == [
        (index, {"text": DOCUMENTS[index], "multi_modal": None}) for index in ranked[:2]
    ]
    assert all(abs(result["relevance_score"] - scores[result["index"]]) < 1e-5 for result in results)
    for path in ("/v1/rerank", "/v2/rerank"):
        every = post(http, path, model="cross", query=QUERY, documents=DOCUMENTS)  # top_n 0: all
        assert [result["index"] for result in every["results"]] == ranked
    by_embedding = post(http, "/rerank", model="embed", query=QUERY, documents=DOCUMENTS[:2], top_n=5)
    assert len(by_embedding["results"]) == 2
    assert by_embedding["results"][0]["relevance_score"] >= by_embedding["results"][1]["relevance_score"]
    assert all(stack.engine(name).stats()["num_gpu_blocks_free"] == 64 for name in ("cross", "embed"))


def error_of(answer) -> tuple[int, dict]:
    return answer.status_code, answer.json()["error"]


def invalid(message: str, param: str | None) -> tuple[int, dict]:
    return 400, {"message": message, "type": "invalid_request_error", "param": param, "code": None}


def refusal(model: str, api: str, kind: str, needs: str) -> tuple[int, dict]:
    return invalid(f"The model `{model}` does not support the {api}: {kind}; {needs} (--runner pooling)", "model")


SCORES_NEED = "scores need a cross-encoder (a classifier of one label) or an embedding model"


def test_each_model_refuses_what_it_does_not_serve(http):
    classify, score = {"input": "hi"}, {"text_1": "a", "text_2": "b"}
    rerank = {"query": "a", "documents": ["b"]}
    for path, body, api, needs in [
        ("/classify", classify, "Classification API", "classification needs a classifier"),
        ("/score", score, "Score API", SCORES_NEED),
        ("/rerank", rerank, "Rerank API", SCORES_NEED),
    ]:
        refused = http.post(path, json={"model": "tiny", **body})
        assert error_of(refused) == refusal("tiny", api, "it generates text", needs)
    assert error_of(http.post("/classify", json={"model": "embed", **classify})) == refusal(
        "embed", "Classification API", "it is an embedding model", "classification needs a classifier"
    )
    for model, labels in (("classifier", "3 labels"), ("cross", "1 label")):
        assert error_of(http.post("/v1/embeddings", json={"model": model, "input": "hi"})) == refusal(
            model, "Embeddings API", f"it is a classifier of {labels}", "embeddings need an embedding model"
        )
    for path, body, api in (("/score", score, "Score API"), ("/v2/rerank", rerank, "Rerank API")):
        assert error_of(http.post(path, json={"model": "classifier", **body})) == refusal(
            "classifier", api, "it is a classifier of 3 labels", SCORES_NEED
        )
    for model, paths in (("classifier", "/classify"), ("cross", "/classify, /score and /rerank")):
        generate = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
        assert error_of(generate) == invalid(
            f"The model `{model}` is a classifier (--runner pooling): it serves {paths}, not generation", "model"
        )


def test_bodies_are_refused_by_the_field_at_fault(http, stack):
    unknown = [
        ("/rerank", {"model": "cross", "query": "a", "documents": ["b"], "return_documents": True}, "return_documents"),
        ("/score", {"model": "cross", "text_1": "a", "text_2": "b", "add_special_tokens": False}, "add_special_tokens"),
        ("/classify", {"model": "classifier", "input": "a", "dimensions": 2}, "dimensions"),
        ("/v1/score", {"model": "cross", "queries": "a", "text_1": "a", "text_2": "b"}, "queries"),
    ]
    for path, body, field in unknown:
        assert error_of(http.post(path, json=body)) == invalid(
            f"{field} is not supported by this server; send the request without it", field
        )
    mismatched = http.post("/score", json={"model": "cross", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert error_of(mismatched) == invalid(
        "Input lengths must be either 1:1, 1:N or N:N: text_1 has 2 texts and text_2 3", "text_1"
    )
    empty = http.post("/rerank", json={"model": "cross", "query": "a", "documents": []})
    assert error_of(empty) == invalid("documents must not be empty", "documents")
    too_many = http.post("/rerank", json={"model": "cross", "query": "a", "documents": ["b"] * (MAX_PROMPTS + 1)})
    assert error_of(too_many) == invalid(
        f"documents has {MAX_PROMPTS + 1} inputs, more than the limit of {MAX_PROMPTS} (--max-prompts-per-request)",
        "documents",
    )
    too_long = http.post("/classify", json={"model": "classifier", "input": [[5, 9], list(range(100, 165))]})
    assert error_of(too_long) == invalid(
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens in the input for "
        "embedding generation. Please reduce the length of the input.",
        "input",
    )
    assert stack.engine("classifier").stats()["num_gpu_blocks_free"] == 64  # the other input was aborted, or never ran


def test_grpc_embed_takes_a_text_pair_and_a_task(stack, hf, tokenizer):
    stub = stack.grpc_stub()
    info = {m.name: (m.embedding, m.pooling_task, list(m.labels)) for m in stub.Info(pb.InfoRequest()).models}
    assert info == {
        "classifier": (True, "classify", LABELS),
        "cross": (True, "classify", ["LABEL_0"]),
        "embed": (True, "embed", []),
        "bert-cross": (True, "classify", ["LABEL_0"]),
        "tiny": (False, "", []),
    }
    pair = pb.TextPair(text_1=QUERY, text_2=DOCUMENTS[0])
    scored = stub.Embed(pb.EmbedRequest(model="cross", request_id="g-1", text_pair=pair, task="score"))
    ids = tokenizer(QUERY, DOCUMENTS[0])["input_ids"]
    assert (scored.request_id, scored.prompt_tokens) == ("g-1", len(ids))
    assert abs(scored.embedding[0] - float(logits(hf, "cross", ids).sigmoid()[0])) < 1e-5
    bare = stub.Embed(pb.EmbedRequest(model="cross", text_pair=pair, add_special_tokens=False))
    bare_ids = tokenizer(QUERY, DOCUMENTS[0], add_special_tokens=False)["input_ids"]
    assert bare.prompt_tokens == len(bare_ids) == len(ids) - 2
    assert abs(bare.embedding[0] - float(logits(hf, "cross", bare_ids).sigmoid()[0])) < 1e-5
    for request, message in [
        (
            pb.EmbedRequest(model="classifier", text="hi", task="embed"),
            "this model classifies (--convert classify): task 'embed' is not served (classify, score)",
        ),
        (
            pb.EmbedRequest(model="embed", text="hi", task="classify"),
            "this model embeds: task 'classify' is not served (embed, encode, score)",
        ),
    ]:
        with pytest.raises(grpc.RpcError) as refused:
            stub.Embed(request)
        assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        assert ("raypaged-param", "task") in tuple(refused.value.trailing_metadata())
    with pytest.raises(grpc.RpcError) as unknown:
        stub.Embed(pb.EmbedRequest(model="embed", text="hi", task="rank"))
    assert (unknown.value.code(), unknown.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "task must be one of embed, encode, classify, score, got 'rank'",
    )

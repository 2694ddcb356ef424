"""Classifiers (``*ForSequenceClassification``, ``runner="pooling"``): every prompt's class probabilities equal
transformers' (its ``score`` head over the last token's state, through softmax or, for one label, sigmoid), a
cross-encoder scores text pairs as transformers does, an embedding model scores pairs by cosine similarity; what a
classifier cannot do is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from raypaged import LLM, PoolingParams
from tests.conftest import make_classifier

PROMPTS = [list(range(100, 137)), [5, 9, 300], [42] * 20]
OPTIONS = {"device": "cpu", "num_gpu_blocks_override": 64, "block_size": 4, "max_model_len": 64}


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_classifier(tmp_path_factory.mktemp("classifier"), smollm2_dir, "qwen3", 3)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_classifier(tmp_path_factory.mktemp("cross_encoder"), smollm2_dir, "llama", 1)


def hf_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0]


def test_class_probabilities_equal_transformers(classifier_dir):
    llm = LLM(model=str(classifier_dir), max_num_batched_tokens=16, max_num_seqs=4, **OPTIONS)  # runner auto
    try:
        config = llm.llm_engine.config
        assert config.pooler is not None and config.pooler.task == "classify"
        assert config.pooler.labels == ("class_0", "class_1", "class_2")
        outputs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        raw = llm.encode({"prompt_token_ids": PROMPTS[0]}, PoolingParams(use_activation=False), use_tqdm=False)
        with pytest.raises(ValueError, match=r"this model classifies \(--convert classify\): task 'embed' is not"):
            llm.embed("hi", use_tqdm=False)
        with pytest.raises(ValueError, match=r"is a classifier \(--runner pooling\): it serves its scores \(/classify"):
            llm.generate("hi", use_tqdm=False)
        with pytest.raises(ValueError, match=r"^dimensions applies to embeddings, not to a classifier's scores$"):
            llm.classify("hi", PoolingParams(dimensions=2), use_tqdm=False)
        with pytest.raises(ValueError, match=r"^LLM.score needs a classifier of one label \(a cross-encoder\); this"):
            llm.score("a", "b", use_tqdm=False)
        assert llm.stats()["num_gpu_blocks_free"] == 64
    finally:
        llm.shutdown()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = hf_logits(classifier_dir, prompt).softmax(-1)
        assert output.outputs.num_classes == 3
        assert (torch.tensor(output.outputs.probs) - expected).abs().max() < 1e-6
    assert (raw[0].outputs.data - hf_logits(classifier_dir, PROMPTS[0])).abs().max() < 1e-5


def test_a_cross_encoder_scores_pairs_as_transformers(cross_encoder_dir):
    llm = LLM(model=str(cross_encoder_dir), **OPTIONS)
    try:
        scores = llm.score("what is paged attention", ["a kv cache in blocks", "a cat on a mat"], use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    finally:
        llm.shutdown()
    for score, doc in zip(scores, ["a kv cache in blocks", "a cat on a mat"], strict=True):
        pair = tokenizer("what is paged attention", doc)["input_ids"]
        assert score.prompt_token_ids == pair
        assert abs(score.outputs.score - float(hf_logits(cross_encoder_dir, pair).sigmoid()[0])) < 1e-6


def test_an_embedding_model_scores_by_cosine_similarity(tmp_path, smollm2_dir):
    from tests.conftest import make_tiny_embedding_model

    llm = LLM(model=str(make_tiny_embedding_model(tmp_path, smollm2_dir)), **OPTIONS)
    try:
        [score] = llm.score("one text", "another text", use_tqdm=False)
        a, b = (torch.tensor(o.outputs.embedding) for o in llm.embed(["one text", "another text"], use_tqdm=False))
        with pytest.raises(ValueError, match=r"^data_1 has 2 texts and data_2 3: give one against many"):
            llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    finally:
        llm.shutdown()
    assert abs(score.outputs.score - float(torch.nn.functional.cosine_similarity(a, b, dim=0))) < 1e-6


def test_what_a_classifier_cannot_be_is_refused(classifier_dir, smollm2_dir):
    with pytest.raises(ValueError, match=r"has no language-model head, so it cannot generate: serve it with --runner"):
        LLM(model=str(classifier_dir), runner="generate", **OPTIONS)
    with pytest.raises(ValueError, match=r"^--convert classify needs a classification head"):
        LLM(model=str(smollm2_dir), convert="classify", **OPTIONS)
    with pytest.raises(
        ValueError,
        match=r"pooling_type 'MEAN' is not supported for this classifier: its head reads the last token's state "
        r"\(LAST\)",
    ):
        LLM(model=str(classifier_dir), pooler_config={"pooling_type": "MEAN"}, **OPTIONS)


@pytest.mark.parametrize(
    "arch, tied, tokens, reranker",
    [("qwen3", True, ["no", "yes"], True), ("llama", False, ["yes", "no", "maybe"], False)],
    ids=["qwen3-reranker", "tokens"],
)
def test_a_causal_lm_classifies_with_rows_of_its_head(tmp_path, smollm2_dir, arch, tied, tokens, reranker):
    """vLLM's ``classifier_from_token`` (by ``hf_overrides``): Qwen3-Reranker's p(yes) is sigmoid(logit_yes -
    logit_no) of the causal LM's last position; other token lists give one label per token, softmax over their
    logits. The head rows come from the tied embeddings or from lm_head."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import make_tiny_model

    path = make_tiny_model(tmp_path, smollm2_dir, arch, tie_word_embeddings=tied)
    overrides = {"architectures": [f"{'Qwen3' if arch == 'qwen3' else 'Llama'}ForSequenceClassification"]}
    overrides |= {"classifier_from_token": tokens} | ({"is_original_qwen3_reranker": True} if reranker else {})
    llm = LLM(model=str(path), runner="pooling", hf_overrides=overrides, **OPTIONS)
    try:
        assert llm.llm_engine.config.pooler.labels == (("LABEL_0",) if reranker else tuple(tokens))
        outputs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        ids = [llm.get_tokenizer().convert_tokens_to_ids(t) for t in tokens]
    finally:
        llm.shutdown()
    causal = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        with torch.inference_mode():
            logits = causal(torch.tensor([prompt])).logits[0, -1, ids]
        expected = (logits[1] - logits[0]).sigmoid()[None] if reranker else logits.softmax(-1)
        assert (torch.tensor(output.outputs.probs) - expected).abs().max() < 1e-5

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
    with pytest.raises(ValueError, match=r"pooling_type 'MEAN' is not supported for a classifier"):
        LLM(model=str(classifier_dir), pooler_config={"pooling_type": "MEAN"}, **OPTIONS)

"""Encoder-only models (BERT, XLM-RoBERTa) as embedding models and cross-encoders: raypaged's vectors and scores of
tiny random checkpoints equal transformers' ``AutoModel`` and ``AutoModelForSequenceClassification`` (BERT's text
pairs with their token types), in batches of prompts that fill the step's budget; the options an encoder runs
without, and bad token types, are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from raypaged import LLM, PoolingParams
from tests.conftest import make_tiny_encoder

# the prompts' tokens (7, 9, 5 and 33 with the special ones) overflow a step of 64 tokens: the last waits for the next
PROMPTS = [
    "what is paged attention",
    "a kv cache in blocks of keys",
    "bread",
    "the encoder embeds text and scores pairs the encoder embeds text and scores pairs over pages of keys",
]
QUERY = "what is paged attention"
DOCUMENTS = ["a kv cache in blocks", "a cat on a mat", "attention over pages of keys"]
OPTIONS = dict(enforce_eager=True, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("encoders")


def hf_states(path: Path, texts: list[str]) -> list[torch.Tensor]:
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        return [model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0] for text in texts]


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "modernbert"])
def test_embeddings_equal_transformers(root, arch):
    """CLS pooling (an encoder's default), normalized; MEAN over every token with --pooler-config; the fourth
    prompt waits for a step of its own (a prompt is never cut)."""
    path = make_tiny_encoder(root, arch)
    states = hf_states(path, PROMPTS)
    llm = LLM(model=str(path), **OPTIONS)
    assert llm.llm_engine.config.pooler.pooling_type == "CLS"
    assert not llm.llm_engine.config.enable_prefix_caching
    assert llm.llm_engine.executor.worker.runner.cache.device_blocks.numel() == 0  # no KV cache: blocks count tokens
    for output, state in zip(llm.embed(PROMPTS), states, strict=True):
        expected = torch.nn.functional.normalize(state[0], dim=-1)
        assert len(output.prompt_token_ids) == state.shape[0]
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=2e-6, rtol=0)
    mean = LLM(model=str(path), pooler_config={"pooling_type": "MEAN", "normalize": False}, **OPTIONS)
    for output, state in zip(mean.embed(PROMPTS), states, strict=True):
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), state.mean(0), atol=2e-6, rtol=0)
    # truncate_prompt_tokens as the tokenizer truncates (vLLM's, from the left): the text's first tokens go, the
    # special tokens around it stay, so the first token read is still [CLS] / <s>
    tokenizer = AutoTokenizer.from_pretrained(path, truncation_side="left")
    expected_ids = tokenizer(PROMPTS[3], truncation=True, max_length=6)["input_ids"]
    (output,) = mean.embed(PROMPTS[3], truncate_prompt_tokens=6)
    assert output.prompt_token_ids == expected_ids and len(expected_ids) == 6
    (state,) = hf_states(path, [tokenizer.decode(expected_ids[1:-1])])
    torch.testing.assert_close(torch.tensor(output.outputs.embedding), state.mean(0), atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens 2 leaves no room for the text beside the 2 special"):
        mean.embed(PROMPTS[3], truncate_prompt_tokens=2)


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "modernbert"])
def test_cross_encoder_scores_equal_transformers(root, arch):
    """``LLM.score``: each pair tokenized together (BERT's second text of token type 1), its head over the first
    token's state, through the sigmoid; the same pair given as token ids with vLLM's ``token_type_ids``."""
    path = make_tiny_encoder(root, arch, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = [torch.sigmoid(model(**tokenizer(QUERY, d, return_tensors="pt")).logits[0, 0]) for d in DOCUMENTS]
    llm = LLM(model=str(path), **OPTIONS)
    scores = [output.outputs.score for output in llm.score(QUERY, DOCUMENTS)]
    torch.testing.assert_close(torch.tensor(scores), torch.stack(expected), atol=1e-6, rtol=0)
    pair = tokenizer(QUERY, DOCUMENTS[0])
    prompt = {
        "prompt_token_ids": pair["input_ids"],
        **({"token_type_ids": pair["token_type_ids"]} if arch == "bert" else {}),
    }
    (output,) = llm.encode(prompt, pooling_task="score")
    torch.testing.assert_close(output.outputs.data[0], expected[0], atol=1e-6, rtol=0)
    if arch == "bert":  # the same ids as one text (all of type 0) are another input: another score
        (single,) = llm.encode({"prompt_token_ids": pair["input_ids"]}, pooling_task="score")
        assert abs(float(single.outputs.data[0]) - float(expected[0])) > 1e-4


def test_bert_classifier_probabilities_and_refusals(root):
    """A 3-label BERT classifier's softmax equals transformers'; bad token types, and the options an encoder runs
    without, are refused by name."""
    path = make_tiny_encoder(root, "bert", num_labels=3)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = [model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1) for text in PROMPTS]
    llm = LLM(model=str(path), **OPTIONS)
    outputs = llm.classify(PROMPTS)
    torch.testing.assert_close(
        torch.tensor([o.outputs.probs for o in outputs]), torch.stack(expected), atol=1e-6, rtol=0
    )
    ids = tokenizer(QUERY)["input_ids"]
    for types, message in (
        ([0, 1] * 3, r"^token_type_ids must be 0s then 1s"),
        ([0, 1], r"^token_type_ids has 2 entries for 6 prompt tokens"),
    ):
        with pytest.raises(ValueError, match=message):
            llm.encode({"prompt_token_ids": ids, "token_type_ids": types})
    with pytest.raises(ValueError, match=r"^a prompt's 'token_type_ids' is not supported"):
        llm.generate({"prompt_token_ids": ids, "token_type_ids": [0] * len(ids)})
    with pytest.raises(ValueError, match=r"^dimensions applies to embeddings"):
        llm.encode(QUERY, PoolingParams(dimensions=8))
    for options, message in (
        (
            {"tensor_parallel_size": 2},
            r"^--tensor-parallel-size 2 is not supported for BertForSequenceClassification, ",
        ),
        ({"quantization": "fp8"}, r"^--quantization is not supported for BertForSequenceClassification, an encoder"),
        ({"kv_cache_dtype": "fp8"}, r"^--kv-cache-dtype and --calculate-kv-scales do not apply to an encoder"),
        ({"max_num_batched_tokens": 32}, r"^--max-num-batched-tokens 32 is below max_model_len 64: an encoder"),
        ({"max_model_len": 65}, r"^max_model_len 65 exceeds the model's position embeddings 64"),
        (
            {"pooler_config": {"pooling_type": "LAST"}},
            r"pooling_type 'LAST' is not supported for this classifier: its "
            r"head reads the first token's state \(CLS\)",
        ),
        ({"runner": "generate"}, r"cannot generate"),
    ):
        with pytest.raises(ValueError, match=message):
            LLM(model=str(path), **{**OPTIONS, **options})


def test_xlm_roberta_has_one_token_type(root):
    """XLM-R's pairs are ``<s> A </s></s> B </s>`` with one token type: a type 1 is refused by name."""
    path = make_tiny_encoder(root, "xlm-roberta")
    llm = LLM(model=str(path), **OPTIONS)
    with pytest.raises(ValueError, match=r"^this model has one token type \(0\)"):
        llm.encode({"prompt_token_ids": [0, 5, 2], "token_type_ids": [0, 1, 1]})


def test_modernbert_classifier_pooling_the_mean(root):
    """A ModernBERT classifier of ``classifier_pooling`` mean: its head reads the mean of the prompt's final states."""
    path = make_tiny_encoder(root, "modernbert", num_labels=3, classifier_pooling="mean")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = [model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1) for text in PROMPTS]
    llm = LLM(model=str(path), **OPTIONS)
    assert llm.llm_engine.config.pooler.pooling_type == "MEAN"
    probs = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS)])
    torch.testing.assert_close(probs, torch.stack(expected), atol=1e-6, rtol=0)

"""Speculative decoding as a vLLM user turns it on: ``--speculative-config`` on the command line,
served over HTTP next to the same model without it, with vLLM's metrics."""

import json

import pytest

from raypaged.entrypoints.cli import build_parser, engine_configs
from raypaged.spec_decode.config import SpeculativeConfig
from tests.conftest import make_tiny_model
from tests.serving.conftest import Stack, tiny_model_dir  # noqa: F401  (session fixture)
from tests.serving.test_metrics_vllm import samples

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def configs(*argv: str):
    return engine_configs(build_parser().parse_args(["serve", *argv]))


def test_the_flag_reaches_the_engine_config(tiny_model_dir):
    [config] = configs(str(tiny_model_dir), "--speculative-config", json.dumps(NGRAM))
    assert config.speculative_config == SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1)
    [config] = configs(str(tiny_model_dir))
    assert config.speculative_config is None


def test_a_draft_model_that_cannot_draft_is_refused_by_name(tiny_model_dir, tmp_path, smollm2_dir):
    other_vocab = make_tiny_model(tmp_path, smollm2_dir, vocab_size=1000)
    with pytest.raises(
        ValueError,
        match=f"the draft model {other_vocab} has a vocabulary of 1000 tokens, the model "
        "49152: a draft model must share the model's tokenizer",
    ):
        configs(
            str(tiny_model_dir),
            "--speculative-config",
            json.dumps({"model": str(other_vocab), "num_speculative_tokens": 2}),
        )
    with pytest.raises(ValueError, match="draft model .* holds 512 positions, fewer than max_model_len 1024"):
        configs(
            str(smollm2_dir),
            "--max-model-len",
            "1024",
            "--speculative-config",
            json.dumps({"model": str(tiny_model_dir), "num_speculative_tokens": 2}),
        )
    with pytest.raises(ValueError, match="unknown or unsupported key 'speculative_token_tree'"):
        configs(str(tiny_model_dir), "--speculative-config", json.dumps({**NGRAM, "speculative_token_tree": "[(0,)]"}))


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    plain = configs(
        str(tiny_model_dir), "--served-model-name", "plain", "--num-gpu-blocks-override", "64", "--max-model-len", "256"
    )
    spec = configs(
        str(tiny_model_dir),
        "--served-model-name",
        "spec",
        "--num-gpu-blocks-override",
        "64",
        "--max-model-len",
        "256",
        "--speculative-config",
        json.dumps(NGRAM),
    )
    server = Stack(plain + spec)
    yield server
    server.close()


def complete(client, model: str, stream: bool) -> dict | str:
    body = {
        "model": model,
        "prompt": "one two three one two three one two",
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": 1,
        "stream": stream,
    }
    if not stream:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]
    text = ""
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_completions_with_speculation_equal_those_without_whole_and_streamed(stack):
    with stack.client() as client:
        plain, spec = complete(client, "plain", False), complete(client, "spec", False)
        assert spec["text"] == plain["text"] and spec["finish_reason"] == plain["finish_reason"] == "length"
        assert spec["logprobs"]["tokens"] == plain["logprobs"]["tokens"]
        assert spec["logprobs"]["token_logprobs"] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-4)
        assert complete(client, "spec", True) == plain["text"]
        text = client.get("/metrics").text
    found = samples(text)
    labels = frozenset({"model_name": "spec", "engine": "0"}.items())
    drafts = found[("raypaged:spec_decode_num_drafts_total", labels)]
    draft_tokens = found[("raypaged:spec_decode_num_draft_tokens_total", labels)]
    accepted = found[("raypaged:spec_decode_num_accepted_tokens_total", labels)]
    per_pos = [
        found[("raypaged:spec_decode_num_accepted_tokens_per_pos_total", labels | {("position", str(i))})]
        for i in range(3)
    ]
    assert drafts > 0 and accepted > 0 and accepted <= draft_tokens <= 3 * drafts
    assert sum(per_pos) == accepted
    # the model without speculation exports none of them, as vLLM
    assert not [name for name, labels in found if "spec_decode" in name and ("model_name", "plain") in labels]

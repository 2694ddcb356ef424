"""``echo`` and ``prompt_logprobs``: the prompt's log-probabilities equal transformers' log-softmax
(SmolLM2 fp32), over HTTP (the ``openai`` client) and through ``LLM``, chunked prefill included."""

from __future__ import annotations

import openai
import pytest
import torch

from raypaged import LLM, SamplingParams
from raypaged.config import EngineConfig
from tests.serving.conftest import Stack

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is Paris"


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    config = EngineConfig(
        model=str(smollm2_dir),
        served_model_name="smollm2",
        dtype="float32",
        num_gpu_blocks_override=256,
        max_model_len=1024,
        max_num_batched_tokens=16,
    )
    stack = Stack([config])  # a 16-token budget: the prompt is prefilled in chunks
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none")


@pytest.fixture(scope="module")
def reference(smollm2_dir, hf_smollm2):
    """(prompt ids, each prompt token's logprob given those before, the top-2 ids at each position)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2_dir)(PROMPT)["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), -1)
    chosen = [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]
    return ids, chosen, logprobs[:-1].topk(2, dim=-1).indices.tolist()


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_every_prompt_token(client, reference, max_tokens):
    ids, chosen, _ = reference
    completion = client.completions.create(
        model="smollm2", prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
    )
    choice = completion.choices[0]
    assert choice.text.startswith(PROMPT) and (max_tokens == 1 or choice.text == PROMPT)
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx(chosen, abs=1e-4)
    assert len(logprobs.tokens) == len(ids) + max_tokens
    assert "".join(logprobs.tokens[: len(ids)]) == PROMPT
    assert logprobs.text_offset[:3] == [0, len(logprobs.tokens[0]), len(logprobs.tokens[0]) + len(logprobs.tokens[1])]
    assert completion.usage.completion_tokens == max_tokens


def test_echo_streams_the_prompt_first(client):
    stream = client.completions.create(
        model="smollm2", prompt=PROMPT, echo=True, max_tokens=3, temperature=0, stream=True
    )
    texts = [c.choices[0].text for c in stream if c.choices]
    assert texts[0].startswith(PROMPT)
    whole = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0)
    assert "".join(texts) == PROMPT + whole.choices[0].text


def test_prompt_logprobs_in_vllms_shape(client, reference):
    ids, chosen, top2 = reference
    completion = client.completions.create(
        model="smollm2", prompt=ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    found = completion.choices[0].model_extra["prompt_logprobs"]
    assert found[0] is None and len(found) == len(ids)
    for position, entry in enumerate(found[1:], start=1):
        assert entry[str(ids[position])]["logprob"] == pytest.approx(chosen[position - 1], abs=1e-4)
        ranked = sorted((v["rank"], int(k)) for k, v in entry.items() if v["rank"] is not None)
        assert [token for _, token in ranked] == top2[position - 1]
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 5


def test_llm_prompt_logprobs_survive_prefix_caching_and_chunks(smollm2_dir, reference):
    ids, chosen, _ = reference
    llm = LLM(
        model=str(smollm2_dir),
        dtype="float32",
        num_gpu_blocks_override=128,
        max_model_len=512,
        max_num_batched_tokens=16,
        block_size=4,
    )
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)  # caches the prompt's blocks
    output = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False
    )[0]
    assert output.prompt_logprobs[0] is None
    assert [entry[token] for entry, token in zip(output.prompt_logprobs[1:], ids[1:])] == pytest.approx(
        chosen, abs=1e-4
    )
    assert all(len(entry) == 1 for entry in output.prompt_logprobs[1:])
    assert llm.stats()["num_gpu_blocks_free"] == 128


def test_chat_echo_of_a_user_turn_adds_nothing_and_over_the_limit_is_refused(stack):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0}
    with stack.client() as http:
        echoed = http.post("/v1/chat/completions", json={**body, "echo": True})
        plain = http.post("/v1/chat/completions", json=body)
        over = http.post("/v1/completions", json={"model": "smollm2", "prompt": "x", "prompt_logprobs": 21})
    # vLLM echoes the last message only when its role is the answer's (tests/serving/test_request_fields.py)
    assert echoed.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert over.json()["error"]["message"] == (
        "prompt_logprobs 21 is more than the limit of 20 (--max-logprobs, at most the vocabulary size 49152)"
    )

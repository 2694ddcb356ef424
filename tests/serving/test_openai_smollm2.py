"""The official ``openai`` client, unchanged but for ``base_url``, against SmolLM2 behind the gateway."""

from __future__ import annotations

import openai
import pytest

from raypaged import SamplingParams
from raypaged.config import EngineConfig
from tests.serving.conftest import Stack

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    stack = Stack(
        [
            EngineConfig(
                model=str(smollm2_dir), served_model_name="smollm2", dtype="float32", num_gpu_blocks_override=1024
            )
        ],
        api_key="sk-test",
    )
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-test")


def test_completion_greedy_equals_llm_generate(client, smollm2_llm):
    completion = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    expected = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert completion.choices[0].text == expected.text
    assert completion.choices[0].finish_reason == expected.finish_reason
    assert completion.usage.completion_tokens == len(expected.token_ids)


def test_chat_completion_greedy_equals_llm_chat(client, smollm2_llm):
    chat = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=20, temperature=0)
    expected = smollm2_llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert chat.choices[0].message.content == expected.text
    assert "Paris" in expected.text


def test_streaming_chat_joins_to_the_whole_answer(client):
    stream = client.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=20, temperature=0)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_logprobs_and_stop(client, smollm2_llm):
    completion = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    expected = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0].outputs[0]
    logprobs = completion.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([lp[t] for t, lp in zip(expected.token_ids, expected.logprobs)])
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=20, temperature=0, logprobs=True, top_logprobs=3
    )
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 for entry in chat.choices[0].logprobs.content)
    full = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    word = full.split()[1]
    stopped = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, stop=[word])
    assert stopped.choices[0].text == full[: full.index(word)]
    assert stopped.choices[0].finish_reason == "stop"


def test_wrong_key_and_unknown_model_raise_the_openai_errors(stack, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert [m.id for m in client.models.list()] == ["smollm2"]


def test_n_2_returns_two_choices_like_llm_generate(client, smollm2_llm):
    completion = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0.8, seed=3, n=2)
    expected = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0.8, max_tokens=8, seed=3, n=2))[0].outputs
    assert [c.index for c in completion.choices] == [0, 1]
    assert [c.text for c in completion.choices] == [c.text for c in sorted(expected, key=lambda c: c.index)]
    assert completion.usage.completion_tokens == sum(len(c.token_ids) for c in expected)


def test_best_of_gives_the_n_best_like_llm_generate_streamed_or_not(client, smollm2_llm):
    sampling = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.8, "seed": 3, "best_of": 3}
    expected = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0.8, max_tokens=8, seed=3, best_of=3))[0].outputs
    completion = client.completions.create(**sampling)
    assert [(c.index, c.text, c.finish_reason) for c in completion.choices] == [
        (0, expected[0].text, expected[0].finish_reason)
    ]
    chunks = list(client.completions.create(**sampling, stream=True))
    assert {c.choices[0].index for c in chunks} == {0}
    assert "".join(c.choices[0].text for c in chunks) == expected[0].text

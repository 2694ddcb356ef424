"""The offline API on the real SmolLM2-135M-Instruct weights, against transformers."""

import math
from dataclasses import replace

import pytest
import torch

from raypaged import LLM, SamplingParams
from tests.conftest import hf_greedy_batch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "The three laws of thermodynamics are",
    "Translate to French: I love programming.",
    "List five fruits:",
    "Q: What is 12 times 7?\nA:",
    "In 1969, the first humans walked on the Moon. Write a short poem about it, in the style of a sea shanty,"
    " with a chorus that repeats.",
]
NUM_NEW = 64
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_references(smollm2_llm, hf_smollm2):
    tokenizer = smollm2_llm.get_tokenizer()
    return hf_greedy_batch(hf_smollm2, [tokenizer(p)["input_ids"] for p in PROMPTS], NUM_NEW)


def test_greedy_batch_equals_transformers(smollm2_llm, hf_references):
    outputs = smollm2_llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outputs] == PROMPTS
    for output, reference in zip(outputs, hf_references):
        completion = output.outputs[0]
        assert completion.token_ids == reference
        assert completion.finish_reason == "length"
        assert completion.text == smollm2_llm.get_tokenizer().decode(reference, skip_special_tokens=True)
    stats = smollm2_llm.stats()
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"] == 1024
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def test_tiny_pool_preempts_recomputes_and_frees_everything(smollm2_dir, hf_references):
    llm = LLM(model=str(smollm2_dir), num_gpu_blocks_override=20, block_size=16, max_model_len=320)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_gpu_blocks_free"] == 20
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def test_token_id_prompts_give_the_same_tokens(smollm2_llm, hf_references):
    tokenizer = smollm2_llm.get_tokenizer()
    [output] = smollm2_llm.generate({"prompt_token_ids": tokenizer(PROMPTS[2])["input_ids"]}, GREEDY)
    assert output.prompt is None
    assert output.outputs[0].token_ids == hf_references[2]


def test_seeded_request_is_the_same_alone_and_in_a_batch(smollm2_llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=32, ignore_eos=True)
    [alone] = smollm2_llm.generate("Write a haiku about the sea.", seeded)
    others = [SamplingParams(temperature=1.0 + i / 10, max_tokens=8 + 3 * i, repetition_penalty=1.1) for i in range(16)]
    prompts = [f"Story number {i}: once" for i in range(16)]
    batch = smollm2_llm.generate(
        prompts[:7] + ["Write a haiku about the sea."] + prompts[7:], others[:7] + [seeded] + others[7:]
    )
    assert batch[7].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(alone.outputs[0].token_ids) == 32
    # a different seed gives different tokens
    [other] = smollm2_llm.generate(
        "Write a haiku about the sea.", SamplingParams(temperature=0.9, seed=99, max_tokens=32)
    )
    assert other.outputs[0].token_ids != alone.outputs[0].token_ids


def _greedy_text(llm, prompt, **kwargs):
    [output] = llm.generate(prompt, SamplingParams(temperature=0, **kwargs))
    return output.outputs[0]


def test_stop_string_cuts_the_text_before_it(smollm2_llm):
    full = _greedy_text(smollm2_llm, PROMPTS[1], max_tokens=48)
    stop = full.text[20:26]
    expected = full.text[: full.text.index(stop)]
    cut = _greedy_text(smollm2_llm, PROMPTS[1], max_tokens=48, stop=[stop, "never-appears"])
    assert cut.text == expected
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert len(cut.token_ids) < len(full.token_ids)


def test_stop_token_ids_end_on_that_token(smollm2_llm):
    full = _greedy_text(smollm2_llm, PROMPTS[3], max_tokens=40, ignore_eos=True)
    stop_token = full.token_ids[10]
    first = full.token_ids.index(stop_token)
    cut = _greedy_text(smollm2_llm, PROMPTS[3], max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token])
    assert cut.token_ids == full.token_ids[: first + 1]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop_token)


def test_a_stop_token_is_not_part_of_the_text_unless_asked(smollm2_llm):
    """As vLLM: the token that stops a sequence (the EOS, or one of stop_token_ids) is in its token ids but not its
    text, even where special tokens are kept; include_stop_str_in_output puts it back. Stop strings are found in the
    text before it."""
    tokenizer = smollm2_llm.get_tokenizer()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False)
    [kept] = smollm2_llm.chat(chat, params)
    answer = kept.outputs[0]
    eos = smollm2_llm.llm_engine.eos_token_id
    assert answer.finish_reason == "stop" and answer.token_ids[-1] == eos
    assert answer.text == tokenizer.decode(answer.token_ids[:-1], skip_special_tokens=False)
    [shown] = smollm2_llm.chat(chat, replace(params, include_stop_str_in_output=True))
    assert shown.outputs[0].text == answer.text + tokenizer.decode([eos])
    full = _greedy_text(smollm2_llm, PROMPTS[3], max_tokens=40, ignore_eos=True)
    stop_token = full.token_ids[10]
    first = full.token_ids.index(stop_token)
    cut = _greedy_text(smollm2_llm, PROMPTS[3], max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token])
    assert cut.text == tokenizer.decode(full.token_ids[:first]) and cut.token_ids[-1] == stop_token
    with_it = _greedy_text(
        smollm2_llm,
        PROMPTS[3],
        max_tokens=40,
        ignore_eos=True,
        stop_token_ids=[stop_token],
        include_stop_str_in_output=True,
    )
    assert with_it.text == tokenizer.decode(full.token_ids[: first + 1])


def test_max_tokens_min_tokens_and_ignore_eos(smollm2_llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    [short] = smollm2_llm.chat(chat, SamplingParams(temperature=0, max_tokens=64))
    eos = smollm2_llm.llm_engine.eos_token_id
    answer = short.outputs[0]
    assert "Paris" in answer.text
    assert answer.finish_reason == "stop" and answer.token_ids[-1] == eos
    assert eos not in answer.token_ids[:-1]
    n = len(answer.token_ids)

    [ignored] = smollm2_llm.chat(chat, SamplingParams(temperature=0, max_tokens=n + 5, ignore_eos=True))
    assert len(ignored.outputs[0].token_ids) == n + 5
    assert ignored.outputs[0].token_ids[:n] == answer.token_ids
    assert ignored.outputs[0].finish_reason == "length"

    [delayed] = smollm2_llm.chat(chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 3))
    tokens = delayed.outputs[0].token_ids
    assert tokens[: n - 1] == answer.token_ids[:-1]
    assert eos not in tokens[: n + 3]
    assert len(tokens) >= n + 3

    [capped] = smollm2_llm.chat(chat, SamplingParams(temperature=0, max_tokens=3))
    assert capped.outputs[0].token_ids == answer.token_ids[:3]
    assert capped.outputs[0].finish_reason == "length"


def test_logprobs_are_the_models_log_softmax(smollm2_llm, hf_smollm2):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    [output] = smollm2_llm.generate(PROMPTS[0], params)
    completion = output.outputs[0]
    ids = output.prompt_token_ids + completion.token_ids
    with torch.inference_mode():
        logits = hf_smollm2(torch.tensor([ids])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    num_prompt = len(output.prompt_token_ids)
    assert len(completion.logprobs) == 6
    for i, (token, top) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[num_prompt - 1 + i]
        expected_top = row.topk(3).indices.tolist()
        assert list(top)[0] == token  # greedy: the sampled token is the best one
        assert set(top) == {token, *expected_top} and len(top) == 3
        for token_id, logprob in top.items():
            assert logprob == pytest.approx(row[token_id].item(), abs=1e-4)
    assert completion.cumulative_logprob == pytest.approx(
        sum(t[tok] for tok, t in zip(completion.token_ids, completion.logprobs))
    )
    [plain] = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert plain.outputs[0].logprobs is None
    assert math.isfinite(plain.outputs[0].cumulative_logprob)


def test_logprobs_are_vllms_logprob_objects_with_rank_and_text(smollm2_llm, hf_smollm2):
    """Sampled at temperature 1: the sampled token's rank is its place in the model's own ordering."""
    from raypaged.outputs import Logprob

    tokenizer = smollm2_llm.get_tokenizer()
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    [output] = smollm2_llm.generate(PROMPTS[0], params, use_tqdm=False)
    completion = output.outputs[0]
    ids = output.prompt_token_ids + completion.token_ids
    with torch.inference_mode():
        reference = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), dim=-1)
    num_prompt = len(output.prompt_token_ids)
    for i, (token, top) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[num_prompt - 1 + i]
        order = row.argsort(descending=True).tolist()
        for token_id, entry in top.items():
            assert isinstance(entry, Logprob) and entry.logprob == float(entry)
            assert entry.rank == order.index(token_id) + 1
            assert entry.decoded_token == tokenizer.decode([token_id])
        assert [e.rank for t, e in top.items() if t != token] == [r for r in (1, 2) if order[r - 1] != token]
    assert any(top[token].rank > 1 for token, top in zip(completion.token_ids, completion.logprobs))  # it sampled
    assert output.prompt_logprobs[0] is None
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        target = output.prompt_token_ids[position]
        order = reference[position - 1].argsort(descending=True).tolist()
        assert entry[target].rank == order.index(target) + 1
        assert entry[target].decoded_token == tokenizer.decode([target])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be non-negative, got -0.1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"top_k": -5}, "top_k must be -1 .disable. or at least 1, got -5"),
        ({"min_p": 2.0}, r"min_p must be in \[0, 1\], got 2.0"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens must be less than or equal to max_tokens=2, got 5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero, got 0.0"),
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number, got inf"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_before_anything_runs(smollm2_llm):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        smollm2_llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    with pytest.raises(
        ValueError, match="prompt has 8192 tokens, which leaves no room to generate within max_model_len 8192"
    ):
        smollm2_llm.generate({"prompt_token_ids": [5] * 8192})
    with pytest.raises(ValueError, match=r"prompt must be token ids in \[0, 49152\), got 49152"):
        smollm2_llm.generate({"prompt_token_ids": [5, 49152]})
    stats = smollm2_llm.stats()
    assert stats["num_requests_waiting"] == 0 and stats["num_gpu_blocks_free"] == 1024


def test_max_model_len_is_checked_against_the_model(smollm2_dir):
    with pytest.raises(ValueError, match="max_model_len 10000 exceeds the model's max_position_embeddings 8192"):
        LLM(model=str(smollm2_dir), max_model_len=10000)

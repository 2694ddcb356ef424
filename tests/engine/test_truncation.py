"""``truncate_prompt_tokens`` on a text prompt cuts it as the tokenizer's truncation does (vLLM's): the text keeps
its last tokens (``truncation_side`` "right": its first), and the special tokens the tokenizer adds around it stay;
a prompt of token ids is cut as it is."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from raypaged import LLM, SamplingParams
from tests.conftest import BOS_ID, add_bos, make_tiny_model

TEXT = "one two three four five six"


@pytest.fixture(scope="module")
def llm(tmp_path_factory, smollm2_dir):
    """A tiny model whose tokenizer adds a BOS to every text."""
    path = add_bos(make_tiny_model(tmp_path_factory.mktemp("truncation"), smollm2_dir))
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = LLM(model=str(path), device="cpu", num_gpu_blocks_override=16, max_model_len=64)
    yield engine, tokenizer
    engine.shutdown()


def prompt_ids(engine: LLM, prompt, **params) -> list[int]:
    (output,) = engine.generate(prompt, SamplingParams(max_tokens=1, **params), use_tqdm=False)
    return output.prompt_token_ids


def test_a_text_keeps_its_special_tokens(llm):
    engine, tokenizer = llm
    content = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert prompt_ids(engine, TEXT) == [BOS_ID, *content] and len(content) > 4
    assert prompt_ids(engine, TEXT, truncate_prompt_tokens=4) == [BOS_ID, *content[-3:]]
    assert prompt_ids(engine, TEXT, truncate_prompt_tokens=4, truncation_side="right") == [BOS_ID, *content[:3]]
    assert prompt_ids(engine, TEXT, truncate_prompt_tokens=50) == [BOS_ID, *content]
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens 1 leaves no room for the text beside the 1 spec"):
        prompt_ids(engine, TEXT, truncate_prompt_tokens=1)
    ids = [BOS_ID, *content]  # token ids are cut as they are
    assert prompt_ids(engine, {"prompt_token_ids": ids}, truncate_prompt_tokens=4) == ids[-4:]


def test_minus_one_keeps_as_many_tokens_as_max_model_len_holds(llm):
    """vLLM's -1: a prompt that fits is kept whole; a longer one is cut to max_model_len (which a generation then
    finds too long to add a token to)."""
    engine, _ = llm
    ids = list(range(100, 110))
    assert prompt_ids(engine, {"prompt_token_ids": ids}, truncate_prompt_tokens=-1) == ids
    with pytest.raises(ValueError, match=r"^prompt has 64 tokens, which leaves no room to generate within max_model_l"):
        prompt_ids(engine, {"prompt_token_ids": list(range(100, 180))}, truncate_prompt_tokens=-1)
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens must be at least 1, or -1 for as many as max_model"):
        SamplingParams(truncate_prompt_tokens=0)

"""``truncate_prompt_tokens`` on a text prompt cuts it as the tokenizer's truncation does (vLLM's): the text keeps
its last tokens (``truncation_side`` "right": its first), and the special tokens the tokenizer adds around it stay;
a prompt of token ids is cut as it is."""

from __future__ import annotations

import pytest
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from raypaged import LLM, SamplingParams
from tests.conftest import make_tiny_model

BOS_ID = 1
TEXT = "one two three four five six"


@pytest.fixture(scope="module")
def llm(tmp_path_factory, smollm2_dir):
    """A tiny model whose tokenizer adds a BOS to every text."""
    path = make_tiny_model(tmp_path_factory.mktemp("truncation"), smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    bos = tokenizer.convert_ids_to_tokens(BOS_ID)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, BOS_ID)])
    tokenizer.save_pretrained(path)
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

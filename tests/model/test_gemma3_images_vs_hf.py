"""Gemma 3 (``Gemma3ForConditionalGeneration``) with images, through ``LLM.generate`` and ``LLM.chat``: an image's
tokens attend to each other both ways (beside the causal and sliding-window masks), so a chunk never ends inside an
image. Logprobs equal transformers' log-softmax and greedy tokens its ``generate``, whole, in chunks of 5 and 6
tokens (which would cut the 4-token images), from the prefix cache and after preemption."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from raypaged import LLM, SamplingParams
from raypaged.multimodal import ImageInputs
from tests.conftest import make_tiny_gemma3

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
BOI = "<start_of_image>"


def image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


PROMPTS = [
    (f"Describe {BOI} in a few words.", [image(1)]),
    (f"Compare {BOI} with {BOI} please, and tell", [image(2), image(3, (64, 30))]),
    ("A plain text prompt", []),
    (f"Describe {BOI} in a few words.", [image(4)]),  # the first prompt's text, another image
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), smollm2_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(model_dir, hf) -> list[list[int]]:
    processor = AutoProcessor.from_pretrained(model_dir)
    out = []
    for text, images in PROMPTS:
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        with torch.no_grad():
            tokens = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(tokens[0, inputs["input_ids"].shape[1] :].tolist())
    return out


def generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    requests = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(requests, GREEDY, use_tqdm=False)]


def test_a_chunk_never_ends_inside_an_image():
    images = ImageInputs(None, ((3, 4), (9, 4)), ("", ""), bidirectional=True)
    assert images.whole_images_end(0, 5) == 3  # before the first image
    assert images.whole_images_end(0, 8) == 8  # after it
    assert images.whole_images_end(3, 5) == 3  # starting at an image that does not fit: nothing
    assert images.whole_images_end(5, 10) == 9  # from inside the first (a cache hit) to before the second
    assert images.whole_images_end(5, 13) == 13
    assert images.blocks(5, 13) == ((3, 7), (9, 13))


def test_logprobs_equal_transformers_logits(model_dir, hf):
    """A two-image prompt's prompt and sampled logprobs within 1e-4 of transformers' log-softmax, whole and in
    chunks of 5 and 6 tokens: an image's tokens see each other both ways (causal attention gives other values)."""
    text, images = PROMPTS[1]
    inputs = AutoProcessor.from_pretrained(model_dir)(text=text, images=images, return_tensors="pt")
    prompt = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        tokens = hf.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)[0, len(prompt) :].tolist()
        whole = dict(inputs, input_ids=torch.tensor([prompt + tokens]))
        whole["attention_mask"] = torch.ones_like(whole["input_ids"])
        whole["token_type_ids"] = torch.nn.functional.pad(inputs["token_type_ids"], (0, len(tokens)))
        expected = hf(**whole).logits[0, :-1].log_softmax(-1)
    targets = prompt[1:] + tokens
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    for options in ({}, {"max_num_batched_tokens": 5}, {"max_num_batched_tokens": 6, "enable_prefix_caching": False}):
        llm = LLM(model=str(model_dir), num_gpu_blocks_override=64, block_size=4, max_model_len=128, **options)
        try:
            [out] = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}], params, use_tqdm=False)
        finally:
            llm.shutdown()
        assert out.prompt_token_ids == prompt and list(out.outputs[0].token_ids) == tokens
        got = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
        got += [e[t].logprob for e, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        want = expected[torch.arange(len(targets)), torch.tensor(targets)]
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)


def test_greedy_tokens_equal_transformers(model_dir, expected):
    assert expected[0] != expected[3]  # the image, not the text alone, decides
    for options in ({}, {"max_num_batched_tokens": 5, "max_num_seqs": 2}, {"async_scheduling": True}):
        llm = LLM(model=str(model_dir), num_gpu_blocks_override=64, block_size=4, max_model_len=128, **options)
        try:
            assert generate(llm) == expected
            assert generate(llm) == expected  # again, from the prefix cache
            assert llm.stats()["num_gpu_blocks_free"] == 64
        finally:
            llm.shutdown()


def test_preempted_requests_compute_their_images_whole_again(model_dir, expected):
    llm = LLM(
        model=str(model_dir),
        num_gpu_blocks_override=12,
        block_size=4,
        max_model_len=40,
        max_num_batched_tokens=5,
        preemption_mode="recompute",
        enable_prefix_caching=False,
    )
    try:
        assert generate(llm) == expected
        assert llm.stats()["num_preemptions"] > 0
    finally:
        llm.shutdown()


def test_chat_with_image_parts(model_dir, hf):
    """Each message's images become begin-image lines before its text (the string content format)."""
    images = PROMPTS[1][1]
    content = [{"type": "text", "text": "Compare these"}, *({"type": "image_pil", "image_pil": i} for i in images)]
    llm = LLM(model=str(model_dir), num_gpu_blocks_override=64, block_size=4, max_model_len=128)
    try:
        [out] = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    text = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [{"role": "user", "content": f"{BOI}\n{BOI}\nCompare these"}], tokenize=False, add_generation_prompt=True
    )
    inputs = AutoProcessor.from_pretrained(model_dir)(
        text=text, images=images, return_tensors="pt", add_special_tokens=False
    )
    with torch.no_grad():
        tokens = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == tokens[0, inputs["input_ids"].shape[1] :].tolist()


def test_a_token_budget_below_one_image_is_refused(model_dir):
    with pytest.raises(ValueError) as refused:
        LLM(model=str(model_dir), max_num_batched_tokens=3, max_model_len=128)
    assert str(refused.value) == (
        "--max-num-batched-tokens 3 is below the 4 tokens of one image: Gemma3ForConditionalGeneration computes an "
        "image's tokens in one step (raise it, or serve text only with --limit-mm-per-prompt '{\"image\": 0}')"
    )
    llm = LLM(model=str(model_dir), max_num_batched_tokens=3, max_model_len=128, limit_mm_per_prompt={"image": 0})
    llm.shutdown()

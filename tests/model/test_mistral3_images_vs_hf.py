"""Mistral 3 (``Mistral3ForConditionalGeneration``, Mistral Small 3.1/3.2: a Pixtral tower) with images, through
``LLM.generate`` and ``LLM.chat``: each image is rows of image tokens with a break token after each row, so its
embeddings go to the rows and not to the breaks. Logprobs equal transformers' log-softmax and greedy tokens its
``generate``, whole, in 3-token chunks, from the prefix cache and after preemption."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from raypaged import LLM, SamplingParams
from tests.conftest import make_tiny_mistral3

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def image(seed: int, size: tuple[int, int] = (60, 100)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


PROMPTS = [
    ("Describe [IMG] in a few words.", [image(1)]),
    ("Compare [IMG] with [IMG] please", [image(2, (110, 40)), image(3, (30, 30))]),
    ("A plain text prompt", []),
    ("Describe [IMG] in a few words.", [image(4)]),  # the first prompt's text, another image
]


def processed(model_dir: Path, text: str, images: list[Image.Image], add_special_tokens: bool = True) -> dict:
    """transformers' inputs as Pixtral's processor makes them (it needs torchvision, so its steps are taken here):
    the image processor at 28-pixel units (patch 14, merged 2 x 2), each ``[IMG]`` expanded into rows of ``[IMG]``
    with ``[IMG_BREAK]`` after each and ``[IMG_END]`` in place of the last."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not images:
        return dict(tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens))
    pixels = AutoImageProcessor.from_pretrained(model_dir)(
        images, patch_size={"height": 28, "width": 28}, return_tensors="pt"
    )
    pieces = text.split("[IMG]")
    for index, (height, width) in enumerate(pixels["image_sizes"].tolist()):
        rows = ["[IMG]" * (width // 28) + "[IMG_BREAK]"] * (height // 28)
        tokens = "".join(rows)[: -len("[IMG_BREAK]")] + "[IMG_END]"
        pieces[index + 1] = tokens + pieces[index + 1]
    ids = tokenizer("".join(pieces), return_tensors="pt", add_special_tokens=add_special_tokens)
    return {**ids, "pixel_values": pixels["pixel_values"], "image_sizes": pixels["image_sizes"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_mistral3(tmp_path_factory.mktemp("mistral3"), smollm2_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(model_dir, hf) -> list[list[int]]:
    out = []
    for text, images in PROMPTS:
        inputs = processed(model_dir, text, images)
        with torch.no_grad():
            tokens = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(tokens[0, inputs["input_ids"].shape[1] :].tolist())
    return out


def generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    requests = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(requests, GREEDY, use_tqdm=False)]


def test_logprobs_equal_transformers_logits(model_dir, hf):
    """A two-image prompt's prompt and sampled logprobs within 1e-4 of transformers' log-softmax, whole and in
    3-token chunks (which cut rows of image tokens)."""
    text, images = PROMPTS[1]
    inputs = processed(model_dir, text, images)
    prompt = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        tokens = hf.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)[0, len(prompt) :].tolist()
        whole = dict(inputs, input_ids=torch.tensor([prompt + tokens]))
        whole["attention_mask"] = torch.ones_like(whole["input_ids"])
        expected = hf(**whole).logits[0, :-1].log_softmax(-1)
    targets = prompt[1:] + tokens
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    for options in ({}, {"max_num_batched_tokens": 3, "enable_prefix_caching": False}):
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
    for options in ({}, {"max_num_batched_tokens": 3, "max_num_seqs": 2}):
        llm = LLM(model=str(model_dir), num_gpu_blocks_override=64, block_size=4, max_model_len=128, **options)
        try:
            assert generate(llm) == expected
            assert generate(llm) == expected  # again, from the prefix cache
            assert llm.stats()["num_gpu_blocks_free"] == 64
        finally:
            llm.shutdown()
    llm = LLM(
        model=str(model_dir),
        num_gpu_blocks_override=14,
        block_size=4,
        max_model_len=48,
        preemption_mode="recompute",
        enable_prefix_caching=False,
    )
    try:
        assert generate(llm) == expected
        assert llm.stats()["num_preemptions"] > 0
    finally:
        llm.shutdown()


def test_chat_with_image_parts(model_dir, hf):
    """Each message's images become ``[IMG]`` lines before its text (the string content format)."""
    images = PROMPTS[1][1]
    content = [{"type": "text", "text": "Compare these"}, *({"type": "image_pil", "image_pil": i} for i in images)]
    llm = LLM(model=str(model_dir), num_gpu_blocks_override=64, block_size=4, max_model_len=128)
    try:
        [out] = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    text = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [{"role": "user", "content": "[IMG]\n[IMG]\nCompare these"}], tokenize=False, add_generation_prompt=True
    )
    inputs = processed(model_dir, text, images, add_special_tokens=False)
    with torch.no_grad():
        tokens = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == tokens[0, inputs["input_ids"].shape[1] :].tolist()

"""Mistral 3 (``Mistral3ForConditionalGeneration``, Mistral Small 3.1/3.2: a Pixtral tower) with images, through
``LLM.generate`` and ``LLM.chat``: each image is rows of image tokens with a break token after each row, so its
embeddings go to the rows and not to the breaks. Logprobs equal transformers' log-softmax and greedy tokens its
``generate``, whole, in 3-token chunks, from the prefix cache and after preemption."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from raypaged import SamplingParams
from tests.conftest import make_tiny_mistral3
from tests.model.image_checks import (
    check_chat_with_image_parts,
    check_greedy_tokens,
    check_logprobs_equal_transformers,
    check_preempted,
    transformers_greedy,
)
from tests.model.image_checks import image as random_image

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def image(seed: int, size: tuple[int, int] = (60, 100)) -> Image.Image:
    return random_image(seed, size)


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
    return [transformers_greedy(hf, processed(model_dir, text, images), MAX_TOKENS) for text, images in PROMPTS]


def test_logprobs_equal_transformers_logits(model_dir, hf):
    """A two-image prompt's prompt and sampled logprobs within 1e-4 of transformers' log-softmax, whole and in
    3-token chunks (which cut rows of image tokens)."""
    inputs = processed(model_dir, *PROMPTS[1])
    chunked = {"max_num_batched_tokens": 3, "enable_prefix_caching": False}
    check_logprobs_equal_transformers(model_dir, hf, PROMPTS[1], inputs, ({}, chunked), block_size=4)


def test_greedy_tokens_equal_transformers(model_dir, expected):
    assert expected[0] != expected[3]  # the image, not the text alone, decides
    option_sets = ({}, {"max_num_batched_tokens": 3, "max_num_seqs": 2})
    check_greedy_tokens(model_dir, PROMPTS, GREEDY, expected, option_sets, block_size=4, again=True)
    check_preempted(model_dir, PROMPTS, GREEDY, expected, num_gpu_blocks_override=14, max_model_len=48)


def test_chat_with_image_parts(model_dir, hf):
    """Each message's images become ``[IMG]`` lines before its text (the string content format)."""
    process = partial(processed, model_dir, add_special_tokens=False)
    check_chat_with_image_parts(model_dir, hf, PROMPTS[1][1], "[IMG]", process, GREEDY, block_size=4)

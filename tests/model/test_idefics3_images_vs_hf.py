"""Idefics3 (``Idefics3ForConditionalGeneration``, SmolVLM's architecture) with images, through ``LLM.generate`` and
``LLM.chat``: each image is its grid of tiles and the whole image, each tile a run of image tokens between its
row/column tokens. Logprobs equal transformers' log-softmax and greedy tokens its ``generate``, whole, in 3-token
chunks, from the prefix cache and after preemption."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from raypaged import SamplingParams
from tests.conftest import make_tiny_idefics3
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
    ("Describe <image> in a few words.", [image(1)]),  # 1 x 2 tiles and the whole image
    ("Compare <image> with <image> please", [image(2, (110, 40)), image(3, (90, 90))]),  # 2 x 1 and 2 x 2
    ("A plain text prompt", []),
    ("Describe <image> in a few words.", [image(4)]),  # the first prompt's text, another image
]


def processed(model_dir: Path, text: str, images: list[Image.Image], add_special_tokens: bool = True) -> dict:
    """transformers' processor's inputs (``Idefics3Processor`` needs no torchvision)."""
    processor = AutoProcessor.from_pretrained(model_dir)
    return dict(processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=add_special_tokens))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"), smollm2_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(model_dir, hf) -> list[list[int]]:
    return [transformers_greedy(hf, processed(model_dir, text, images), MAX_TOKENS) for text, images in PROMPTS]


def test_logprobs_equal_transformers_logits(model_dir, hf):
    """A two-image prompt's (8 tiles) prompt and sampled logprobs within 1e-4 of transformers' log-softmax, whole and
    in 3-token chunks (which cut tiles' runs of image tokens)."""
    inputs = processed(model_dir, *PROMPTS[1])
    assert (
        int((inputs["input_ids"] == hf.config.image_token_id).sum()) == 8 * 4
    )  # 2 x 1 tiles and the whole image, 2 x 2 and the whole image
    chunked = {"max_num_batched_tokens": 3, "enable_prefix_caching": False}
    check_logprobs_equal_transformers(model_dir, hf, PROMPTS[1], inputs, ({}, chunked), block_size=4)


def test_greedy_tokens_equal_transformers(model_dir, expected):
    assert expected[0] != expected[3]  # the image, not the text alone, decides
    option_sets = ({}, {"max_num_batched_tokens": 3, "max_num_seqs": 2})
    check_greedy_tokens(model_dir, PROMPTS, GREEDY, expected, option_sets, block_size=4, again=True)
    # three prompts of 10, 10 and 1 blocks that outgrow 22 blocks together (the two-image prompt needs 15 alone)
    order = [0, 3, 2]
    preempted = [PROMPTS[i] for i in order]
    check_preempted(
        model_dir, preempted, GREEDY, [expected[i] for i in order], num_gpu_blocks_override=22, max_model_len=48
    )


def test_chat_with_image_parts(model_dir, hf):
    """Each message's images become ``<image>`` lines before its text (the string content format)."""
    process = partial(processed, model_dir, add_special_tokens=False)
    check_chat_with_image_parts(model_dir, hf, PROMPTS[1][1], "<image>", process, GREEDY, block_size=4)

"""Gemma 3 (``Gemma3ForConditionalGeneration``) with images, through ``LLM.generate`` and ``LLM.chat``: an image's
tokens attend to each other both ways (beside the causal and sliding-window masks), so a chunk never ends inside an
image. Logprobs equal transformers' log-softmax and greedy tokens its ``generate``, whole, in chunks of 5 and 6
tokens (which would cut the 4-token images), from the prefix cache and after preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from raypaged import LLM, SamplingParams
from raypaged.multimodal import ImageInputs
from tests.conftest import make_tiny_gemma3
from tests.model.image_checks import (
    check_chat_with_image_parts,
    check_greedy_tokens,
    check_logprobs_equal_transformers,
    check_preempted,
    image,
    transformers_greedy,
)

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
BOI = "<start_of_image>"


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
    return [
        transformers_greedy(hf, processor(text=text, images=images or None, return_tensors="pt"), MAX_TOKENS)
        for text, images in PROMPTS
    ]


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
    option_sets = ({}, {"max_num_batched_tokens": 5}, {"max_num_batched_tokens": 6, "enable_prefix_caching": False})
    check_logprobs_equal_transformers(
        model_dir, hf, PROMPTS[1], inputs, option_sets, block_size=4, token_types="token_type_ids"
    )


def test_pan_and_scan_crops_equal_transformers(model_dir, hf):
    """``--mm-processor-kwargs '{"do_pan_and_scan": true}'`` (vLLM's): a wide image's crops follow it, each its own
    run of image tokens attending to itself both ways; logprobs within 1e-4 of transformers' with the same option,
    whole and in 5-token chunks."""
    pan = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}
    prompt = (f"Compare {BOI} with {BOI}", [image(6, (30, 120)), image(7, (40, 40))])  # a wide one and a square one
    inputs = AutoProcessor.from_pretrained(model_dir)(text=prompt[0], images=prompt[1], return_tensors="pt", **pan)
    assert inputs["pixel_values"].shape[0] == 1 + 4 + 1  # the wide image, its 4 crops, the square image
    option_sets = ({"mm_processor_kwargs": pan}, {"mm_processor_kwargs": pan, "max_num_batched_tokens": 5})
    check_logprobs_equal_transformers(
        model_dir, hf, prompt, inputs, option_sets, block_size=4, token_types="token_type_ids"
    )


def test_greedy_tokens_equal_transformers(model_dir, expected):
    assert expected[0] != expected[3]  # the image, not the text alone, decides
    option_sets = ({}, {"max_num_batched_tokens": 5, "max_num_seqs": 2}, {"async_scheduling": True})
    check_greedy_tokens(model_dir, PROMPTS, GREEDY, expected, option_sets, block_size=4, again=True)


def test_preempted_requests_compute_their_images_whole_again(model_dir, expected):
    options = dict(num_gpu_blocks_override=12, max_model_len=40, max_num_batched_tokens=5)
    check_preempted(model_dir, PROMPTS, GREEDY, expected, **options)


def test_chat_with_image_parts(model_dir, hf):
    """Each message's images become begin-image lines before its text (the string content format)."""
    processor = AutoProcessor.from_pretrained(model_dir)

    def process(text, images):
        return processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)

    check_chat_with_image_parts(model_dir, hf, PROMPTS[1][1], BOI, process, GREEDY, block_size=4)


def test_a_token_budget_below_one_image_is_refused(model_dir):
    with pytest.raises(ValueError) as refused:
        LLM(model=str(model_dir), max_num_batched_tokens=3, max_model_len=128)
    assert str(refused.value) == (
        "--max-num-batched-tokens 3 is below the 4 tokens of one image: Gemma3ForConditionalGeneration computes an "
        "image's tokens in one step (raise it, or serve text only with --limit-mm-per-prompt '{\"image\": 0}')"
    )
    llm = LLM(
        model=str(model_dir),
        max_num_batched_tokens=3,
        max_model_len=128,
        limit_mm_per_prompt={"image": 0},
        num_gpu_blocks_override=32,
    )
    llm.shutdown()

"""LLaVA (``LlavaForConditionalGeneration``) with images, through ``LLM.generate`` and vLLM's ``multi_modal_data``:
greedy tokens equal transformers' ``generate`` on the same processed inputs, whole, chunked across an image's tokens,
after a preemption, and from the prefix cache (whose blocks an image keys)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoProcessor,
    LlavaForConditionalGeneration,
)

from raypaged import LLM, SamplingParams
from tests.conftest import make_tiny_llava
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("llava"), smollm2_dir)


@pytest.fixture(scope="module")
def hf_llava(llava_dir):
    return LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


def hf_tokens(hf_llava, llava_dir: Path, prompt: str, images: list[Image.Image]) -> list[int]:
    processor = AutoProcessor.from_pretrained(llava_dir)
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = hf_llava.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


PROMPTS = [
    ("USER: <image>\nWhat is in the picture? ASSISTANT:", [image(1)]),
    ("Compare <image> with <image> please", [image(2), image(3, (64, 30))]),
    ("A plain text prompt", []),
    ("USER: <image>\nWhat is in the picture? ASSISTANT:", [image(4)]),  # the first prompt's text, another image
]


def generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    requests = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(requests, GREEDY, use_tqdm=False)]


def test_images_greedy_tokens_equal_transformers_whole_and_chunked(llava_dir, hf_llava):
    expected = [hf_tokens(hf_llava, llava_dir, text, images) for text, images in PROMPTS]
    assert expected[0] != expected[3]  # the image, not the text alone, decides
    for options in (
        {},
        {"max_num_batched_tokens": 3, "max_num_seqs": 2, "enable_prefix_caching": False},
    ):  # 3-token chunks cut images
        llm = LLM(model=str(llava_dir), num_gpu_blocks_override=64, block_size=8, max_model_len=128, **options)
        try:
            assert generate(llm) == expected
            assert llm.stats()["num_gpu_blocks_free"] == 64
        finally:
            llm.shutdown()


def test_the_prefix_cache_keys_blocks_by_image(llava_dir, hf_llava):
    llm = LLM(model=str(llava_dir), num_gpu_blocks_override=64, block_size=4, max_model_len=128)
    try:
        first = llm.generate(
            [{"prompt": PROMPTS[0][0], "multi_modal_data": {"image": PROMPTS[0][1]}}], GREEDY, use_tqdm=False
        )
        again = llm.generate(
            [{"prompt": PROMPTS[0][0], "multi_modal_data": {"image": PROMPTS[0][1]}}], GREEDY, use_tqdm=False
        )
        other = llm.generate(
            [{"prompt": PROMPTS[3][0], "multi_modal_data": {"image": PROMPTS[3][1]}}], GREEDY, use_tqdm=False
        )
        assert again[0].num_cached_tokens > 0 and other[0].num_cached_tokens == 0
        assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
        assert list(other[0].outputs[0].token_ids) == hf_tokens(hf_llava, llava_dir, *PROMPTS[3])
    finally:
        llm.shutdown()


def test_preempted_requests_encode_their_images_again(llava_dir, hf_llava):
    expected = [hf_tokens(hf_llava, llava_dir, text, images) for text, images in PROMPTS]
    llm = LLM(
        model=str(llava_dir),
        num_gpu_blocks_override=10,
        block_size=4,
        max_model_len=40,
        preemption_mode="recompute",
        enable_prefix_caching=False,
    )
    try:
        assert generate(llm) == expected
        assert llm.stats()["num_preemptions"] > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "prompt, options, message",
    [
        (
            {"prompt": "two <image> <image>", "multi_modal_data": {"image": [image(1)]}},
            {},
            "the prompt has 2 image placeholders (<image>) for 1 images",
        ),
        (
            {"prompt": "<image> <image>", "multi_modal_data": {"image": [image(1), image(2)]}},
            {"limit_mm_per_prompt": {"image": 1}},
            "2 images in one prompt; --limit-mm-per-prompt allows 1",
        ),
        (
            {"prompt": "<image>", "multi_modal_data": {"video": [image(1)]}},
            {},
            "a prompt's multi_modal_data 'video' is not supported: the served models read images",
        ),
        (
            {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": [image(1)]}},
            {},
            "images go with a text prompt (its image placeholders), not ids",
        ),
    ],
)
def test_bad_image_prompts_are_refused_by_name(llava_dir, prompt, options, message):
    llm = LLM(model=str(llava_dir), num_gpu_blocks_override=16, max_model_len=128, **options)
    try:
        with pytest.raises(ValueError) as info:
            llm.generate([prompt], GREEDY, use_tqdm=False)
        assert str(info.value).endswith(message)
    finally:
        llm.shutdown()


def test_a_text_model_refuses_images(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=16, max_model_len=128)
    try:
        with pytest.raises(ValueError) as info:
            llm.generate([{"prompt": "<image>", "multi_modal_data": {"image": [image(1)]}}], GREEDY, use_tqdm=False)
        assert str(info.value).endswith("reads text only (no images)")
    finally:
        llm.shutdown()
    with pytest.raises(ValueError) as refused:
        LLM(model=str(tiny_model_dir), num_gpu_blocks_override=16, limit_mm_per_prompt={"image": 1})
    assert str(refused.value) == "--limit-mm-per-prompt image: 1 is not supported: the model reads text only"


def test_two_ray_shards_read_images_as_one(ray_session, llava_dir, hf_llava):
    """Each shard encodes the images itself (the vision tower is whole on every shard)."""
    expected = [hf_tokens(hf_llava, llava_dir, text, images) for text, images in PROMPTS]
    llm = LLM(model=str(llava_dir), device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=64, max_model_len=128)
    try:
        assert generate(llm) == expected
    finally:
        llm.shutdown()


def test_a_request_whose_images_fail_to_encode_fails_alone(llava_dir, hf_llava):
    """Pixels the vision tower refuses (an image of the wrong size, as no processor makes): that request ends with
    the error, the others in its steps get transformers' tokens."""
    from dataclasses import replace

    llm = LLM(model=str(llava_dir), num_gpu_blocks_override=64, max_model_len=128)
    try:
        engine = llm.llm_engine
        processed = [
            engine.process_request(str(i), text, GREEDY, images=images) for i, (text, images) in enumerate(PROMPTS)
        ]
        images = processed[0].core_request.images
        processed[0].core_request.images = replace(images, pixel_values=images.pixel_values[:, :, :14, :14])
        for request in processed:
            engine.add_processed(request)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert done["0"].error == (
            "encoding its images failed: ValueError: image of 14x14 pixels, the vision tower takes 28x28"
        )
        for i in (1, 2, 3):
            assert list(done[str(i)].outputs[0].token_ids) == hf_tokens(hf_llava, llava_dir, *PROMPTS[i])
        assert llm.stats()["num_gpu_blocks_free"] == 64
    finally:
        llm.shutdown()


def test_more_images_than_the_context_holds_are_refused_before_any_is_processed(llava_dir):
    llm = LLM(model=str(llava_dir), num_gpu_blocks_override=16, max_model_len=32)
    try:
        with pytest.raises(ValueError) as info:
            llm.generate({"prompt": "<image>" * 8, "multi_modal_data": {"image": [image(1)] * 8}}, GREEDY)
        assert str(info.value) == "8 images of 4 tokens each leave no room in max_model_len 32"
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("llava_next"), smollm2_dir, next_=True)


NEXT_PROMPTS = [
    ("USER: <image>\nWhat is in the picture? ASSISTANT:", [image(5, (40, 90))]),  # wide: a 28x56 grid
    ("Compare <image> with <image> please", [image(6, (90, 40)), image(7, (50, 50))]),  # tall, square
    ("A plain text prompt", []),
]


def test_llava_next_images_of_every_shape_equal_transformers_whole_and_chunked(next_dir):
    """LLaVA-NeXT (``LlavaNextForConditionalGeneration``): each image is its whole picture and a grid of patches,
    packed with a newline row embedding and unpadded to the image's aspect ratio, so images of other shapes take
    other numbers of tokens."""
    from transformers import LlavaNextForConditionalGeneration

    hf = LlavaNextForConditionalGeneration.from_pretrained(next_dir, dtype=torch.float32).eval()
    expected = [hf_tokens(hf, next_dir, text, images) for text, images in NEXT_PROMPTS]
    for options in ({}, {"max_num_batched_tokens": 5, "max_num_seqs": 2, "enable_prefix_caching": False}):
        llm = LLM(model=str(next_dir), num_gpu_blocks_override=64, block_size=8, max_model_len=128, **options)
        try:
            assert generate(llm, NEXT_PROMPTS) == expected
        finally:
            llm.shutdown()

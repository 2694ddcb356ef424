"""LLaVA (``LlavaForConditionalGeneration``) with images, through ``LLM.generate`` and vLLM's ``multi_modal_data``:
greedy tokens equal transformers' ``generate`` on the same processed inputs, whole, chunked across an image's tokens,
after a preemption, and from the prefix cache (whose blocks an image keys)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import (
    AutoProcessor,
    LlavaForConditionalGeneration,
)

from raypaged import LLM, SamplingParams
from raypaged.inputs.multimodal_input import MultiModalInput
from tests.conftest import make_tiny_llava
from tests.model.image_checks import (
    check_greedy_tokens,
    check_preempted,
    check_prefix_cache_keys_images,
    generate,
    image,
    serving,
    transformers_greedy,
)
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("llava"), smollm2_dir)


@pytest.fixture(scope="module")
def hf_llava(llava_dir):
    return LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


def hf_tokens(hf_llava, llava_dir: Path, prompt: str, images: list[Image.Image]) -> list[int]:
    processor = AutoProcessor.from_pretrained(llava_dir)
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    return transformers_greedy(hf_llava, inputs, MAX_TOKENS)


PROMPTS = [
    ("USER: <image>\nWhat is in the picture? ASSISTANT:", [image(1)]),
    ("Compare <image> with <image> please", [image(2), image(3, (64, 30))]),
    ("A plain text prompt", []),
    ("USER: <image>\nWhat is in the picture? ASSISTANT:", [image(4)]),  # the first prompt's text, another image
]


@pytest.fixture(scope="module")
def expected(llava_dir, hf_llava) -> list[list[int]]:
    """transformers' greedy tokens of each of PROMPTS."""
    return [hf_tokens(hf_llava, llava_dir, text, images) for text, images in PROMPTS]


def test_images_greedy_tokens_equal_transformers_whole_and_chunked(llava_dir, expected):
    assert expected[0] != expected[3]  # the image, not the text alone, decides
    # 3-token chunks cut images
    chunked = {"max_num_batched_tokens": 3, "max_num_seqs": 2, "enable_prefix_caching": False}
    check_greedy_tokens(llava_dir, PROMPTS, GREEDY, expected, ({}, chunked), block_size=8)


def test_the_prefix_cache_keys_blocks_by_image(llava_dir, expected):
    _, other = check_prefix_cache_keys_images(llava_dir, GREEDY, PROMPTS[0], PROMPTS[3])
    assert other == expected[3]


def test_preempted_requests_encode_their_images_again(llava_dir, expected):
    check_preempted(llava_dir, PROMPTS, GREEDY, expected, num_gpu_blocks_override=10, max_model_len=40)


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
    with serving(llava_dir, num_gpu_blocks_override=16, max_model_len=128, **options) as llm:
        with pytest.raises(ValueError) as info:
            llm.generate([prompt], GREEDY, use_tqdm=False)
        assert str(info.value).endswith(message)


def test_a_text_model_refuses_images(tiny_model_dir):
    with serving(tiny_model_dir, num_gpu_blocks_override=16, max_model_len=128) as llm:
        with pytest.raises(ValueError) as info:
            llm.generate([{"prompt": "<image>", "multi_modal_data": {"image": [image(1)]}}], GREEDY, use_tqdm=False)
        assert str(info.value).endswith("reads text only (no images)")
    with pytest.raises(ValueError) as refused:
        LLM(model=str(tiny_model_dir), num_gpu_blocks_override=16, limit_mm_per_prompt={"image": 1})
    assert str(refused.value) == "--limit-mm-per-prompt image: 1 is not supported: the model reads text only"


def test_two_ray_shards_read_images_as_one(ray_session, llava_dir, expected):
    """Each shard encodes the images itself (the vision tower is whole on every shard)."""
    options = dict(device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=64, max_model_len=128)
    with serving(llava_dir, **options) as llm:
        assert generate(llm, PROMPTS, GREEDY) == expected


def test_a_request_whose_images_fail_to_encode_fails_alone(llava_dir, expected):
    """Pixels the vision tower refuses (an image of the wrong size, as no processor makes): that request ends with
    the error, the others in its steps get transformers' tokens."""
    check_a_bad_image_fails_alone(llava_dir, expected)


def test_two_pipeline_stages_read_images_as_one_and_a_bad_image_fails_alone(ray_session, llava_dir, expected):
    """The first stage alone holds the vision tower and encodes the images; its rank reports the request whose
    image it could not encode, though the last stage samples."""
    options = dict(device="cpu", pipeline_parallel_size=2, num_gpu_blocks_override=64, max_model_len=128)
    with serving(llava_dir, **options) as llm:
        assert generate(llm, PROMPTS, GREEDY) == expected
    check_a_bad_image_fails_alone(llava_dir, expected, pipeline_parallel_size=2)


def check_a_bad_image_fails_alone(llava_dir, expected, **options) -> None:
    from dataclasses import replace

    with serving(llava_dir, num_gpu_blocks_override=64, max_model_len=128, **options) as llm:
        engine = llm.llm_engine
        processed = [
            engine.process_request(str(i), text, GREEDY, multi_modal=MultiModalInput.of(images))
            for i, (text, images) in enumerate(PROMPTS)
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
            assert list(done[str(i)].outputs[0].token_ids) == expected[i]
        assert llm.stats()["num_gpu_blocks_free"] == 64


def test_more_images_than_the_context_holds_are_refused_before_any_is_processed(llava_dir):
    with serving(llava_dir, num_gpu_blocks_override=16, max_model_len=32) as llm:
        with pytest.raises(ValueError) as info:
            llm.generate({"prompt": "<image>" * 8, "multi_modal_data": {"image": [image(1)] * 8}}, GREEDY)
        assert str(info.value) == "8 images of 4 tokens each leave no room in max_model_len 32"


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
    chunked = {"max_num_batched_tokens": 5, "max_num_seqs": 2, "enable_prefix_caching": False}
    check_greedy_tokens(next_dir, NEXT_PROMPTS, GREEDY, expected, ({}, chunked), block_size=8)

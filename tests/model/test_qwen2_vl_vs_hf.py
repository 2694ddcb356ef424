"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (deepstack, interleaved M-RoPE) with images, through ``LLM.generate`` (vLLM's
``multi_modal_data``) and ``LLM.chat``: greedy tokens equal transformers' ``generate`` on the same processed inputs,
whole and chunked across an image's tokens, beside text-only prompts, after a preemption, and from the prefix cache;
logprobs equal its logits'; M-RoPE's positions equal transformers' ``get_rope_index``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoTokenizer,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
)
from transformers.processing_utils import ProcessorMixin

from raypaged import LLM, SamplingParams
from raypaged.multimodal import ImageInputs, mrope_positions
from tests.conftest import make_tiny_qwen_vl

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def image(seed: int, size: tuple[int, int] = (90, 130)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


PROMPTS = [
    (f"Describe {IMAGE} in a few words.", [image(1)]),
    (f"Compare {IMAGE} with {IMAGE} please", [image(2, (60, 200)), image(3, (150, 70))]),
    ("A plain text prompt", []),
    (f"Describe {IMAGE} in a few words.", [image(4)]),  # the first prompt's text, another image
    (f"{IMAGE}", [image(5, (56, 56))]),  # an image alone, one token
]


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def model_dir(request, tmp_path_factory, smollm2_dir) -> Path:
    root = tmp_path_factory.mktemp("qwen-vl")
    return make_tiny_qwen_vl(root, smollm2_dir, request.param)


def hf_processor(path: Path) -> Qwen2VLProcessor | Qwen3VLProcessor:
    """transformers' processor of the model (made without a video processor, which needs torchvision)."""
    processor = Qwen3VLProcessor if path.name == "qwen3-vl" else Qwen2VLProcessor
    check = ProcessorMixin.check_argument_for_proper_class
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            ProcessorMixin,
            "check_argument_for_proper_class",
            lambda self, name, arg: None if arg is None else check(self, name, arg),
        )
        return processor(
            image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=AutoTokenizer.from_pretrained(path)
        )


@pytest.fixture(scope="module")
def expected(model_dir) -> list[list[int]]:
    """transformers' greedy tokens of each of PROMPTS."""
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = hf_processor(model_dir)
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


def test_mrope_positions_equal_transformers(model_dir):
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    text, images = PROMPTS[1]
    inputs = hf_processor(model_dir)(text=f"{text} and more text", images=images, return_tensors="pt")
    positions, deltas = hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    ids = inputs["input_ids"][0].tolist()
    image_id = hf.config.image_token_id
    first = [i for i, t in enumerate(ids) if t == image_id and (i == 0 or ids[i - 1] != image_id)]
    grids = tuple(tuple(g) for g in inputs["image_grid_thw"].tolist())
    counts = [t * h * w // 4 for t, h, w in grids]
    ours = ImageInputs(None, tuple(zip(first, counts)), ("", ""), grids=grids, merge_size=2)
    rope, shift = mrope_positions(len(ids), ours)
    assert rope.tolist() == positions[:, 0].tolist()
    assert shift == int(deltas) < 0  # an image takes fewer positions than tokens


def test_images_greedy_tokens_equal_transformers_whole_and_chunked(model_dir, expected):
    assert expected[0] != expected[3]  # the image, not the text alone, decides
    for options in (
        {},
        {"max_num_batched_tokens": 3, "max_num_seqs": 2, "enable_prefix_caching": False},  # chunks cut images
        {"async_scheduling": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}},
    ):
        llm = LLM(model=str(model_dir), num_gpu_blocks_override=64, block_size=8, max_model_len=128, **options)
        try:
            assert generate(llm) == expected
            assert llm.stats()["num_gpu_blocks_free"] == 64
        finally:
            llm.shutdown()


def test_logprobs_equal_transformers_logits(model_dir):
    """Prompt and sampled logprobs of a two-image prompt within 1e-4 of transformers' log-softmax, whole and in
    5-token chunks: every position's rotary (M-RoPE's three axes) and every image row counts."""
    text, images = PROMPTS[1]
    inputs = hf_processor(model_dir)(text=text, images=images, return_tensors="pt")
    prompt = inputs["input_ids"][0].tolist()
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        tokens = hf.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)[0, len(prompt) :].tolist()
        whole = {**inputs, "input_ids": torch.tensor([prompt + tokens])}
        whole["attention_mask"] = torch.ones_like(whole["input_ids"])
        whole["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, len(tokens)))
        expected = hf(**whole).logits[0, :-1].log_softmax(-1)
    targets = prompt[1:] + tokens
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    for options in ({}, {"max_num_batched_tokens": 5, "enable_prefix_caching": False}):
        llm = LLM(model=str(model_dir), num_gpu_blocks_override=64, block_size=8, max_model_len=128, **options)
        try:
            [out] = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}], params, use_tqdm=False)
        finally:
            llm.shutdown()
        assert out.prompt_token_ids == prompt and list(out.outputs[0].token_ids) == tokens
        got = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
        got += [e[t].logprob for e, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        want = expected[torch.arange(len(targets)), torch.tensor(targets)]
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)


def test_prefix_cache_and_preemption(model_dir, expected):
    llm = LLM(model=str(model_dir), num_gpu_blocks_override=64, block_size=4, max_model_len=128)
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
        assert list(first[0].outputs[0].token_ids) == list(again[0].outputs[0].token_ids) == expected[0]
        assert list(other[0].outputs[0].token_ids) == expected[3]
    finally:
        llm.shutdown()
    llm = LLM(
        model=str(model_dir),
        num_gpu_blocks_override=12,
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


def test_chat_with_image_parts(model_dir, expected):
    """A chat message's images go before its text, each between the vision start and end tokens, as vLLM renders
    Qwen-VL's content for a chat template of strings."""
    llm = LLM(model=str(model_dir), num_gpu_blocks_override=64, block_size=8, max_model_len=128)
    images = PROMPTS[1][1]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare these"},
                *({"type": "image_pil", "image_pil": im} for im in images),
            ],
        }
    ]
    try:
        out = llm.chat(messages, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{IMAGE}\n{IMAGE}\nCompare these"}], tokenize=False, add_generation_prompt=True
    )
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = hf_processor(model_dir)(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        tokens = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    assert out[0].prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out[0].outputs[0].token_ids) == tokens[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize(
    "prompt, message",
    [
        (
            {"prompt": f"two {IMAGE} {IMAGE}", "multi_modal_data": {"image": [image(1)]}},
            "the prompt has 2 image placeholders (<|image_pad|>) for 1 images",
        ),
    ],
)
def test_bad_image_prompts_are_refused(model_dir, prompt, message):
    llm = LLM(model=str(model_dir), num_gpu_blocks_override=64, block_size=8, max_model_len=128)
    try:
        with pytest.raises(ValueError) as info:
            llm.generate(prompt, GREEDY, use_tqdm=False)
        assert str(info.value).endswith(message)
    finally:
        llm.shutdown()

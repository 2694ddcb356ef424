"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL (deepstack, interleaved M-RoPE) and Qwen3-VL-MoE with images, through
``LLM.generate`` (vLLM's ``multi_modal_data``) and ``LLM.chat``: greedy tokens equal transformers' ``generate`` on the
same processed inputs, whole and chunked across an image's tokens, beside text-only prompts, after a preemption, and
from the prefix cache; logprobs equal its logits'; M-RoPE's positions equal transformers' ``get_rope_index``;
Qwen3-VL-MoE's experts load alike from either stacked layout."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoTokenizer,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
)
from transformers.processing_utils import ProcessorMixin

from raypaged import SamplingParams
from raypaged.multimodal import ImageInputs, mrope_positions
from tests.conftest import make_tiny_qwen_vl
from tests.model.image_checks import (
    check_chat_with_image_parts,
    check_greedy_tokens,
    check_logprobs_equal_transformers,
    check_preempted,
    check_prefix_cache_keys_images,
    serving,
    transformers_greedy,
)
from tests.model.image_checks import image as random_image

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def image(seed: int, size: tuple[int, int] = (90, 130)) -> Image.Image:
    return random_image(seed, size)


PROMPTS = [
    (f"Describe {IMAGE} in a few words.", [image(1)]),
    (f"Compare {IMAGE} with {IMAGE} please", [image(2, (60, 200)), image(3, (150, 70))]),
    ("A plain text prompt", []),
    (f"Describe {IMAGE} in a few words.", [image(4)]),  # the first prompt's text, another image
    (f"{IMAGE}", [image(5, (56, 56))]),  # an image alone, one token
]


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe"])
def model_dir(request, tmp_path_factory, smollm2_dir) -> Path:
    root = tmp_path_factory.mktemp("qwen-vl")
    return make_tiny_qwen_vl(root, smollm2_dir, request.param)


def hf_processor(path: Path) -> Qwen2VLProcessor | Qwen3VLProcessor:
    """transformers' processor of the model (made without a video processor, which needs torchvision)."""
    processor = Qwen3VLProcessor if path.name.startswith("qwen3") else Qwen2VLProcessor
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
def hf(model_dir):
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(model_dir, hf) -> list[list[int]]:
    """transformers' greedy tokens of each of PROMPTS."""
    processor = hf_processor(model_dir)
    return [
        transformers_greedy(hf, processor(text=text, images=images or None, return_tensors="pt"), MAX_TOKENS)
        for text, images in PROMPTS
    ]


def test_mrope_positions_equal_transformers(model_dir, hf):
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
    option_sets = (
        {},
        {"max_num_batched_tokens": 3, "max_num_seqs": 2, "enable_prefix_caching": False},  # chunks cut images
        {"async_scheduling": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}},
    )
    check_greedy_tokens(model_dir, PROMPTS, GREEDY, expected, option_sets, block_size=8)


def test_logprobs_equal_transformers_logits(model_dir, hf):
    """Prompt and sampled logprobs of a two-image prompt within 1e-4 of transformers' log-softmax, whole and in
    5-token chunks: every position's rotary (M-RoPE's three axes) and every image row counts."""
    text, images = PROMPTS[1]
    inputs = hf_processor(model_dir)(text=text, images=images, return_tensors="pt")
    chunked = {"max_num_batched_tokens": 5, "enable_prefix_caching": False}
    check_logprobs_equal_transformers(
        model_dir, hf, PROMPTS[1], inputs, ({}, chunked), block_size=8, token_types="mm_token_type_ids"
    )


def test_prefix_cache_and_preemption(model_dir, expected):
    first, other = check_prefix_cache_keys_images(model_dir, GREEDY, PROMPTS[0], PROMPTS[3])
    assert first == expected[0]
    assert other == expected[3]
    check_preempted(model_dir, PROMPTS, GREEDY, expected, num_gpu_blocks_override=12, max_model_len=48)


def test_chat_with_image_parts(model_dir, hf):
    """A chat message's images go before its text, each between the vision start and end tokens, as vLLM renders
    Qwen-VL's content for a chat template of strings."""
    processor = hf_processor(model_dir)

    def process(text, images):
        return processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)

    check_chat_with_image_parts(model_dir, hf, PROMPTS[1][1], IMAGE, process, GREEDY, block_size=8)


# Qwen2-VL's own template, in short: it loops over a message's parts and writes each image's vision tokens in place
QWEN_PARTS = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_loops_over_parts_writes_the_images_where_they_stand(model_dir, hf):
    """vLLM's openai content format (auto, for a template that loops over parts): the text, then the image's vision
    tokens as the template writes them, with no placeholder line; tokens equal transformers'."""
    processor = hf_processor(model_dir)

    def process(text, images):
        return processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)

    check_chat_with_image_parts(model_dir, hf, PROMPTS[1][1], IMAGE, process, GREEDY, 8, chat_template=QWEN_PARTS)


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
    with serving(model_dir, num_gpu_blocks_override=64, block_size=8, max_model_len=128) as llm:
        with pytest.raises(ValueError) as info:
            llm.generate(prompt, GREEDY, use_tqdm=False)
        assert str(info.value).endswith(message)


def test_published_stacked_experts_load_as_transformers_5_saves_them(tmp_path, smollm2_dir):
    """Qwen3-VL-MoE's published checkpoints stack each layer's experts as ``[E, in, out]``; transformers 5 saves
    ``[E, out, in]``: both load the same weights (the same logprobs, bit for bit)."""
    from safetensors.torch import load_file, save_file

    saved = make_tiny_qwen_vl(tmp_path / "saved", smollm2_dir, "qwen3-vl-moe")
    published = tmp_path / "published"
    shutil.copytree(saved, published)
    tensors = load_file(saved / "model.safetensors")
    stacked = [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(stacked) == 4  # two layers, each its gate_up and down
    save_file(
        {n: t.transpose(1, 2).contiguous() if n in stacked else t for n, t in tensors.items()},
        published / "model.safetensors",
        metadata={"format": "pt"},
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    text, images = PROMPTS[1]
    outputs = []
    for path in (saved, published):
        with serving(path, num_gpu_blocks_override=64, block_size=8, max_model_len=128) as llm:
            [out] = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}], params, use_tqdm=False)
        outputs.append((list(out.outputs[0].token_ids), [sorted(e.items()) for e in out.prompt_logprobs[1:]]))
    assert outputs[0] == outputs[1]


def test_mm_processor_kwargs_bound_an_images_pixels(model_dir, hf):
    """``--mm-processor-kwargs`` min_pixels/max_pixels (vLLM's, for Qwen-VL) resize the image as transformers'
    processor does with the same bounds: fewer image tokens, and transformers' tokens after them."""
    unit = 32 if model_dir.name.startswith("qwen3") else 28  # a merged patch's side
    bounds = {"min_pixels": 4 * unit**2, "max_pixels": 6 * unit**2}
    text, images = PROMPTS[1]
    with serving(model_dir, num_gpu_blocks_override=64, block_size=8, max_model_len=128) as llm:
        [default] = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}], GREEDY, use_tqdm=False)
    with serving(
        model_dir, num_gpu_blocks_override=64, block_size=8, max_model_len=128, mm_processor_kwargs=bounds
    ) as llm:
        [out] = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}], GREEDY, use_tqdm=False)
        # a request's own (vLLM's prompt mm_processor_kwargs) over the server's: the checkpoint's bounds again
        [own] = llm.generate(
            [{"prompt": text, "multi_modal_data": {"image": images}, "mm_processor_kwargs": {"max_pixels": 12845056}}],
            GREEDY,
            use_tqdm=False,
        )
    with serving(model_dir, num_gpu_blocks_override=64, block_size=8, max_model_len=128) as llm:
        [per_request] = llm.generate(
            [{"prompt": text, "multi_modal_data": {"image": images}, "mm_processor_kwargs": bounds}],
            GREEDY,
            use_tqdm=False,
        )
        with pytest.raises(ValueError) as refused:
            llm.generate({"prompt": "no image", "mm_processor_kwargs": bounds}, GREEDY, use_tqdm=False)
        assert str(refused.value) == "mm_processor_kwargs applies to a request with images"
    processor = hf_processor(model_dir)
    processor.image_processor.size = {"shortest_edge": bounds["min_pixels"], "longest_edge": bounds["max_pixels"]}
    inputs = processor(text=text, images=images, return_tensors="pt")
    assert out.prompt_token_ids == per_request.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert len(out.prompt_token_ids) < len(default.prompt_token_ids) == len(own.prompt_token_ids)
    assert list(out.outputs[0].token_ids) == list(per_request.outputs[0].token_ids)
    assert list(out.outputs[0].token_ids) == transformers_greedy(hf, inputs, MAX_TOKENS)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"do_resize": False},
            "--mm-processor-kwargs 'do_resize' is not supported for {arch} (supported: min_pixels, max_pixels for "
            "Qwen2-VL, Qwen2.5-VL and Qwen3-VL; do_pan_and_scan, pan_and_scan_min_crop_size, "
            "pan_and_scan_max_num_crops, pan_and_scan_min_ratio_to_activate for Gemma 3)",
        ),
        ({"max_pixels": 0}, "--mm-processor-kwargs max_pixels: a whole number of 1 or more, got 0"),
        (
            {"do_pan_and_scan": True},
            "--mm-processor-kwargs 'do_pan_and_scan' is not supported for {arch} (supported: min_pixels, max_pixels "
            "for Qwen2-VL, Qwen2.5-VL and Qwen3-VL; do_pan_and_scan, pan_and_scan_min_crop_size, "
            "pan_and_scan_max_num_crops, pan_and_scan_min_ratio_to_activate for Gemma 3)",
        ),
        (
            {"min_pixels": 5000, "max_pixels": 4000},
            "--mm-processor-kwargs min_pixels 5000 is above max_pixels 4000",
        ),
    ],
)
def test_bad_mm_processor_kwargs_are_refused(model_dir, kwargs, message):
    from raypaged.config import EngineConfig

    with pytest.raises(ValueError) as refused:
        EngineConfig(model=str(model_dir), mm_processor_kwargs=kwargs)
    arch = AutoConfig.from_pretrained(model_dir).architectures[0]
    assert str(refused.value) == message.format(arch=arch)

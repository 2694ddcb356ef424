"""Images offline: raypaged ``LLM.generate`` with ``multi_modal_data`` against transformers' ``generate``.

``--family llava`` (default): LLaVA-1.5's vision side at its real shape (CLIP ViT-L/14 at 336 pixels: 24 layers of
1024, 576 tokens an image, the two-layer projector). ``--family qwen2.5-vl``: Qwen2.5-VL-3B/7B's vision tower at its
real shape (32 blocks of 1280, window attention of 112 pixels but in blocks 7, 15, 23 and 31, the 2 x 2 merger), 336
pixel images (576 patches, 144 tokens). ``--family smolvlm``: SmolVLM-256M's (Idefics3: SigLIP-B/16 at 512 pixels, 12
layers of 768, pixel-shuffled 4 x 4 to 64 tokens a tile; an image resized to 512 pixels is one tile and the whole
image, 128 tokens), whose language model is SmolLM2-135M. Each on SmolLM2-135M's language model, with random
weights (written once to a temporary folder; nothing is downloaded) and SmolLM2's tokenizer with the image tokens
added. Every system answers
the same prompts, one noise image each, with exactly ``--max-tokens`` greedy tokens, fp32, the same threads; one
timed run after a warm-up on other images. Peer: transformers' ``generate`` in left-padded batches of ``--batch``.
Tokens are compared with raypaged's.

    python benchmarks/image_bench.py --quick
    python benchmarks/image_bench.py --quick --family qwen2.5-vl
    python benchmarks/image_bench.py --quick --family smolvlm
    python benchmarks/image_bench.py --num-prompts 32
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import load_average, machine_info, write_json
from PIL import Image

from raypaged.model.default_model import default_model_dir

PROMPTS = {
    "llava": "USER: <image>\nDescribe the picture in detail. ASSISTANT:",
    "qwen2.5-vl": "<|vision_start|><|image_pad|><|vision_end|>Describe the picture in detail.",
    "smolvlm": "User:<image>Describe the picture in detail.<end_of_utterance>\nAssistant:",
}
IDEFICS3_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
)
QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def smollm2_tokenizer(path: Path, tokens: list[str]):
    """SmolLM2's tokenizer with ``tokens`` added, and SmolLM2's config with the vocabulary that makes."""
    from transformers import AutoConfig, AutoTokenizer

    smollm2 = default_model_dir()
    staging = path / "tokenizer"
    staging.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, staging / name)
    tokenizer = AutoTokenizer.from_pretrained(staging)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    text = AutoConfig.from_pretrained(smollm2)
    text.vocab_size = len(tokenizer)
    return tokenizer, text


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    return model


def qwen_vl_shaped(path: Path, seed: int) -> Path:
    """A random checkpoint of Qwen2.5-VL-3B/7B's vision tower and merger on SmolLM2-135M (M-RoPE sections of its
    32 frequencies: 8, 12, 12, as the published 16, 24, 24 of 64)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer, text = smollm2_tokenizer(path, list(QWEN_VL_TOKENS))
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS))
    text_config = text.to_dict()
    text_config["rope_parameters"] = {"rope_type": "default", "rope_theta": 100000.0, "mrope_section": [8, 12, 12]}
    vision = dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=text.hidden_size,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )
    model = randomized(Qwen2_5_VLForConditionalGeneration(config).to(torch.float32), seed)
    model.save_pretrained(path / "qwen2.5-vl")
    tokenizer.save_pretrained(path / "qwen2.5-vl")
    Qwen2VLImageProcessorPil(min_pixels=336 * 336, max_pixels=336 * 336).save_pretrained(path / "qwen2.5-vl")
    return path / "qwen2.5-vl"


def smolvlm_shaped(path: Path, seed: int) -> Path:
    """A random SmolVLM-256M-shaped checkpoint (Idefics3: SigLIP-B/16-512, the 4 x 4 pixel-shuffle connector, on
    SmolLM2-135M), its processor resizing an image to 512 pixels: one tile and the whole image."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer, text = smollm2_tokenizer(path, list(IDEFICS3_TOKENS))
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512)
    config = Idefics3Config(
        vision_config=dict(vision, patch_size=16),
        text_config=text.to_dict(),
        scale_factor=4,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )
    model = randomized(Idefics3ForConditionalGeneration(config).to(torch.float32), seed)
    model.save_pretrained(path / "smolvlm")
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 512}, max_image_size={"longest_edge": 512}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    Idefics3Processor(image_processor, tokenizer, image_seq_len=64).save_pretrained(path / "smolvlm")
    return path / "smolvlm"


def llava_shaped(path: Path, seed: int) -> Path:
    """A random LLaVA-1.5-shaped checkpoint: CLIP ViT-L/14-336 and its projector on SmolLM2-135M."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer, text = smollm2_tokenizer(path, ["<image>"])
    vision = CLIPVisionConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
        projection_dim=768,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids("<image>")
    )
    randomized(LlavaForConditionalGeneration(config).to(torch.float32), seed).save_pretrained(path / "llava")
    LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    ).save_pretrained(path / "llava")
    return path / "llava"


def images(count: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (336, 336, 3), dtype=np.uint8)) for _ in range(count)]


def bench_raypaged(model_dir: Path, family: str, timed: list[Image.Image], warm_up: list[Image.Image], max_tokens: int):
    from raypaged import LLM, SamplingParams

    prompt = PROMPTS[family]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(model=str(model_dir), device="cpu", max_model_len=1024, kv_cache_space=1)
    try:
        llm.generate([{"prompt": prompt, "multi_modal_data": {"image": i}} for i in warm_up], params, use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": i}} for i in timed], params, False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    return seconds, [list(o.outputs[0].token_ids) for o in outputs]


def qwen_vl_processor(model_dir: Path):
    """transformers' Qwen2-VL processor of the checkpoint, made without a video processor (which needs torchvision)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: (  # type: ignore[method-assign]
        None if arg is None else check(self, name, arg)
    )
    try:
        return Qwen2VLProcessor(
            image_processor=AutoImageProcessor.from_pretrained(model_dir),
            tokenizer=AutoTokenizer.from_pretrained(model_dir),
        )
    finally:
        ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]


def bench_hf(
    model_dir: Path, family: str, timed: list[Image.Image], warm_up: list[Image.Image], max_tokens: int, batch: int
):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = qwen_vl_processor(model_dir) if family == "qwen2.5-vl" else AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = PROMPTS[family]

    def run(pictures: list[Image.Image]) -> list[list[int]]:
        tokens = []
        for first in range(0, len(pictures), batch):
            chunk = pictures[first : first + batch]
            inputs = processor(text=[prompt] * len(chunk), images=chunk, return_tensors="pt", padding=True)
            with torch.inference_mode():
                out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            tokens += out[:, inputs["input_ids"].shape[1] :].tolist()
        return tokens

    run(warm_up)
    start = time.perf_counter()
    tokens = run(timed)
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="16 prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="transformers' batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=sorted(PROMPTS), default="llava")
    args = parser.parse_args()
    count = 16 if args.quick else args.num_prompts
    family = args.family
    make = {"llava": llava_shaped, "qwen2.5-vl": qwen_vl_shaped, "smolvlm": smolvlm_shaped}[family]
    model_dir = make(Path(tempfile.mkdtemp(prefix=f"{family}-shaped-")), args.seed)
    timed, warm_up = images(count, args.seed), images(4, args.seed + 1)
    results, reference = [], None
    peer = {
        "llava": "LlavaForConditionalGeneration",
        "qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
        "smolvlm": "Idefics3ForConditionalGeneration",
    }[family]
    systems = {
        "raypaged LLM.generate": lambda: bench_raypaged(model_dir, family, timed, warm_up, args.max_tokens),
        f"transformers {peer}.generate, batches of {args.batch}": lambda: bench_hf(
            model_dir, family, timed, warm_up, args.max_tokens, args.batch
        ),
    }
    for name, run in systems.items():
        seconds, tokens = run()
        reference = tokens if reference is None else reference
        same = sum(a == b for a, b in zip(tokens, reference))
        results.append(
            {
                "system": name,
                "seconds": round(seconds, 2),
                "images_per_s": round(count / seconds, 3),
                "generated_tokens_per_s": round(count * args.max_tokens / seconds, 1),
                "outputs_equal_to_raypaged": f"{same}/{count}",
            }
        )
    base = results[0]["seconds"]
    shape = {
        "llava": "CLIP ViT-L/14-336 (576 image tokens) + SmolLM2-135M",
        "qwen2.5-vl": "Qwen2.5-VL's vision tower (144 image tokens) + SmolLM2-135M",
        "smolvlm": "SmolVLM-256M (SigLIP-B/16-512, 2 tiles of 64 image tokens) on SmolLM2-135M",
    }[family]
    print(
        f"{count} prompts with one 336-pixel image each, {args.max_tokens} greedy tokens each, {shape} shapes, "
        f"random weights, fp32, {torch.get_num_threads()} threads"
    )
    print("| system | seconds | images/s | generated tokens/s | raypaged ÷ this | outputs equal |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['system']} | {r['seconds']} | {r['images_per_s']} | {r['generated_tokens_per_s']} | "
            f"{r['seconds'] / base:.2f} | {r['outputs_equal_to_raypaged']} |"
        )
    report = {
        "workload": {
            "model": f"{shape}, random weights",
            "prompts": count,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
        },
        "machine": machine_info(torch.get_num_threads()),
        "load_average": load_average(),
        "results": results,
    }
    name = "image_bench" if family == "llava" else f"image_bench_{family.replace('.', '_').replace('-', '_')}"
    print(f"wrote {write_json(name, report)}")
    shutil.rmtree(model_dir.parent, ignore_errors=True)


if __name__ == "__main__":
    main()

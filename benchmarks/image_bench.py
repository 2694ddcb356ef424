"""Images offline: raypaged ``LLM.generate`` with ``multi_modal_data`` against transformers' LLaVA ``generate``.

The model is LLaVA-1.5's vision side at its real shape (CLIP ViT-L/14 at 336 pixels: 24 layers of 1024, 576 tokens
an image, the two-layer projector) on SmolLM2-135M's language model, with random weights (written once to a
temporary folder; nothing is downloaded) and SmolLM2's tokenizer with ``<image>`` added. Every system answers the
same prompts, one 336-pixel noise image each, with exactly ``--max-tokens`` greedy tokens, fp32, the same threads;
one timed run after a warm-up on other images. Peer: ``LlavaForConditionalGeneration.generate`` in left-padded
batches of ``--batch``. Tokens are compared with raypaged's.

    python benchmarks/image_bench.py --quick
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

PROMPT = "USER: <image>\nDescribe the picture in detail. ASSISTANT:"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def llava_shaped(path: Path, seed: int) -> Path:
    """A random LLaVA-1.5-shaped checkpoint: CLIP ViT-L/14-336 and its projector on SmolLM2-135M."""
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    smollm2 = default_model_dir()
    staging = path / "tokenizer"
    staging.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, staging / name)
    tokenizer = AutoTokenizer.from_pretrained(staging)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = AutoConfig.from_pretrained(smollm2)
    text.vocab_size = len(tokenizer)
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
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    model.save_pretrained(path / "llava")
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


def bench_raypaged(model_dir: Path, timed: list[Image.Image], warm_up: list[Image.Image], max_tokens: int):
    from raypaged import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(model=str(model_dir), device="cpu", max_model_len=1024, kv_cache_space=1)
    try:
        llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": i}} for i in warm_up], params, use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": i}} for i in timed], params, False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    return seconds, [list(o.outputs[0].token_ids) for o in outputs]


def bench_hf(model_dir: Path, timed: list[Image.Image], warm_up: list[Image.Image], max_tokens: int, batch: int):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(pictures: list[Image.Image]) -> list[list[int]]:
        tokens = []
        for first in range(0, len(pictures), batch):
            chunk = pictures[first : first + batch]
            inputs = processor(text=[PROMPT] * len(chunk), images=chunk, return_tensors="pt", padding=True)
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
    args = parser.parse_args()
    count = 16 if args.quick else args.num_prompts
    model_dir = llava_shaped(Path(tempfile.mkdtemp(prefix="llava-shaped-")), args.seed)
    timed, warm_up = images(count, args.seed), images(4, args.seed + 1)
    results, reference = [], None
    systems = {
        "raypaged LLM.generate": lambda: bench_raypaged(model_dir, timed, warm_up, args.max_tokens),
        f"transformers LlavaForConditionalGeneration.generate, batches of {args.batch}": lambda: bench_hf(
            model_dir, timed, warm_up, args.max_tokens, args.batch
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
    print(
        f"{count} prompts with one 336-pixel image each (576 image tokens), {args.max_tokens} greedy tokens each, "
        f"CLIP ViT-L/14-336 + SmolLM2-135M shapes, random weights, fp32, {torch.get_num_threads()} threads"
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
            "model": "CLIP ViT-L/14-336 + LLaVA projector + SmolLM2-135M, random weights",
            "prompts": count,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
        },
        "machine": machine_info(torch.get_num_threads()),
        "load_average": load_average(),
        "results": results,
    }
    print(f"wrote {write_json('image_bench', report)}")
    shutil.rmtree(model_dir.parent, ignore_errors=True)


if __name__ == "__main__":
    main()

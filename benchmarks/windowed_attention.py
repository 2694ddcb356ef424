"""Sliding-window models on CPU: the CPU backend's decode kernel (which takes the window, sinks, chunks and
soft-capping) against the torch attention ops, on the same Gemma 3 shape in the same run.

A Gemma-3-shaped model (12 layers of 576, 9 query heads over 3 KV heads of 64, a sliding window of 128 on five of
every six layers) with dummy weights; 16 prompts of 150-300 tokens, 128 greedy tokens each (EOS ignored);
``--runs`` alternations of the two backends, one timed generate each after a warm-up. The outputs of both
backends are compared token for token.

    python benchmarks/windowed_attention.py
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import load_average, machine_info, write_json
from transformers import AutoConfig

from raypaged import LLM, SamplingParams
from raypaged.model.default_model import default_model_dir

SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=12,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
    sliding_window=128,
    query_pre_attn_scalar=64,
    tie_word_embeddings=True,
)
NUM_PROMPTS, MAX_TOKENS = 16, 128


def gemma3_folder() -> Path:
    """The model's config (its weights are dummy: raypaged fills them at load) and SmolLM2's tokenizer."""
    path = Path(tempfile.mkdtemp(prefix="gemma3-"))
    config = AutoConfig.for_model("gemma3_text", **SHAPE)
    config.architectures = ["Gemma3ForCausalLM"]
    config.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default_model_dir() / name).exists():
            shutil.copy(default_model_dir() / name, path / name)
    return path


def run(path: Path, backend: str, prompts: list[dict]) -> tuple[float, list[list[int]]]:
    llm = LLM(model=str(path), attention_backend=backend, max_model_len=1024, load_format="dummy")
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    return NUM_PROMPTS * MAX_TOKENS / seconds, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    path = gemma3_folder()
    prompts = [{"prompt_token_ids": list(range(100 + i, 250 + i + 10 * i))} for i in range(NUM_PROMPTS)]
    rates: dict[str, list[float]] = {"torch": [], "cpu": []}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.runs):
        for backend in rates:
            rate, tokens[backend] = run(path, backend, prompts)
            rates[backend].append(round(rate, 1))
    same = tokens["torch"] == tokens["cpu"]
    print(f"Gemma 3 shape, {NUM_PROMPTS} prompts x {MAX_TOKENS} tokens, {torch.get_num_threads()} threads")
    print("| backend | tokens/s per run | cpu ÷ torch |")
    print("| --- | --- | ---: |")
    for backend, values in rates.items():
        ratio = sum(rates["cpu"]) / sum(values)
        print(f"| {backend} | {' / '.join(map(str, values))} | {ratio:.2f} |")
    print(f"same tokens on both backends: {same}")
    report = {
        "workload": {"model": "gemma3_text", **SHAPE, "prompts": NUM_PROMPTS, "max_tokens": MAX_TOKENS},
        "machine": machine_info(torch.get_num_threads()),
        "load_average": load_average(),
        "tokens_per_s": rates,
        "same_tokens": same,
    }
    print(f"wrote {write_json('windowed_attention', report)}")


if __name__ == "__main__":
    main()

"""W6 (offline batch generation, BENCHMARKS.md) on a mixture-of-experts model: raypaged against transformers.

No mixture-of-experts checkpoint fits this machine in fp32, so the model is a random-weight Qwen3-MoE built once with
transformers and SmolLM2's tokenizer (its shape below: about SmolLM2's active parameters per token, 8 of 32 experts),
cached under the raypaged cache folder. Every system gets the same prompts (uniform 50-200 tokens) and generates
exactly 100 tokens greedily in fp32 with the same threads, as ``offline_throughput.py`` runs them:

    python benchmarks/moe_bench.py --quick
    python benchmarks/moe_bench.py --systems raypaged,hf-static --num-prompts 64
    python benchmarks/moe_bench.py --quick --systems raypaged --dtype bfloat16 --name moe_bench_bf16
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

import torch
from common import build_prompts, check_args, count_parameters, load_average, machine_info, write_json
from offline_throughput import SYSTEMS, add_w6_args, markdown_table, run_systems, w6_counts

from raypaged import envs
from raypaged.model.default_model import default_model_dir

SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=12,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    moe_intermediate_size=512,
    num_experts=32,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def moe_model_dir() -> Path:
    """The random Qwen3-MoE of ``SHAPE`` with SmolLM2's tokenizer (built on first use)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    path = envs.cache_dir() / "bench_models" / "qwen3-moe-random"
    if (path / "config.json").exists():
        return path
    smollm2 = default_model_dir()
    config = AutoConfig.for_model("qwen3_moe", vocab_size=49152, bos_token_id=1, eos_token_id=2, **SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.05)
    model.save_pretrained(path)
    for file in smollm2.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(file, path / file.name)
    return path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_w6_args(parser, 128, 8)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"])
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="raypaged's dtype (bfloat16: raypaged alone; with --attention-backend torch, torch's own bf16 path)",
    )
    parser.add_argument("--name", default="moe_bench", help="results file stem under benchmarks/results/")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    w6_counts(args, 128, 8)
    args.tensor_parallel_size, args.pipeline_parallel_size, args.device = [1], [1], "cpu"
    check_args(parser, args, SYSTEMS)
    if args.dtype != "float32" and args.systems != ["raypaged"]:
        parser.error("--dtype bfloat16 runs raypaged alone (--systems raypaged): the peers run fp32")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    started, args.load_at_start = time.perf_counter(), load_average()
    model_dir = moe_model_dir()
    prompts = build_prompts(model_dir, args.num_prompts, args.seed)
    results = run_systems(model_dir, prompts, args)
    raypaged = next((r for r in results if r.system == "raypaged"), None)
    report = {
        "workload": {"prompts": len(prompts), "model": "random Qwen3-MoE", "shape": SHAPE, "dtype": args.dtype},
        "attention_backend": args.attention_backend,
        "parameters": count_parameters(model_dir),
        "name": args.name,
        "load_average": {"start": args.load_at_start, "end": load_average()},
        "machine": machine_info(args.threads),
        "systems": [asdict(r) | {"tokens_per_s": r.tokens_per_s, "median_tokens_per_s": r.median} for r in results],
        "wall_seconds": time.perf_counter() - started,
    }
    if raypaged:
        report["ratios_raypaged_over"] = {r.system: raypaged.median / r.median for r in results if r is not raypaged}
    write_json(args.name, report)
    print(markdown_table(results))
    for system, ratio in report.get("ratios_raypaged_over", {}).items():
        print(f"raypaged / {system}: {ratio:.2f}x")


if __name__ == "__main__":
    main()

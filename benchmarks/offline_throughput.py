"""Workload W6 of BENCHMARKS.md: offline batch generation, raypaged against transformers.

Every system gets the same prompt token ids (uniform 50-200 tokens drawn from the
tokenizer's ordinary vocabulary with a seeded RNG), generates exactly 100 tokens
greedily, in fp32, on the same weights and torch thread count, in one process:

    python benchmarks/offline_throughput.py --quick
    python benchmarks/offline_throughput.py --systems raypaged,hf-static --threads 2
    python benchmarks/offline_throughput.py --quick --systems raypaged --tensor-parallel-size 1,3 \
        --name offline_throughput_tp

``--pipeline-parallel-size 2`` also runs raypaged as that many pipeline stages of one shard each (Ray
CPU shards, each with its layers' share of the same total KV cache).

``--tensor-parallel-size 1,3`` runs raypaged at each size: 1 in this process, N > 1 as N Ray
CPU shards (threads per shard: max(1, cores // N) unless $RAYPAGED_CPU_THREADS_PER_SHARD), with
the same total KV cache. For each it reports the per-step driver overhead: the wall time of
``generate`` minus the slowest shard's time in its ``execute_model``, per step, and the part of it
spent inside the executor (for Ray shards: the compiled graph's send and return).

The ceiling it prints is the run's GEMMs alone, at the rate the model's own linear reaches at the
step's shapes (all prompt tokens in steps of the 8,192-token budget, then 99 decode steps of all the
sequences; the gate | up projection with its SiLU stored from the tiles, as the model runs it), measured
in the same process with the same threads; raypaged's fraction of it is the share
of its time spent in GEMMs at library speed. ``--attention-backend torch`` runs raypaged's decode
attention as torch gather + SDPA instead of the CPU kernel. ``--sampling article`` samples every token as the
article's example does (``SamplingParams(temperature=0.8, top_p=0.95)``; transformers with ``do_sample=True`` and
the same values) instead of greedily: the systems' tokens then differ, and none is compared.

Writes benchmarks/results/NAME.{json,png} (NAME: offline_throughput) and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from common import (
    MAX_TOKENS,
    PROMPT_LEN,
    RESULTS_DIR,
    SAMPLING,
    Prompts,
    build_prompts,
    check_args,
    count_parameters,
    load_average,
    machine_info,
    peak_rss_mib,
    pyplot,
    write_json,
)

from raypaged.model.default_model import default_model_dir

SYSTEMS = {
    "raypaged": "raypaged `LLM.generate`",
    "hf-single": "transformers `generate`, one request at a time",
    "hf-static": "transformers `generate`, static batches of {batch}",
}


@dataclass
class SystemResult:
    system: str
    label: str
    requests: int
    generated_tokens: int
    run_seconds: list[float]
    peak_rss_mib: float  # process peak so far: systems run in order, so later ones include earlier ones
    extra: dict[str, float | int | str] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> list[float]:
        return [self.generated_tokens / s for s in self.run_seconds]

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)


def add_w6_args(parser: argparse.ArgumentParser, prompts: int, single: int) -> None:
    """The options of a W6 run: prompts (``prompts`` and ``single`` one at a time unless --quick), repeats,
    threads, the static batch, raypaged's KV cache and the systems."""
    parser.add_argument("--quick", action="store_true", help="32 prompts, 4 one-at-a-time, 1 repeat")
    parser.add_argument(
        "--num-prompts", type=int, help=f"prompts for raypaged and static batches ({prompts}; 32 quick)"
    )
    parser.add_argument("--single-prompts", type=int, help=f"subset run one at a time ({single}; 4 quick)")
    parser.add_argument("--repeats", type=int, help="timed runs per system (3; 1 quick)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch-size", type=int, default=16, help="static batch size of hf-static")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="raypaged KV cache (split over the shards)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {list(SYSTEMS)}")
    parser.add_argument(
        "--sampling",
        default="greedy",
        choices=list(SAMPLING),
        help="greedy, or article: temperature 0.8 and top_p 0.95, the article's example (tokens then differ)",
    )


def w6_counts(args: argparse.Namespace, prompts: int, single: int) -> None:
    """``add_w6_args``' counts filled in: the given ones, else the --quick ones or ``prompts``, ``single`` and 3."""
    args.num_prompts = args.num_prompts or (32 if args.quick else prompts)
    args.single_prompts = min(args.single_prompts or (4 if args.quick else single), args.num_prompts)
    args.repeats = args.repeats or (1 if args.quick else 3)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_w6_args(parser, 256, 32)
    parser.add_argument("--tensor-parallel-size", default="1", help="comma-separated sizes raypaged runs at (1,3)")
    parser.add_argument(
        "--pipeline-parallel-size", default="1", help="comma-separated stage counts raypaged also runs at (2,3)"
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="raypaged's device")
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu", "cuda"],
        help="raypaged's paged attention (torch: the gather + SDPA path on CPU)",
    )
    parser.add_argument("--name", default="offline_throughput", help="results file stem under benchmarks/results/")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for flag in ("tensor_parallel_size", "pipeline_parallel_size"):
        given = getattr(args, flag)
        name = "--" + flag.replace("_", "-")
        try:
            setattr(args, flag, [int(size) for size in given.split(",")])
        except ValueError:
            parser.error(f"{name} takes comma-separated integers, got {given!r}")
        if min(getattr(args, flag)) < 1:
            parser.error(f"{name} values must be at least 1")
    w6_counts(args, 256, 32)
    check_args(parser, args, SYSTEMS)
    return args


def timed_runs(run: Callable[[], Prompts], repeats: int) -> tuple[list[float], Prompts]:
    """Wall seconds of each run and the generated token ids of the last one."""
    seconds, outputs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = run()
        seconds.append(time.perf_counter() - start)
    return seconds, outputs


def check_lengths(system: str, outputs: Prompts) -> int:
    bad = [len(o) for o in outputs if len(o) != MAX_TOKENS]
    if bad:
        raise RuntimeError(f"{system}: {len(bad)} outputs are not {MAX_TOKENS} tokens long (e.g. {bad[0]})")
    return len(outputs) * MAX_TOKENS


def raypaged_system(tp: int, pp: int = 1) -> str:
    return "raypaged" + ("" if tp == 1 else f"-tp{tp}") + ("" if pp == 1 else f"-pp{pp}")


def layouts(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(tensor-parallel size, pipeline stages) of each raypaged run: the tp sizes, then the stage counts at tp 1."""
    return [(tp, 1) for tp in args.tensor_parallel_size] + [(1, pp) for pp in args.pipeline_parallel_size if pp > 1]


def bench_raypaged(
    model_dir: Path, prompts: Prompts, tp: int, args: argparse.Namespace, pp: int = 1
) -> tuple[SystemResult, Prompts]:
    from raypaged import LLM, SamplingParams

    # no prefix caching: a repeat would find the previous run's prompts cached and skip their prefill
    llm = LLM(
        model=str(model_dir),
        dtype=getattr(args, "dtype", "float32"),  # moe_bench's --dtype; the others run fp32
        device=args.device,
        kv_cache_space=args.kv_cache_gib / (tp * pp),  # per shard: the same total, each stage its layers'
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        attention_backend=args.attention_backend,
        enable_prefix_caching=False,
    )
    params = SamplingParams(**SAMPLING[args.sampling], max_tokens=MAX_TOKENS, ignore_eos=True)
    executor = llm.llm_engine.executor

    def run(batch: Prompts, sampling: SamplingParams) -> Prompts:
        requests = [{"prompt_token_ids": p} for p in batch]
        return [o.outputs[0].token_ids for o in llm.generate(requests, sampling, use_tqdm=False)]

    try:
        run(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        executor.step_times.reset()
        seconds, outputs = timed_runs(lambda: run(prompts, params), args.repeats)
        times = executor.step_times
        stats = llm.stats()
        pipelined = llm.llm_engine.core.num_pipelined_steps
        threads = [args.threads] if tp * pp == 1 else [s["torch_threads"] for s in executor_thread_settings(executor)]
    finally:
        llm.shutdown()
    hf = llm.llm_engine.config.hf_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_bytes_per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4
    blocks = int(stats["num_gpu_blocks_total"])
    extra = {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        # the backend that ran (auto resolves per device); Ray shards resolve it the same way
        "attention_backend": executor.worker.attn_backend.name if tp * pp == 1 else args.attention_backend,
        "threads_per_shard": "/".join(map(str, threads)),
        "steps": times.num_steps,
        "forward_ms_per_step": 1e3 * times.worker_s / times.num_steps,
        "driver_overhead_ms_per_step": 1e3 * (sum(seconds) - times.worker_s) / times.num_steps,
        "executor_overhead_ms_per_step": 1e3 * (times.executor_s - times.worker_s) / times.num_steps,
        "kv_cache_blocks": blocks,
        "kv_cache_gib": blocks * llm.llm_engine.config.block_size * kv_bytes_per_token / 2**30,
        "kv_gib_if_all_live": sum(len(p) + MAX_TOKENS for p in prompts) * kv_bytes_per_token / 2**30,
        "preemptions": int(stats["num_preemptions"]),
    }
    if pp > 1:  # micro-batches sent while others were in flight (the stages overlap)
        extra["pipelined_steps"] = pipelined
    system = raypaged_system(tp, pp)
    label = SYSTEMS["raypaged"] + ("" if tp == 1 else f", tp {tp} ({tp} Ray CPU shards)")
    label += "" if pp == 1 else f", {pp} pipeline stages ({tp * pp} Ray CPU shards)"
    result = SystemResult(system, label, len(prompts), check_lengths(system, outputs), seconds, peak_rss_mib(), extra)
    return result, outputs


def executor_thread_settings(executor) -> list[dict]:
    import ray

    return ray.get([worker.thread_settings.remote() for worker in executor.workers])


def hf_generate(
    model: torch.nn.Module, batch: Prompts, pad_id: int, max_new_tokens: int, sampling: str = "greedy"
) -> Prompts:
    """Generate on a left-padded batch (greedy, or sampled as ``SAMPLING[sampling]``); exactly ``max_new_tokens``
    new tokens per row."""
    values = SAMPLING[sampling]
    options = {"do_sample": True, **values} if values["temperature"] > 0 else {"do_sample": False}
    width = max(map(len, batch))
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(batch):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        **options,
        pad_token_id=pad_id,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
    )
    return out[:, width:].tolist()


def bench_hf(
    model: torch.nn.Module, prompts: Prompts, batch_size: int, system: str, args: argparse.Namespace
) -> tuple[SystemResult, Prompts]:
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]

    def run() -> Prompts:
        return [tokens for batch in batches for tokens in hf_generate(model, batch, pad_id, MAX_TOKENS, args.sampling)]

    hf_generate(model, prompts[: min(2, batch_size)], pad_id, 8)
    seconds, outputs = timed_runs(run, args.repeats)
    label = SYSTEMS[system].format(batch=batch_size)
    result = SystemResult(
        system, label, len(prompts), check_lengths(system, outputs), seconds, peak_rss_mib(), {"batch_size": batch_size}
    )
    return result, outputs


def matmul_gflops(m: int, k: int, n: int, gate_up: bool = False, min_seconds: float = 0.5) -> float:
    """[m x k] @ [k x n] through the model's own linear (``raypaged.model.layers.linear``: for fp32 on CPU
    ``cpu_gemm.c``, or oneDNN where the C kernels do not build, on a weight packed as the loader packs the model's).
    ``gate_up``: an MLP's gate | up projection, run as the model runs it: where the weight packs gated, with its
    silu(gate) * up stored from the tiles (``silu_and_mul_linear``; [m x n/2] written instead of [m x n])."""
    from raypaged.model.layers import PackedWeight, linear, pack_weight, packs_weights, silu_and_mul_linear

    x, weight = torch.randn(m, k), torch.randn(n, k)
    if packs_weights(x.dtype, x.device):
        weight = pack_weight(weight, gated=gate_up)
    run = linear
    if isinstance(weight, PackedWeight) and weight.gated:
        run = silu_and_mul_linear
    run(x, weight)  # warm-up
    iters, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        run(x, weight)
        iters += 1
    return 2 * m * k * n * iters / elapsed / 1e9


def model_linears(model_dir: Path) -> tuple[list[tuple[int, int, bool]], tuple[int, int, bool], int]:
    """One layer's (in, out, is gate | up) projections as the model runs them (fused qkv, o, fused gate_up,
    down), the LM head's, and the layer count."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    hidden, inter = hf.hidden_size, hf.intermediate_size
    layer = [
        (hidden, (hf.num_attention_heads + 2 * hf.num_key_value_heads) * head_dim, False),
        (hf.num_attention_heads * head_dim, hidden, False),
        (hidden, 2 * inter, True),
        (inter, hidden, False),
    ]
    return layer, (hidden, hf.vocab_size, False), hf.num_hidden_layers


def gemm_ceiling(model_dir: Path, prompts: Prompts, prefill_rows: int, decode_rows: int) -> dict[str, float | str]:
    """The run's GEMMs alone at the rate the model's linear reaches at the step's shapes: every prompt
    token through the layers in steps of ``prefill_rows`` (the LM head on each prompt's last token),
    then MAX_TOKENS - 1 decode steps of ``decode_rows`` sequences (layers and LM head). Tokens/s =
    generated tokens / those seconds; raypaged's tokens/s over it is the share of its time that is GEMM
    at library speed, everything else (attention, elementwise ops, Python) being the rest."""
    layer, head, num_layers = model_linears(model_dir)
    prompt_tokens, requests = sum(map(len, prompts)), len(prompts)
    rates: dict[str, float] = {}

    def seconds(m: int, shapes: list[tuple[int, int, bool]], times: float) -> float:
        total = 0.0
        for k, n, gate_up in shapes:
            name = f"[{m} x {k}] @ [{k} x {n}]" + (" gate | up" if gate_up else "")
            rate = rates.setdefault(name, matmul_gflops(m, k, n, gate_up))
            total += 2 * m * k * n / (rate * 1e9)
        return total * times

    prefill = seconds(prefill_rows, layer, num_layers * prompt_tokens / prefill_rows)
    prefill += seconds(requests, [head], 1)
    decode_steps = (MAX_TOKENS - 1) * requests / decode_rows
    decode = seconds(decode_rows, layer, num_layers * decode_steps) + seconds(decode_rows, [head], decode_steps)
    total = prefill + decode
    return {
        "prefill_rows": prefill_rows,
        "decode_rows": decode_rows,
        "prefill_gemm_s": prefill,
        "decode_gemm_s": decode,
        "gemm_s": total,
        "tokens_per_s": requests * MAX_TOKENS / total,
        "gflops_by_shape": rates,
        "peak_gflops_2048": matmul_gflops(2048, 2048, 2048),
    }


def agreement(reference: Prompts, outputs: Prompts) -> str:
    """How many of the prompts both ran came out with identical tokens."""
    same = sum(a == b for a, b in zip(reference, outputs))
    return f"{same}/{min(len(reference), len(outputs))}"


def markdown_table(results: list[SystemResult]) -> str:
    base = next((r.median for r in results if r.system == "raypaged"), None)
    lines = [
        "| system | requests | generated tokens | tokens/s (median) | spread (min–max) "
        "| ratio to raypaged (raypaged ÷ this) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        ratio = f"{base / r.median:.2f}" if base else "n/a"
        lines.append(
            f"| {r.label} | {r.requests} | {r.generated_tokens} | {r.median:.1f} | "
            f"{min(r.tokens_per_s):.1f}–{max(r.tokens_per_s):.1f} | {ratio} |"
        )
    return "\n".join(lines)


def plot(results: list[SystemResult], ceiling: dict, info: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    medians = [r.median for r in results]
    errors = [[r.median - min(r.tokens_per_s) for r in results], [max(r.tokens_per_s) - r.median for r in results]]
    ax.bar(
        [f"{r.system}\n({r.requests} req)" for r in results],
        medians,
        yerr=errors,
        capsize=6,
        color=["tab:green" if r.system.startswith("raypaged") else "tab:gray" for r in results],
    )
    for i, value in enumerate(medians):
        ax.annotate(f"{value:.1f}", (i, value), ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
    ax.axhline(ceiling["tokens_per_s"], ls="--", color="tab:red", label="GEMMs alone at the step's shapes")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"W6 offline batch, fp32, {info['threads']} threads, {info['cpu']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def tp_table(results: list[SystemResult]) -> str:
    """raypaged at each tensor-parallel size: throughput and where a step's time goes."""
    lines = [
        "| tp | pp | threads per shard | tokens/s (median) | steps | shard forward ms/step "
        "| driver overhead ms/step | of which executor (Ray) ms/step |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        if r.system.startswith("raypaged"):
            e = r.extra
            lines.append(
                f"| {e['tensor_parallel_size']} | {e.get('pipeline_parallel_size', 1)} | {e['threads_per_shard']} | "
                f"{r.median:.1f} | {e['steps']} | "
                f"{e['forward_ms_per_step']:.1f} | {e['driver_overhead_ms_per_step']:.2f} | "
                f"{e['executor_overhead_ms_per_step']:.2f} |"
            )
    return "\n".join(lines)


def print_report(results: list[SystemResult], ceiling: dict, report: dict) -> None:
    info, load = report["machine"], report["workload"]
    print(
        f"\nW6 offline batch: {info['cpu']}, {info['nproc']} CPUs, {info['threads']} threads, torch {info['torch']}, "
        f"fp32, {load['parameters'] / 1e6:.1f}M parameters, prompts {PROMPT_LEN[0]}–{PROMPT_LEN[1]} tokens, "
        f"{MAX_TOKENS} generated each, {load['repeats']} timed run(s) per system\n"
    )
    print(markdown_table(results) + "\n")
    print(tp_table(results) + "\n")
    raypaged = next((r for r in results if r.system == "raypaged"), None)
    c = ceiling
    share = f"; raypaged at {raypaged.median / c['tokens_per_s']:.1%} of it" if raypaged else ""
    print(
        f"GEMM ceiling at the step's shapes (prefill {c['prefill_rows']} rows, decode {c['decode_rows']}): "
        f"{c['prefill_gemm_s']:.1f} s + {c['decode_gemm_s']:.1f} s of GEMM → {c['tokens_per_s']:.1f} tokens/s{share}"
    )
    print(
        "  GFLOP/s by shape: "
        + ", ".join(f"{shape} {g:.0f}" for shape, g in c["gflops_by_shape"].items())
        + f"; [2048 x 2048] @ [2048 x 2048] {c['peak_gflops_2048']:.0f}"
    )
    for r in results:
        print(f"{r.system}: peak process RSS so far {r.peak_rss_mib:.0f} MiB; {r.extra}")
    print(
        f"load average at start {report['load_average']['start']}, at end {report['load_average']['end']}; "
        f"wall time {report['wall_seconds']:.0f} s; "
        f"wrote {RESULTS_DIR}/{report['name']}.json and .png"
    )


def run_systems(model_dir: Path, prompts: Prompts, args: argparse.Namespace) -> list[SystemResult]:
    """Each chosen system in turn (raypaged first, so its peak RSS holds no transformers model)."""
    results, outputs = [], {}
    if "raypaged" in args.systems:
        for tp, pp in layouts(args):
            result, outputs[raypaged_system(tp, pp)] = bench_raypaged(model_dir, prompts, tp, args, pp)
            results.append(result)
    if {"hf-single", "hf-static"} & set(args.systems):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        for system, batch_size, subset in (
            ("hf-single", 1, prompts[: args.single_prompts]),
            ("hf-static", args.batch_size, prompts),
        ):
            if system in args.systems:
                result, outputs[system] = bench_hf(model, subset, batch_size, system, args)
                results.append(result)
    for r in results:
        if r.system != "raypaged" and "raypaged" in outputs and args.sampling == "greedy":  # sampled ones differ
            r.extra["same_tokens_as_raypaged"] = agreement(outputs["raypaged"], outputs[r.system])
    return results


def build_report(
    results: list[SystemResult], ceiling: dict, params: int, model_dir: Path, args: argparse.Namespace
) -> dict:
    raypaged = next((r for r in results if r.system == "raypaged"), None)
    report = {
        "workload": {
            "id": "W6",
            "prompt_len": PROMPT_LEN,
            "max_tokens": MAX_TOKENS,
            "greedy": args.sampling == "greedy",
            "sampling": SAMPLING[args.sampling],
            "dtype": "float32",
            "seed": args.seed,
            "num_prompts": args.num_prompts,
            "single_prompts": args.single_prompts,
            "repeats": args.repeats,
            "quick": args.quick,
            "model": str(model_dir),
            "parameters": params,
            "tensor_parallel_sizes": args.tensor_parallel_size,
            "pipeline_parallel_sizes": args.pipeline_parallel_size,
        },
        "name": args.name,
        "load_average": {"start": args.load_at_start, "end": load_average()},
        "machine": machine_info(args.threads),
        "gemm_ceiling": ceiling,
        "systems": [asdict(r) | {"tokens_per_s": r.tokens_per_s, "median_tokens_per_s": r.median} for r in results],
    }
    if raypaged:
        report["ratios_raypaged_over"] = {r.system: raypaged.median / r.median for r in results if r is not raypaged}
        report["raypaged_fraction_of_ceiling"] = raypaged.median / ceiling["tokens_per_s"]
    return report


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    args.load_at_start = load_average()  # above the core count: other work competed for the CPUs
    model_dir = default_model_dir()
    prompts = build_prompts(model_dir, args.num_prompts, args.seed)
    results = run_systems(model_dir, prompts, args)
    params = count_parameters(model_dir)
    # the engine's defaults: an 8,192-token step budget, up to 256 sequences a step
    ceiling = gemm_ceiling(model_dir, prompts, min(sum(map(len, prompts)), 8192), min(len(prompts), 256))
    report = build_report(results, ceiling, params, model_dir, args)
    report["wall_seconds"] = time.perf_counter() - started
    write_json(args.name, report)
    plot(results, ceiling, report["machine"], RESULTS_DIR / f"{args.name}.png")
    print_report(results, ceiling, report)


if __name__ == "__main__":
    main()

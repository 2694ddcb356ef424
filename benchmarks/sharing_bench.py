"""Workloads W3, W4 and W5 of BENCHMARKS.md: how well raypaged's paged KV cache is used and shared.

Everything runs in this process on `LLM` (fp32, the default model), stepping the engine by
hand so that the KV cache can be read after every step:

- W3 KV memory efficiency: W1 load (prompts uniform 50-200 tokens, exactly 100 greedy tokens)
  kept at 80 requests in flight (closed loop); after every step, live tokens (K/V written, of
  the running sequences) / tokens the allocated blocks hold. From the same run: the most
  sequences that fit its KV budget when paged (blocks each request really reached) against
  contiguous per-request allocation at max_model_len (and at prompt + max_tokens).
- W5 parallel sampling: n=4 on 500-token prompts with prefix caching off (the sharing is the
  fork and copy-on-write) against 4 independent requests per prompt: peak KV blocks used.
  Beam width 4 as well when this build has `BeamSearchParams`/`LLM.beam_search`.
- W4 shared prefix: a 1,000-token system prompt + 20-60 token user turns, closed loop: time to
  first token per request and throughput, prefix caching on against off.

    python benchmarks/sharing_bench.py --quick

Writes benchmarks/results/sharing_bench.{json,png} and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from common import (
    CONTENTION_NOTE,
    MAX_TOKENS,
    PROMPT_LEN,
    RESULTS_DIR,
    Prompts,
    build_prompts,
    check_args,
    load_average,
    machine_info,
    ordinary_token_ids,
    percentile,
    pyplot,
    write_json,
)

from raypaged import LLM, SamplingParams
from raypaged.model.default_model import default_model_dir


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller request counts (W3 80 requests, W5 1 prompt, W4 6 requests at concurrency 3)",
    )
    parser.add_argument("--w3-requests", type=int, help="W3 requests in all (240; 80 quick)")
    parser.add_argument("--w3-concurrency", type=int, default=80)
    parser.add_argument("--w5-prompts", type=int, help="W5 prompts (8; 1 quick)")
    parser.add_argument("--w5-tokens", type=int, help="W5 tokens generated per sample (64; 16 quick)")
    parser.add_argument("--w4-requests", type=int, help="W4 requests per setting (48; 6 quick)")
    parser.add_argument("--w4-concurrency", type=int, help="W4 requests in flight (8; 3 quick)")
    parser.add_argument("--w4-tokens", type=int, help="W4 tokens generated per request (32; 8 quick)")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="kv_cache_space: the fixed KV budget")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    q = args.quick
    args.w3_requests = args.w3_requests or (80 if q else 240)
    args.w5_prompts = args.w5_prompts or (1 if q else 8)
    args.w5_tokens = args.w5_tokens or (16 if q else 64)
    args.w4_requests = args.w4_requests or (6 if q else 48)
    args.w4_concurrency = args.w4_concurrency or (3 if q else 8)
    args.w4_tokens = args.w4_tokens or (8 if q else 32)
    check_args(parser, args)
    return args


def make_llm(args: argparse.Namespace, prefix_caching: bool) -> LLM:
    return LLM(dtype="float32", kv_cache_space=args.kv_cache_gib, enable_prefix_caching=prefix_caching, seed=args.seed)


def used_blocks(llm: LLM) -> int:
    stats = llm.stats()
    return int(stats["num_gpu_blocks_total"] - stats["num_gpu_blocks_free"])


def closed_loop(
    llm: LLM, prompts: Prompts, params: SamplingParams, concurrency: int, on_step: Callable[[LLM], None] | None = None
) -> dict:
    """Keep ``concurrency`` requests in flight until ``prompts`` run out; per request: seconds to first token and
    to finish; ``on_step`` after every step."""
    engine = llm.llm_engine
    pending = list(reversed(prompts))
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    generated = steps = 0
    start = time.perf_counter()

    def top_up() -> None:
        while pending and len(added) - len(done) < concurrency:
            rid = engine.add_request(None, params, prompt_token_ids=pending.pop())
            added[rid] = time.perf_counter()

    top_up()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        for out in outputs:
            if out.request_id not in first and any(c.token_ids for c in out.outputs):
                first[out.request_id] = now - added[out.request_id]
            if out.finished:
                done[out.request_id] = now - added[out.request_id]
                generated += sum(len(c.token_ids) for c in out.outputs)
        if on_step:
            on_step(llm)
        top_up()
    seconds = time.perf_counter() - start
    return {
        "requests": len(done),
        "steps": steps,
        "seconds": seconds,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds,
        "ttft_s": list(first.values()),
        "latency_s": list(done.values()),
    }


# ---- W3 -----------------------------------------------------------------------------------------------------
def bench_w3(llm: LLM, model_dir: Path, args: argparse.Namespace) -> dict:
    engine = llm.llm_engine
    kv = engine.scheduler.kv
    block_size = engine.config.block_size
    prompts = build_prompts(model_dir, args.w3_requests, args.seed)
    samples: list[dict] = []
    blocks_reached: dict[str, int] = {}

    def sample(llm: LLM) -> None:
        running = list(engine.scheduler.running)
        live = sum(r.num_computed_tokens for r in running)
        used = used_blocks(llm)
        for r in running:
            blocks_reached[r.request_id] = max(blocks_reached.get(r.request_id, 0), len(kv.get_block_ids(r.request_id)))
        if used:
            samples.append(
                {
                    "running": len(running),
                    "live_tokens": live,
                    "used_blocks": used,
                    "efficiency": live / (used * block_size),
                }
            )

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    run = closed_loop(llm, prompts, params, args.w3_concurrency, sample)
    stats = llm.stats()
    num_blocks = int(stats["num_gpu_blocks_total"])
    budget_tokens = num_blocks * block_size
    max_model_len = engine.config.max_model_len
    steady = [s for s in samples if s["running"] >= args.w3_concurrency] or samples
    eff = [s["efficiency"] for s in samples]
    mean_blocks = statistics.mean(blocks_reached.values())
    mean_reserved = statistics.mean(len(p) + MAX_TOKENS for p in prompts)
    return {
        "run": {k: v for k, v in run.items() if k not in ("ttft_s", "latency_s")},
        "preemptions": int(stats["num_preemptions"]),
        "steps_sampled": len(samples),
        "efficiency_mean": statistics.mean(eff),
        "efficiency_min": min(eff),
        "efficiency_at_full_concurrency_mean": statistics.mean(s["efficiency"] for s in steady),
        "steps_at_full_concurrency": len([s for s in samples if s["running"] >= args.w3_concurrency]),
        "peak_running": max(s["running"] for s in samples),
        "peak_used_blocks": max(s["used_blocks"] for s in samples),
        "block_size": block_size,
        "kv_budget_blocks": num_blocks,
        "kv_budget_tokens": budget_tokens,
        "max_model_len": max_model_len,
        "mean_blocks_per_request": mean_blocks,
        "fit_paged": int(num_blocks // mean_blocks),
        "fit_contiguous_max_model_len": budget_tokens // max_model_len,
        "fit_contiguous_prompt_plus_max_tokens": int(budget_tokens // mean_reserved),
        "samples": samples,
    }


# ---- W5 -----------------------------------------------------------------------------------------------------
def peak_blocks(llm: LLM, submit: Callable[[], None]) -> tuple[int, float, int]:
    """(peak used blocks, seconds, generated tokens) of running what ``submit`` added until done."""
    engine = llm.llm_engine
    base = used_blocks(llm)
    submit()
    peak, generated, start = 0, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += sum(len(c.token_ids) for c in out.outputs)
        peak = max(peak, used_blocks(llm) - base)
    return peak, time.perf_counter() - start, generated


def beam_search_api():
    """(BeamSearchParams, True) when this build has beam search, else (None, False)."""
    try:
        from raypaged.sampling_params import BeamSearchParams  # noqa: PLC0415
    except ImportError:
        try:
            from raypaged import BeamSearchParams  # noqa: PLC0415
        except ImportError:
            return None, False
    return BeamSearchParams, hasattr(LLM, "beam_search")


def bench_w5(llm: LLM, model_dir: Path, args: argparse.Namespace) -> dict:
    engine = llm.llm_engine
    block_size = engine.config.block_size
    prompts = build_prompts(model_dir, args.w5_prompts, args.seed + 5, length=(500, 500))
    tokens = args.w5_tokens
    sampled = SamplingParams(n=4, temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=args.seed)
    single = SamplingParams(n=1, temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=args.seed)

    def add_n4() -> None:
        for p in prompts:
            engine.add_request(None, sampled, prompt_token_ids=p)

    def add_copies() -> None:
        for p in prompts:
            for _ in range(4):
                engine.add_request(None, single, prompt_token_ids=p)

    shared, shared_s, shared_gen = peak_blocks(llm, add_n4)
    copies, copies_s, copies_gen = peak_blocks(llm, add_copies)
    prompt_blocks = math.ceil(500 / block_size)
    result = {
        "prompts": len(prompts),
        "prompt_tokens": 500,
        "generated_per_sample": tokens,
        "block_size": block_size,
        "prefix_caching": False,
        "n4": {"peak_blocks": shared, "seconds": shared_s, "generated_tokens": shared_gen},
        "four_copies": {"peak_blocks": copies, "seconds": copies_s, "generated_tokens": copies_gen},
        "ratio_n4_over_copies": shared / copies,
        # per prompt: one copy of the full prompt blocks, 4 private tails (the partial last prompt block is copied on
        # write by each sample, then the generated tokens)
        "expected_n4_per_prompt": (500 // block_size) + 4 * math.ceil((500 % block_size + tokens) / block_size),
        "expected_copies_per_prompt": 4 * math.ceil((500 + tokens) / block_size),
        "prompt_blocks_per_prompt": prompt_blocks,
    }
    params_cls, has_beam = beam_search_api()
    if params_cls is None or not has_beam:
        result["beam4"] = {"skipped": "this build has no BeamSearchParams / LLM.beam_search"}
    else:
        peak = [0]
        original = engine.step
        base = used_blocks(llm)

        def recording_step():
            outputs = original()
            peak[0] = max(peak[0], used_blocks(llm) - base)
            return outputs

        engine.step = recording_step
        start = time.perf_counter()
        try:
            llm.beam_search([{"prompt_token_ids": p} for p in prompts], params_cls(beam_width=4, max_tokens=tokens))
            result["beam4"] = {
                "peak_blocks": peak[0],
                "seconds": time.perf_counter() - start,
                "ratio_over_copies": peak[0] / copies,
            }
        except Exception as exc:  # an API of another shape than vLLM's: report, do not fail the benchmark
            result["beam4"] = {"skipped": f"beam_search failed: {type(exc).__name__}: {exc}"}
        finally:
            engine.step = original
    return result


# ---- W4 -----------------------------------------------------------------------------------------------------
def w4_prompts(model_dir: Path, args: argparse.Namespace) -> tuple[Prompts, list[int]]:
    """Requests (system prompt + user turn) and a warm-up request with another user turn."""
    from transformers import AutoTokenizer

    ordinary = ordinary_token_ids(AutoTokenizer.from_pretrained(model_dir))
    rng = np.random.default_rng(args.seed + 4)
    system = rng.choice(ordinary, size=1000).tolist()
    turns = [rng.choice(ordinary, size=int(n)).tolist() for n in rng.integers(20, 61, size=args.w4_requests + 1)]
    return [system + t for t in turns[1:]], system + turns[0]


def bench_w4(llm: LLM, prompts: Prompts, warmup: list[int], args: argparse.Namespace) -> dict:
    # warm-up (both settings alike): with prefix caching this leaves the system prompt cached, as on a live server
    llm.generate(
        [{"prompt_token_ids": warmup}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    before = llm.stats()
    params = SamplingParams(temperature=0, max_tokens=args.w4_tokens, ignore_eos=True)
    run = closed_loop(llm, prompts, params, args.w4_concurrency)
    after = llm.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    prompt_tokens = sum(map(len, prompts))
    return {
        "requests": run["requests"],
        "seconds": run["seconds"],
        "generated_tokens": run["generated_tokens"],
        "tokens_per_s": run["tokens_per_s"],
        "requests_per_s": run["requests"] / run["seconds"],
        "prompt_tokens": prompt_tokens,
        "ttft_p50_s": percentile(run["ttft_s"], 50),
        "ttft_p99_s": percentile(run["ttft_s"], 99),
        "ttft_mean_s": statistics.mean(run["ttft_s"]),
        "latency_p50_s": percentile(run["latency_s"], 50),
        "prefix_cache_queries": int(queries),
        "prefix_cache_hits": int(hits),
        "hit_rate": hits / queries if queries else 0.0,
    }


# ---- report -------------------------------------------------------------------------------------------------
def tables(report: dict) -> str:
    w3, w5, w4 = report["w3"], report["w5"], report["w4"]
    out = [
        f"W3 — KV memory efficiency, {w3['run']['requests']} W1 requests at concurrency "
        f"{report['workload']['w3_concurrency']} ({w3['steps_sampled']} steps sampled, "
        f"{w3['preemptions']} preemptions)",
        "",
        "| measure | value |",
        "| --- | ---: |",
        f"| live tokens / allocated block capacity, mean over steps | {w3['efficiency_mean']:.1%} |",
        f"| same, steps with {report['workload']['w3_concurrency']} requests running "
        f"({w3['steps_at_full_concurrency']} steps) | {w3['efficiency_at_full_concurrency_mean']:.1%} |",
        f"| same, worst step | {w3['efficiency_min']:.1%} |",
        f"| peak blocks used / budget | {w3['peak_used_blocks']} / {w3['kv_budget_blocks']} |",
        f"| KV budget ({report['workload']['kv_cache_gib']} GiB) | {w3['kv_budget_tokens']:,} tokens |",
        f"| sequences that fit, paged ({w3['mean_blocks_per_request']:.1f} blocks each on average) "
        f"| {w3['fit_paged']:,} |",
        f"| sequences that fit, contiguous at max_model_len {w3['max_model_len']} "
        f"| {w3['fit_contiguous_max_model_len']:,} |",
        f"| sequences that fit, contiguous at prompt + max_tokens | {w3['fit_contiguous_prompt_plus_max_tokens']:,} |",
        f"| W3 run throughput | {w3['run']['tokens_per_s']:.1f} tokens/s |",
        "",
    ]
    out += [
        f"W5 — parallel sampling, {w5['prompts']} prompts of 500 tokens, {w5['generated_per_sample']} tokens per "
        "sample, prefix caching off",
        "",
        "| system | peak KV blocks | expected | ratio to 4 copies | seconds |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| 4 independent requests per prompt | {w5['four_copies']['peak_blocks']} | "
        f"{w5['expected_copies_per_prompt'] * w5['prompts']} | 1.00 | {w5['four_copies']['seconds']:.1f} |",
        f"| n=4 (fork + copy-on-write) | {w5['n4']['peak_blocks']} | "
        f"{w5['expected_n4_per_prompt'] * w5['prompts']} "
        f"| {w5['ratio_n4_over_copies']:.2f} | {w5['n4']['seconds']:.1f} |",
    ]
    beam = w5["beam4"]
    out.append(
        f"| beam width 4 | {beam['peak_blocks']} | | {beam['ratio_over_copies']:.2f} | {beam['seconds']:.1f} |"
        if "peak_blocks" in beam
        else f"| beam width 4 | not measured: {beam['skipped']} | | | |"
    )
    out += [
        "",
        f"W4 — shared prefix, 1,000-token system prompt + 20–60 token turns, {w4['on']['requests']} requests, "
        f"concurrency {report['workload']['w4_concurrency']}, {report['workload']['w4_tokens']} tokens each",
        "",
        "| prefix caching | TTFT p50 / p99 (s) | generated tokens/s | requests/s | prefix cache hit rate |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key in ("off", "on"):
        r = w4[key]
        out.append(
            f"| {key} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {r['tokens_per_s']:.1f} | "
            f"{r['requests_per_s']:.2f} | {r['hit_rate']:.1%} |"
        )
    out.append(
        f"| on ÷ off | TTFT p50 ×{w4['on']['ttft_p50_s'] / w4['off']['ttft_p50_s']:.2f} | "
        f"×{w4['on']['tokens_per_s'] / w4['off']['tokens_per_s']:.2f} | | |"
    )
    return "\n".join(out)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    w3, w5, w4 = report["w3"], report["w5"], report["w4"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    ax = axes[0]
    eff = [s["efficiency"] for s in w3["samples"]]
    ax.plot(range(len(eff)), [e * 100 for e in eff], color="tab:green", label="live / allocated (%)")
    ax.set_ylim(0, 105)
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV efficiency (%)")
    ax2 = ax.twinx()
    ax2.plot(range(len(eff)), [s["running"] for s in w3["samples"]], color="tab:gray", lw=0.8, label="running")
    ax2.set_ylabel("running sequences")
    ax.set_title(
        f"W3: mean {w3['efficiency_mean']:.1%}; fit {w3['fit_paged']} paged vs "
        f"{w3['fit_contiguous_max_model_len']} contiguous",
        fontsize=9,
    )
    ax = axes[1]
    labels = ["4 copies", "n=4"] + (["beam 4"] if "peak_blocks" in w5["beam4"] else [])
    values = [w5["four_copies"]["peak_blocks"], w5["n4"]["peak_blocks"]] + (
        [w5["beam4"]["peak_blocks"]] if "peak_blocks" in w5["beam4"] else []
    )
    ax.bar(labels, values, color=["tab:gray", "tab:green", "tab:olive"][: len(values)])
    for i, v in enumerate(values):
        ax.annotate(str(v), (i, v), ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
    ax.set_ylabel("peak KV blocks")
    ax.set_title(f"W5: {w5['prompts']} × 500-token prompts, {w5['generated_per_sample']} tokens/sample", fontsize=9)
    ax = axes[2]
    xs = np.arange(2)
    ax.bar(xs - 0.2, [w4["off"]["ttft_p50_s"], w4["on"]["ttft_p50_s"]], 0.4, color="tab:blue", label="TTFT p50 (s)")
    ax.set_xticks(xs, ["prefix cache off", "prefix cache on"])
    ax.set_ylabel("TTFT p50 (s)")
    ax3 = ax.twinx()
    ax3.bar(xs + 0.2, [w4["off"]["tokens_per_s"], w4["on"]["tokens_per_s"]], 0.4, color="tab:orange", label="tokens/s")
    ax3.set_ylabel("generated tokens/s")
    ax.set_title("W4: 1,000-token shared system prompt", fontsize=9)
    fig.legend(loc="lower center", ncol=4, fontsize=8)
    info = report["machine"]
    fig.suptitle(f"KV sharing, fp32, {info['threads']} threads, {info['cpu']}", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    loads = {"before": load_average()}
    model_dir = default_model_dir()
    timings = {}

    llm = make_llm(args, prefix_caching=False)
    # warm-up
    llm.generate(
        [{"prompt_token_ids": p} for p in build_prompts(model_dir, 2, args.seed + 99)],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    t = time.perf_counter()
    w3 = bench_w3(llm, model_dir, args)
    timings["w3"] = time.perf_counter() - t
    print(f"W3 done in {timings['w3']:.0f} s: mean efficiency {w3['efficiency_mean']:.1%}", flush=True)
    t = time.perf_counter()
    w5 = bench_w5(llm, model_dir, args)
    timings["w5"] = time.perf_counter() - t
    print(f"W5 done in {timings['w5']:.0f} s: n=4 / copies = {w5['ratio_n4_over_copies']:.2f}", flush=True)
    prompts, warmup = w4_prompts(model_dir, args)
    t = time.perf_counter()
    w4 = {"off": bench_w4(llm, prompts, warmup, args)}
    del llm
    gc.collect()
    llm = make_llm(args, prefix_caching=True)
    w4["on"] = bench_w4(llm, prompts, warmup, args)
    timings["w4"] = time.perf_counter() - t
    print(f"W4 done in {timings['w4']:.0f} s", flush=True)
    del llm
    loads["after"] = load_average()
    report = {
        "workload": {
            "ids": ["W3", "W4", "W5"],
            "dtype": "float32",
            "seed": args.seed,
            "quick": args.quick,
            "model": str(model_dir),
            "kv_cache_gib": args.kv_cache_gib,
            "w3_requests": args.w3_requests,
            "w3_concurrency": args.w3_concurrency,
            "w3_prompt_len": PROMPT_LEN,
            "w3_max_tokens": MAX_TOKENS,
            "w3_prefix_caching": False,
            "w5_prompts": args.w5_prompts,
            "w5_tokens": args.w5_tokens,
            "w4_requests": args.w4_requests,
            "w4_concurrency": args.w4_concurrency,
            "w4_tokens": args.w4_tokens,
            "w4_system_prompt_tokens": 1000,
            "w4_turn_tokens": [20, 60],
        },
        "machine": machine_info(args.threads) | {"load_average": loads},
        "note": CONTENTION_NOTE,
        "seconds": timings,
        "w3": w3,
        "w5": w5,
        "w4": w4,
    }
    report["wall_seconds"] = time.perf_counter() - started
    write_json("sharing_bench", report)
    plot(report, RESULTS_DIR / "sharing_bench.png")
    info = report["machine"]
    print(
        f"\nKV sharing: {info['cpu']}, {info['nproc']} CPUs, {info['threads']} threads, torch {info['torch']}, fp32, "
        f"block size {w3['block_size']}\n"
    )
    print(tables(report) + "\n")
    print(
        f"load average (1/5/15 min) before {loads['before']}, after {loads['after']} on {info['nproc']} CPUs — "
        f"{CONTENTION_NOTE}"
    )
    print(f"wall time {report['wall_seconds']:.0f} s; wrote {RESULTS_DIR}/sharing_bench.json and .png")


if __name__ == "__main__":
    main()

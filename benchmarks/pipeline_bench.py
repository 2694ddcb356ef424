"""Pipeline parallelism's micro-batches on one machine: a long prompt's prefill, one shard against stages.

One prompt of ``--prompt-len`` tokens, computed in ``--chunk``-token steps and one generated token
(``LLM.generate``, SmolLM2-135M fp32): one shard with every core, then ``--pipeline-parallel-size`` stages of
one shard each (Ray actors, the cores split between them). While a chunk is in a later stage the first stage
computes the next one, so the stages work together on one prompt. Runs alternate (one shard, stages, one
shard...) so drift on a shared machine hits both alike; reported: seconds per prefill (median run), the
micro-batches sent while others were in flight, and whether the generated token was the same.

    python benchmarks/pipeline_bench.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import CONTENTION_NOTE, build_prompts, load_average, machine_info, write_json

from raypaged import LLM, SamplingParams
from raypaged.model.default_model import default_model_dir


def start(pp: int, args: argparse.Namespace) -> LLM:
    return LLM(
        str(default_model_dir()),
        dtype="float32",
        pipeline_parallel_size=pp,
        max_model_len=args.prompt_len + 16,
        max_num_batched_tokens=args.chunk,
        enable_prefix_caching=False,  # a repeat would find the prompt cached
        kv_cache_space=0.5 / pp,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256, help="--max-num-batched-tokens: the prefill's step size")
    parser.add_argument("--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="prefills of each configuration, alternating")
    parser.add_argument("--name", default="pipeline_bench", help="results file stem under benchmarks/results/")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    [prompt] = build_prompts(default_model_dir(), 1, seed=0, length=(args.prompt_len, args.prompt_len))
    params = SamplingParams(temperature=0, max_tokens=1)
    report: dict = {
        "machine": machine_info(threads),
        "load_average_start": load_average(),
        "note": CONTENTION_NOTE,
        "prompt_len": len(prompt),
        "chunk": args.chunk,
        "pipeline_parallel_size": args.pipeline_parallel_size,
    }
    systems = {1: start(1, args), args.pipeline_parallel_size: start(args.pipeline_parallel_size, args)}
    seconds: dict[int, list[float]] = {pp: [] for pp in systems}
    tokens: dict[int, list[int]] = {}
    pipelined: dict[int, int] = {}
    try:
        for llm in systems.values():  # warm up
            llm.generate([{"prompt_token_ids": prompt[:64]}], params, use_tqdm=False)
        for _ in range(args.repeats):
            for pp, llm in systems.items():
                core = llm.llm_engine.core
                before = core.num_pipelined_steps
                begin = time.perf_counter()
                [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                seconds[pp].append(time.perf_counter() - begin)
                tokens[pp] = list(out.outputs[0].token_ids)
                pipelined[pp] = core.num_pipelined_steps - before
    finally:
        for llm in systems.values():
            llm.shutdown()
    one, stages = 1, args.pipeline_parallel_size
    report["runs"] = {
        str(pp): {
            "seconds": seconds[pp],
            "median_s": statistics.median(seconds[pp]),
            "prefill_tokens_per_s": len(prompt) / statistics.median(seconds[pp]),
            "pipelined_steps": pipelined[pp],
        }
        for pp in systems
    }
    report["same_token"] = tokens[one] == tokens[stages]
    report["stages_over_one_shard"] = statistics.median(seconds[one]) / statistics.median(seconds[stages])
    report["load_average_end"] = load_average()
    print(f"prefill of {len(prompt)} tokens in {args.chunk}-token steps, {threads} threads:")
    for pp, run in report["runs"].items():
        print(
            f"  pp {pp}: {run['median_s']:.3f} s ({run['prefill_tokens_per_s']:.0f} tokens/s), "
            f"{run['pipelined_steps']} micro-batches sent beside others"
        )
    print(f"  stages / one shard: {report['stages_over_one_shard']:.2f}x; same token: {report['same_token']}")
    print(f"wrote {write_json(args.name, report)}")


if __name__ == "__main__":
    main()

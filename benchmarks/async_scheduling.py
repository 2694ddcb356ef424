"""Async scheduling off and on, in one run: decode throughput of the same requests (CPU or CUDA).

Each configuration runs the same greedy requests (``--num-seqs`` at once, ``--max-tokens``
each, all admitted in the first step) through ``LLM.generate``; runs alternate off, on, off,
on... so drift on a shared machine hits both alike. Reported: wall tokens/s and ms per step
(median run), the overlapped steps under async scheduling, and whether the tokens were
identical (they must be).

    python benchmarks/async_scheduling.py                   # synthetic tiny Llama (host cost dominates)
    python benchmarks/async_scheduling.py --model smollm2   # SmolLM2-135M (the forward dominates on CPU)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import CONTENTION_NOTE, build_prompts, load_average, machine_info, write_json
from engine_overhead import tiny_model

from raypaged import LLM, SamplingParams
from raypaged.model.default_model import default_model_dir


def one_run(model_dir: Path, async_scheduling: bool, prompts: list[list[int]], max_tokens: int, device: str) -> dict:
    llm = LLM(
        str(model_dir),
        async_scheduling=async_scheduling,
        max_num_seqs=len(prompts),
        device=device,
        max_model_len=1024,
        load_format="dummy" if "tiny" in model_dir.name else "auto",
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm up
        core = llm.llm_engine.core
        before = core.num_overlapped_steps
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return {
            "seconds": elapsed,
            "tokens_per_s": sum(map(len, tokens)) / elapsed,
            "ms_per_step": 1000 * elapsed / max_tokens,
            "overlapped_steps": core.num_overlapped_steps - before,
            "tokens": tokens,
        }
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration, alternating")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--name", default="async_scheduling", help="results file stem under benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report: dict = {
        "machine": machine_info(args.threads),
        "load_average_start": load_average(),
        "note": CONTENTION_NOTE,
        "model": args.model,
        "num_seqs": args.num_seqs,
        "max_tokens": args.max_tokens,
        "device": args.device,
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(Path(tmp)) if args.model == "tiny" else default_model_dir()
        prompts = build_prompts(model_dir, args.num_seqs, seed=0, length=(16, 64))
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeats):
            for mode in (False, True):
                run = one_run(model_dir, mode, prompts, args.max_tokens, args.device)
                runs[mode].append(run)
                print(
                    f"async_scheduling={mode!s:5}: {run['tokens_per_s']:8.1f} tokens/s, "
                    f"{run['ms_per_step']:.2f} ms/step, {run['overlapped_steps']} overlapped steps"
                )
    identical = all(run["tokens"] == runs[False][0]["tokens"] for mode in runs for run in runs[mode])
    summary = {}
    for mode, label in ((False, "off"), (True, "on")):
        summary[label] = {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs[mode]),
            "ms_per_step_median": statistics.median(r["ms_per_step"] for r in runs[mode]),
            "tokens_per_s_runs": [round(r["tokens_per_s"], 1) for r in runs[mode]],
            "overlapped_steps": [r["overlapped_steps"] for r in runs[mode]],
        }
    ratio = summary["on"]["tokens_per_s_median"] / summary["off"]["tokens_per_s_median"]
    print(
        f"on/off: {ratio:.3f}x (median tokens/s {summary['on']['tokens_per_s_median']:.1f} vs "
        f"{summary['off']['tokens_per_s_median']:.1f}); identical tokens: {identical}"
    )
    report.update(summary=summary, on_over_off=ratio, identical_tokens=identical, load_average_end=load_average())
    print(f"wrote {write_json(args.name, report)}")
    if not identical:
        raise SystemExit("async scheduling changed the tokens")


if __name__ == "__main__":
    main()

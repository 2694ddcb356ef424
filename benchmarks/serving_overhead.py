"""What the serving layer costs when the model costs almost nothing (CPU).

The synthetic 1-layer Llama of engine_overhead.py (dummy weights, SmolLM2's tokenizer)
generates the same prompts two ways:

- offline: ``LLM.generate`` on every prompt at once (after a small warm-up generate);
- served: ``raypaged serve`` as a subprocess, driven over HTTP by a closed-loop asyncio
  httpx client: each of C workers streams a /v1/completions request to ``[DONE]`` and
  sends the next, until the prompts are used up (after one warm-up request).

The two alternate (3 runs each, one engine and one server for all of them), so load that
comes and goes falls on both; medians are reported. Both use the same engine knobs
(``--max-num-seqs``, KV blocks for every sequence at ``--max-model-len``, prefix caching
off). Prompts are token ids drawn uniformly from the ordinary vocabulary, 50-200 tokens;
each asks for exactly 100 greedy tokens. tokens/s is generated tokens (the streams'
``usage.completion_tokens``) over wall time; served / offline is what the serving layer
keeps of the engine's throughput. No request is cut off.

    python benchmarks/serving_overhead.py --quick    # 64 prompts, concurrency 32 (under a minute)
    python benchmarks/serving_overhead.py            # 256 prompts, concurrency 64
    python benchmarks/serving_overhead.py --server-env PYTHONPATH=/tmp/other   # serve another checkout's raypaged
    python benchmarks/serving_overhead.py --server-arg=--stream-interval --server-arg=8   # more server flags

Writes benchmarks/results/serving_overhead.json (``--name``: another name); prints a summary line and a
Markdown table row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

import httpx
import psutil
import torch
from common import (
    CONTENTION_NOTE,
    MAX_TOKENS,
    PROMPT_LEN,
    Prompts,
    build_prompts,
    load_average,
    machine_info,
    percentile,
    write_json,
)
from engine_overhead import tiny_model
from serve_bench import Server, free_port

from raypaged.entrypoints.llm import LLM
from raypaged.sampling_params import SamplingParams

VENV_BIN = Path(sys.executable).parent
BLOCK_SIZE = 16
STARTUP_TIMEOUT_S = 300
NUM_WARMUP_PROMPTS = 4
TABLE_HEADER = (
    "| prompts | concurrency | --max-num-seqs | offline tok/s | served tok/s | served ÷ offline "
    "| TTFT p50 (s) | inter-chunk p50 (ms) | load avg start → end |\n"
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
)


@dataclass
class ServedResult:
    requests: int
    ok: int
    generated_tokens: int
    seconds: float
    errors: list[str]
    ttft_s: list[float] = field(repr=False)
    inter_chunk_s: list[float] = field(repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    def summary(self) -> dict:
        return {
            "tokens_per_s": self.tokens_per_s,
            "ttft_p50_s": percentile(self.ttft_s, 50),
            "ttft_p99_s": percentile(self.ttft_s, 99),
            "inter_chunk_p50_s": percentile(self.inter_chunk_s, 50),
            "inter_chunk_p99_s": percentile(self.inter_chunk_s, 99),
        }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 prompts at concurrency 32")
    parser.add_argument("--num-prompts", type=int, help="measured prompts (256; 64 quick)")
    parser.add_argument("--concurrency", type=int, help="closed-loop clients (64; 32 quick)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="engine batch size, offline and served")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="offline and served runs, alternated; medians reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, offline and in the server")
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set in the server's environment (repeatable)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument of the server's command line (repeatable: --server-arg=--stream-interval "
        "--server-arg=8)",
    )
    parser.add_argument("--name", default="serving_overhead", help="results file: benchmarks/results/NAME.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.num_prompts = args.num_prompts or (64 if args.quick else 256)
    args.concurrency = args.concurrency or (32 if args.quick else 64)
    if any("=" not in pair for pair in args.server_env):
        parser.error("--server-env takes NAME=VALUE")
    args.server_env = dict(pair.split("=", 1) for pair in args.server_env)
    return args


def num_kv_blocks(args: argparse.Namespace) -> int:
    """Blocks for every sequence of a full batch at the longest context: no preemption, offline or served."""
    return args.max_num_seqs * -(-args.max_model_len // BLOCK_SIZE) + 8


# ---- offline -------------------------------------------------------------------------------------------------
def make_llm(model_dir: Path, warmup: Prompts, args: argparse.Namespace) -> LLM:
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_gpu_blocks_override=num_kv_blocks(args),
        enable_prefix_caching=False,
    )
    llm.generate(
        [{"prompt_token_ids": ids} for ids in warmup],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    return llm


def run_offline(llm: LLM, prompts: Prompts) -> dict:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "requests": len(prompts),
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
    }


# ---- served --------------------------------------------------------------------------------------------------
def server_command(model_dir: Path, port: int, args: argparse.Namespace) -> list[str]:
    return [
        str(VENV_BIN / "raypaged"),
        "serve",
        "--model",
        str(model_dir),
        "--load-format",
        "dummy",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(args.max_model_len),
        "--num-gpu-blocks-override",
        str(num_kv_blocks(args)),
        "--no-enable-prefix-caching",
        "--disable-log-requests",
        "--port",
        str(port),
        "--grpc-port",
        str(free_port()),
        *args.server_arg,
    ]


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float | None, list[float], int]:
    """(TTFT, gaps between text chunks, usage.completion_tokens) of one streamed completion read to [DONE]."""
    start = time.perf_counter()
    arrivals: list[float] = []
    completion_tokens, done = None, False
    async with client.stream("POST", url, json=body, headers={"Content-Type": "application/json"}) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if any(c.get("text") for c in chunk.get("choices") or []):
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
    if not done or completion_tokens is None:
        raise RuntimeError(f"stream ended without {'[DONE]' if not done else 'usage'}")
    ttft = arrivals[0] - start if arrivals else None
    return ttft, [b - a for a, b in zip(arrivals, arrivals[1:])], completion_tokens


async def closed_loop(base: str, model: str, prompts: Prompts, concurrency: int, max_tokens: int) -> ServedResult:
    url = f"{base}/v1/completions"
    queue = list(reversed(prompts))
    result = ServedResult(len(prompts), 0, 0, 0.0, [], [], [])
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def worker() -> None:
            while queue:
                body = {
                    "model": model,
                    "prompt": queue.pop(),
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                try:
                    ttft, gaps, tokens = await stream_one(client, url, body)
                except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as exc:
                    result.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                result.ok += 1
                result.generated_tokens += tokens
                if ttft is not None:
                    result.ttft_s.append(ttft)
                result.inter_chunk_s.extend(gaps)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.seconds = time.perf_counter() - start
    return result


def start_server(model_dir: Path, warmup: Prompts, args: argparse.Namespace) -> tuple[Server, dict]:
    """The server, healthy and warmed up by one request, and what its start took."""
    port = free_port()
    command = server_command(model_dir, port, args)
    started = time.perf_counter()
    with mock.patch.dict(os.environ, args.server_env):
        server = Server(command, port, args.threads)
    try:
        server.wait_healthy(STARTUP_TIMEOUT_S)
        startup_s = time.perf_counter() - started
        warm = asyncio.run(closed_loop(server_url(server), str(model_dir), warmup[:1], 1, 8))
        if warm.errors:
            raise RuntimeError(f"warm-up failed: {warm.errors[0]}; log tail:\n{server.log_tail()}")
    except BaseException:
        server.stop()
        raise
    return server, {"command": command, "env": args.server_env, "startup_s": startup_s}


def server_url(server: Server) -> str:
    return f"http://127.0.0.1:{server.port}"


def without_samples(items: list[tuple[str, object]]) -> dict:
    """A ``ServedResult`` as a dict without its per-request and per-chunk times (their percentiles stand for them)."""
    return {k: v for k, v in items if k not in ("ttft_s", "inter_chunk_s")}


def server_cpu_seconds(server: Server) -> float:
    times = psutil.Process(server.proc.pid).cpu_times()
    return times.user + times.system


def run_served(server: Server, model_dir: Path, prompts: Prompts, args: argparse.Namespace) -> dict:
    result = asyncio.run(closed_loop(server_url(server), str(model_dir), prompts, args.concurrency, MAX_TOKENS))
    alive = server.proc.poll() is None
    return {
        "alive_at_end": alive,
        "log_tail": server.log_tail(30) if result.errors or not alive else "",
        **asdict(result, dict_factory=without_samples),
        **result.summary(),
    }


# ---- report --------------------------------------------------------------------------------------------------
def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s, with every run's tokens/s (in order) beside it."""
    middle = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    return middle | {"tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


def table_row(report: dict) -> str:
    w, off, srv = report["workload"], report["offline"], report["served"]
    return (
        f"| {w['num_prompts']} | {w['concurrency']} | {w['max_num_seqs']} | {off['tokens_per_s']:.0f} | "
        f"{srv['tokens_per_s']:.0f} | {report['served_over_offline']:.0%} | {srv['ttft_p50_s']:.2f} | "
        f"{srv['inter_chunk_p50_s'] * 1e3:.1f} | {report['load_average_start']} → {report['load_average_end']} |"
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    report: dict = {
        "machine": machine_info(args.threads),
        "load_average_start": load_average(),
        "note": CONTENTION_NOTE,
    }
    offline_runs, served_runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(Path(tmp))
        all_prompts = build_prompts(model_dir, NUM_WARMUP_PROMPTS + args.num_prompts, args.seed)
        warmup, prompts = all_prompts[:NUM_WARMUP_PROMPTS], all_prompts[NUM_WARMUP_PROMPTS:]
        llm = make_llm(model_dir, warmup, args)
        server, server_info = start_server(model_dir, warmup, args)
        try:
            for i in range(args.repeats):  # alternated, so load that comes and goes falls on both
                server_cpu_s = server_cpu_seconds(server)
                offline_runs.append(run_offline(llm, prompts))
                offline_runs[-1]["server_cpu_s"] = server_cpu_seconds(server) - server_cpu_s  # idle: about 0
                served_runs.append(run_served(server, model_dir, prompts, args))
                off, srv = offline_runs[-1], served_runs[-1]
                print(
                    f"run {i + 1}/{args.repeats}: offline {off['tokens_per_s']:.0f} tokens/s, served "
                    f"{srv['tokens_per_s']:.0f} ({srv['ok']}/{srv['requests']} ok) = "
                    f"{srv['tokens_per_s'] / off['tokens_per_s']:.0%}; load {load_average()}",
                    flush=True,
                )
        finally:
            server_info["peak_rss_mib"] = server.peak_rss / 2**20
            server.stop()
            llm.shutdown()
    report["load_average_end"] = load_average()
    offline, served = median_run(offline_runs), median_run(served_runs) | server_info
    errors = [e for r in served_runs for e in r["errors"]]
    report.update(
        workload={
            "model": "synthetic 1-layer Llama (engine_overhead.TINY_SHAPE), dummy weights, SmolLM2 tokenizer",
            "num_prompts": args.num_prompts,
            "prompt_len": PROMPT_LEN,
            "max_tokens": MAX_TOKENS,
            "greedy": True,
            "ignore_eos": True,
            "concurrency": args.concurrency,
            "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len,
            "num_gpu_blocks_override": num_kv_blocks(args),
            "enable_prefix_caching": False,
            "repeats": args.repeats,
            "quick": args.quick,
            "seed": args.seed,
            "server_args": args.server_arg,
            "client": "one asyncio httpx process, closed loop, streaming /v1/completions, on the same CPUs",
        },
        offline=offline,
        served=served,
        served_over_offline=served["tokens_per_s"] / offline["tokens_per_s"],
        served_over_offline_runs=[s["tokens_per_s"] / o["tokens_per_s"] for o, s in zip(offline_runs, served_runs)],
    )
    path = write_json(args.name, report)
    ratios = ", ".join(f"{r:.0%}" for r in report["served_over_offline_runs"])
    env = f" (server env {args.server_env})" if args.server_env else ""
    print(
        f"served {served['tokens_per_s']:.0f} tokens/s ({sum(r['ok'] for r in served_runs)}/"
        f"{sum(r['requests'] for r in served_runs)} ok{', errors: ' + str(errors[:2]) if errors else ''}) vs offline "
        f"{offline['tokens_per_s']:.0f} = {report['served_over_offline']:.0%} (medians of {args.repeats}; per run "
        f"{ratios}) at concurrency {args.concurrency}, --max-num-seqs {args.max_num_seqs}{env}; TTFT p50 "
        f"{served['ttft_p50_s']:.2f} s, inter-chunk p50 {served['inter_chunk_p50_s'] * 1e3:.1f} ms; load "
        f"{report['load_average_start']} → {report['load_average_end']} on {report['machine']['nproc']} CPUs; "
        f"wrote {path}"
    )
    print(TABLE_HEADER)
    print(table_row(report))


if __name__ == "__main__":
    main()

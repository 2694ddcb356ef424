"""Workload W1 of BENCHMARKS.md through HTTP: `raypaged serve` against `transformers serve
--continuous-batching` and llama.cpp's `llama-server`.

Each server runs as a subprocess (same thread count, offline) and is driven by one
closed-loop client: at concurrency C, C workers each send a request, wait for its last
byte, and send the next, until the level's requests (4 × C by default) are used up. Every
request of every system runs to completion: nothing is cut at a deadline. Two rates are
reported per level: over the whole level (all requests, the last wave's drain included),
and over the steady-state window while all C clients are busy (from the start until the
first client finds the queue empty), from each streamed chunk's arrival time (each
request's completion tokens spread over its chunks). Prompts are uniform 50-200 tokens of
ordinary vocabulary (seeded), the same for every system and different for every level (no
prefix-cache hits); each asks for exactly 100 greedy tokens. Requests stream (SSE) on
/v1/completions, so TTFT is measured; generated tokens are counted from `usage`.

    python benchmarks/serve_bench.py --quick
    python benchmarks/serve_bench.py --concurrency 10,30,50,80 --systems raypaged

raypaged and llama-server get the prompt as token ids (their /v1/completions accept
them); transformers serve accepts only text, so every prompt is text whose tokenization
gives back those exact ids (checked against `usage.prompt_tokens`). transformers is told
to ignore EOS by a per-request `generation_config` with `eos_token_id: -1`.

raypaged and transformers serve the default model's safetensors folder in fp32, which is
the shipped GGUF (Q4_1) dequantized; llama-server serves that GGUF itself, so all three
compute with the same weight values, llama.cpp from 4-bit storage with 8-bit activations.
`raypaged-w8a8` serves the same folder quantized by the reference quantizer (W8A8 int8,
SmoothQuant 0.6: raypaged's fast CPU path), written once under the cache directory; `raypaged-bf16` serves
the same folder with `--dtype bfloat16` (its linears' weights and the KV cache in bf16: README, "bf16 models on CPU");
`raypaged-gguf` serves the GGUF file llama-server serves, as a user would (`raypaged serve FILE.gguf`: converted once
into a folder whose dtype is bf16, README "GGUF files"), so it runs what `raypaged-bf16` runs.
llama-server is a benchmark-only peer: build it with `benchmarks/build_llama_server.sh`
(or pass `--llama-server PATH`); it gets one slot per client of the largest level
(`--parallel`), each slot the context a W1 request needs.

`raypaged-dp2` is `raypaged serve -dp 2`: two engine processes with half the threads each, behind one gateway.

Writes benchmarks/results/serve_bench.{json,png} (`--name` another stem) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil
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
    percentile,
    pyplot,
    write_json,
)

from raypaged import envs
from raypaged.model.default_model import default_model_dir, shipped_gguf

SYSTEMS = {
    "raypaged": "`raypaged serve`",
    "raypaged-w8a8": "`raypaged serve` W8A8 int8",
    "raypaged-bf16": "`raypaged serve --dtype bfloat16`",
    "raypaged-gguf": "`raypaged serve` of the shipped GGUF (Q4_1) file",
    "raypaged-dp2": "`raypaged serve -dp 2` (two engine processes, half the threads each)",
    "transformers": "`transformers serve --continuous-batching`",
    "llama.cpp": "`llama-server` (shipped GGUF, Q4_1)",
}
PEERS = ("transformers", "llama.cpp")
OURS = ("raypaged", "raypaged-w8a8", "raypaged-bf16", "raypaged-gguf", "raypaged-dp2")
LLAMA_SLOT_CONTEXT = 512  # tokens per llama-server slot: a 200-token prompt, 100 generated, and room
VENV_BIN = Path(sys.executable).parent
STARTUP_TIMEOUT_S = 300
TF_PAGE_SIZE = 256  # transformers' default page (block) size


@dataclass
class LevelResult:
    system: str
    concurrency: int
    requests: int
    ok: int
    errors: list[str]
    prompt_tokens: int
    generated_tokens: int
    seconds: float
    latency_s: list[float] = field(repr=False)
    ttft_s: list[float] = field(repr=False)
    peak_kv_usage: float | None = None  # raypaged's kv_cache_usage_perc, sampled from /metrics
    tokens_per_s_runs: list[float] = field(default_factory=list)  # every repeat; this one is their median
    steady_seconds: float = 0.0  # from the start until the first client found the queue empty
    steady_tokens: float = 0.0  # generated in that window (each request's tokens spread over its chunks)
    retries: int = 0  # requests sent again after a kept-alive connection turned out closed

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def steady_tokens_per_s(self) -> float:
        return self.steady_tokens / self.steady_seconds if self.steady_seconds else 0.0

    def summary(self) -> dict:
        return {
            "tokens_per_s": self.tokens_per_s,
            "steady_tokens_per_s": self.steady_tokens_per_s,
            "latency_p50_s": percentile(self.latency_s, 50),
            "latency_p99_s": percentile(self.latency_s, 99),
            "ttft_p50_s": percentile(self.ttft_s, 50),
            "ttft_p99_s": percentile(self.ttft_s, 99),
        }


@dataclass
class SystemRun:
    system: str
    label: str
    command: list[str]
    available: bool = True
    why_not: str | None = None  # exactly why the system could not be measured
    startup_s: float | None = None
    rss_after_load_mib: float | None = None
    peak_rss_mib: float | None = None  # of the server's process tree, sampled every 0.2 s
    levels: list[LevelResult] = field(default_factory=list)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="concurrency 10 and 30 only, one repeat (about 9 minutes with all four systems)",
    )
    parser.add_argument("--concurrency", help="comma-separated levels (10,30,50,80; 10,30 quick)")
    parser.add_argument(
        "--requests-per-client",
        type=float,
        default=4.0,
        help="requests per level = this x concurrency, at least 4 x concurrency (4)",
    )
    parser.add_argument("--repeats", type=int, help="timed runs per level (3; 1 quick); the median is reported")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads of each server")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {list(SYSTEMS)}")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="raypaged --kv-cache-space")
    parser.add_argument("--llama-server", help="llama-server binary (default: what build_llama_server.sh built)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="serve_bench", help="results file stem under benchmarks/results/")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in (args.concurrency or ("10,30" if args.quick else "10,30,50,80")).split(",")]
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.requests_per_client < 4:
        parser.error("--requests-per-client must be at least 4: fewer, and the first wave and the drain dominate")
    args.requests = [round(args.requests_per_client * c) for c in args.concurrency]
    check_args(parser, args, SYSTEMS)
    return args


# ---- prompts -------------------------------------------------------------------------------------------------
def stable_text_prompts(model_dir: Path, count: int, seed: int) -> tuple[Prompts, list[str]]:
    """W1 prompts as (token ids, text) where tokenizing the text gives back exactly the ids.

    Random ids rarely survive decode -> encode unchanged, so each prompt is taken to the
    fixed point of that round trip (lengths move by a few tokens at most).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids_list, texts = [], []
    for ids in build_prompts(model_dir, count, seed):
        for _ in range(8):
            text = tokenizer.decode(ids)
            again = tokenizer(text)["input_ids"]
            if again == ids:
                break
            ids = again
        else:
            raise RuntimeError("a prompt did not reach a decode/encode fixed point in 8 round trips")
        ids_list.append(ids)
        texts.append(text)
    return ids_list, texts


# ---- servers -------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_binary(args: argparse.Namespace) -> Path | None:
    if args.llama_server:
        return Path(args.llama_server)
    found = sorted((envs.cache_dir() / "llama.cpp").glob("*/build/bin/llama-server"))
    return found[-1] if found else None


def w8a8_model(model_dir: Path) -> Path:
    """The default model in W8A8 int8 (SmoothQuant 0.6), quantized once into the cache directory."""
    target = envs.cache_dir() / "models" / f"{model_dir.name}-w8a8-int8-sq0.6"
    if not (target / "config.json").exists():
        from raypaged.quantization.quantizer import quantize_checkpoint

        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        quantize_checkpoint(model_dir, staging, "w8a8-int8", 128, True, False, 0.6)
        staging.rename(target)
    return target


def server_command(system: str, model_dir: Path, port: int, args: argparse.Namespace) -> list[str]:
    if system in OURS:
        model = {"raypaged-w8a8": [str(w8a8_model(model_dir))], "raypaged-gguf": [str(shipped_gguf())]}.get(system, [])
        dtype = {"raypaged-bf16": "bfloat16", "raypaged-gguf": "auto"}.get(system, "float32")
        return [
            str(VENV_BIN / "raypaged"),
            "serve",
            *model,
            "--port",
            str(port),
            "--grpc-port",
            str(free_port()),
            "--dtype",
            dtype,
            "--kv-cache-space",
            str(args.kv_cache_gib),
            "--disable-log-requests",
            "--log-level",
            "warning",
            *(["-dp", "2"] if system == "raypaged-dp2" else []),
        ]
    if system == "llama.cpp":
        slots = max(args.concurrency)
        return [
            str(llama_server_binary(args)),
            "-m",
            str(shipped_gguf()),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--parallel",
            str(slots),
            "--ctx-size",
            str(slots * LLAMA_SLOT_CONTEXT),
            "--threads",
            str(args.threads),
            "--threads-batch",
            str(args.threads),
            "--cont-batching",
            "--no-webui",
            "--log-disable",
        ]
    exe = shutil.which("transformers", path=str(VENV_BIN)) or shutil.which("transformers") or "transformers"
    # Its CPU attention reads the whole paged cache every step (a dense [M, cache + M] mask), so a cache sized from
    # free memory (GiBs) makes every step crawl; size it for the workload: pages of TF_PAGE_SIZE tokens per request.
    pages = max(args.concurrency) * -(-(PROMPT_LEN[1] + 16 + MAX_TOKENS) // TF_PAGE_SIZE) + 4
    return [
        exe,
        "serve",
        str(model_dir),
        "--continuous-batching",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--log-level",
        "warning",
        "--cb-block-size",
        str(TF_PAGE_SIZE),
        "--cb-num-blocks",
        str(pages),
    ]


class Server:
    """A server subprocess in its own session, its log in a temp file, its tree's RSS sampled in a thread."""

    def __init__(self, command: list[str], port: int, threads: int) -> None:
        self.command, self.port = command, port
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve_bench_", suffix=".log", delete=False)
        env = os.environ | {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.peak_rss = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def tree_rss(self) -> int:
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            self.peak_rss = max(self.peak_rss, self.tree_rss())

    def log_tail(self, lines: int = 15) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"exited with status {self.proc.returncode} before /health answered 200; "
                    f"log tail:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"/health did not answer 200 within {timeout:.0f} s; log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server (then SIGKILL), and to any child it left behind, each by pid."""
        self._stop.set()
        children = []
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        self.log.close()
        os.unlink(self.log.name)


# ---- client --------------------------------------------------------------------------------------------------
def request_body(system: str, model: str, ids: list[int], text: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if system in (*OURS, "llama.cpp"):
        return body | {"prompt": ids, "ignore_eos": True, "stream_options": {"include_usage": True}}
    # transformers serve: text only; ignore_eos is not a field there, an eos id that never occurs is
    config = {"eos_token_id": -1, "do_sample": False, "max_new_tokens": max_tokens}
    return body | {"prompt": text, "generation_config": json.dumps(config)}


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict, chunk_times: list[float]
) -> tuple[float, float | None, dict | None]:
    """(latency, TTFT, usage) of one streamed completion; the arrival time of each chunk with text is
    appended to ``chunk_times``."""
    start = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if any(c.get("text") for c in chunk.get("choices") or []):
                chunk_times.append(time.perf_counter())
                if ttft is None:
                    ttft = chunk_times[-1] - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    return time.perf_counter() - start, ttft, usage


async def kv_usage_poller(client: httpx.AsyncClient, base: str, peak: list[float], stop: asyncio.Event) -> None:
    """raypaged's kv_cache_usage_perc from /metrics once a second; the peak goes in ``peak[0]``."""
    while not stop.is_set():
        try:
            text = (await client.get(f"{base}/metrics", timeout=5)).text
            for line in text.splitlines():
                if line.startswith("raypaged:kv_cache_usage_perc"):
                    peak[0] = max(peak[0], float(line.rsplit(" ", 1)[1]))
        except (httpx.HTTPError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def closed_loop(
    system: str, base: str, model: str, prompts: list[tuple[list[int], str]], concurrency: int, max_tokens: int
) -> LevelResult:
    """Every prompt through ``concurrency`` clients, each to completion."""
    url = f"{base}/v1/completions"
    queue = list(reversed(prompts))
    latencies, ttfts, errors = [], [], []
    retries = 0
    prompt_tokens = generated = 0
    streams: list[tuple[list[float], int]] = []  # each finished request's chunk times and completion tokens
    steady_end: list[float] = []  # when the first client found the queue empty
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:

        async def send(body: dict, chunk_times: list[float]) -> tuple[float, float | None, dict | None] | None:
            """One request's result, or None after recording its error. A request that finds a kept-alive
            connection already closed by the server never reached it: it goes again on a fresh connection
            (counted in ``retries``); once a response has begun, a broken stream is an error."""
            nonlocal retries
            for attempt in range(3):
                try:
                    return await one_request(client, url, body, chunk_times)
                except httpx.RemoteProtocolError as exc:
                    error = exc
                    if chunk_times or attempt == 2:
                        break
                    retries += 1
                except (httpx.HTTPError, RuntimeError) as exc:
                    error = exc
                    break
            errors.append(f"{type(error).__name__}: {error}"[:300])
            return None

        async def worker() -> None:
            nonlocal prompt_tokens, generated
            while queue:
                ids, text = queue.pop()
                chunk_times: list[float] = []
                result = await send(request_body(system, model, ids, text, max_tokens), chunk_times)
                if result is None:
                    continue
                latency, ttft, usage = result
                latencies.append(latency)
                if ttft is not None:
                    ttfts.append(ttft)
                if usage:
                    prompt_tokens += usage.get("prompt_tokens", 0)
                    generated += usage.get("completion_tokens", 0)
                    streams.append((chunk_times, usage.get("completion_tokens", 0)))
            if not steady_end:
                steady_end.append(time.perf_counter())

        stop, peak = asyncio.Event(), [0.0]
        poller = asyncio.create_task(kv_usage_poller(client, base, peak, stop)) if system in OURS else None
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
        stop.set()
        if poller:
            await poller
    expected_prompt_tokens = sum(len(ids) for ids, _ in prompts)
    if not errors and prompt_tokens != expected_prompt_tokens:
        errors.append(f"usage says {prompt_tokens} prompt tokens, the prompts have {expected_prompt_tokens}")
    window = steady_end[0] if steady_end else start + seconds
    steady = sum(tokens * sum(t <= window for t in times) / len(times) for times, tokens in streams if times)
    return LevelResult(
        system,
        concurrency,
        len(prompts),
        len(latencies),
        errors,
        prompt_tokens,
        generated,
        seconds,
        latencies,
        ttfts,
        peak[0] if poller else None,
        steady_seconds=window - start,
        steady_tokens=steady,
        retries=retries,
    )


def served_model(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]


def bench_system(
    system: str,
    model_dir: Path,
    warmup: list[tuple[list[int], str]],
    levels: list[list[list[tuple[list[int], str]]]],
    args: argparse.Namespace,
) -> SystemRun:
    """Start the server, warm it up, run every level ``repeats`` times (median by tokens/s kept), stop it."""
    port = free_port()
    command = server_command(system, model_dir, port, args)
    run = SystemRun(system, SYSTEMS[system], command)
    if system == "transformers" and importlib.util.find_spec("fastapi") is None:
        run.available, run.why_not = (
            False,
            ("transformers serve needs FastAPI and Uvicorn (pip install transformers[serving])"),
        )
        return run
    if system == "llama.cpp" and not Path(command[0]).is_file():
        run.available, run.why_not = (
            False,
            ("no llama-server binary: run benchmarks/build_llama_server.sh or pass --llama-server PATH"),
        )
        return run
    print(f"[{system}] starting: {' '.join(command)}", flush=True)
    started = time.perf_counter()
    try:
        # -dp 2: each engine process gets half the threads, as a rank takes its share of the node
        server = Server(command, port, max(1, args.threads // 2) if system == "raypaged-dp2" else args.threads)
    except OSError as exc:
        run.available, run.why_not = False, f"could not start {command[0]}: {exc}"
        return run
    base = f"http://127.0.0.1:{port}"
    try:
        server.wait_healthy(STARTUP_TIMEOUT_S)
        model = served_model(base)
        run.startup_s = time.perf_counter() - started
        run.rss_after_load_mib = server.tree_rss() / 2**20
        print(
            f"[{system}] healthy after {run.startup_s:.0f} s, model {model!r}, RSS {run.rss_after_load_mib:.0f} MiB",
            flush=True,
        )
        # warm-up: the first request of transformers also builds its continuous-batching manager
        result = asyncio.run(closed_loop(system, base, model, warmup, len(warmup), 8))
        if result.errors:
            raise RuntimeError(f"warm-up failed: {result.errors[0]}; log tail:\n{server.log_tail()}")
        for concurrency, repeats in zip(args.concurrency, levels):
            tries = []
            for prompts in repeats:
                result = asyncio.run(closed_loop(system, base, model, prompts, concurrency, MAX_TOKENS))
                s = result.summary()
                print(
                    f"[{system}] c={concurrency}: {result.ok}/{result.requests} ok, {result.generated_tokens} tokens "
                    f"in {result.seconds:.1f} s = {result.tokens_per_s:.1f} tokens/s (steady "
                    f"{result.steady_tokens_per_s:.1f} over {result.steady_seconds:.1f} s), p50 "
                    f"{s['latency_p50_s']:.1f} s, TTFT p50 {s['ttft_p50_s']:.2f} s"
                    + (f"; {result.retries} sent again on a fresh connection" if result.retries else "")
                    + (f"; errors: {result.errors[:2]}" if result.errors else ""),
                    flush=True,
                )
                tries.append(result)
            tries.sort(key=lambda r: r.tokens_per_s)
            median = tries[len(tries) // 2]
            median.tokens_per_s_runs = [r.tokens_per_s for r in tries]
            run.levels.append(median)
            if server.proc.poll() is not None:
                raise RuntimeError(f"server died during concurrency {concurrency}; log tail:\n{server.log_tail()}")
    except (RuntimeError, httpx.HTTPError) as exc:
        run.available = bool(run.levels)
        run.why_not = f"{system}: {exc}"
        print(f"[{system}] FAILED: {exc}", flush=True)
    finally:
        run.peak_rss_mib = server.peak_rss / 2**20
        server.stop()
    return run


# ---- report --------------------------------------------------------------------------------------------------
def ratios(runs: list[SystemRun], ours: str, peer: str, steady: bool = False) -> dict[int, float | None]:
    """``ours``'s tokens/s over ``peer``'s at each concurrency (whole level, or the steady window)."""
    by = {r.system: {lv.concurrency: lv for lv in r.levels} for r in runs}
    rate = (lambda lv: lv.steady_tokens_per_s) if steady else (lambda lv: lv.tokens_per_s)
    out = {}
    for c in sorted({lv.concurrency for r in runs for lv in r.levels}):
        mine, theirs = by.get(ours, {}).get(c), by.get(peer, {}).get(c)
        out[c] = rate(mine) / rate(theirs) if mine and theirs and rate(theirs) else None
    return out


def markdown_table(runs: list[SystemRun]) -> str:
    measured = [ours for ours in OURS if any(r.system == ours and r.levels for r in runs)]
    by_pair = {
        (ours, peer): (ratios(runs, ours, peer), ratios(runs, ours, peer, steady=True))
        for ours in measured
        for peer in PEERS
    }
    lines = [
        "| concurrency | system | requests ok | generated tokens | tokens/s, whole level | tokens/s, steady "
        "| latency p50 / p99 (s) | TTFT p50 / p99 (s) | server peak RSS (MiB) | "
        + " | ".join(f"{SYSTEMS[ours]} ÷ this (whole / steady)" for ours in measured)
        + " |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(measured),
    ]
    rows = sorted(
        ((lv, r) for r in runs for lv in r.levels), key=lambda x: (x[0].concurrency, list(SYSTEMS).index(x[1].system))
    )
    for lv, r in rows:
        s = lv.summary()
        cells = []
        for ours in measured:
            whole, steady = by_pair.get((ours, r.system), ({}, {}))
            cells.append(
                f"{whole[lv.concurrency]:.2f} / {steady[lv.concurrency]:.2f}"
                if whole.get(lv.concurrency) and steady.get(lv.concurrency)
                else ""
            )
        lines.append(
            f"| {lv.concurrency} | {r.label} | {lv.ok}/{lv.requests} | {lv.generated_tokens} | "
            f"{lv.tokens_per_s:.1f} | {lv.steady_tokens_per_s:.1f} | "
            f"{s['latency_p50_s']:.1f} / {s['latency_p99_s']:.1f} | "
            f"{s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f} | {r.peak_rss_mib:.0f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def plot(runs: list[SystemRun], info: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = {
        "raypaged": "tab:green",
        "raypaged-w8a8": "tab:olive",
        "raypaged-bf16": "tab:purple",
        "raypaged-gguf": "tab:pink",
        "raypaged-dp2": "tab:cyan",
        "transformers": "tab:gray",
        "llama.cpp": "tab:orange",
    }
    for r in runs:
        if not r.levels:
            continue
        cs = [lv.concurrency for lv in r.levels]
        ax.plot(cs, [lv.tokens_per_s for lv in r.levels], "o-", color=colors[r.system], label=r.system)
        ax2.plot(
            cs,
            [lv.summary()["latency_p50_s"] for lv in r.levels],
            "o-",
            color=colors[r.system],
            label=f"{r.system} p50",
        )
        ax2.plot(
            cs,
            [lv.summary()["latency_p99_s"] for lv in r.levels],
            "o--",
            color=colors[r.system],
            label=f"{r.system} p99",
        )
        for lv in r.levels:
            ax.annotate(
                f"{lv.tokens_per_s:.0f}",
                (lv.concurrency, lv.tokens_per_s),
                ha="center",
                va="bottom",
                xytext=(0, 3),
                textcoords="offset points",
            )
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("generated tokens/s")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax2.set_xlabel("concurrent clients")
    ax2.set_ylabel("request latency (s)")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=8)
    fig.suptitle(f"W1 over HTTP (streaming), fp32, {info['threads']} threads, {info['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_report(
    runs: list[SystemRun], model_dir: Path, args: argparse.Namespace, prompt_lens: list[int], loads: dict
) -> dict:
    systems = []
    for r in runs:
        entry = asdict(r)
        entry["levels"] = [asdict(lv) | lv.summary() for lv in r.levels]
        systems.append(entry)
    return {
        "workload": {
            "id": "W1",
            "transport": "HTTP /v1/completions, streaming (SSE)",
            "prompt_len": PROMPT_LEN,
            "prompt_len_after_round_trip": [min(prompt_lens), max(prompt_lens)],
            "max_tokens": MAX_TOKENS,
            "greedy": True,
            "dtype": "float32",
            "seed": args.seed,
            "concurrency": args.concurrency,
            "requests_per_level": args.requests,
            "repeats": args.repeats,
            "quick": args.quick,
            "every_request_completes": True,
            "model": str(model_dir),
            "client": "one asyncio httpx process, closed loop, on the same CPUs",
        },
        "machine": machine_info(args.threads) | {"load_average": loads},
        "note": CONTENTION_NOTE,
        "systems": systems,
        "ratios": {
            f"{ours}/{peer}": {
                "whole": {str(c): v for c, v in ratios(runs, ours, peer).items()},
                "steady": {str(c): v for c, v in ratios(runs, ours, peer, steady=True).items()},
            }
            for ours in OURS
            for peer in PEERS
        },
    }


def print_report(runs: list[SystemRun], report: dict) -> None:
    info, load = report["machine"], report["workload"]
    print(
        f"\nW1 over HTTP: {info['cpu']}, {info['nproc']} CPUs, {info['threads']} torch threads per server, "
        f"torch {info['torch']}, fp32, prompts {load['prompt_len_after_round_trip'][0]}–"
        f"{load['prompt_len_after_round_trip'][1]} tokens, {MAX_TOKENS} generated each, streaming, closed loop, "
        f"{load['repeats']} run(s) per level (median), {load['requests_per_level']} requests per level, every one "
        "to completion\n"
    )
    print(markdown_table(runs) + "\n")
    for r in runs:
        if not r.available or r.why_not:
            print(f"{r.label}: NOT MEASURED{' completely' if r.levels else ''} — {r.why_not}")
        else:
            kv = ", ".join(
                f"c={lv.concurrency}: {lv.peak_kv_usage:.1%}" for lv in r.levels if lv.peak_kv_usage is not None
            )
            print(
                f"{r.label}: started in {r.startup_s:.0f} s, RSS after load {r.rss_after_load_mib:.0f} MiB, "
                f"peak {r.peak_rss_mib:.0f} MiB" + (f"; peak KV cache usage {kv}" if kv else "")
            )
    print(
        f"load average (1/5/15 min) before {info['load_average']['before']}, after {info['load_average']['after']}"
        f" on {info['nproc']} CPUs — {CONTENTION_NOTE}"
    )
    print(f"wall time {report['wall_seconds']:.0f} s; wrote {RESULTS_DIR}/{report['name']}.json and .png")


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    loads = {"before": load_average()}
    model_dir = default_model_dir()
    total = 4 + sum(n * args.repeats for n in args.requests)
    ids, texts = stable_text_prompts(model_dir, total, args.seed)
    pairs = list(zip(ids, texts))
    warmup, rest = pairs[:4], pairs[4:]
    levels = []
    for n in args.requests:  # disjoint prompts per level and repeat: no prefix-cache hits between them
        levels.append([rest[i * n : (i + 1) * n] for i in range(args.repeats)])
        rest = rest[n * args.repeats :]
    runs = [bench_system(system, model_dir, warmup, levels, args) for system in args.systems]
    loads["after"] = load_average()
    report = build_report(runs, model_dir, args, [len(i) for i in ids], loads)
    report["wall_seconds"] = time.perf_counter() - started
    report["name"] = args.name
    write_json(args.name, report)
    plot(runs, report["machine"], RESULTS_DIR / f"{args.name}.png")
    print_report(runs, report)


if __name__ == "__main__":
    main()

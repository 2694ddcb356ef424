"""Multi-turn chat over ``raypaged serve -dp 2``: ``--data-parallel-routing least_loaded`` (vLLM's) against
``cache_aware``, in one run.

Each of ``--conversations`` clients holds one conversation: a long first user message (a document of ordinary
words, different for each), then ``--turns`` turns, each sending the whole conversation so far plus a short new
question, after a think time (``--think-s`` on average, the same draws for both routings), and waiting for the
answer (``--max-tokens`` greedy tokens) before the next. With the prefix cache on, a
turn that lands on the replica of the turns before it reads their KV blocks instead of computing them again.
Reported per routing: the whole run's seconds, the mean time to first token of the later turns, and the share of
the later turns' prompt tokens read from the prefix cache (``usage.prompt_tokens_details.cached_tokens``).

    python benchmarks/dp_routing_bench.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import numpy as np
import torch
from common import load_average, machine_info, write_json
from serve_bench import VENV_BIN, Server, free_port
from transformers import AutoTokenizer

from raypaged.model.default_model import default_model_dir

ROUTINGS = ("least_loaded", "cache_aware")


def documents(count: int, words: int, seed: int) -> list[str]:
    vocab = [w for w in AutoTokenizer.from_pretrained(default_model_dir()).get_vocab() if w.isalpha() and len(w) > 3]
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(vocab, words)) for _ in range(count)]


async def conversation(
    client: httpx.AsyncClient, document: str, turns: int, max_tokens: int, think_s: float, rng: np.random.Generator
) -> list[dict]:
    """One client's turns, each after a think time drawn uniformly from [0, 2 * think_s] (users reading: other
    clients' requests come in between); each later turn's (time to first token, prompt tokens, cached tokens)."""
    messages = [{"role": "user", "content": f"Read this: {document}\nWhat is it about?"}]
    measured = []
    for turn in range(turns):
        await asyncio.sleep(rng.uniform(0, 2 * think_s))
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        start, first, text, usage = time.perf_counter(), None, [], None
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = first or time.perf_counter() - start
                    text.append(chunk["choices"][0]["delta"]["content"])
                usage = chunk.get("usage") or usage
        assert usage is not None
        if turn:
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            measured.append({"ttft": first, "prompt": usage["prompt_tokens"], "cached": cached})
        messages += [{"role": "assistant", "content": "".join(text)}, {"role": "user", "content": f"And {turn}?"}]
    return measured


def bench(routing: str, docs: list[str], args: argparse.Namespace) -> dict:
    port = free_port()
    command = [str(VENV_BIN / "raypaged"), "serve", "--served-model-name", "m", "--port", str(port)]
    command += ["--grpc-port", "0", "-dp", "2", "--data-parallel-routing", routing, "--dtype", "float32"]
    command += ["--kv-cache-space", "1", "--enable-prompt-tokens-details", "--log-level", "warning"]
    server = Server(command, port, max(1, args.threads // 2))
    try:
        server.wait_healthy(300)

        async def run() -> list[dict]:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
                rng = np.random.default_rng(args.seed)  # the same think times for every routing
                await conversation(client, "warm up " * 50, 1, 4, 0.0, rng)
                results = await asyncio.gather(
                    *(conversation(client, d, args.turns, args.max_tokens, args.think_s, rng) for d in docs)
                )
            return [turn for turns in results for turn in turns]

        start = time.perf_counter()
        turns = asyncio.run(run())
        seconds = time.perf_counter() - start
    finally:
        server.stop()
    return {
        "routing": routing,
        "seconds": round(seconds, 2),
        "mean_ttft_later_turns_s": round(float(np.mean([t["ttft"] for t in turns])), 3),
        "cached_share_later_turns": round(sum(t["cached"] for t in turns) / sum(t["prompt"] for t in turns), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--words", type=int, default=300, help="words of each conversation's document")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--think-s", type=float, default=1.0, help="mean seconds a client waits before each turn")
    parser.add_argument("--quick", action="store_true", help="6 conversations of 3 turns")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns = 6, 3
    docs = documents(args.conversations, args.words, args.seed)
    results = [bench(routing, docs, args) for routing in ROUTINGS]
    print(
        f"raypaged serve -dp 2, SmolLM2-135M fp32, {args.conversations} conversations at once, {args.turns} turns, "
        f"documents of {args.words} words, {args.max_tokens} tokens an answer, think time {args.think_s:g} s on "
        f"average, {args.threads} threads in all"
    )
    print("| routing | seconds | mean TTFT of later turns (s) | later turns' prompt tokens from the cache |")
    print("| --- | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['routing']} | {r['seconds']} | {r['mean_ttft_later_turns_s']} | "
            f"{r['cached_share_later_turns']:.1%} |"
        )
    report = {
        "workload": {k: getattr(args, k) for k in ("conversations", "turns", "words", "max_tokens", "think_s", "seed")},
        "machine": machine_info(args.threads),
        "load_average": load_average(),
        "results": results,
    }
    print(f"wrote {write_json('dp_routing_bench', report)}")


if __name__ == "__main__":
    main()

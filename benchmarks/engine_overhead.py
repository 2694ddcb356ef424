"""W7: the engine's host cost per sequence-step, where the model costs almost nothing (CPU).

A synthetic Llama (1 layer, hidden 64, random weights, SmolLM2's byte-level BPE
tokenizer) runs greedy decode batches (sampled with ``--sampling article``) of
1/32/128/256/512 sequences through ``LLMEngine.step()``. Every phase of a step is timed: schedule, prepare inputs,
model (forward and logits), sample, update (scheduler bookkeeping), output
(detokenizing, stop strings, building outputs). Reported in microseconds per
sequence-step. A second measurement runs 32 sequences for 4,000 tokens and
compares the output phase over the first and the last 100 steps: a cost that
grows with the generation shows up there. Requests ask for ``DELTA`` outputs, as the
servers do.

    python benchmarks/engine_overhead.py            # batches 1..512, 4,000-token run
    python benchmarks/engine_overhead.py --quick    # batches 1, 32, 256; 1,000-token run
    python benchmarks/engine_overhead.py --quick --sampling article --name engine_overhead_sampled
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from common import CONTENTION_NOTE, SAMPLING, load_average, machine_info, pyplot, write_json

from raypaged.config import EngineConfig
from raypaged.engine.llm_engine import LLMEngine
from raypaged.model.default_model import default_model_dir
from raypaged.model.synthetic import write_synthetic_model
from raypaged.sampling_params import RequestOutputKind, SamplingParams
from raypaged.worker import model_runner as model_runner_module

PHASES = ("schedule", "prepare", "model", "sample", "update", "output")
TINY_SHAPE = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPT_LEN = 16


def tiny_model(root: Path) -> Path:
    path = write_synthetic_model(root / "tiny", **TINY_SHAPE)
    for name in TOKENIZER_FILES:
        if (default_model_dir() / name).exists():
            shutil.copy(default_model_dir() / name, path / name)
    return path


class PhaseTimer:
    """Wraps the engine's phase functions with wall-clock timers; ``model`` is what remains of the
    executor call after prepare and sample."""

    def __init__(self, engine: LLMEngine) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.active = False
        scheduler = engine.scheduler
        runner = engine.executor.worker.runner
        self._wrap(scheduler, "schedule", "schedule")
        self._wrap(scheduler, "update_from_output", "update")
        self._wrap(runner, "prepare_inputs", "prepare")
        self._wrap(engine.executor, "execute_model", "_execute")
        self._wrap(engine, "step", "_step")
        for name in ("sample", "greedy_fast_path"):
            self._wrap(model_runner_module, name, "sample")

    def _wrap(self, owner: object, name: str, phase: str) -> None:
        inner: Callable = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.active:
                    self.totals[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def split(self) -> dict[str, float]:
        t = self.totals
        return {
            "schedule": t["schedule"],
            "prepare": t["prepare"],
            "model": t["_execute"] - t["prepare"] - t["sample"],
            "sample": t["sample"],
            "update": t["update"],
            "output": t["_step"] - t["schedule"] - t["_execute"] - t["update"],
        }


def make_engine(model_dir: Path, num_seqs: int, max_model_len: int) -> LLMEngine:
    blocks_per_seq = -(-max_model_len // 16)
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            load_format="dummy",
            max_num_seqs=num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max(8192, num_seqs * PROMPT_LEN),
            num_gpu_blocks_override=num_seqs * blocks_per_seq + 8,
            enable_prefix_caching=False,
        )
    )


def add_requests(engine: LLMEngine, num_seqs: int, max_tokens: int, stop: list[str], sampling: str) -> None:
    generator = torch.Generator().manual_seed(0)
    for i in range(num_seqs):
        prompt = torch.randint(100, 40000, (PROMPT_LEN,), generator=generator).tolist()
        params = SamplingParams(
            **SAMPLING[sampling],
            max_tokens=max_tokens,
            ignore_eos=True,
            stop=stop,
            output_kind=RequestOutputKind.DELTA,
        )  # what the servers ask for
        engine.add_request(None, params, request_id=f"r{i}", prompt_token_ids=prompt)


def decode_batch(model_dir: Path, num_seqs: int, steps: int, stop: list[str], sampling: str) -> dict:
    engine = make_engine(model_dir, num_seqs, 256)
    add_requests(engine, num_seqs, steps + 12, stop, sampling)
    timer = PhaseTimer(engine)
    for _ in range(10):  # prefill and warm-up
        engine.step()
    timer.active = True
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    timer.active = False
    per_seq_step = {k: v / (steps * num_seqs) * 1e6 for k, v in timer.split().items()}
    host = sum(v for k, v in per_seq_step.items() if k != "model")
    return {
        "num_seqs": num_seqs,
        "steps": steps,
        "wall_ms_per_step": wall / steps * 1e3,
        "us_per_seq_step": per_seq_step,
        "host_us_per_seq_step": host,
    }


def long_generation(model_dir: Path, num_seqs: int, num_tokens: int, window: int, sampling: str) -> dict:
    engine = make_engine(model_dir, num_seqs, num_tokens + PROMPT_LEN + 8)
    add_requests(engine, num_seqs, num_tokens, [], sampling)
    timer = PhaseTimer(engine)
    engine.step()  # prefill
    per_step: list[float] = []
    while engine.has_unfinished_requests():
        before = timer.split()["output"] if timer.active else 0.0
        timer.active = True
        engine.step()
        per_step.append(timer.split()["output"] - before)
    first = statistics.mean(per_step[:window]) / num_seqs * 1e6
    last = statistics.mean(per_step[-window - 1 : -1]) / num_seqs * 1e6  # the final step flushes and ends all
    return {
        "num_seqs": num_seqs,
        "num_tokens": num_tokens,
        "window": window,
        "output_us_first": first,
        "output_us_last": last,
        "last_over_first": last / first,
    }


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [str(r["num_seqs"]) for r in rows]
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        if phase == "model":
            continue
        values = [r["us_per_seq_step"][phase] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("sequences in the decode batch")
    ax.set_ylabel("host µs per sequence-step")
    ax.set_title("raypaged engine host cost per sequence-step (model excluded), CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="measured decode steps per batch size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the model is tiny)")
    parser.add_argument(
        "--sampling", default="greedy", choices=list(SAMPLING), help="greedy, or article: temperature 0.8, top_p 0.95"
    )
    parser.add_argument("--name", default="engine_overhead", help="results file stem under benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = (1, 32, 256) if args.quick else (1, 32, 128, 256, 512)
    steps = args.steps or (30 if args.quick else 100)
    num_tokens = 1000 if args.quick else 4000
    report: dict = {
        "machine": machine_info(args.threads),
        "load_average_start": load_average(),
        "note": CONTENTION_NOTE,
        "phases": PHASES,
        "sampling": SAMPLING[args.sampling],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(Path(tmp))
        rows = []
        for num_seqs in batches:
            row = decode_batch(model_dir, num_seqs, steps, [], args.sampling)
            rows.append(row)
            split = " ".join(f"{k}={v:.1f}" for k, v in row["us_per_seq_step"].items())
            print(
                f"batch {num_seqs:4d}: host {row['host_us_per_seq_step']:6.1f} µs/seq-step ({split}); "
                f"{row['wall_ms_per_step']:.2f} ms/step"
            )
        stops = decode_batch(model_dir, 32, steps, ["never-matched stop", "another one"], args.sampling)
        print(f"batch 32 with two stop strings: output {stops['us_per_seq_step']['output']:.1f} µs/seq-step")
        long = long_generation(model_dir, 32, num_tokens, 100, args.sampling)
        print(
            f"{num_tokens}-token generation at 32: output {long['output_us_first']:.1f} µs/seq-step over the first "
            f"100 steps, {long['output_us_last']:.1f} over the last 100 ({long['last_over_first']:.2f}x)"
        )
    report.update(batches=rows, with_stop_strings=stops, long_generation=long, load_average_end=load_average())
    path = write_json(args.name, report)
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()

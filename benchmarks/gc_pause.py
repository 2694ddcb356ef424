"""Garbage-collector pauses in the engine's steps, with the start-up heap frozen and not (CPU).

The synthetic tiny Llama of ``engine_overhead.py`` decodes 256 sequences for 200 tokens (greedy,
``DELTA`` outputs) through ``LLMEngine.step()``. Every garbage collection is timed through
``gc.callbacks``, and every step's wall time recorded. The engine freezes its start-up heap
(``raypaged.heap``); the "thawed" runs start their engine with that call made a no-op, which is
the engine before the change. The two alternate, each in a fresh engine of the same process
(an engine thaws what it froze when it shuts down).

    python benchmarks/gc_pause.py [--runs 2] [--seqs 256] [--tokens 200]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from common import load_average, machine_info, write_json
from engine_overhead import add_requests, make_engine, tiny_model

from raypaged.engine import core


def one_run(model_dir: Path, frozen: bool, num_seqs: int, num_tokens: int) -> dict:
    with mock.patch.object(core, "freeze_startup_heap", core.freeze_startup_heap if frozen else lambda what: None):
        engine = make_engine(model_dir, num_seqs, num_tokens + 32)
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))

    add_requests(engine, num_seqs, num_tokens, [])
    engine.step()  # the prefill
    gc.callbacks.append(timed)
    steps = []
    try:
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
    finally:
        gc.callbacks.remove(timed)
        engine.shutdown()
    full = [seconds for generation, seconds in pauses if generation == 2]
    ordered = sorted(steps)
    return {
        "frozen": frozen,
        "steps": len(steps),
        "median_step_ms": statistics.median(steps) * 1e3,
        "p99_step_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3,
        "max_step_ms": ordered[-1] * 1e3,
        "collections": len(pauses),
        "full_collections": len(full),
        "longest_full_collection_ms": max(full, default=0.0) * 1e3,
        "all_collections_ms": sum(seconds for _, seconds in pauses) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="runs of each kind, alternating")
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = tiny_model(Path(tempfile.mkdtemp()))
    load_before = load_average()
    rows = [one_run(model_dir, frozen, args.seqs, args.tokens) for _ in range(args.runs) for frozen in (False, True)]
    print(
        "| heap | steps | median step ms | p99 step ms | longest step ms | collections (full) | longest full "
        "collection ms | all collections ms |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for row in rows:
        print(
            f"| {'frozen' if row['frozen'] else 'thawed'} | {row['steps']} | {row['median_step_ms']:.1f} | "
            f"{row['p99_step_ms']:.1f} | {row['max_step_ms']:.1f} | {row['collections']} ({row['full_collections']}) "
            f"| {row['longest_full_collection_ms']:.1f} | {row['all_collections_ms']:.1f} |"
        )
    path = write_json(
        "gc_pause",
        {
            "machine": machine_info(1),
            "load_average": [load_before, load_average()],
            "num_seqs": args.seqs,
            "num_tokens": args.tokens,
            "runs": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

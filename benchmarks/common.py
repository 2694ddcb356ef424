"""Helpers shared by the scripts under benchmarks/: prompts, machine info, results, plots.

The scripts run as ``python benchmarks/NAME.py``, so this module is imported as ``common``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

MAX_TOKENS = 100
PROMPT_LEN = (50, 200)
RESULTS_DIR = Path(__file__).parent / "results"
# --sampling: greedy, or the article's own example's sampling (section 5: temperature 0.8, top_p 0.95)
SAMPLING = {"greedy": {"temperature": 0.0}, "article": {"temperature": 0.8, "top_p": 0.95}}
CONTENTION_NOTE = (
    "taken on a shared machine while other work (tests) may run: numbers under contention are "
    "indicative only; compare systems within one run, not across runs"
)

Prompts = list[list[int]]


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """The vocabulary minus special and added tokens."""
    special = set(tokenizer.get_added_vocab().values()) | set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special])


def build_prompts(model_dir: Path, count: int, seed: int, length: tuple[int, int] = PROMPT_LEN) -> Prompts:
    """Token ids drawn uniformly from the vocabulary minus special/added tokens; lengths uniform in ``length``."""
    from transformers import AutoTokenizer

    ordinary = ordinary_token_ids(AutoTokenizer.from_pretrained(model_dir))
    rng = np.random.default_rng(seed)
    lengths = rng.integers(length[0], length[1] + 1, size=count)
    return [rng.choice(ordinary, size=int(n)).tolist() for n in lengths]


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, systems: dict | None = None) -> None:
    """Split ``args.systems`` (comma-separated) against ``systems``; the plot needs matplotlib."""
    if systems is not None:
        args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = set(args.systems) - set(systems)
        if unknown:
            parser.error(f"unknown systems {sorted(unknown)}; choose from {list(systems)}")
    if importlib.util.find_spec("matplotlib") is None:
        parser.error("the plot needs matplotlib: pip install -e '.[bench]'")


def peak_rss_mib() -> float:
    """This process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def count_parameters(model_dir: Path) -> int:
    """Unique parameters in the checkpoint (tied embeddings counted once, as the lm_head matmul)."""
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sum(int(np.prod(f.get_slice(name).get_shape())) for name in f.keys())


def machine_info(threads: int) -> dict[str, str | int]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    return {
        "cpu": model or platform.processor(),
        "nproc": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "threads": threads,
        "python": platform.python_version(),
    }


def load_average() -> list[float]:
    """1/5/15-minute load averages: above the core count, something else competed for the CPUs."""
    return [round(x, 2) for x in os.getloadavg()]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def write_json(name: str, report: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


class Log:
    """Prints lines and keeps them for the .log file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

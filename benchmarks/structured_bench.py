"""Structured outputs: what JSON-schema constraints cost a decode step (CPU, SmolLM2-135M).

Two engines on the default model run the same 32 greedy requests in lockstep, one step of each
in turn (which goes first alternates): in one, 16 of the requests are constrained by a JSON
schema of tests/structured/schemas.py; in the other, none is. Prompts and max_tokens are the
same in both. Unconstrained rows ignore EOS; the constrained rows use the schemas whose outputs
run past ``MAX_TOKENS`` (checked every round), so both batches hold 32 sequences at every
measured step; steps that are not a full 32-sequence decode in both engines are left out.

Reported: the mean decode step of both engines and the overhead ratio (the goal: at most
10%), with the constrained engine's host costs per step: filling the masks (``_fill_masks``, on
the mask thread while the forward runs, so off the step's path), the worker's wait for them after
the forward (``GrammarBitmask.ready``), advancing 16 matchers (``_advance_grammar``) and applying
the masks in the worker (``apply_token_bitmask``). Apart from the engines: ``apply_token_bitmask``
on [32, 49152] logits with 16 masked rows (a mask captured from the run) beside xgrammar's own
CPU applier, and compile times: the one-time TokenizerInfo build, each of the 20 schemas cold on
a fresh GrammarBackend, then cached.

    python benchmarks/structured_bench.py            # 12 rounds of 13 decode steps, about 75 s
    python benchmarks/structured_bench.py --quick    # 3 rounds, about 30 s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import CONTENTION_NOTE, RESULTS_DIR, Log, load_average, machine_info, pyplot, write_json

from raypaged.config import EngineConfig
from raypaged.core.outputs import GrammarBitmask
from raypaged.engine import llm_engine as llm_engine_module
from raypaged.engine.llm_engine import LLMEngine
from raypaged.model.default_model import default_model_dir
from raypaged.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from raypaged.structured.backend import GrammarBackend
from raypaged.structured.config import StructuredOutputsConfig
from raypaged.worker import model_runner as model_runner_module
from raypaged.worker.sampler import apply_token_bitmask

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.structured.schemas import SCHEMAS  # noqa: E402

NUM_SEQS = 32
MAX_TOKENS = 14
MAX_MODEL_LEN = 256
# the 16 schemas whose greedy SmolLM2 outputs take more than MAX_TOKENS tokens with PROMPT
CONSTRAINED = (
    "uuid",
    "objects_array",
    "ref",
    "nested",
    "const",
    "variants",
    "optional",
    "closed",
    "nullable",
    "date",
    "integer_range",
    "deep",
    "enum_array",
    "any_of",
    "person",
    "booleans",
)
PROMPT = "Answer in JSON: an example of {}."
FREE_PROMPT = "Write a few sentences about {}."
PUBLISHED = [
    {
        "source": "vLLM blog, Structured Decoding in vLLM: a gentle introduction (2025-01-14)",
        "url": "https://blog.vllm.ai/2025/01/14/struct-decode-intro.html",
        "finding": "XGrammar in vLLM V0: up to 5x lower TPOT under load than the outlines backend; "
        "a comparison between backends, not against unconstrained decoding",
    },
    {
        "source": "vLLM PR 24300, overlapping the grammar bitmask with the forward pass",
        "url": "https://github.com/vllm-project/vllm/pull/24300",
        "finding": "Qwen3-8B, benchmark_serving_structured_output.py, xgrammar_bench, 100 prompts: request throughput "
        "18.47 -> 24.29 req/s (+31.5%), mean TPOT -21%, once mask filling no longer blocks the step",
    },
]
PUBLISHED_NOTE = (
    "no vLLM documentation or blog found that states the step/TPOT overhead of structured outputs "
    "against the same unconstrained batch; the published figures found are relative ones"
)


class HostTimer:
    """Per-step wall time of the constrained engine's grammar work: mask filling (on the mask
    thread, beside the forward), the wait for the masks, matcher advancing (summed over the
    step's calls) and the worker's mask application."""

    PARTS = ("fill", "wait", "advance", "apply")
    ON_STEP = ("wait", "advance", "apply")  # the parts the step waits for

    def __init__(self, engine: LLMEngine) -> None:
        self.current = dict.fromkeys(self.PARTS, 0.0)
        self.captured: tuple[torch.Tensor, list[int]] | None = None  # a full step's bitmask and rows
        self._wrap(llm_engine_module, "_fill_masks", "fill")
        self._wrap(GrammarBitmask, "ready", "wait")
        self._wrap(engine, "_advance_grammar", "advance")
        self._wrap(model_runner_module, "apply_token_bitmask", "apply", capture=True)

    def _wrap(self, owner: object, name: str, part: str, capture: bool = False) -> None:
        inner: Callable = getattr(owner, name)

        def timed(*args, **kwargs):
            if capture and len(args[2]) == len(CONSTRAINED):
                self.captured = (args[1].clone(), list(args[2]))
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - start

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        taken, self.current = self.current, dict.fromkeys(self.PARTS, 0.0)
        return taken


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    tokenizer = engine.tokenizer
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def make_engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(default_model_dir()),
            dtype="float32",
            max_num_seqs=NUM_SEQS,
            max_model_len=MAX_MODEL_LEN,
            num_gpu_blocks_override=NUM_SEQS * -(-MAX_MODEL_LEN // 16) + 8,
        )
    )


def add_requests(engine: LLMEngine, round_index: int, constrained: bool) -> list[str]:
    """32 requests: rows 0, 2, 4 ... ask for JSON (constrained when ``constrained``), the others
    for free text; the ids of the constrained ones are returned."""
    names = list(CONSTRAINED)
    constrained_ids = []
    for i in range(NUM_SEQS):
        name = names[i // 2]
        request_id = f"r{round_index}-{i}"
        if i % 2 == 0 and constrained:
            params = SamplingParams(
                temperature=0,
                max_tokens=MAX_TOKENS,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]),
            )
            constrained_ids.append(request_id)
        else:
            params = SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )
        text = (PROMPT if i % 2 == 0 else FREE_PROMPT).format(name.replace("_", " "))
        engine.add_request(None, params, request_id=request_id, prompt_token_ids=chat_ids(engine, text))
    return constrained_ids


def full_decode(engine: LLMEngine) -> Callable[[], bool]:
    """Wraps ``engine.scheduler.schedule``; the returned function says whether the last step was a
    decode of all 32 sequences."""
    scheduler = engine.scheduler
    inner = scheduler.schedule
    last = {"full": False}

    def schedule():
        so = inner()
        counts = so.num_scheduled_tokens.values()
        last["full"] = len(so.num_scheduled_tokens) == NUM_SEQS and all(n == 1 for n in counts)
        return so

    scheduler.schedule = schedule
    return lambda: last["full"]


def timed_step(engine: LLMEngine, finish_reasons: dict[str, str]) -> float:
    start = time.perf_counter()
    outputs = engine.step()
    elapsed = time.perf_counter() - start
    for output in outputs:
        if output.finished:
            finish_reasons[output.request_id] = output.outputs[0].finish_reason or ""
    return elapsed


def lockstep(plain: LLMEngine, constrained: LLMEngine, num_rounds: int, log: Log) -> tuple[dict, HostTimer]:
    plain_full, constrained_full = full_decode(plain), full_decode(constrained)
    timer = HostTimer(constrained)
    pairs: list[tuple[float, float, dict[str, float]]] = []
    rounds = []
    num_left_out = num_early = 0
    for round_index in range(num_rounds + 1):  # round 0: warm-up (first forward passes, grammar compiles)
        add_requests(plain, round_index, constrained=False)
        constrained_ids = add_requests(constrained, round_index, constrained=True)
        reasons: dict[str, str] = {}
        round_pairs = []
        step = 0
        while plain.has_unfinished_requests() or constrained.has_unfinished_requests():
            order = (plain, constrained) if step % 2 == 0 else (constrained, plain)
            times = {
                id(engine): timed_step(engine, reasons) if engine.has_unfinished_requests() else 0.0 for engine in order
            }
            host = timer.take()
            if plain_full() and constrained_full():
                round_pairs.append((times[id(plain)], times[id(constrained)], host))
            elif step > 0:
                num_left_out += round_index > 0
            step += 1
        early = [rid for rid in constrained_ids if reasons.get(rid) != "length"]
        if round_index == 0:
            log(
                f"warm-up round: {len(round_pairs)} full decode steps; constrained rows that ended before "
                f"max_tokens: {len(early)}"
            )
            continue
        num_early += len(early)
        pairs += round_pairs
        plain_ms = statistics.mean(p for p, _, _ in round_pairs) * 1e3
        constrained_ms = statistics.mean(c for _, c, _ in round_pairs) * 1e3
        rounds.append(
            {
                "steps": len(round_pairs),
                "plain_ms": plain_ms,
                "constrained_ms": constrained_ms,
                "ratio": constrained_ms / plain_ms,
                "constrained_ended_early": len(early),
            }
        )
        log(
            f"round {round_index:2d}: {len(round_pairs)} steps, plain {plain_ms:6.1f} ms, constrained "
            f"{constrained_ms:6.1f} ms ({constrained_ms / plain_ms - 1:+.1%})"
        )
    plain_mean = statistics.mean(p for p, _, _ in pairs) * 1e3
    constrained_mean = statistics.mean(c for _, c, _ in pairs) * 1e3
    host = {part: statistics.mean(h[part] for _, _, h in pairs) * 1e3 for part in HostTimer.PARTS}
    host_total = sum(host[part] for part in HostTimer.ON_STEP)
    step_ratios = [c / p for p, c, _ in pairs]
    round_ratios = [r["ratio"] for r in rounds]
    result = {
        "num_seqs": NUM_SEQS,
        "num_constrained": len(CONSTRAINED),
        "max_tokens": MAX_TOKENS,
        "schemas": list(CONSTRAINED),
        "measured_steps": len(pairs),
        "steps_left_out": num_left_out,
        "constrained_ended_early": num_early,
        "plain_step_ms": plain_mean,
        "constrained_step_ms": constrained_mean,
        "plain_ms_per_token": plain_mean / NUM_SEQS,
        "constrained_ms_per_token": constrained_mean / NUM_SEQS,
        "overhead": constrained_mean / plain_mean - 1,
        "overhead_median_of_step_ratios": statistics.median(step_ratios) - 1,
        "overhead_round_min_max": [min(round_ratios) - 1, max(round_ratios) - 1],
        "host_ms_per_step": host,
        "host_total_ms_per_step": host_total,
        "host_share_of_plain_step": host_total / plain_mean,
        "fill_us_per_constrained_row": host["fill"] / len(CONSTRAINED) * 1e3,
        "advance_us_per_constrained_row": host["advance"] / len(CONSTRAINED) * 1e3,
        "rounds": rounds,
    }
    return result, timer


def time_appliers(bitmask: torch.Tensor, rows: list[int], vocab: int, repeats: int) -> dict:
    """raypaged's ``apply_token_bitmask`` and xgrammar's CPU applier (which takes one mask row per
    logits row, so unconstrained rows get an all-allowed mask) on the same [32, 49152] logits,
    alternated; median microseconds of each, and a check that both mask the same entries."""
    import xgrammar as xgr

    logits = torch.randn(NUM_SEQS, vocab, generator=torch.Generator().manual_seed(0))
    full_mask = torch.full((NUM_SEQS, bitmask.shape[1]), -1, dtype=torch.int32)
    full_mask[rows] = bitmask
    ours, theirs = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask, rows)
    xgr.apply_token_bitmask_inplace(theirs, full_mask, indices=rows)
    appliers = {
        "raypaged": lambda x: apply_token_bitmask(x, bitmask, rows),
        "xgrammar_cpu": lambda x: xgr.apply_token_bitmask_inplace(x, full_mask, indices=rows),
    }
    samples: dict[str, list[float]] = {name: [] for name in appliers}
    for _ in range(repeats):
        for name, apply in appliers.items():
            x = logits.clone()
            start = time.perf_counter()
            apply(x)
            samples[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) * 1e6 for name, values in samples.items()}
    allowed = int(sum(bin(v & 0xFFFFFFFF).count("1") for v in bitmask.flatten().tolist()))
    return {
        "logits_shape": [NUM_SEQS, vocab],
        "masked_rows": len(rows),
        "repeats": repeats,
        "allowed_tokens_per_masked_row": allowed / len(rows),
        "us": medians,
        "raypaged_over_xgrammar": medians["raypaged"] / medians["xgrammar_cpu"],
        "same_result": bool(torch.equal(ours, theirs)),
    }


def time_compiles(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> dict:
    """TokenizerInfo and GrammarCompiler built once, then each schema's first (cold) and second
    (cached) compile on a fresh backend."""
    backend = GrammarBackend(tokenizer, vocab_size, stop_token_ids, StructuredOutputsConfig())
    start = time.perf_counter()
    backend._xgr_compiler()  # the build that the first compile of a backend pays
    tokenizer_info_and_compiler_ms = (time.perf_counter() - start) * 1e3
    per_schema = {}
    for name, schema in SCHEMAS.items():
        params = StructuredOutputsParams(json=schema)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            backend.compile(params)
            times.append((time.perf_counter() - start) * 1e3)
        per_schema[name] = {"cold_ms": times[0], "cached_ms": times[1]}
    cold = [t["cold_ms"] for t in per_schema.values()]
    cached = [t["cached_ms"] for t in per_schema.values()]
    return {
        "tokenizer_info_and_compiler_ms": tokenizer_info_and_compiler_ms,
        "num_schemas": len(per_schema),
        "cold_ms": {
            "median": statistics.median(cold),
            "mean": statistics.mean(cold),
            "max": max(cold),
            "total": sum(cold),
        },
        "cached_us": {"median": statistics.median(cached) * 1e3, "max": max(cached) * 1e3},
        "per_schema": per_schema,
    }


def plot(steps: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    host = steps["host_ms_per_step"]
    rest = steps["constrained_step_ms"] - steps["host_total_ms_per_step"]
    ax.bar(["no constraints"], [steps["plain_step_ms"]], label="step")
    ax.bar(["16 of 32 constrained"], [rest], color="C0")
    bottom = rest
    for i, (part, value) in enumerate((part, host[part]) for part in HostTimer.ON_STEP):
        ax.bar(["16 of 32 constrained"], [value], bottom=bottom, color=f"C{i + 1}", label=f"grammar: {part}")
        bottom += value
    ax.set_ylabel("mean decode step, ms")
    ax.set_title(f"SmolLM2-135M, batch 32, CPU: JSON-schema constraints {steps['overhead']:+.1%}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds of 32 requests (12; 3 with --quick)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: a second core is often busy here, and two threads then stall)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    num_rounds = args.rounds or (3 if args.quick else 12)
    log = Log()
    report: dict = {
        "machine": machine_info(args.threads),
        "load_average_start": load_average(),
        "note": CONTENTION_NOTE,
        "model": default_model_dir().name,
        "quick": args.quick,
    }
    log(
        f"{report['model']} fp32, torch threads {args.threads}, batch {NUM_SEQS} ({len(CONSTRAINED)} constrained), "
        f"max_tokens {MAX_TOKENS}, {num_rounds} rounds; load {report['load_average_start']}"
    )
    start = time.perf_counter()
    plain, constrained = make_engine(), make_engine()
    vocab = plain.config.hf_config.vocab_size
    steps, timer = lockstep(plain, constrained, num_rounds, log)
    host = steps["host_ms_per_step"]
    log(
        f"decode step: plain {steps['plain_step_ms']:.1f} ms, constrained {steps['constrained_step_ms']:.1f} ms: "
        f"overhead {steps['overhead']:+.1%} (median of per-step ratios {steps['overhead_median_of_step_ratios']:+.1%}, "
        f"rounds {steps['overhead_round_min_max'][0]:+.1%} .. {steps['overhead_round_min_max'][1]:+.1%}; "
        f"{steps['measured_steps']} steps, goal <= +10%)"
    )
    log(
        f"grammar host work per step: fill {host['fill']:.2f} ms ({steps['fill_us_per_constrained_row']:.0f} µs/row) "
        f"on the mask thread during the forward, then on the step's path: wait {host['wait']:.2f} ms, "
        f"advance {host['advance']:.2f} ms ({steps['advance_us_per_constrained_row']:.0f} µs/row), apply "
        f"{host['apply']:.2f} ms: {steps['host_total_ms_per_step']:.2f} ms = {steps['host_share_of_plain_step']:.1%} "
        f"of the plain step"
    )
    if steps["constrained_ended_early"]:
        log(f"warning: {steps['constrained_ended_early']} constrained rows ended before max_tokens")
    if timer.captured is None:
        raise SystemExit("no full step's bitmask was captured")
    appliers = time_appliers(*timer.captured, vocab=vocab, repeats=50 if args.quick else 200)
    log(
        f"apply_token_bitmask [{NUM_SEQS}, {vocab}], {len(CONSTRAINED)} masked rows: "
        f"{appliers['us']['raypaged']:.0f} µs; xgrammar's CPU "
        f"applier {appliers['us']['xgrammar_cpu']:.0f} µs ({appliers['raypaged_over_xgrammar']:.1f}x); "
        f"same result: {appliers['same_result']}"
    )
    compiles = time_compiles(plain.tokenizer, vocab, list(plain.eos_token_ids))  # the engine's own arguments
    plain.shutdown()
    constrained.shutdown()
    log(
        f"compile: TokenizerInfo + compiler {compiles['tokenizer_info_and_compiler_ms']:.0f} ms once; "
        f"{compiles['num_schemas']} schemas cold median {compiles['cold_ms']['median']:.1f} ms "
        f"(max {compiles['cold_ms']['max']:.1f}, total {compiles['cold_ms']['total']:.0f}); "
        f"cached median {compiles['cached_us']['median']:.1f} µs"
    )
    log(f"vLLM, published: {PUBLISHED_NOTE}")
    for item in PUBLISHED:
        log(f"  {item['source']} ({item['url']}): {item['finding']}")
    report.update(
        steps=steps,
        apply_token_bitmask=appliers,
        compile=compiles,
        vllm_published={"note": PUBLISHED_NOTE, "sources": PUBLISHED},
        wall_s=time.perf_counter() - start,
        load_average_end=load_average(),
    )
    log(f"wall {report['wall_s']:.0f} s; load at the end {report['load_average_end']}")
    path = write_json("structured_bench", report)
    (RESULTS_DIR / "structured_bench.log").write_text("\n".join(log.lines) + "\n")
    plot(steps, path.with_suffix(".png"))
    print(f"wrote {path}, {path.with_suffix('.log')} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()

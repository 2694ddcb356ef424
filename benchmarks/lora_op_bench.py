"""The batched LoRA product against the base linear, SmolLM2's projections at rank 16.

For T tokens spread over 1, 4 or 16 adapters (one slot each), times ``add_lora`` as it
dispatches, each of its multi-slot paths forced (padded batch, per-slot loop) and the
gather+bmm reference, beside raypaged's base ``linear`` of the same projection. Also a
skewed step (one prefill holding 60% or 90% of the tokens on one adapter, the rest spread over the others). Each time is
the fastest of ``--repeats`` calls, the variants taking turns, in the best of ``--passes``
sweeps (robust to other work on a shared machine).

    python benchmarks/lora_op_bench.py          # writes benchmarks/results/lora_op.{json,md}
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from common import CONTENTION_NOTE, RESULTS_DIR, load_average, machine_info, write_json

from raypaged.lora import ops
from raypaged.lora.ops import add_lora, add_lora_reference, build_lora_mapping
from raypaged.model.layers import linear

RANK = 16
# SmolLM2-135M: name -> (in, out, projections fused in it)
SHAPES = {
    "qkv_proj": (576, 960, 3),
    "o_proj": (576, 576, 1),
    "gate_up_proj": (576, 3072, 2),
    "down_proj": (1536, 576, 1),
}
NUM_TOKENS = (1, 16, 64, 256)
NUM_ADAPTERS = (1, 4, 16)


def timed_us(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each function's fastest call in microseconds, the functions taking turns (so contention hits all alike)."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(3):
        for fn in fns.values():
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {f"{name}_us": seconds * 1e6 for name, seconds in best.items()}


def forced(token_slots: list[int | None], padded: bool) -> ops.LoRAMapping:
    """The mapping with its multi-slot path chosen: the padded batch or the per-slot loop."""
    saved = ops.PADDED_ROW_COST
    ops.PADDED_ROW_COST = 0.0 if padded else float("inf")
    try:
        return build_lora_mapping(token_slots)
    finally:
        ops.PADDED_ROW_COST = saved


def measure(
    in_f: int, out_f: int, num_fused: int, token_slots: list[int | None], num_slots: int, repeats: int
) -> dict[str, float | str]:
    g = torch.Generator().manual_seed(0)
    rank = num_fused * RANK
    lora_a = torch.randn(num_slots, in_f, rank, generator=g) * 0.01
    lora_b = torch.randn(num_slots, rank, out_f, generator=g) * 0.01
    weight = torch.randn(out_f, in_f, generator=g) * 0.01
    x = torch.randn(len(token_slots), in_f, generator=g)
    y = torch.zeros(len(token_slots), out_f)
    mapping = build_lora_mapping(token_slots)
    fns: dict[str, Callable[[], object]] = {
        "base": lambda: linear(x, weight),
        "lora": lambda: add_lora(y, x, lora_a, lora_b, mapping),
        "reference": lambda: add_lora_reference(y, x, lora_a, lora_b, token_slots),
    }
    if len(mapping.slot_ids) > 1:
        padded, loop = forced(token_slots, True), forced(token_slots, False)
        fns["padded"] = lambda: add_lora(y, x, lora_a, lora_b, padded)
        fns["loop"] = lambda: add_lora(y, x, lora_a, lora_b, loop)
    row: dict[str, float | str] = dict(timed_us(fns, repeats))
    row["path"] = "one slot" if mapping.one_slot_for_all else "padded" if mapping.padded is not None else "loop"
    row["padding"] = _padding(mapping)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="calls of each variant per pass")
    parser.add_argument("--passes", type=int, default=3, help="sweeps over every case; each time is the best pass's")
    args = parser.parse_args()
    cases = list(spreads())
    best: dict[tuple[int, int, str, str], dict[str, float | str]] = {}
    with torch.inference_mode():
        for _ in range(args.passes):
            for num_adapters, num_tokens, spread, token_slots in cases:
                mapping_us = timed_us({"build": partial(build_lora_mapping, token_slots)}, 100)["build_us"]
                for name, (in_f, out_f, num_fused) in SHAPES.items():
                    row = {
                        "mapping_us": mapping_us,
                        **measure(in_f, out_f, num_fused, token_slots, num_adapters, args.repeats),
                    }
                    key = (num_adapters, num_tokens, spread, name)
                    kept = best.setdefault(key, row)
                    for field, value in row.items():
                        if isinstance(value, float):
                            kept[field] = min(float(kept[field]), value)
                    print(key, kept, flush=True)
    rows = [{"adapters": k[0], "tokens": k[1], "spread": k[2], "linear": k[3], **v} for k, v in best.items()]
    report = {
        "machine": machine_info(torch.get_num_threads()),
        "load_average": load_average(),
        "rank": RANK,
        "passes": args.passes,
        "repeats": args.repeats,
        "rows": rows,
        "model_rows": model_rows(max(5, args.repeats // 3), args.passes),
    }
    write_json("lora_op", report)
    (RESULTS_DIR / "lora_op.md").write_text(markdown(report))


def model_rows(repeats: int, passes: int) -> list[dict[str, float | int | str]]:
    """SmolLM2's whole forward (no KV cache read: each sequence attends over itself) without LoRA,
    and with LoRA attached (rank 16 on every projection of 16 resident adapters) for tokens of
    no adapter or spread round-robin over 1, 4 or 16; the step's mapping build included."""
    from transformers import AutoConfig

    from raypaged.lora.layers import attach_lora
    from raypaged.model.default_model import default_model_dir
    from raypaged.model.loader import load_model
    from raypaged.model.parallel import TensorParallel

    model_dir, cpu = default_model_dir(), torch.device("cpu")
    base = load_model(model_dir, AutoConfig.from_pretrained(model_dir), 512, torch.float32, cpu)
    adapted = load_model(model_dir, AutoConfig.from_pretrained(model_dir), 512, torch.float32, cpu)
    lora = attach_lora(adapted, 16, RANK, TensorParallel(), torch.float32, cpu)
    g = torch.Generator().manual_seed(0)
    for wrapped in lora.linears.values():
        rank = wrapped.lora_a.shape[2]
        for slot in range(16):
            wrapped.set_slot(
                slot,
                (
                    torch.randn(wrapped.target.in_features, rank, generator=g) * 0.01,
                    torch.randn(rank, wrapped.target.out_features, generator=g) * 0.01,
                ),
            )
    rows: list[dict[str, float | int | str]] = []
    for layout, lengths in (("16 one-token sequences", [1] * 16), ("one 256-token prompt", [256])):
        inputs = _forward_inputs(base, lengths)
        cases: dict[str, list[int | None] | None] = {"base model": None, "LoRA attached, no adapter": None}
        num_tokens = sum(lengths)
        for num_adapters in (1, 4, 16) if len(lengths) > 1 else (1,):
            cases[f"{num_adapters} adapters"] = [i % num_adapters for i in range(num_tokens)]

        def run(model, token_slots, inputs):
            def step():
                lora.step.mapping = None if token_slots is None else build_lora_mapping(token_slots)
                model(*inputs)

            return step

        fns = {name: run(base if name == "base model" else adapted, slots, inputs) for name, slots in cases.items()}
        best = dict.fromkeys(fns, float("inf"))
        with torch.inference_mode():
            for _ in range(passes):
                for name, us in timed_us(fns, repeats).items():
                    best[name.removesuffix("_us")] = min(best[name.removesuffix("_us")], us)
        for name, us in best.items():
            rows.append(
                {
                    "layout": layout,
                    "tokens": num_tokens,
                    "case": name,
                    "ms": us / 1000,
                    "vs_base": us / best["base model"],
                }
            )
            print(rows[-1], flush=True)
    lora.step.mapping = None
    return rows


def _forward_inputs(model, lengths: list[int]) -> tuple:
    from raypaged.attention.metadata import AttentionMetadata, PrefillSpan

    ids = torch.randint(100, 40000, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    spans = [PrefillSpan(start, n, n, torch.zeros(1, dtype=torch.long)) for start, n in zip(starts, lengths)]
    meta = AttentionMetadata(
        torch.full((len(ids),), -1, dtype=torch.long),
        0,
        torch.zeros((0, 1), dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
        spans,
    )
    attn = model.model.layers[0].self_attn
    cache = torch.zeros(1, attn.num_kv_heads, 1, attn.head_dim)
    return ids, positions, [(cache, cache)] * len(model.model.layers), meta


def spreads():  # -> (adapters, tokens, spread name, each token's slot)
    rng = np.random.default_rng(0)
    for num_adapters in NUM_ADAPTERS:
        for num_tokens in NUM_TOKENS:
            yield num_adapters, num_tokens, "random", rng.integers(0, num_adapters, num_tokens).tolist()
            if num_adapters > 1 and num_tokens >= 64:
                for share in (0.6, 0.9):  # one prefill with this share of the tokens, the rest spread evenly
                    first = int(share * num_tokens)
                    rest = [1 + i % (num_adapters - 1) for i in range(num_tokens - first)]
                    yield num_adapters, num_tokens, f"prefill {share:.0%}", [0] * first + rest


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# The batched LoRA op against the base linear",
        "",
        (
            f"`python benchmarks/lora_op_bench.py`: {m['cpu']}, {m['nproc']} cores, torch {m['torch']}, "
            f"{m['threads']} threads, fp32, rank {report['rank']} per projection (a fused linear stacks its "
            f"projections' ranks), load average {report['load_average']}. Times are the fastest of "
            f"{report['repeats']} calls (the variants taking turns) in the best of {report['passes']} sweeps, "
            f"in microseconds; {CONTENTION_NOTE}."
        ),
        "",
        (
            "`lora`: `add_lora` as it dispatches (`path`); `padded` / `loop`: its multi-slot paths forced; "
            "`reference`: the gather+bmm reference. `share`: lora / base."
        ),
        "",
        "| adapters | tokens | spread (padding) | linear | base | lora | path | share | padded | loop | reference |",
        "| ---: | ---: | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['adapters']} | {r['tokens']} | {r['spread']} ({r['padding']:.2f}) | {r['linear']} | "
            f"{r['base_us']:.0f} | {r['lora_us']:.0f} | {r['path']} | {r['lora_us'] / r['base_us']:.2f} | "
            f"{_us(r.get('padded_us'))} | {_us(r.get('loop_us'))} | {r['reference_us']:.0f} |"
        )
    multi = [r for r in report["rows"] if "padded_us" in r]
    picked = sum(r[f"{r['path']}_us"] <= 1.1 * min(r["padded_us"], r["loop_us"]) for r in multi)
    lines += [
        "",
        (
            f"Of the {len(multi)} multi-slot rows, the path `add_lora` picks is within 10% of the faster "
            f"forced path in {picked}."
        ),
    ]
    lines += [
        "",
        (
            "A decoder layer's four linears together (sum over them), and the step's mapping build "
            "(once per step, shared by every layer):"
        ),
        "",
        "| adapters | tokens | spread | base | lora | share | mapping build |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    keys = sorted({(r["adapters"], r["tokens"], r["spread"]) for r in report["rows"]})
    for key in keys:
        group = [r for r in report["rows"] if (r["adapters"], r["tokens"], r["spread"]) == key]
        base, lora = sum(r["base_us"] for r in group), sum(r["lora_us"] for r in group)
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {base:.0f} | {lora:.0f} | {lora / base:.2f} | "
            f"{group[0]['mapping_us']:.0f} |"
        )
    lines += [
        "",
        (
            "SmolLM2's whole forward (ms; `vs base`: over the model without LoRA). The op rows above reuse "
            "one layer's weights (hot in cache); here each layer's adapter weights stream from memory, "
            "which a few-token step pays for in full:"
        ),
        "",
        "| layout | tokens | case | ms | vs base |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for r in report["model_rows"]:
        lines.append(f"| {r['layout']} | {r['tokens']} | {r['case']} | {r['ms']:.2f} | {r['vs_base']:.2f} |")
    return "\n".join(lines) + "\n"


def _padding(mapping: ops.LoRAMapping) -> float:
    """Rows of the padded batch over the adapter tokens."""
    counts = [end - start for start, end in mapping.segments]
    return len(counts) * max(counts) / sum(counts)


def _us(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


if __name__ == "__main__":
    main()
